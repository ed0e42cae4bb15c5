"""`RuntimeLogitNoiseProcessor`: fresh gaussian noise on the served logits at every step.

Simulates analog or stochastic hardware: every row's logits get iid N(0, σ²) noise, drawn anew
each step (`checkpoints.perturbation.add_runtime_logit_noise`, the one implementation the pair
scorer uses too). It changes the argmax, so it is *not* argmax-invariant: vLLM runs it
before penalties, the request temperature and `NoisyTemperatureLogitsProcessor`, greedy rows
included — exactly as noisy hardware would.

Configuration (`engine_env.EngineConfig`, read in the engine process when the processor is
built):

- ``NTS_RUNTIME_NOISE_SIGMA``: σ in logit units for every row (default 0: off);
- ``NTS_RUNTIME_NOISE_SEED``: seed of the processor's generator (default 0). The noise drawn for
  a row depends on the batch it shares, so it is reproducible for a fixed schedule only;
- the request key ``nts_runtime_noise_sigma`` overrides σ for one request (0 turns it off).

This class is *not* an entry point: the server registers it by name
(``noisy_temp_server.vllm_plugin.runtime_noise:RuntimeLogitNoiseProcessor``) when runtime noise
is configured, so a stock vLLM server in the same environment is never silently noised.
Serves both model runners (`runners.RunnerDispatch`): under V1 it runs before penalties and the
request temperature; under Model Runner V2 custom processors run after penalties and before the
request temperature, so the noise lands after penalties there. Model Runner V2 runs entry-point
processors before class-path ones, i.e. the T* processor before this one (so does the V1 runner
among non-argmax-invariant processors, where the T* processor is when a bias directory is
configured): then this processor hands its noise to the engine's T* processor
(``NoisyTemperatureV2.first``, ``NoisyTemperatureV1.first``), which runs it first, and its own
call from vLLM does nothing. Under both runners the T* processor (and its capture of the served
logits) therefore sees the noisy rows, and T* divides the noise too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

from noisy_temp_server.checkpoints.perturbation import add_runtime_logit_noise
from noisy_temp_server.engine_contract.engine_env import engine_config
from noisy_temp_server.engine_contract.request_args import parse_runtime_noise_sigma
from noisy_temp_server.vllm_plugin.batch_rows import BatchRows
from noisy_temp_server.vllm_plugin.processor_common import tuning_processor
from noisy_temp_server.vllm_plugin.processor_v1 import NoisyTemperatureV1
from noisy_temp_server.vllm_plugin.processor_v2 import NoisyTemperatureV2
from noisy_temp_server.vllm_plugin.runners import RunnerDispatch

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "RuntimeLogitNoiseProcessor",
]


def _validate(sampling_params: SamplingParams) -> None:
    """Raises ValueError when ``nts_runtime_noise_sigma`` is not a finite number ≥ 0."""
    parse_runtime_noise_sigma(sampling_params.extra_args)


class RuntimeNoiseV1(LogitsProcessor):
    """V1 runner: adds iid N(0, σ²) noise to every row's logits at every step."""

    validate_params = staticmethod(_validate)

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        config = engine_config()
        self.default_sigma = config.runtime_noise_sigma
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(config.runtime_noise_seed)
        capacity = vllm_config.scheduler_config.max_num_seqs
        # Rows whose σ differs from the default (a request override).
        self._rows = BatchRows(capacity)
        _, self._sigma = self._rows.array(torch.float32)
        # The T* processor runs before this one when it is not argmax-invariant (a bias
        # directory): then it runs the noise first.
        tuner = tuning_processor(vllm_config)
        self.handed_over = False
        if isinstance(tuner, NoisyTemperatureV1) and not tuner.is_argmax_invariant():
            self.handed_over = tuner.first is None
            tuner.first = tuner.first or self.noise

    def is_argmax_invariant(self) -> bool:
        """Noise reorders tokens, so greedy sampling sees it."""
        return False

    def _admit(self, row: int, params: SamplingParams, _output_ids: list[int]) -> bool:
        sigma = parse_runtime_noise_sigma(params.extra_args)
        if sigma is None or sigma == self.default_sigma:
            return False
        self._sigma[row] = sigma
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Track the rows that override σ."""
        self._rows.update(batch_update, self._admit)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, V] float32, returned as they are when the T* processor runs the noise
        (``handed_over``), else `noise`."""
        return logits if self.handed_over else self.noise(logits)

    def noise(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, V] float32. Returns the noised logits (a new tensor when every row shares
        the default σ, else ``logits`` modified in place)."""
        batch = logits.shape[0]
        if self._rows.n_active == 0:
            return add_runtime_logit_noise(logits, self.default_sigma, self._generator)
        overridden = self._rows.active[:batch]
        sigmas = self._sigma[:batch].copy()
        sigmas[~overridden] = self.default_sigma
        for sigma in {float(s) for s in sigmas}:
            if sigma == 0:
                continue
            rows = torch.from_numpy((sigmas == sigma).nonzero()[0]).to(logits.device)
            logits[rows] = add_runtime_logit_noise(logits[rows], sigma, self._generator)
        return logits


class RuntimeNoiseV2(V2LogitsProcessor):
    """Model Runner V2: the same noise, σ kept per persistent slot on the device."""

    validate_params = staticmethod(_validate)

    def __init__(self, vllm_config: VllmConfig, req_states: LogitsProcRequestState) -> None:
        config = engine_config()
        self.default_sigma = config.runtime_noise_sigma
        self._generator = torch.Generator(device=req_states.device)
        self._generator.manual_seed(config.runtime_noise_seed)
        self._sigma = torch.full(
            (req_states.max_num_reqs,), self.default_sigma, device=req_states.device
        )
        self._staged: dict[int, float] = {}
        tuner = tuning_processor(vllm_config)
        self.handed_over = False
        if isinstance(tuner, NoisyTemperatureV2):
            self.handed_over = tuner.first is None
            tuner.first = tuner.first or self.noise

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        """Set the slot's σ (the request's override or the default); True when σ > 0."""
        sigma = parse_runtime_noise_sigma(sampling_params.extra_args)
        sigma = self.default_sigma if sigma is None else sigma
        self._staged[req_idx] = sigma
        return sigma > 0

    def apply_staged_writes(self) -> None:
        """Copy the staged σ to the device."""
        if self._staged:
            slots = torch.tensor(list(self._staged), dtype=torch.int64)
            values = torch.tensor(list(self._staged.values()), dtype=torch.float32)
            device = self._sigma.device
            self._sigma.index_copy_(0, slots.to(device), values.to(device))
            self._staged.clear()

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        """logits: [rows, V] float32, returned as they are when the T* processor runs the noise
        (``handed_over``), else `noise`."""
        return logits if self.handed_over else self.noise(logits, ctx)

    def noise(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        """logits: [rows, V] float32; each row gets noise of its slot's σ, in place."""
        sigma = self._sigma[ctx.expanded_idx_mapping.long()].unsqueeze(1)
        noise = torch.randn(
            logits.shape, generator=self._generator, device=logits.device, dtype=logits.dtype
        )
        return logits.add_(noise * sigma)


class RuntimeLogitNoiseProcessor(RunnerDispatch):
    """Adds iid N(0, σ²) noise to every row's logits at every step (see the module docstring);
    builds `RuntimeNoiseV1` or `RuntimeNoiseV2` depending on the runner."""

    v1_class = RuntimeNoiseV1
    v2_class = RuntimeNoiseV2

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raises ValueError when ``nts_runtime_noise_sigma`` is not a finite number ≥ 0."""
        _validate(sampling_params)
