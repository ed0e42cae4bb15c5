"""The flat per-request keys of noisy-temp-server, parsed from ``SamplingParams.extra_args``.

One parser for both sides: the API server validates a request with `parse_request_args` (a
``ValueError`` becomes HTTP 400) and writes the keys with `issue_extra_args`
(`TuningKeys.to_extra_args`); inside vLLM, `NoisyTemperatureLogitsProcessor.validate_params`
and the processor's admission of the request read them with the same function.

Two objects describe a request's tuning, one per stage of its path:

- `TuningKeys`: the parsed, validated keys as the client (and the server) sent them, overrides
  still unresolved (`parse_request_args`);
- `RequestTuning`: what the processor applies to a tuned request, the overrides resolved against
  the pinned policy (`resolve_request`; None for a request that is not tuned).

Each process parses a request's keys once: the API server at admission (`parse_request_args`,
then `resolve_request` and `resolve_correction` of the result; it writes each engine request's
keys with `issue_extra_args`, so that vLLM's ``validate_params``, which runs in the API process
too, gets them back without parsing them again), vLLM's engine when it admits the request into
its batch (`admit_request`: one `AdmittedRequest` that the T* processor and the capture of
served logits share).

The keys, and who may set each, are named in `keys` (`keys.REQUEST_KEYS`); what each means is
the table "Flat request keys" of ``docs/architecture.md``.

Values may arrive as JSON types or as strings (vLLM's ``vllm_xargs`` carries strings, ints and
floats): booleans accept ``true/false/1/0/yes/no/on/off`` (`engine_env.BOOLEAN_WORDS`, the one
list of boolean words), numbers accept numeric strings. Any other ``nts_*`` key is rejected (a
typo must not silently do nothing); keys without the prefix belong to others and are ignored.

Without ``nts_policy`` (e.g. a stock vLLM server with this package installed), the policy comes
from the JSON file named by ``NTS_POLICY_FILE`` (`engine_env.EngineConfig.policy_file`, a
`TemperaturePolicy` JSON), else the identity policy (rule ``off``): nothing is tuned unless a
request asks for a rule.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from noisy_temp_server.engine_contract.engine_env import BOOLEAN_WORDS, engine_config
from noisy_temp_server.engine_contract.keys import (
    KEY_BIAS,
    KEY_CAPTURE,
    KEY_POLICY,
    KEY_PREFIX,
    KEY_RULE,
    KEY_RUNTIME_NOISE_SIGMA,
    KEY_T,
    KEY_T_MAX,
    KEY_T_MIN,
    KEY_TRACE,
    KEY_TRACE_ID,
    KEY_TUNE,
    POLICY_FILE_ENV,
    REQUEST_KEYS,
)
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule, TemperatureBounds

__all__ = [
    "GREEDY_TEMPERATURE",
    "NOT_ADMITTED",
    "AdmittedRequest",
    "LogitCorrection",
    "RequestTuning",
    "SamplingSettings",
    "TuningKeys",
    "admit_request",
    "capturable",
    "capture_trace_id",
    "default_policy_json",
    "issue_extra_args",
    "parse_policy_json",
    "parse_request_args",
    "parse_runtime_noise_sigma",
    "resolve_correction",
    "resolve_request",
]

_RULE_NAMES = " ".join(rule.value for rule in Rule)
_POLICY_CACHE_SIZE = 32
_ISSUED_HELD = 4096
_ISSUED: OrderedDict[tuple[tuple[str, type, Any], ...], TuningKeys] = OrderedDict()
_ISSUED_LOCK = threading.Lock()
GREEDY_TEMPERATURE = 1e-5
"""vLLM samples greedily below this request temperature (``_SAMPLING_EPS``); never tuned."""


@dataclass(frozen=True)
class TuningKeys:
    """One request's ``nts_*`` keys, validated (the policy's overrides not yet resolved).

    ``rule``/``fixed_t``/``t_min``/``t_max`` are the request's overrides of its policy (None:
    the policy's own). ``policy_json`` is the snapshot the server pinned at admission (None: the
    engine's default, see `default_policy_json`). ``capture``: the engine captures the request's
    served logits under ``trace_id`` (`vllm_plugin.capture`), tuned or not.
    """

    tune: bool = True
    rule: Rule | None = None
    fixed_t: float | None = None
    t_min: float | None = None
    t_max: float | None = None
    trace: bool = False
    bias: bool = True
    policy_json: str | None = None
    trace_id: str | None = None
    capture: bool = False

    def to_extra_args(self) -> dict[str, Any]:
        """The flat keys for ``SamplingParams.extra_args`` (only the ones that differ from the
        defaults); `parse_request_args` of the result gives back an equal object."""
        keys: dict[str, Any] = {}
        if not self.tune:
            keys[KEY_TUNE] = False
        if self.rule is not None:
            keys[KEY_RULE] = self.rule.value
        for key, value in ((KEY_T, self.fixed_t), (KEY_T_MIN, self.t_min), (KEY_T_MAX, self.t_max)):
            if value is not None:
                keys[key] = value
        if self.trace:
            keys[KEY_TRACE] = True
        if not self.bias:
            keys[KEY_BIAS] = False
        if self.policy_json is not None:
            keys[KEY_POLICY] = self.policy_json
        if self.trace_id is not None:
            keys[KEY_TRACE_ID] = self.trace_id
        if self.capture:
            keys[KEY_CAPTURE] = True
        return keys


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in BOOLEAN_WORDS:
        return BOOLEAN_WORDS[value.strip().lower()]
    raise ValueError(f"{key} must be a boolean (true or false), got {value!r}.")


def _as_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"{key} must be a number, got {value!r}.")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{key} must be a number, got {value!r}.") from None
    if not math.isfinite(number):
        raise ValueError(f"{key} must be finite, got {value!r}.")
    return number


def _as_str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a non-empty string, got {value!r}.")
    return value


def _as_rule(value: Any) -> Rule:
    name = value.strip().lower() if isinstance(value, str) else value
    try:
        return Rule(name)
    except ValueError:
        raise ValueError(
            f"{KEY_RULE}={value!r} is not a rule; use one of: {_RULE_NAMES}."
        ) from None


def parse_request_args(extra_args: Mapping[str, Any] | None) -> TuningKeys:
    """Validate the ``nts_*`` keys of ``extra_args`` (None or empty: all defaults).

    Raises ValueError, naming the key and what to send instead, for: an unknown ``nts_*`` key,
    a value of the wrong type, an unknown rule, ``nts_t`` not finite or <= 0, ``nts_t`` with an
    ``nts_rule`` other than ``fixed``, bounds outside ``0 < t_min <= 1 <= t_max`` or
    ``t_min > t_max``, and an ``nts_policy`` that is not a valid policy JSON.

    ``nts_rule=fixed`` without ``nts_t`` uses the policy's ``fixed_temperature`` (fitted when the
    policy comes from a profile; 1 under the identity policy). ``nts_t`` without ``nts_rule``
    applies only when the policy's own rule is ``fixed``; otherwise `resolve_request` refuses it.

    Keys this process issued itself (`issue_extra_args`) come back as they were issued, once,
    without being parsed again.
    """
    if not extra_args:
        return TuningKeys()
    issued = _take_issued(extra_args) if _ISSUED else None
    return _parse(extra_args) if issued is None else issued


def _parse(extra_args: Mapping[str, Any]) -> TuningKeys:
    unknown = sorted(k for k in extra_args if k.startswith(KEY_PREFIX) and k not in REQUEST_KEYS)
    if unknown:
        raise ValueError(
            f"Unknown noisy-temp-server request key(s) {', '.join(unknown)}; "
            f"the known keys are {', '.join(sorted(REQUEST_KEYS))}."
        )
    get = extra_args.get
    tune = _as_bool(KEY_TUNE, get(KEY_TUNE)) if get(KEY_TUNE) is not None else True
    trace = _as_bool(KEY_TRACE, get(KEY_TRACE)) if get(KEY_TRACE) is not None else False
    capture = _as_bool(KEY_CAPTURE, get(KEY_CAPTURE)) if get(KEY_CAPTURE) is not None else False
    bias = _as_bool(KEY_BIAS, get(KEY_BIAS)) if get(KEY_BIAS) is not None else True
    rule = _as_rule(get(KEY_RULE)) if get(KEY_RULE) is not None else None
    fixed_t = _as_float(KEY_T, get(KEY_T)) if get(KEY_T) is not None else None
    t_min = _as_float(KEY_T_MIN, get(KEY_T_MIN)) if get(KEY_T_MIN) is not None else None
    t_max = _as_float(KEY_T_MAX, get(KEY_T_MAX)) if get(KEY_T_MAX) is not None else None
    policy_json = _as_str(KEY_POLICY, get(KEY_POLICY)) if get(KEY_POLICY) is not None else None
    trace_id = _as_str(KEY_TRACE_ID, get(KEY_TRACE_ID)) if get(KEY_TRACE_ID) is not None else None

    if fixed_t is not None and fixed_t <= 0:
        raise ValueError(f"{KEY_T} must be > 0, got {fixed_t!r}.")
    if fixed_t is not None and rule not in (None, Rule.FIXED):
        raise ValueError(
            f"{KEY_T} only applies to {KEY_RULE}=fixed, got {KEY_RULE}={rule.value!r}; "
            f"drop {KEY_T} or send {KEY_RULE}=fixed."
        )
    if t_min is not None and t_max is not None and t_min > t_max:
        raise ValueError(f"{KEY_T_MIN}={t_min!r} is greater than {KEY_T_MAX}={t_max!r}.")
    try:
        TemperatureBounds(
            t_min=1.0 if t_min is None else t_min, t_max=1.0 if t_max is None else t_max
        )
    except ValueError as error:
        raise ValueError(f"{KEY_T_MIN}/{KEY_T_MAX}: {error}.") from None
    if policy_json is not None:
        parse_policy_json(policy_json)
    parse_runtime_noise_sigma(extra_args)
    return TuningKeys(
        tune=tune,
        rule=rule,
        fixed_t=fixed_t,
        t_min=t_min,
        t_max=t_max,
        trace=trace,
        bias=bias,
        policy_json=policy_json,
        trace_id=trace_id,
        capture=capture,
    )


def issue_extra_args(keys: TuningKeys) -> dict[str, Any]:
    """``keys.to_extra_args()`` for a request this process hands to vLLM, remembered so that the
    next `parse_request_args` in this process of exactly these keys returns ``keys`` without
    parsing them again: vLLM runs the processors' ``validate_params`` in the API process, on
    keys the server has parsed already. ``keys`` must come from `parse_request_args` (valid).
    The last `_ISSUED_HELD` issued and not yet parsed are held."""
    extra_args = keys.to_extra_args()
    with _ISSUED_LOCK:
        _ISSUED[_fingerprint(extra_args)] = keys
        while len(_ISSUED) > _ISSUED_HELD:
            _ISSUED.popitem(last=False)
    return extra_args


def _fingerprint(extra_args: Mapping[str, Any]) -> tuple[tuple[str, type, Any], ...]:
    """The ``nts_*`` keys of ``extra_args`` with each value and its type (True is not 1)."""
    return tuple(
        sorted(
            (key, type(value), value)
            for key, value in extra_args.items()
            if key.startswith(KEY_PREFIX)
        )
    )


def _take_issued(extra_args: Mapping[str, Any]) -> TuningKeys | None:
    try:
        with _ISSUED_LOCK:
            return _ISSUED.pop(_fingerprint(extra_args), None)
    except TypeError:  # an unhashable value: never issued
        return None


def parse_runtime_noise_sigma(extra_args: Mapping[str, Any] | None) -> float | None:
    """``nts_runtime_noise_sigma`` (None when absent). Raises ValueError unless finite and >= 0."""
    if not extra_args or extra_args.get(KEY_RUNTIME_NOISE_SIGMA) is None:
        return None
    sigma = _as_float(KEY_RUNTIME_NOISE_SIGMA, extra_args[KEY_RUNTIME_NOISE_SIGMA])
    if sigma < 0:
        raise ValueError(f"{KEY_RUNTIME_NOISE_SIGMA} must be >= 0, got {sigma!r}.")
    return sigma


@lru_cache(maxsize=_POLICY_CACHE_SIZE)
def parse_policy_json(text: str) -> TemperaturePolicy:
    """Parse a policy snapshot; cached by its exact text (bounded LRU), so each policy version
    is parsed once, not once per request. Raises ValueError when the text is not a policy."""
    try:
        return TemperaturePolicy.from_json(text)
    except ValueError as error:
        raise ValueError(f"{KEY_POLICY} is not a valid temperature policy JSON: {error}") from None


@lru_cache(maxsize=1)
def _policy_file_json(path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"{POLICY_FILE_ENV}={path!r} cannot be read: {error}.") from None
    try:
        policy = TemperaturePolicy.from_json(text)
    except ValueError as error:
        raise ValueError(
            f"{POLICY_FILE_ENV}={path!r} is not a temperature policy JSON: {error}"
        ) from None
    return policy.to_json()


@lru_cache(maxsize=1)
def _identity_policy_json() -> str:
    return TemperaturePolicy.identity().to_json()


@lru_cache(maxsize=_POLICY_CACHE_SIZE)
def _policy_with_rule(policy_json: str, rule: Rule | None) -> TemperaturePolicy:
    policy = parse_policy_json(policy_json)
    return policy if rule is None else policy.with_overrides(rule=rule)


@dataclass(frozen=True)
class RequestTuning:
    """What the processor applies to a tuned request: its policy with the rule override in
    place, and its per-row fixed T and bounds with the request's overrides resolved.
    `trace_id` keys its per-step T* on the trace channel; `trace` says whether the client asked
    for the per-step trace in the response."""

    policy: TemperaturePolicy
    fixed_t: float
    t_min: float
    t_max: float
    trace_id: str | None
    trace: bool = False

    @property
    def rule(self) -> Rule:
        return self.policy.rule


def resolve_request(keys: TuningKeys, request_temperature: float) -> RequestTuning | None:
    """The request's tuning, or None when it is not tuned: ``nts_tune`` off, a greedy request
    (``request_temperature < GREEDY_TEMPERATURE``) or rule ``off``. The server uses this to
    know whether trace records will come (none come for an untuned request).

    Raises ValueError when the default policy (``NTS_POLICY_FILE``) is needed and invalid, and
    when ``nts_t`` is given but the rule in force (``nts_rule``, else the policy's) is not
    ``fixed``: a T that would be ignored.
    """
    if not keys.tune:
        return None
    policy = _policy_with_rule(keys.policy_json or default_policy_json(), keys.rule)
    if keys.fixed_t is not None and policy.rule is not Rule.FIXED:  # greedy requests too
        raise ValueError(
            f"{KEY_T} only applies to the fixed rule, and the policy in force has rule "
            f"{policy.rule.value!r}; send {KEY_RULE}=fixed with it, or drop {KEY_T}."
        )
    if request_temperature < GREEDY_TEMPERATURE or policy.rule is Rule.OFF:
        return None
    bounds = policy.bounds
    return RequestTuning(
        policy=policy,
        fixed_t=policy.fixed_temperature if keys.fixed_t is None else keys.fixed_t,
        t_min=bounds.t_min if keys.t_min is None else keys.t_min,
        t_max=bounds.t_max if keys.t_max is None else keys.t_max,
        trace_id=keys.trace_id,
        trace=keys.trace,
    )


@dataclass(frozen=True)
class LogitCorrection:
    """The correction a request's logits get before its temperature: the sha256 of its
    per-token bias."""

    bias: str


def resolve_correction(keys: TuningKeys) -> LogitCorrection | None:
    """The per-token bias the request gets: its policy's, whatever the rule and
    the request temperature (greedy requests get it too), or None: no bias in the policy,
    ``nts_bias`` off, or ``nts_tune`` off (no correction at all).

    Raises ValueError when the default policy (``NTS_POLICY_FILE``) is needed and invalid.
    """
    if not keys.tune or not keys.bias:
        return None
    policy = parse_policy_json(keys.policy_json or default_policy_json())
    return None if policy.bias is None else LogitCorrection(policy.bias)


def capture_trace_id(keys: TuningKeys, request_temperature: float) -> str | None:
    """The trace id to capture a request's served logits under, or None: not marked with
    ``nts_capture``, no trace id, or greedy (vLLM's V1 sampler skips argmax-invariant processors
    for an all-greedy batch, so a greedy request could not be captured reliably)."""
    if not keys.capture or keys.trace_id is None or request_temperature < GREEDY_TEMPERATURE:
        return None
    return keys.trace_id


@dataclass(frozen=True)
class AdmittedRequest:
    """What the engine does with one request, from one parse of its keys when vLLM admits it
    into its batch (`admit_request`): its temperature tuning (`resolve_request`; None:
    untuned), its per-token bias (`resolve_correction`; None: none) and the trace id its served
    logits are captured under (`capture_trace_id`; None: not captured)."""

    tuning: RequestTuning | None = None
    correction: LogitCorrection | None = None
    capture_trace_id: str | None = None


NOT_ADMITTED = AdmittedRequest()
"""Nothing to do for the request (a duplicate processor's admission)."""


def admit_request(
    extra_args: Mapping[str, Any] | None, request_temperature: float
) -> AdmittedRequest:
    """The engine's one parse of a request's keys (``SamplingParams.extra_args``; the request
    temperature as vLLM samples it): its `AdmittedRequest`. Raises ValueError as
    `parse_request_args`, `resolve_request` and `resolve_correction` do."""
    keys = parse_request_args(extra_args)
    return AdmittedRequest(
        tuning=resolve_request(keys, request_temperature),
        correction=resolve_correction(keys),
        capture_trace_id=capture_trace_id(keys, request_temperature),
    )


def default_policy_json() -> str:
    """The compact JSON of the engine's default policy: the file of ``NTS_POLICY_FILE``
    (`EngineConfig.policy_file`, read once per path) or the identity policy. Raises ValueError
    when the file is unreadable or invalid."""
    path = engine_config().policy_file
    return _policy_file_json(str(path)) if path is not None else _identity_policy_json()


class SamplingSettings(Protocol):
    """What `capturable` reads of a request's sampling parameters (vLLM's `SamplingParams`;
    typed here so that the contract imports no vLLM)."""

    @property
    def temperature(self) -> float: ...

    @property
    def presence_penalty(self) -> float: ...

    @property
    def frequency_penalty(self) -> float: ...

    @property
    def repetition_penalty(self) -> float: ...

    @property
    def logit_bias(self) -> object: ...

    @property
    def min_tokens(self) -> object: ...

    @property
    def structured_outputs(self) -> object: ...

    @property
    def bad_words(self) -> object: ...

    @property
    def allowed_token_ids(self) -> object: ...


def capturable(params: SamplingSettings) -> bool:
    """Whether the rows vLLM samples a request from are the served model's own, so that the
    shadow scorer may sample it (and the server mark it with ``nts_capture``): not greedy (see
    `capture_trace_id`), and no penalties, logit bias, minimum length, bad
    words, allowed-token list or structured-output grammar (vLLM applies them before our
    processor: the rows would measure them, not the model)."""
    return (
        params.temperature >= GREEDY_TEMPERATURE
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.logit_bias
        and not params.min_tokens
        and not params.bad_words
        and params.allowed_token_ids is None
        and params.structured_outputs is None
    )
