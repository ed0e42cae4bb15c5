"""`NoisyTemperatureLogitsProcessor`: the per-step temperature T* inside vLLM's sampler.

Registered under the ``vllm.logits_processors`` entry point (``noisy_temperature``), so every
vLLM engine in this environment loads it; it does nothing for a request unless that request (or
the engine's default policy, ``NTS_POLICY_FILE``) selects a rule other than ``off``. Do not
also pass it in ``logits_processors``: vLLM would build it twice; the second instance for the
same engine config logs a warning and does nothing (`duplicate`), so T* is applied once.

Where it runs (``vllm/v1/sample/sampler.py``): it is argmax-invariant, so vLLM applies it in
``Sampler.sample`` *after* penalties, the request's own temperature and the builtin min-p
filter, and before top-k/top-p and the random draw. The effective temperature is therefore
``T_request × T*``; greedy rows (temperature < 1e-5) are never tuned (and vLLM takes the greedy
sample for them anyway). min-p is evaluated at ``T_request``, before T* (vLLM's order).
With ``logprobs_mode="processed_logprobs"`` the returned logprobs include T*.

Per step, for the tuned rows only:

1. the generation step of each row is ``len(output_token_ids)`` (vLLM keeps a live reference to
   that list; 0 while the first token is sampled; vLLM's builtin min-tokens processor relies on
   the same length);
2. rows are grouped by (policy snapshot, rule) -- usually one or two groups -- and
   `policy_temperature` (the one implementation of rule → T) runs once per group. Rules that
   read the served row (`TemperaturePolicy.reads_served_row`) get the logits multiplied back by the
   request temperature, i.e. the served logits z̃ (after penalties);
3. the rows' logits are divided by T* in place; untuned rows are not touched.

Bad rows never stop the engine: a row whose logits contain NaN or +inf, or are all -inf (every
token masked), or whose T* comes out non-finite or <= 0, gets T* = 1 (its logits are left as they
are) and is counted in `NoisyTemperatureLogitsProcessor.bad_rows` (the first one is logged).

Reporting: T* reaches the host with one ``.tolist()`` of the tuned rows' values per step (free
on CPU; one small device→host sync on GPU), then feeds the ``nts_step_temperature`` histogram
(`noisy_temp_server.vllm_plugin.metrics`) and, for rows with an ``nts_trace_id``, the trace
channel (`noisy_temp_server.vllm_plugin.trace_channel`, enabled by ``NTS_TRACE_ENDPOINT``).

Batch state lives in preallocated CPU arrays of ``max_num_seqs`` rows (`BatchRows`), updated
removed → added → moved like vLLM's builtins; the per-group index tensors are rebuilt and
copied to the device only when the batch changed, and `apply` returns at once when no row is
tuned.

Needs the V1 model runner: see `noisy_temp_server.vllm_plugin.runner` for how this interacts
with vLLM's Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=0``).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from prometheus_client import CollectorRegistry
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from noisy_temp_server.temperature.policy import (
    TemperaturePolicy,
    bucket_index,
    policy_temperature,
)
from noisy_temp_server.vllm_plugin.batch_rows import BatchRows
from noisy_temp_server.vllm_plugin.metrics import (
    StepTemperatureMetrics,
    step_bucket_labels,
    step_temperature_metrics,
)
from noisy_temp_server.vllm_plugin.request_args import (
    default_policy_json,
    parse_request_args,
    resolve_request,
)
from noisy_temp_server.vllm_plugin.runner import require_v1_model_runner
from noisy_temp_server.vllm_plugin.trace_channel import TraceSender

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["NoisyTemperatureLogitsProcessor"]

_LOGGER = logging.getLogger(__name__)
_INSTANCES: weakref.WeakValueDictionary[int, NoisyTemperatureLogitsProcessor] = (
    weakref.WeakValueDictionary()
)


@dataclass(frozen=True)
class _Group:
    """Tuned rows sharing one (policy, rule): a contiguous slice of the tuned order."""

    policy: TemperaturePolicy
    step_bucket_edges: torch.Tensor  # [K] int64, CPU
    step_bucket_labels: tuple[str, ...]  # [K]
    start: int
    stop: int
    request_temperature: torch.Tensor  # [n, 1] float32 on the device
    fixed_t: torch.Tensor  # [n] float32 on the device
    t_min: torch.Tensor  # [n]
    t_max: torch.Tensor  # [n]


class NoisyTemperatureLogitsProcessor(LogitsProcessor):
    """Divides each tuned row's logits by its policy's T* (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError (HTTP 400 in vLLM's server) when the ``nts_*`` keys are invalid."""
        parse_request_args(sampling_params.extra_args)

    def __init__(
        self,
        vllm_config: VllmConfig,
        device: torch.device,
        is_pin_memory: bool,
        *,
        registry: CollectorRegistry | None = None,
    ) -> None:
        """vLLM's constructor signature; ``registry`` (default: prometheus_client's ``REGISTRY``)
        receives ``nts_step_temperature``. The trace sender comes from ``NTS_TRACE_ENDPOINT``.
        Raises `ModelRunnerV2Error` under Model Runner V2, and ValueError when
        ``NTS_POLICY_FILE`` is set but unreadable or invalid (at startup, not on a request)."""
        require_v1_model_runner(vllm_config, type(self).__name__)
        default_policy_json()
        # Loaded twice into one engine (entry point + logits_processors=[...]) it would apply
        # T* twice; the second instance for the same config stays inert.
        self._vllm_config = vllm_config  # keeps id(vllm_config) unique while self lives
        self.duplicate = _INSTANCES.setdefault(id(vllm_config), self) is not self
        if self.duplicate:
            _LOGGER.warning(
                "%s is loaded twice into one engine (it is an installed entry point; do not "
                "also pass it in logits_processors). The second instance does nothing.",
                type(self).__name__,
            )
        self.device = torch.device(device)
        capacity = vllm_config.scheduler_config.max_num_seqs
        self._rows = BatchRows(capacity)
        _, self._request_temperature = self._rows.array(torch.float32, 1.0)
        _, self._fixed_t = self._rows.array(torch.float32, 1.0)
        _, self._t_min = self._rows.array(torch.float32, 1.0)
        _, self._t_max = self._rows.array(torch.float32, 1.0)
        self._policy = self._rows.objects()
        self._outputs = self._rows.objects()
        self._trace_id = self._rows.objects()

        self._groups: list[_Group] = []
        self._tuned_rows = torch.empty(0, dtype=torch.int64, device=self.device)
        self._tuned_in_order = False
        self._tuned_outputs: list[list[int]] = []
        self._traced_positions: list[int] = []
        self._traced_ids: list[str] = []

        self.metrics: StepTemperatureMetrics = step_temperature_metrics(registry)
        self.trace_sender = TraceSender.from_env()
        self.bad_rows = 0

    def is_argmax_invariant(self) -> bool:
        """A positive temperature never changes the argmax."""
        return True

    def _admit(self, row: int, params: SamplingParams, output_ids: list[int]) -> bool:
        if self.duplicate:
            return False
        resolved = resolve_request(parse_request_args(params.extra_args), params.temperature)
        if resolved is None:
            return False
        self._request_temperature[row] = params.temperature
        self._fixed_t[row] = resolved.fixed_t
        self._t_min[row] = resolved.t_min
        self._t_max[row] = resolved.t_max
        self._policy[row] = resolved.policy
        self._outputs[row] = output_ids
        self._trace_id[row] = resolved.trace_id
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Apply the batch changes; rebuild the groups when a tuned row changed."""
        if self._rows.update(batch_update, self._admit):
            self._rebuild_groups()

    def _rebuild_groups(self) -> None:
        rows_by_policy: dict[TemperaturePolicy, list[int]] = {}
        for row in self._rows.active.nonzero()[0].tolist():
            rows_by_policy.setdefault(self._policy[row], []).append(row)
        groups: list[_Group] = []
        order: list[int] = []
        for policy, rows in rows_by_policy.items():
            groups.append(
                _Group(
                    policy=policy,
                    step_bucket_edges=torch.tensor(policy.step_edges, dtype=torch.int64),
                    step_bucket_labels=step_bucket_labels(policy.step_edges),
                    start=len(order),
                    stop=len(order) + len(rows),
                    request_temperature=self._to_device(
                        torch.from_numpy(self._request_temperature[rows]).unsqueeze(1)
                    ),
                    fixed_t=self._to_device(torch.from_numpy(self._fixed_t[rows])),
                    t_min=self._to_device(torch.from_numpy(self._t_min[rows])),
                    t_max=self._to_device(torch.from_numpy(self._t_max[rows])),
                )
            )
            order.extend(rows)
        self._groups = groups
        self._tuned_rows = self._to_device(torch.tensor(order, dtype=torch.int64))
        self._tuned_in_order = order == list(range(len(order)))
        self._tuned_outputs = [self._outputs[row] for row in order]
        traced = [(i, self._trace_id[row]) for i, row in enumerate(order) if self._trace_id[row]]
        self._traced_positions = [i for i, _ in traced] if self.trace_sender else []
        self._traced_ids = [tid for _, tid in traced] if self.trace_sender else []

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device, non_blocking=True)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [B, V] float32 (B = the current batch), divided in place on the tuned rows
        and returned. Untuned rows are bitwise unchanged."""
        if not self._groups:
            return logits
        steps = torch.tensor(list(map(len, self._tuned_outputs)), dtype=torch.int64)
        steps_device = steps.to(self.device, non_blocking=True)
        # [n_tuned, V] in tuned order: a view when the tuned rows are the batch's first rows,
        # else a copy written back below.
        in_place = self._tuned_in_order
        tuned = (
            logits[: self._tuned_rows.shape[0]]
            if in_place
            else logits.index_select(0, self._tuned_rows)
        )
        # amax is NaN or +inf for any NaN or +inf, and -inf only when every token is masked.
        row_ok = torch.isfinite(tuned.amax(dim=1))  # [n_tuned]
        temperatures = torch.cat(
            [
                self._group_temperature(
                    group, tuned[group.start : group.stop], steps_device[group.start : group.stop]
                )
                for group in self._groups
            ]
        )  # [n_tuned], tuned order
        ok = row_ok & torch.isfinite(temperatures) & (temperatures > 0)
        temperatures = torch.where(ok, temperatures, torch.ones_like(temperatures))
        tuned.div_(temperatures.unsqueeze(1))
        if not in_place:
            logits.index_copy_(0, self._tuned_rows, tuned)
        host_temperatures, host_ok = torch.stack((temperatures, ok.float())).tolist()  # one sync
        self._report(steps, host_temperatures, [flag == 1.0 for flag in host_ok])
        return logits

    def _group_temperature(
        self, group: _Group, group_logits: torch.Tensor, steps: torch.Tensor
    ) -> torch.Tensor:
        """T* of the group's rows; ``group_logits`` ([n, V], as vLLM hands them) is not modified."""
        served: torch.Tensor | None = None
        if group.policy.reads_served_row:
            # Undo the request temperature: the rule reads the served row z~, not z~ / T_req.
            served = group_logits.mul(group.request_temperature)
        return policy_temperature(
            group.policy,
            steps,
            served,
            fixed=group.fixed_t,
            t_min=group.t_min,
            t_max=group.t_max,
            validate=False,  # no sync; bad rows are caught in apply()
        )

    def _report(self, steps_cpu: torch.Tensor, temperatures: list[float], ok: list[bool]) -> None:
        """Count bad rows, observe the histogram, send the trace (host-side values only)."""
        n_bad = ok.count(False)
        if n_bad:
            if not self.bad_rows:
                _LOGGER.warning(
                    "noisy-temp-server: %d row(s) had NaN/+inf or all -inf logits or a "
                    "non-finite T*; they were sampled at T* = 1 (further occurrences are only "
                    "counted).",
                    n_bad,
                )
            self.bad_rows += n_bad
        for group in self._groups:
            buckets = bucket_index(steps_cpu[group.start : group.stop], group.step_bucket_edges)
            labels = [group.step_bucket_labels[b] for b in buckets.tolist()]
            self.metrics.observe(
                group.policy.rule.value, labels, temperatures[group.start : group.stop]
            )
        if self._traced_ids and self.trace_sender is not None:
            positions = self._traced_positions
            self.trace_sender.send_step(
                self._traced_ids,
                [int(steps_cpu[i]) for i in positions],
                [temperatures[i] for i in positions],
            )
