"""The vLLM engine behind the server: environment, engine arguments, and a thin wrapper.

Order matters, because vLLM and prometheus_client read their environment when first imported:

1. `prepare_environment` (before anything imports vLLM's engine or prometheus_client) settles
   the multiprocess metrics directory (below), sets the CPU KV cache size and hands the engine
   the trace channel's address and the capture bounds;
2. `publish_bias_directories` (once the startup policy is known, before the engine starts)
   hands it the folders of the per-token bias files, only when a policy can name a bias (a bias
   directory makes the V1 processor non-argmax-invariant, see `vllm_plugin.processor_v1`);
3. `start_engine` builds `AsyncEngineArgs` (logprobs reflect the tuned temperature:
   `logprobs_mode="processed_logprobs"`, unless `tuned_logprobs` is off; the temperature
   processor is loaded once, from its entry point when the package is installed, else by its
   `<module>:<type>` name) and starts
   `AsyncLLM`. For runtime logit noise it also registers `RuntimeLogitNoiseProcessor` by name
   (it is no entry point) and hands the engine its σ and seed; vLLM runs it before the
   temperature processor because it is not argmax-invariant.

What the engine gets from the server is one `engine_contract.engine_env.EngineConfig`, written
into the environment the engine process inherits with `EngineConfig.apply`: each step above
adds what it knows to the configuration in force (`engine_config`) and writes it whole.

Multiprocess metrics directory: a `PROMETHEUS_MULTIPROC_DIR` given by the deployment (the
Docker image sets one; Kubernetes mounts an in-memory volume there) is used as it is: created if
missing, and its metric files (`*.db`) are deleted at start, because a restarted server must not
sum the samples of an earlier run into `/metrics`; other files are left alone and the directory
stays after shutdown. Unset (or empty), the server uses a fresh directory of its own, removed at
shutdown. Two servers must never share one directory.

`GenerationEngine` is the interface the HTTP layer needs; `AsyncLLM` satisfies it, and so does
the small fake engine of the unit tests.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from noisy_temp_server.engine_contract.engine_env import EngineConfig, engine_config
from noisy_temp_server.server.vllm_flags import engine_flag_overrides
from noisy_temp_server.settings import Settings, engine_settings

if TYPE_CHECKING:
    from vllm.inputs import TokensInput
    from vllm.lora.request import LoRARequest
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from noisy_temp_server.checkpoints.perturbation import RuntimeLogitNoiseSpec
    from noisy_temp_server.temperature.policy import TemperaturePolicy

__all__ = [
    "PROCESSOR_CLASS_PATH",
    "RUNTIME_NOISE_PROCESSOR_CLASS_PATH",
    "EngineEnvironment",
    "GenerationEngine",
    "build_engine_args",
    "prepare_environment",
    "publish_bias_directories",
    "start_engine",
]

_LOGGER = logging.getLogger(__name__)

PROCESSOR_CLASS_PATH = "noisy_temp_server.vllm_plugin.processor:NoisyTemperatureLogitsProcessor"
RUNTIME_NOISE_PROCESSOR_CLASS_PATH = (
    "noisy_temp_server.vllm_plugin.runtime_noise:RuntimeLogitNoiseProcessor"
)
_LOGITS_PROCESSORS_GROUP = "vllm.logits_processors"
_PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


class GenerationEngine(Protocol):
    """What the HTTP layer uses of `AsyncLLM`: `generate`, `check_health`, and its
    `input_processor` (vLLM's beam search calls its `resolve_watermarking`)."""

    input_processor: Any

    def generate(
        self,
        prompt: TokensInput,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs (DELTA or FINAL_ONLY as the parameters say), with the
        LoRA adapter `lora_request` when given (an engine started with LoRA enabled) and the
        scheduling `priority` (vLLM's meaning)."""
        ...

    async def check_health(self) -> None:
        """Raise when the engine cannot serve."""
        ...


@dataclass(frozen=True)
class EngineEnvironment:
    """What `prepare_environment` set up; `cleanup` removes the runtime directory (which holds
    `prometheus_dir` unless the deployment chose that directory, and `online_bias_dir`)."""

    runtime_dir: Path
    prometheus_dir: Path
    trace_endpoint: str

    @property
    def online_bias_dir(self) -> Path:
        """Where the online refinement writes the per-token biases it publishes: a folder of
        this server's runtime directory (writable, unshared, created by the online estimator
        when it starts, removed at shutdown; the server restarts from its profile, so they are
        not needed after it)."""
        return self.runtime_dir / "biases"

    def cleanup(self) -> None:
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


def prepare_environment(settings: Settings) -> EngineEnvironment:
    """Set the environment vLLM, its engine process and prometheus_client will read.

    Must run before `prometheus_client` is imported in this process (its multiprocess mode is
    chosen at import): raises RuntimeError otherwise. Creates a fresh runtime directory (the
    trace socket; the metric files unless `PROMETHEUS_MULTIPROC_DIR` is already set, see the
    module docstring, whose stale `*.db` files it then deletes); the caller removes it with
    `EngineEnvironment.cleanup`. Raises ValueError naming the variable, and creates nothing,
    when an engine variable this process inherited is invalid (`EngineConfig.from_environ`).
    """
    if "prometheus_client" in sys.modules:
        raise RuntimeError(
            "prometheus_client was imported before prepare_environment(); metrics of the "
            "engine process would be lost. Call prepare_environment() first thing at startup."
        )
    inherited = engine_config()
    runtime_dir = Path(tempfile.mkdtemp(prefix="nts-serve-"))
    prometheus_dir = _multiprocess_directory(runtime_dir)
    trace_endpoint = f"ipc://{runtime_dir / 'trace.sock'}"
    os.environ[_PROMETHEUS_DIR_ENV] = str(prometheus_dir)
    cpu_kv_cache_gib = engine_settings(settings, on_cpu=True).kv_cache_gib
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gib)
    _hand_to_engine(
        dataclasses.replace(
            inherited,
            trace_endpoint=trace_endpoint,
            capture_rows_per_step=settings.capture_rows_per_step,
            capture_positions=settings.capture_positions,
            capture_queue_rows=settings.capture_queue_rows,
            fused_step=settings.fused_step,
        )
    )
    return EngineEnvironment(runtime_dir, prometheus_dir, trace_endpoint)


def publish_bias_directories(
    settings: Settings,
    environment: EngineEnvironment,
    policy: TemperaturePolicy | None,
    *,
    profile_dir: Path | None,
) -> tuple[Path, ...]:
    """The folders the engine looks per-token bias files up in, in order, also handed to the
    engine process and this one as `EngineConfig.bias_dirs` (`NTS_BIAS_DIR`,
    `bias_files.bias_directories`): `settings.bias_dir` when given; when the startup
    `policy` names a bias, then `profile_dir`, the folder the startup profile was loaded from
    (None: no profile; its own bias file lies there, so setting `bias_dir` for other biases
    cannot hide it), and then `environment.online_bias_dir`, where the online refinement
    publishes its biases (it starts only from a policy that names one, so without one nothing
    is ever published). Empty, with `NTS_BIAS_DIR` removed, when no policy can name a bias: the
    V1 processor then stays argmax-invariant (skipped on greedy-only batches, after penalties).
    Raises ValueError when a folder's path holds `os.pathsep`."""
    folders: list[Path] = [] if settings.bias_dir is None else [settings.bias_dir]
    if policy is not None and policy.bias is not None:
        if profile_dir is not None and profile_dir not in folders:
            folders.append(profile_dir)
        folders.append(environment.online_bias_dir)
    _hand_to_engine(dataclasses.replace(engine_config(), bias_dirs=tuple(folders)))
    return tuple(folders)


def _hand_to_engine(config: EngineConfig) -> None:
    """Write `config` into this process's environment, which the engine process inherits."""
    config.apply(os.environ)


def _multiprocess_directory(runtime_dir: Path) -> Path:
    """The deployment's `PROMETHEUS_MULTIPROC_DIR`, created and cleared of metric files, or a
    fresh `runtime_dir/prometheus`."""
    given = os.environ.get(_PROMETHEUS_DIR_ENV, "").strip()
    if not given:
        fresh = runtime_dir / "prometheus"
        fresh.mkdir()
        return fresh
    directory = Path(given)
    directory.mkdir(parents=True, exist_ok=True)
    stale = sorted(directory.glob("*.db"))
    for path in stale:
        path.unlink(missing_ok=True)
    _LOGGER.info(
        "Multiprocess metrics in %s (%s); removed %d stale metric files",
        directory,
        _PROMETHEUS_DIR_ENV,
        len(stale),
    )
    return directory


def cpu_compiler_found() -> bool:
    """Whether the C++ compiler that vLLM's compilation (torch inductor) calls on a CPU is on
    the PATH: ``$CXX``, else ``g++``."""
    return shutil.which(os.environ.get("CXX") or "g++") is not None


def _processor_from_entry_point() -> bool:
    """Whether vLLM will load the temperature processor by itself (installed entry point)."""
    return any(
        ep.value == PROCESSOR_CLASS_PATH for ep in entry_points(group=_LOGITS_PROCESSORS_GROUP)
    )


def build_engine_args(
    settings: Settings,
    model_path: Path,
    model_name: str,
    runtime_noise: RuntimeLogitNoiseSpec | None = None,
    *,
    max_lora_rank: int | None = None,
) -> Any:
    """vLLM's `AsyncEngineArgs` for serving `model_path` as `model_name`.

    The settings' ``vllm_args`` are applied last (`vllm_flags`; ValueError for one it
    refuses). With `runtime_noise`, `RuntimeLogitNoiseProcessor` is registered too; its σ and
    seed reach it through the engine's configuration (`start_engine` hands them over), not
    through these arguments. With `max_lora_rank` (a value vLLM accepts), LoRA is enabled for
    one adapter of up to that rank.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415 (after the environment)
    from vllm.platforms import current_platform  # noqa: PLC0415

    processors: list[str | type[Any]] = []
    if not _processor_from_entry_point():
        processors.append(PROCESSOR_CLASS_PATH)
    if runtime_noise is not None:
        processors.append(RUNTIME_NOISE_PROCESSOR_CLASS_PATH)
    resolved = engine_settings(
        settings, on_cpu=current_platform.is_cpu(), cpu_compiler=cpu_compiler_found()
    )
    if current_platform.is_cpu() and resolved.enforce_eager and settings.enforce_eager is None:
        _LOGGER.warning("no C++ compiler (g++, or $CXX) for vLLM's compilation: serving eager")
    kv_cache_bytes = None
    if not current_platform.is_cpu() and resolved.kv_cache_gib is not None:
        kv_cache_bytes = resolved.kv_cache_gib * 2**30
    utilization = resolved.gpu_memory_utilization or AsyncEngineArgs.gpu_memory_utilization
    arguments = AsyncEngineArgs(
        model=str(model_path),
        served_model_name=model_name,
        tokenizer=str(model_path),
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=resolved.max_num_seqs,
        tensor_parallel_size=settings.tensor_parallel_size,
        enforce_eager=resolved.enforce_eager,
        kv_cache_memory_bytes=kv_cache_bytes,
        logprobs_mode=logprobs_mode(settings),
        max_logprobs=20,
        logits_processors=processors or None,
        disable_log_stats=False,
        enable_log_requests=False,
        gpu_memory_utilization=utilization,
        enable_lora=max_lora_rank is not None,
        max_lora_rank=max_lora_rank or AsyncEngineArgs.max_lora_rank,  # type: ignore[arg-type]
        max_loras=1,
    )
    return dataclasses.replace(arguments, **engine_flag_overrides(settings.vllm_args))


def logprobs_mode(settings: Settings) -> Literal["processed_logprobs", "raw_logprobs"]:
    """vLLM's logprobs mode for ``settings.tuned_logprobs`` (see its description)."""
    return "processed_logprobs" if settings.tuned_logprobs else "raw_logprobs"


def start_engine(
    settings: Settings,
    model_path: Path,
    model_name: str,
    runtime_noise: RuntimeLogitNoiseSpec | None = None,
    *,
    max_lora_rank: int | None = None,
) -> AsyncLLM:
    """Start vLLM's `AsyncLLM` on `model_path` (after `prepare_environment`), with LoRA enabled
    up to `max_lora_rank` when given (`build_engine_args`).

    With `runtime_noise`, hands its σ and seed to the engine (`EngineConfig.runtime_noise_sigma`,
    `runtime_noise_seed`) before the engine starts.
    """
    config = engine_config()
    if config.trace_endpoint is None:
        raise RuntimeError("call prepare_environment() before start_engine().")
    from vllm.usage.usage_lib import UsageContext  # noqa: PLC0415
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: PLC0415

    if runtime_noise is not None:
        _hand_to_engine(
            dataclasses.replace(
                config,
                runtime_noise_sigma=runtime_noise.sigma,
                runtime_noise_seed=runtime_noise.seed,
            )
        )
        _LOGGER.info(
            "Runtime logit noise: sigma %g, seed %d (RuntimeLogitNoiseProcessor)",
            runtime_noise.sigma,
            runtime_noise.seed,
        )
    started = time.perf_counter()
    _LOGGER.info("Starting the vLLM engine on %s ...", model_path)
    engine = AsyncLLM.from_engine_args(
        build_engine_args(
            settings, model_path, model_name, runtime_noise, max_lora_rank=max_lora_rank
        ),
        usage_context=UsageContext.OPENAI_API_SERVER,
    )
    _LOGGER.info("vLLM engine started in %.1f s", time.perf_counter() - started)
    return engine
