"""Every name the API process and the engine share, spelled once: the flat ``nts_*`` request keys
and the ``NTS_*`` environment variables the engine reads.

Request keys travel in ``SamplingParams.extra_args`` (`request_args` parses them); who may set
one says where it is accepted:

- `CLIENT_KEYS`: a client of ``noisy-temp-server serve`` sends them (top-level fields of the
  request models in `server.protocol`, or inside ``vllm_xargs``); among them `API_ONLY_KEYS`,
  which the API process consumes (`server.adapter`) and never hands to the engine;
- `SERVER_KEYS`: ``serve`` sets them on every request and refuses them from a client;
- `ENGINE_ONLY_KEYS`: accepted by the engine's parser (a stock vLLM server with this package),
  refused by ``serve``, where the same thing is a server setting.

`REQUEST_KEYS` is all of them but `API_ONLY_KEYS`: the engine's parser refuses any other
``nts_*`` key. The table in ``docs/architecture.md`` ("Flat request keys") lists `REQUEST_KEYS`
and `API_ONLY_KEYS` (a unit test holds it).

The environment variables are the engine's configuration (`engine_env.EngineConfig` reads and
writes them, nothing else does); `ENGINE_ENV_NAMES` is all of them.
"""

from __future__ import annotations

__all__ = [
    "API_ONLY_KEYS",
    "BIAS_DIR_ENV",
    "CAPTURE_POSITIONS_ENV",
    "CAPTURE_QUEUE_ROWS_ENV",
    "CAPTURE_ROWS_PER_STEP_ENV",
    "CLIENT_KEYS",
    "ENGINE_ENV_NAMES",
    "ENGINE_ONLY_KEYS",
    "FUSED_STEP_ENV",
    "KEY_ADAPTER",
    "KEY_BIAS",
    "KEY_CAPTURE",
    "KEY_POLICY",
    "KEY_PREFIX",
    "KEY_RULE",
    "KEY_RUNTIME_NOISE_SIGMA",
    "KEY_T",
    "KEY_TRACE",
    "KEY_TRACE_ID",
    "KEY_TUNE",
    "KEY_T_MAX",
    "KEY_T_MIN",
    "POLICY_FILE_ENV",
    "REQUEST_KEYS",
    "RUNTIME_NOISE_SEED_ENV",
    "RUNTIME_NOISE_SIGMA_ENV",
    "SERVER_KEYS",
    "TRACE_ENDPOINT_ENV",
]

KEY_PREFIX = "nts_"
"""Keys with this prefix belong to noisy-temp-server; an unknown one is an error."""

KEY_TUNE = "nts_tune"
KEY_RULE = "nts_rule"
KEY_T = "nts_t"
KEY_T_MIN = "nts_t_min"
KEY_T_MAX = "nts_t_max"
KEY_TRACE = "nts_trace"
KEY_BIAS = "nts_bias"
KEY_POLICY = "nts_policy"
KEY_TRACE_ID = "nts_trace_id"
KEY_CAPTURE = "nts_capture"
KEY_RUNTIME_NOISE_SIGMA = "nts_runtime_noise_sigma"
KEY_ADAPTER = "nts_adapter"

CLIENT_KEYS: tuple[str, ...] = (
    KEY_TUNE,
    KEY_RULE,
    KEY_T,
    KEY_T_MIN,
    KEY_T_MAX,
    KEY_TRACE,
    KEY_BIAS,
    KEY_ADAPTER,
)
API_ONLY_KEYS: tuple[str, ...] = (KEY_ADAPTER,)
SERVER_KEYS: tuple[str, ...] = (KEY_POLICY, KEY_TRACE_ID, KEY_CAPTURE)
ENGINE_ONLY_KEYS: tuple[str, ...] = (KEY_RUNTIME_NOISE_SIGMA,)
REQUEST_KEYS: frozenset[str] = frozenset(CLIENT_KEYS + SERVER_KEYS + ENGINE_ONLY_KEYS) - frozenset(
    API_ONLY_KEYS
)

TRACE_ENDPOINT_ENV = "NTS_TRACE_ENDPOINT"
BIAS_DIR_ENV = "NTS_BIAS_DIR"
POLICY_FILE_ENV = "NTS_POLICY_FILE"
RUNTIME_NOISE_SIGMA_ENV = "NTS_RUNTIME_NOISE_SIGMA"
RUNTIME_NOISE_SEED_ENV = "NTS_RUNTIME_NOISE_SEED"
CAPTURE_ROWS_PER_STEP_ENV = "NTS_CAPTURE_ROWS_PER_STEP"
CAPTURE_POSITIONS_ENV = "NTS_CAPTURE_POSITIONS"
CAPTURE_QUEUE_ROWS_ENV = "NTS_CAPTURE_QUEUE_ROWS"
FUSED_STEP_ENV = "NTS_FUSED_STEP"

ENGINE_ENV_NAMES: tuple[str, ...] = (
    TRACE_ENDPOINT_ENV,
    BIAS_DIR_ENV,
    POLICY_FILE_ENV,
    RUNTIME_NOISE_SIGMA_ENV,
    RUNTIME_NOISE_SEED_ENV,
    CAPTURE_ROWS_PER_STEP_ENV,
    CAPTURE_POSITIONS_ENV,
    CAPTURE_QUEUE_ROWS_ENV,
    FUSED_STEP_ENV,
)
