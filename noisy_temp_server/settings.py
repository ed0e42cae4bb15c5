"""The one typed settings object of noisy-temp-server.

Values come, in rising precedence, from the defaults here, environment variables prefixed
`NTS_` (e.g. `NTS_CACHE_DIR`, `NTS_PORT`), and CLI flags (`add_settings_arguments` adds one flag
per field, `settings_from_args` builds the `Settings` with the flags given as overrides). A bad
value is an error at startup, never silently replaced.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from noisy_temp_server.adapter import AdapterServing
from noisy_temp_server.engine_contract.engine_env import BOOLEAN_WORDS
from noisy_temp_server.files import default_cache_dir

__all__ = [
    "DEFAULT_PERTURBATION",
    "EngineSettings",
    "Settings",
    "add_settings_arguments",
    "engine_settings",
    "settings_as_json",
    "settings_from_args",
]

DEFAULT_PERTURBATION = '{"kind": "runtime_logit_noise", "sigma": 1.0}'
"""The perturbation `serve` applies to the default model when no served model is given: runtime
logit noise, the derivation's own case, where the calibrated temperature measurably closes part
of the KL gap (docs/quality.md). `serve` starts this
pair from the profile shipped in the package (`data/default-pair.profile.json`)."""

RuleName = Literal["off", "fixed", "sqrt", "linear", "fisher", "schedule", "calibrated"]
PositiveFloat = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]


class Settings(BaseSettings):
    """Server-wide settings. Per-request overrides travel in the request (see the server)."""

    model_config = SettingsConfigDict(env_prefix="NTS_", extra="forbid", frozen=True)

    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="Where converted and perturbed checkpoints are kept.",
    )

    # --- HTTP ---
    host: str = Field(default="127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port (0: any free port).")
    api_key: SecretStr | None = Field(
        default=None,
        description="If set, /v1/* requires `Authorization: Bearer <key>`.",
    )
    max_request_body_bytes: int = Field(
        default=4 * 2**20,
        ge=1024,
        description="Largest request body accepted (bytes); larger ones get a 413.",
    )

    # vllm serve's HTTP flags, with its meaning (uvicorn's and FastAPI's; CORS lists as JSON)
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] | None = (
        Field(default=None, description="uvicorn's log level (default: serve's --log-level).")
    )
    disable_uvicorn_access_log: bool = Field(default=False, description="No access log.")
    allowed_origins: tuple[str, ...] = Field(
        default=(), description="CORS origins, a JSON list ('[\"*\"]': any; default none)."
    )
    allowed_methods: tuple[str, ...] = Field(default=("*",), description="CORS methods.")
    allowed_headers: tuple[str, ...] = Field(default=("*",), description="CORS headers.")
    allow_credentials: bool = Field(default=False, description="CORS: allow credentials.")
    ssl_keyfile: Path | None = Field(default=None, description="HTTPS: the key file.")
    ssl_certfile: Path | None = Field(default=None, description="HTTPS: the certificate file.")
    ssl_ca_certs: Path | None = Field(default=None, description="HTTPS: the CA certificates.")
    ssl_cert_reqs: int = Field(default=0, ge=0, le=2, description="HTTPS: ssl.CERT_* (0 none).")
    root_path: str | None = Field(default=None, description="FastAPI's root path behind a proxy.")

    # --- models ---
    served_model: Path | None = Field(
        default=None,
        description="Checkpoint folder vLLM serves (with the runtime logit noise its manifest "
        "records, if any). Unset: --clean-model or the embedded default model perturbed by "
        "--perturbation (weight perturbations are written once to the cache).",
    )
    served_model_name: str | None = Field(
        default=None,
        description="Model id in the API (/v1/models, `model` field). Unset: the folder name.",
    )
    chat_template: str | None = Field(
        default=None,
        description="The chat template /v1/chat/completions and /tokenize render messages with, "
        "instead of the served model's own: a Jinja template file, or the template itself (as "
        "vLLM's --chat-template).",
    )
    tool_call_parser: str | None = Field(
        default=None,
        description="vLLM's tool parser for tool calls on /v1/chat/completions (vLLM's "
        "--tool-call-parser: hermes, pythonic, llama3_json, ...); with "
        "--enable-auto-tool-choice only, as in vLLM.",
    )
    enable_auto_tool_choice: bool = Field(
        default=False,
        description="Parse tool calls with --tool-call-parser, for tool_choice auto, required "
        "and named (vLLM's --enable-auto-tool-choice).",
    )
    clean_model: Path | None = Field(
        default=None,
        description="Clean checkpoint for shadow scoring, and the one --perturbation applies "
        "to. Unset: the embedded default model when no served model is given; the served folder "
        "itself when its manifest records runtime logit noise on its own weights; otherwise no "
        "shadow scoring.",
    )
    perturbation: str = Field(
        default=DEFAULT_PERTURBATION,
        description="Perturbation spec (JSON) applied to the clean model when no served model "
        "is given; runtime_logit_noise serves the clean weights with noise added in the engine.",
    )
    profile: Path | None = Field(
        default=None,
        description="Profile file to start the policy from. Unset: T = 1 until the shadow "
        "scorer has enough evidence.",
    )
    bias_dir: Path | None = Field(
        default=None,
        description="Folder of the per-token logit bias files (bias-<sha256>.safetensors) a "
        "policy may name, looked up first, then the profile's folder (docs/calibration.md).",
    )
    int4_stack: bool = Field(
        default=False,
        description="Serve the embedded model as int4 (RTN, group 128) with a rank-64 "
        "compensation adapter and T* and the bias calibrated on top, scored live against the "
        "clean model: calibrated at first use (minutes on a CPU) and cached under "
        "cache_dir/stacks/. Takes no served or clean model, profile or adapter of its own.",
    )
    adapter: Path | None = Field(
        default=None,
        description="A PEFT LoRA adapter folder (safetensors) to serve, e.g. one `calibrate "
        "--adapter-rank` wrote; unset: the profile's adapter, if it names and recommends one. "
        "With a profile, it must be the adapter the profile was calibrated with.",
    )
    adapter_serving: AdapterServing = Field(
        default="auto",
        description="How the compensation adapter is served: auto folds it into "
        "float weights (no per-step cost; no request can turn it off) and serves it through "
        "vLLM's LoRA on quantized kernels (a request can turn it off); folded and lora force "
        "one (folded refuses quantized weights); none serves the model without it.",
    )

    # --- temperature defaults (per-request nts_* keys override them) ---
    default_rule: RuleName | None = Field(
        default=None,
        description="Rule forced on every request. Unset: the rule of the policy in force.",
    )
    default_t: PositiveFloat | None = Field(
        default=None, description="The constant T* of the `fixed` rule when forced by default."
    )
    default_t_min: PositiveFloat | None = Field(default=None, description="Lower bound on T*.")
    default_t_max: PositiveFloat | None = Field(default=None, description="Upper bound on T*.")

    # --- shadow scoring / online estimation ---
    shadow_fraction: float = Field(
        default=0.1,
        ge=0.0,
        le=1.0,
        description="Fraction of finished requests scored against the clean model (0: off).",
    )
    shadow_queue_size: int = Field(
        default=64, ge=1, description="Finished requests waiting for scoring; beyond, dropped."
    )
    shadow_device: str = Field(
        default="cpu",
        description="Torch device of the shadow scorer's clean and served models (cpu, cuda).",
    )
    clean_backend: Literal["in_process", "remote"] = Field(
        default="in_process",
        description="Where the shadow scorer gets the clean model's distribution: in_process "
        "(clean_model, loaded here with transformers on shadow_device in clean_dtype) or "
        "remote (a vLLM OpenAI server at clean_url serving the clean model, started with "
        "--max-logprobs -1; several served replicas may share it).",
    )
    clean_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="bfloat16",
        description="Dtype of the in-process clean model. bfloat16 costs less CPU time than "
        "float32 where the CPU has bfloat16 arithmetic, and adds its own rounding to the "
        "measured noise (alpha, sigma2 and the scoreboard's KLD within 1 % of float32's, "
        "tests/integration/test_clean_dtype.py); choose float32 for pairs with alpha < 0.03.",
    )
    clean_url: str | None = Field(
        default=None, description="Base URL of the remote clean server (clean_backend=remote)."
    )
    clean_remote_model: str = Field(
        default="clean",
        description="The name the remote clean server serves the clean model under "
        "(its --served-model-name).",
    )
    clean_api_key: SecretStr | None = Field(
        default=None, description="API key of the remote clean server, if it needs one."
    )
    clean_timeout_s: PositiveFloat = Field(
        default=30.0,
        description="Per-request timeout of the remote clean server; a slower answer drops "
        "that request from scoring (never from serving).",
    )
    shadow_threads: int = Field(
        default=1,
        ge=1,
        description="Torch threads of the API process, i.e. of the shadow scorer (the engine "
        "runs in its own process with its own threads).",
    )
    shadow_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="Nice steps the shadow scoring thread runs below the API process once the "
        "first online policy is out, so that the engine wins shared CPU cores (0: same).",
    )
    shadow_cpu_share: float = Field(
        default=0.02,
        gt=0.0,
        le=1.0,
        description="CPU budget of the shadow scorer once the first online policy is out, as a "
        "share of the machine (all cores): a request drawn at shadow_fraction is scored only "
        "while the budget has credit, so sampling thins out under load (1: no limit).",
    )
    shadow_warmup_cpu_share: float = Field(
        default=0.25,
        gt=0.0,
        le=1.0,
        description="The shadow scorer's CPU budget until the first online policy is out; until "
        "then it also runs at the API process's priority (shadow_nice applies after).",
    )
    shadow_min_positions: int = Field(
        default=1000,
        ge=1,
        description="Scored positions the estimator needs before it publishes its first policy.",
    )
    shadow_bias_rows: int = Field(
        default=32,
        ge=1,
        description="Positions per scored request whose full clean and served rows refine a "
        "served per-token bias online (evenly spaced; 8 bytes per vocabulary entry each, "
        "while the request is scored). Used only when the policy serves a bias.",
    )
    shadow_bias_keep_s: float = Field(
        default=600.0,
        ge=0,
        description="Seconds a superseded online bias file is kept after its successor was "
        "published (beyond the 4 most recent): longer than any request waits in the engine's "
        "queue, which loads its policy's bias when it admits the request.",
    )
    shadow_window_positions: int = Field(
        default=50_000,
        ge=1,
        description="Most recent scored positions the estimator refits on (this bounds its "
        "memory); at least shadow_min_positions.",
    )

    # --- capture of the served logits in the engine (for the shadow scorer) ---
    capture_rows_per_step: int = Field(
        default=8,
        ge=1,
        description="Most served-logit rows the engine captures per step for shadow-sampled "
        "requests (float32, 4 bytes per vocabulary entry each); beyond, dropped and counted.",
    )
    capture_positions: int = Field(
        default=128,
        ge=1,
        description="Generation steps of a shadow-sampled request whose served logits are "
        "captured (steps 0 .. capture_positions - 1); later steps are not scored.",
    )
    capture_queue_rows: int = Field(
        default=64,
        ge=1,
        description="Captured rows waiting for the engine's reporter thread; beyond, dropped "
        "and counted (the step loop never waits).",
    )
    capture_buffer_mib: int = Field(
        default=512,
        ge=1,
        description="Captured rows the API process holds for the shadow scorer (MiB); beyond, "
        "the oldest request's rows are dropped.",
    )

    # --- engine ---
    max_model_len: int = Field(default=2048, ge=16, description="Context length (tokens).")
    kv_cache_gib: int | None = Field(
        default=None,
        ge=1,
        description="KV cache size in GiB (default: 2 on CPU, as VLLM_CPU_KVCACHE_SPACE; on CUDA "
        "unset, the cache is sized by gpu_memory_utilization).",
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Fraction of GPU memory vLLM may use on CUDA (default: vLLM's 0.9, or 0.7 "
        "when the shadow scorer shares the GPU); ignored on CPU and when kv_cache_gib is set.",
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        description="Most sequences in one engine batch (default: 32 on CPU, vLLM's own default "
        "on CUDA).",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="GPUs of one node the served model is sharded over (vLLM tensor "
        "parallelism; must divide the model's attention heads).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Weight and activation dtype of the served model."
    )
    enforce_eager: bool | None = Field(
        default=None,
        description="Skip graph capture / compilation (default: false, as vllm serve, but on a "
        "CPU without the C++ compiler it needs: docs/serving.md).",
    )
    vllm_args: str = Field(
        default="",
        description="vllm serve's flags, shell-quoted (--enable-prefix-caching --seed 0); on "
        "the command line, every flag serve does not have (server/vllm_flags.py).",
    )
    tuned_logprobs: bool = Field(
        default=True,
        description="Returned logprobs describe the tuned distribution, the one sampled from "
        "(vLLM's processed_logprobs: a log-softmax over the vocabulary at every sampled step, "
        "and no FlashInfer sampler on CUDA). false: the served model's raw logprobs, vLLM's "
        "default and faster.",
    )
    fused_step: bool = Field(
        default=True,
        description="On CUDA, the engine's T* step of every rule runs as Triton kernels where "
        "Triton imports (one launch; the rules that read the served row read it twice), "
        "compiled when the engine starts; false: as separate torch operations, as on the CPU "
        "(docs/gpu.md).",
    )
    trace_timeout_s: PositiveFloat = Field(
        default=2.0,
        description="How long a response waits for the engine's last T* trace steps.",
    )

    @field_validator("allowed_origins", "allowed_methods", "allowed_headers", mode="before")
    @classmethod
    def _json_list(cls, value: Any) -> Any:
        """A JSON list given as text (the flag, as vllm serve takes it), as a list."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"expected a JSON list, got {value!r}") from error
        return value

    @field_validator("perturbation")
    @classmethod
    def _perturbation_is_a_spec(cls, value: str) -> str:
        from noisy_temp_server.checkpoints.perturbation import parse_spec  # noqa: PLC0415 (torch, lazily)

        parse_spec(value)
        return value

    @model_validator(mode="after")
    def _remote_clean_has_a_url(self) -> Settings:
        if self.clean_backend == "remote" and not self.clean_url:
            raise ValueError("clean_backend=remote needs clean_url (the clean server's base URL)")
        return self

    @model_validator(mode="after")
    def _shadow_window_holds_the_first_refit(self) -> Settings:
        if self.shadow_window_positions < self.shadow_min_positions:
            raise ValueError(
                f"shadow_window_positions ({self.shadow_window_positions}) must be at least "
                f"shadow_min_positions ({self.shadow_min_positions})."
            )
        return self

    @model_validator(mode="after")
    def _temperature_defaults_are_consistent(self) -> Settings:
        from noisy_temp_server.temperature.rules import TemperatureBounds  # noqa: PLC0415

        low, high = self.default_t_min, self.default_t_max
        if low is not None and high is not None and low > high:
            raise ValueError(
                f"default_t_min ({low}) must not exceed default_t_max ({high}); "
                "swap or drop one of them."
            )
        TemperatureBounds(t_min=1.0 if low is None else low, t_max=1.0 if high is None else high)
        if self.default_t is not None and self.default_rule not in (None, "fixed"):
            raise ValueError(
                f"default_t applies to the `fixed` rule only, but default_rule is "
                f"{self.default_rule!r}; drop default_t or set default_rule to fixed."
            )
        return self


CPU_KV_CACHE_GIB = 2
CPU_MAX_NUM_SEQS = 32
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
GPU_MEMORY_UTILIZATION_WITH_SHADOW = 0.7


@dataclass(frozen=True)
class EngineSettings:
    """The engine settings of `Settings` resolved for a device (None: vLLM decides)."""

    kv_cache_gib: int | None
    gpu_memory_utilization: float | None
    max_num_seqs: int | None
    enforce_eager: bool


def engine_settings(
    settings: Settings, *, on_cpu: bool, cpu_compiler: bool = True
) -> EngineSettings:
    """The engine settings for the CPU (small defaults, vLLM's compilation where `cpu_compiler`
    says a C++ compiler is there for it, eager otherwise) or for CUDA (vLLM's own: CUDA graphs
    and compilation on, KV cache by memory utilisation, leaving room for the shadow scorer's
    two models when they share the GPU, and vLLM's batch size). Explicit settings win."""
    if on_cpu:
        eager = not cpu_compiler if settings.enforce_eager is None else settings.enforce_eager
        return EngineSettings(
            kv_cache_gib=settings.kv_cache_gib or CPU_KV_CACHE_GIB,
            gpu_memory_utilization=None,
            max_num_seqs=settings.max_num_seqs or CPU_MAX_NUM_SEQS,
            enforce_eager=eager,
        )
    shadow_on_gpu = settings.shadow_fraction > 0 and settings.shadow_device.startswith("cuda")
    utilization = settings.gpu_memory_utilization
    if utilization is None and settings.kv_cache_gib is None:
        utilization = (
            GPU_MEMORY_UTILIZATION_WITH_SHADOW if shadow_on_gpu else GPU_MEMORY_UTILIZATION
        )
    return EngineSettings(
        kv_cache_gib=settings.kv_cache_gib,
        gpu_memory_utilization=utilization,
        max_num_seqs=settings.max_num_seqs,
        enforce_eager=bool(settings.enforce_eager),
    )


def _parse_bool(text: str) -> bool:
    try:
        return BOOLEAN_WORDS[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}") from None


def add_settings_arguments(
    parser: argparse.ArgumentParser, fields: list[str] | None = None
) -> None:
    """Add a `--field-name` flag for each named `Settings` field (all fields if None).

    Flags default to "not given" so environment variables and defaults still apply; booleans
    take `true`/`false`, or no value for true (as vLLM's switches: `--enforce-eager`). Values
    are parsed and validated by `Settings` itself.
    """
    names = list(Settings.model_fields) if fields is None else fields
    group = parser.add_argument_group("settings (each also read from NTS_<NAME>)")
    for name in names:
        info = Settings.model_fields[name]
        flag = "--" + name.replace("_", "-")
        boolean = info.annotation in (bool, bool | None)
        group.add_argument(
            flag,
            dest=f"setting_{name}",
            type=_parse_bool if boolean else str,
            nargs="?" if boolean else None,
            const=True if boolean else None,
            default=argparse.SUPPRESS,
            metavar=name.upper(),
            help=f"{info.description} [env NTS_{name.upper()}]".replace("%", "%%"),
        )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """`Settings` from environment and defaults, with the flags added by
    `add_settings_arguments` that were given on the command line as overrides.

    Raises pydantic's `ValidationError` naming the bad field.
    """
    overrides: dict[str, Any] = {
        key.removeprefix("setting_"): value
        for key, value in vars(args).items()
        if key.startswith("setting_")
    }
    return Settings(**overrides)


def settings_as_json(settings: Settings) -> str:
    """The settings as JSON with the API key masked (for startup logs)."""
    return json.dumps(settings.model_dump(mode="json"), sort_keys=True)
