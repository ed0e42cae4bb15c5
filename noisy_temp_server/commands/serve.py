"""`noisy-temp-server serve`: the OpenAI-compatible server in front of vLLM.

With no arguments it serves the embedded default model (SmolLM2-135M-Instruct, converted once
into the cache) with the default perturbation (runtime logit noise, sigma = 1), starts it from
the calibration profile shipped for that pair (`DEFAULT_PAIR_PROFILE`), keeps the clean model for
shadow scoring, runs on the CPU and listens on 127.0.0.1:8000. `--perturbation` serves another
pair (started at T = 1 unless `--profile` is given). A runtime logit noise spec
(`--perturbation`, or recorded in the manifest of `--served-model`) serves unchanged weights
and adds the noise in the engine (`RuntimeLogitNoiseProcessor`) and in the shadow scorer. Every
setting is a flag here and an `NTS_*` environment variable (see `noisy_temp_server.settings`).

Startup order (see `server.engine`): environment first (before vLLM and prometheus_client are
imported), then checkpoints, trace channel, engine, shadow scorer, HTTP server. Each phase is
logged with its duration.

Exit status: 0 after a normal shutdown, 1 when the engine died (`server.engine_watchdog`: the
server then shuts down within a bounded time, for a supervisor to restart it) or a profile does
not match the served pair.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import ipaddress
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from noisy_temp_server.settings import (
    Settings,
    add_settings_arguments,
    settings_as_json,
    settings_from_args,
)

if TYPE_CHECKING:
    from noisy_temp_server.calibration.profile import ModelIdentity, Profile
    from noisy_temp_server.engine_contract.trace_channel import TraceCollector
    from noisy_temp_server.online.shadow import ShadowScorer
    from noisy_temp_server.pairs.perturbation import PerturbationSpec, RuntimeLogitNoiseSpec
    from noisy_temp_server.pairs.scorer import PairScorer
    from noisy_temp_server.server.engine import EngineEnvironment
    from noisy_temp_server.server.metrics import ApiMetrics
    from noisy_temp_server.server.policy_source import PolicySource
    from noisy_temp_server.temperature.policy import TemperaturePolicy

__all__ = [
    "HELP",
    "ServedPair",
    "StartupProfile",
    "add_arguments",
    "ensure_perturbed_checkpoint",
    "listens_beyond_loopback",
    "load_profile_for_pair",
    "pair_identities",
    "pair_scorer",
    "resolve_pair",
    "run",
    "startup_profile",
    "warn_if_open_without_api_key",
]

HELP = "Serve a (perturbed) model over the OpenAI API with tuned temperatures."

_LOGGER = logging.getLogger("noisy_temp_server.serve")


@contextlib.contextmanager
def _phase(what: str) -> Iterator[None]:
    _LOGGER.info("%s ...", what)
    started = time.perf_counter()
    yield
    _LOGGER.info("%s: done in %.1f s", what, time.perf_counter() - started)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser)
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )


def ensure_perturbed_checkpoint(clean_dir: Path, spec: PerturbationSpec, cache_dir: Path) -> Path:
    """The checkpoint of `clean_dir` perturbed by the weight-changing `spec`, in the cache.

    Written once (atomically, with the spec in its metadata) under
    `cache_dir/served/<clean name>-<spec hash>`; later calls reuse it after the fast integrity
    check. Raises ValueError for a spec that does not change weights.
    """
    from noisy_temp_server.pairs.checkpoint import verify_checkpoint  # noqa: PLC0415
    from noisy_temp_server.pairs.perturbation import QuantizationSpec, WeightNoiseSpec  # noqa: PLC0415
    from noisy_temp_server.pairs.perturbed_checkpoint import (  # noqa: PLC0415
        write_perturbed_checkpoint,
    )

    if not isinstance(spec, WeightNoiseSpec | QuantizationSpec):
        raise ValueError(
            f"only weight noise and quantization specs change weights, not {spec.kind}: "
            "runtime logit noise serves the clean weights, an external pair names its folders."
        )
    digest = hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:12]
    dest = cache_dir / "served" / f"{clean_dir.name}-{digest}"
    if dest.exists():
        verify_checkpoint(dest, full=False)
        return dest
    write_perturbed_checkpoint(
        clean_dir,
        spec,
        dest,
        source=f"noisy-temp-server serve: {clean_dir} perturbed by the spec in metadata",
    )
    return dest


@dataclass(frozen=True)
class ServedPair:
    """What `serve` serves (`served`), what it scores against (`clean`, None: no shadow
    scoring) and how the two differ (`spec`, None when unknown)."""

    served: Path
    clean: Path | None
    spec: PerturbationSpec | None

    @property
    def runtime_noise(self) -> RuntimeLogitNoiseSpec | None:
        """The runtime logit noise the engine and the shadow scorer add, if any."""
        from noisy_temp_server.pairs.perturbation import RuntimeLogitNoiseSpec  # noqa: PLC0415

        return self.spec if isinstance(self.spec, RuntimeLogitNoiseSpec) else None


def _served_checkpoint_pair(settings: Settings, served: Path) -> ServedPair:
    """The pair of `--served-model`: the perturbation recorded in its manifest, if it has one.

    A runtime-noise checkpoint (`perturb` copies the clean weights and records the spec) is
    served with that noise, and is its own clean reference unless `--clean-model` says otherwise.
    """
    from noisy_temp_server.calibration.profile import ModelIdentity  # noqa: PLC0415
    from noisy_temp_server.pairs.checkpoint import MANIFEST_FILENAME  # noqa: PLC0415
    from noisy_temp_server.pairs.perturbation import RuntimeLogitNoiseSpec  # noqa: PLC0415

    if not (served / MANIFEST_FILENAME).is_file():
        return ServedPair(served, settings.clean_model, None)
    identity = ModelIdentity.of_checkpoint(served)
    spec = identity.perturbation
    clean = settings.clean_model
    if isinstance(spec, RuntimeLogitNoiseSpec):
        if clean is None and identity.clean_weights_sha256 == identity.weights_sha256:
            clean = served
        _LOGGER.info(
            "%s records %s in its manifest: serving it with that runtime noise, scored against %s",
            served,
            spec.label,
            clean or "nothing (no clean model known; pass --clean-model)",
        )
    return ServedPair(served, clean, spec)


def resolve_pair(settings: Settings) -> ServedPair:
    """The served/clean pair the settings name, writing the served checkpoint if needed.

    `--served-model` wins (see `_served_checkpoint_pair`); else `--perturbation` applies to
    `--clean-model` or the default model: an external pair names both folders, runtime logit
    noise serves the clean weights as they are, and weight perturbations are written once to the
    cache (`ensure_perturbed_checkpoint`).
    """
    from noisy_temp_server.pairs.default_model import ensure_default_model  # noqa: PLC0415
    from noisy_temp_server.pairs.perturbation import (  # noqa: PLC0415
        ExternalPairSpec,
        RuntimeLogitNoiseSpec,
        parse_spec,
    )

    if settings.served_model is not None:
        return _served_checkpoint_pair(settings, settings.served_model)
    spec = parse_spec(settings.perturbation)
    if isinstance(spec, ExternalPairSpec):
        return ServedPair(spec.served_path, settings.clean_model or spec.clean_path, spec)
    with _phase("Preparing the default model (converting the embedded GGUF if needed)"):
        clean = settings.clean_model or ensure_default_model(settings.cache_dir)
    if isinstance(spec, RuntimeLogitNoiseSpec):
        _LOGGER.info("Serving the clean weights of %s with %s", clean, spec.label)
        return ServedPair(clean, clean, spec)
    with _phase(f"Preparing the served model ({spec.label}; written once to the cache)"):
        served = ensure_perturbed_checkpoint(clean, spec, settings.cache_dir)
    return ServedPair(served, clean, spec)


def pair_scorer(settings: Settings, pair: ServedPair) -> PairScorer:
    """The shadow scorer's `PairScorer` for `pair`: the clean side only (the served rows come
    from the engine, `vllm_plugin.capture`, so no copy of the served model is loaded here), from
    `settings.clean_backend`: the pair's clean model in process (on `settings.shadow_device`, in
    `settings.clean_dtype`), or the remote clean server."""
    import torch  # noqa: PLC0415
    from transformers import AutoConfig  # noqa: PLC0415

    from noisy_temp_server.pairs.checkpoint import load_causal_lm  # noqa: PLC0415
    from noisy_temp_server.pairs.clean_backend import RemoteClean  # noqa: PLC0415
    from noisy_temp_server.pairs.scorer import PairScorer  # noqa: PLC0415

    device = settings.shadow_device
    if settings.clean_backend == "remote":
        if settings.clean_url is None:
            raise ValueError("clean_backend=remote needs clean_url")
        config = AutoConfig.from_pretrained(pair.served, local_files_only=True)
        key = settings.clean_api_key
        remote = RemoteClean(
            settings.clean_url,
            settings.clean_remote_model,
            vocab_size=int(config.vocab_size),
            api_key=key.get_secret_value() if key is not None else None,
            timeout_s=settings.clean_timeout_s,
        )
        return PairScorer(remote, device=device)
    if pair.clean is None:
        raise ValueError("shadow scoring needs a clean model; pass --clean-model")
    dtype = getattr(torch, settings.clean_dtype)
    with _phase(f"Loading the clean model for shadow scoring on {device}"):
        clean, _ = load_causal_lm(pair.clean, device=device, dtype=dtype)
    return PairScorer(clean, device=device)


def pair_identities(pair: ServedPair) -> tuple[ModelIdentity | None, ModelIdentity]:
    """The identities a profile must match to serve `pair`: (clean, served); clean is None
    when the pair has no clean model.

    Each folder's identity comes from its manifest. Runtime logit noise on a folder whose
    manifest does not record it (the clean weights served as they are) makes the served identity
    `ModelIdentity.perturbed(clean, spec)`; a runtime-noise checkpoint that is its own clean
    reference has, as the clean model, its weights without the noise. Raises ProfileError when
    a folder has no readable manifest (its weights cannot be identified).
    """
    from noisy_temp_server.calibration.profile import ModelIdentity, ProfileError  # noqa: PLC0415
    from noisy_temp_server.pairs.checkpoint import CorruptCheckpointError  # noqa: PLC0415

    def identity(path: Path) -> ModelIdentity:
        try:
            return ModelIdentity.of_checkpoint(path)
        except CorruptCheckpointError as error:
            raise ProfileError(
                f"cannot check the profile against {path}: {error}; serve a checkpoint written "
                "by `noisy-temp-server model` or `perturb`, or serve without --profile"
            ) from error

    served = identity(pair.served)
    noise = pair.runtime_noise
    if noise is not None and served.perturbation is None:
        served = ModelIdentity.perturbed(served, noise)
    if pair.clean is None:
        return None, served
    if pair.clean.resolve() != pair.served.resolve():
        return identity(pair.clean), served
    recorded = identity(pair.clean)
    return ModelIdentity(name=recorded.name, weights_sha256=recorded.weights_sha256), served


DEFAULT_PAIR_PROFILE = Path(__file__).resolve().parent.parent / "data" / "default-pair.profile.json"
"""The profile of the default pair (the embedded model with `DEFAULT_PERTURBATION`), made by
`benchmarks/quality.py --families logit-noise --profiles DIR` and shipped in the package."""


def serves_default_pair(settings: Settings) -> bool:
    """Whether `settings` name the default pair: no served or clean model given and the default
    perturbation (compared as a parsed spec, so spelling does not matter)."""
    from noisy_temp_server.pairs.perturbation import parse_spec  # noqa: PLC0415
    from noisy_temp_server.settings import DEFAULT_PERTURBATION  # noqa: PLC0415

    return (
        settings.served_model is None
        and settings.clean_model is None
        and parse_spec(settings.perturbation) == parse_spec(DEFAULT_PERTURBATION)
    )


class StartupProfile(NamedTuple):
    """The profile the server starts from (None: none), the file it was loaded from (its
    folder holds the profile's bias file) and where it came from, in words."""

    profile: Profile | None
    path: Path | None
    source: str


def startup_profile(settings: Settings, pair: ServedPair) -> StartupProfile:
    """The profile for the initial policy: `--profile` when given (a profile that does not fit
    the pair raises ProfileError); else, for the default pair, the shipped
    `DEFAULT_PAIR_PROFILE` (if it does not fit, e.g. a differently converted default model,
    a warning and no profile); else none ("identity": T = 1 until the estimator learns)."""
    from noisy_temp_server.calibration.profile import ProfileError  # noqa: PLC0415

    if settings.profile is not None:
        profile = load_profile_for_pair(settings.profile, pair)
        return StartupProfile(profile, settings.profile, f"profile {settings.profile}")
    if not serves_default_pair(settings):
        return StartupProfile(None, None, "identity")
    try:
        profile = load_profile_for_pair(DEFAULT_PAIR_PROFILE, pair)
    except ProfileError as error:
        _LOGGER.warning(
            "Starting at T = 1: the shipped default-pair profile does not fit (%s)", error
        )
        return StartupProfile(None, None, "identity")
    return StartupProfile(profile, DEFAULT_PAIR_PROFILE, "the shipped profile of the default pair")


def load_profile_for_pair(path: Path, pair: ServedPair) -> Profile:
    """The profile at `path`, checked against `pair` (`pair_identities`); ProfileError naming
    the file and the mismatch otherwise. Without a clean model only the served model is
    checked (logged as a warning)."""
    from noisy_temp_server.calibration.profile import Profile, ProfileError  # noqa: PLC0415

    clean, served = pair_identities(pair)
    if clean is not None:
        return Profile.load_for_pair(path, clean, served)
    _LOGGER.warning(
        "No clean model: checking only that the profile %s was calibrated for the served model",
        path,
    )
    profile = Profile.load(path)
    if not profile.served.matches(served):
        raise ProfileError(
            f"profile {path}: the profile was calibrated for served model "
            f"{profile.served.describe()}, but the served model is {served.describe()}; "
            "calibrate this pair with `noisy-temp-server calibrate`"
        )
    return profile


def check_served_bias(policy: TemperaturePolicy, pair: ServedPair) -> None:
    """ProfileError unless the per-token bias `policy` names (None: nothing to check), and the
    head map under it if any, load from the engine's bias directory
    (`step.logit_bias.load_bias`; `prepare_environment` sets it) and fit the served
    model's vocabulary. The engine would otherwise answer 400 to every request naming them, or
    serve them without the bias."""
    if policy.bias is None:
        return
    from transformers import AutoConfig  # noqa: PLC0415

    from noisy_temp_server.calibration.profile import ProfileError  # noqa: PLC0415
    from noisy_temp_server.correction.files import (  # noqa: PLC0415
        check_bias_vocabulary,
        check_head_map_vocabulary,
    )
    from noisy_temp_server.step.logit_bias import load_bias, load_head_map  # noqa: PLC0415

    vocab_size = int(AutoConfig.from_pretrained(pair.served, local_files_only=True).vocab_size)
    where = f"the served model {pair.served}"
    try:
        check_bias_vocabulary(load_bias(policy.bias), vocab_size, where)
        if policy.head_map is not None:
            check_head_map_vocabulary(load_head_map(policy.head_map), vocab_size, where)
    except ValueError as error:
        raise ProfileError(f"the policy's per-token bias cannot be served: {error}") from error


def _policy_gauges(metrics: ApiMetrics) -> Any:
    from noisy_temp_server.server.policy_source import describe_policy  # noqa: PLC0415

    def publish(policy: TemperaturePolicy) -> None:
        described = describe_policy(policy)
        metrics.publish_policy(
            policy.version,
            described["alpha_by_step_bucket"],
            described["sigma2_by_step_bucket"],
            published_at=time.time(),
        )

    return publish


def _shadow(
    settings: Settings,
    pair: ServedPair,
    profile: Profile | None,
    metrics: ApiMetrics,
    rows: TraceCollector,
    *,
    online_bias_dir: Path,
) -> tuple[PolicySource | None, ShadowScorer | None]:
    """The online estimator and its shadow scorer, or (None, None) when scoring is off; the
    scorer takes the engine's captured served rows from `rows`; the estimator finds the
    profile's bias in the engine's bias directories and publishes online biases to
    `online_bias_dir` (one of them, `server.engine.publish_bias_directories`)."""
    if settings.shadow_fraction == 0.0:
        return None, None
    if pair.clean is None and settings.clean_backend == "in_process":
        return None, None
    from noisy_temp_server.online.estimator import OnlineEstimator  # noqa: PLC0415
    from noisy_temp_server.online.heap import fix_mmap_threshold  # noqa: PLC0415
    from noisy_temp_server.online.shadow import ShadowScorer  # noqa: PLC0415
    from noisy_temp_server.step.logit_bias import bias_directories  # noqa: PLC0415

    fix_mmap_threshold()  # the refits' large temporaries would fragment the heap
    scorer = pair_scorer(settings, pair)
    estimator = OnlineEstimator(
        profile,
        min_positions=settings.shadow_min_positions,
        refit_every=settings.shadow_min_positions,
        window_positions=settings.shadow_window_positions,
        bias_dirs=bias_directories(),
        online_bias_dir=online_bias_dir,
        kept_bias_seconds=settings.shadow_bias_keep_s,
        head_basis=scorer.clean_head(),
    )
    shadow = ShadowScorer(
        scorer,
        estimator,
        metrics,
        fraction=settings.shadow_fraction,
        queue_size=settings.shadow_queue_size,
        rows=rows,
        positions=settings.capture_positions,
        rows_timeout_s=settings.trace_timeout_s,
        version_of=lambda policy: policy.version,
        on_policy=_policy_gauges(metrics),
        threads=settings.shadow_threads,
        nice=settings.shadow_nice,
        cpu_share=settings.shadow_cpu_share,
        warmup_cpu_share=settings.shadow_warmup_cpu_share,
        bias_rows=settings.shadow_bias_rows if estimator.refines_bias else 0,
    )
    return estimator, shadow


def listens_beyond_loopback(host: str) -> bool:
    """Whether binding `host` may accept connections from other machines (a name other than
    `localhost` counts, since it may resolve anywhere)."""
    if host.strip().lower() == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return True


def warn_if_open_without_api_key(settings: Settings) -> bool:
    """Log a warning (and return True) when the server will listen beyond loopback with no API
    key: anyone who can reach the port can then use the model."""
    if settings.api_key is not None or not listens_beyond_loopback(settings.host):
        return False
    _LOGGER.warning(
        "Listening on %s without an API key: anyone who can reach port %d can use this server. "
        "Set --api-key (NTS_API_KEY), or bind 127.0.0.1 behind a proxy that authenticates.",
        settings.host,
        settings.port,
    )
    return True


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = settings_from_args(args)
    _LOGGER.info("Settings: %s", settings_as_json(settings))
    warn_if_open_without_api_key(settings)
    from noisy_temp_server.server.engine import prepare_environment  # noqa: PLC0415

    try:
        environment = prepare_environment(settings)
    except ValueError as error:  # an invalid engine variable (NTS_*) in the environment
        _LOGGER.error("Refusing to serve: %s", error)
        return 1
    from noisy_temp_server.calibration.profile import ProfileError  # noqa: PLC0415

    with contextlib.ExitStack() as stack:
        stack.callback(environment.cleanup)
        try:
            return _serve(settings, environment, args.log_level, stack)
        except ProfileError as error:
            _LOGGER.error("Refusing to serve: %s", error)
            return 1


def _serve(
    settings: Settings,
    environment: EngineEnvironment,
    log_level: str,
    stack: contextlib.ExitStack[Any],
) -> int:
    """Start everything, registering its teardown on `stack`, and serve until stopped. The
    app's lifespan closes `stack` (see `create_app`'s `on_shutdown`)."""
    import uvicorn  # noqa: PLC0415
    from prometheus_client import CollectorRegistry  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    from noisy_temp_server.engine_contract.trace_channel import TraceCollector  # noqa: PLC0415
    from noisy_temp_server.server.app import create_app  # noqa: PLC0415
    from noisy_temp_server.server.engine import (  # noqa: PLC0415
        publish_bias_directories,
        start_engine,
    )
    from noisy_temp_server.server.engine_watchdog import EngineWatchedServer  # noqa: PLC0415
    from noisy_temp_server.server.metrics import ApiMetrics, serving_registry  # noqa: PLC0415
    from noisy_temp_server.server.policy_source import StaticPolicySource  # noqa: PLC0415
    from noisy_temp_server.temperature.policy import TemperaturePolicy  # noqa: PLC0415

    started = time.perf_counter()
    pair = resolve_pair(settings)
    model_name = settings.served_model_name or pair.served.name
    profile, profile_path, profile_source = startup_profile(settings, pair)
    startup_policy = None if profile is None else profile.to_policy()
    publish_bias_directories(
        settings,
        environment,
        startup_policy,
        profile_dir=None if profile_path is None else profile_path.parent,
    )
    if startup_policy is not None:
        check_served_bias(startup_policy, pair)
    metrics = ApiMetrics(CollectorRegistry())  # values live in the multiprocess directory
    tokenizer = AutoTokenizer.from_pretrained(pair.served, local_files_only=True)
    collector = stack.enter_context(
        TraceCollector(
            environment.trace_endpoint,
            max_row_bytes=settings.capture_buffer_mib << 20,
            on_rows_dropped=lambda reason, n: metrics.capture_dropped_rows.labels(reason).inc(n),
        )
    )
    with _phase("Starting the vLLM engine"):
        engine = start_engine(settings, pair.served, model_name, pair.runtime_noise)
    stack.callback(engine.shutdown)
    estimator, shadow = _shadow(
        settings, pair, profile, metrics, collector, online_bias_dir=environment.online_bias_dir
    )
    policy_source: PolicySource = estimator or StaticPolicySource(
        TemperaturePolicy.identity() if startup_policy is None else startup_policy,
        profile_source,
    )
    initial = policy_source.current_policy()
    _LOGGER.info(
        "Initial policy: version %d, rule %s, from %s (%s)",
        initial.version,
        initial.rule.value,
        profile_source,
        "online estimator" if estimator is not None else "no shadow scoring",
    )
    _policy_gauges(metrics)(initial)
    if shadow is not None:
        shadow.start()
        stack.callback(shadow.close)
    app = create_app(
        settings,
        engine,
        tokenizer=tokenizer,
        model_name=model_name,
        max_model_len=settings.max_model_len,
        policy_source=policy_source,
        metrics=metrics,
        metrics_registry=serving_registry(),
        trace_source=collector,
        shadow=shadow,
        on_shutdown=stack.close,
    )
    _LOGGER.info(
        "Serving %s on http://%s:%d (startup took %.1f s)",
        model_name,
        settings.host,
        settings.port,
        time.perf_counter() - started,
    )
    server = EngineWatchedServer(
        uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level), engine
    )
    server.run()
    if server.engine_failure is not None:
        _LOGGER.error("Exiting with status 1: the engine failed; restart the server.")
        return 1
    return 0
