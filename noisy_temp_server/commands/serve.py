"""`noisy-temp-server serve`: the OpenAI-compatible server in front of vLLM.

With no arguments it serves the embedded default model (SmolLM2-135M-Instruct, converted once
into the cache) with the default perturbation (runtime logit noise, sigma = 1), starts it from
the calibration profile shipped for that pair (`DEFAULT_PAIR_PROFILE`), keeps the clean model for
shadow scoring, runs on the CPU and listens on 127.0.0.1:8000. `--perturbation` serves another
pair (started at T = 1 unless `--profile` is given). A runtime logit noise spec
(`--perturbation`, or recorded in the manifest of `--served-model`) serves unchanged weights
and adds the noise in the engine (`RuntimeLogitNoiseProcessor`) and in the shadow scorer. Every
setting is a flag here and an `NTS_*` environment variable (see `noisy_temp_server.settings`).

This module turns the settings into calls: the pair is `pairs.served_pair`'s, the starting
profile and its checks `online.startup`'s, the estimator and shadow scorer `online`'s, the
engine and the HTTP app `server`'s. Startup order (see `server.engine`): environment first
(before vLLM and prometheus_client are imported), then checkpoints, trace channel, engine,
shadow scorer, HTTP server. Each phase is logged with its duration.

Imports are function-local: `noisy-temp-server --help` imports every command module, and
torch, transformers and vLLM would make it slow; prometheus_client must be imported only after
`prepare_environment`.

Exit status: 0 after a normal shutdown, 1 when the engine died (`server.engine_watchdog`: the
server then shuts down within a bounded time, for a supervisor to restart it) or a profile does
not match the served pair.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from noisy_temp_server.server.exposure import warn_if_open_without_api_key
from noisy_temp_server.settings import (
    DEFAULT_PERTURBATION,
    Settings,
    add_settings_arguments,
    settings_as_json,
    settings_from_args,
)

if TYPE_CHECKING:
    from noisy_temp_server.calibration.profile import Profile
    from noisy_temp_server.engine_contract.trace_channel import TraceCollector
    from noisy_temp_server.online.policy_source import PolicySource
    from noisy_temp_server.online.shadow import ShadowScorer
    from noisy_temp_server.online.startup import StartupProfile
    from noisy_temp_server.pairs.scorer import PairScorer
    from noisy_temp_server.pairs.served_pair import ServedPair
    from noisy_temp_server.server.engine import EngineEnvironment
    from noisy_temp_server.server.metrics import ApiMetrics
    from noisy_temp_server.temperature.policy import TemperaturePolicy

__all__ = [
    "DEFAULT_PAIR_PROFILE",
    "HELP",
    "add_arguments",
    "pair_scorer",
    "resolve_pair",
    "run",
    "serves_default_pair",
    "startup_profile",
]

HELP = "Serve a (perturbed) model over the OpenAI API with tuned temperatures."

_LOGGER = logging.getLogger("noisy_temp_server.serve")

DEFAULT_PAIR_PROFILE = Path(__file__).resolve().parent.parent / "data" / "default-pair.profile.json"
"""The profile of the default pair (the embedded model with `DEFAULT_PERTURBATION`), made by
`benchmarks/quality.py --families logit-noise --profiles DIR` and shipped in the package."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser)
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )


def serves_default_pair(settings: Settings) -> bool:
    """Whether `settings` name the default pair: no served or clean model given and the default
    perturbation (compared as a parsed spec, so spelling does not matter)."""
    from noisy_temp_server.pairs.perturbation import parse_spec  # noqa: PLC0415

    return (
        settings.served_model is None
        and settings.clean_model is None
        and parse_spec(settings.perturbation) == parse_spec(DEFAULT_PERTURBATION)
    )


def resolve_pair(settings: Settings) -> ServedPair:
    """The served/clean pair the settings name (`pairs.served_pair.resolve_served_pair`)."""
    from noisy_temp_server.pairs.served_pair import resolve_served_pair  # noqa: PLC0415

    return resolve_served_pair(
        served_model=settings.served_model,
        clean_model=settings.clean_model,
        perturbation=settings.perturbation,
        cache_dir=settings.cache_dir,
    )


def pair_scorer(settings: Settings, pair: ServedPair) -> PairScorer:
    """The shadow scorer's `PairScorer` for `pair`, of its clean side only, from the
    `clean_*` settings and `shadow_device` (`pairs.served_pair.clean_pair_scorer`)."""
    from noisy_temp_server.pairs.served_pair import clean_pair_scorer  # noqa: PLC0415

    key = settings.clean_api_key
    return clean_pair_scorer(
        pair,
        remote_url=settings.clean_url if settings.clean_backend == "remote" else None,
        remote_model=settings.clean_remote_model,
        api_key=key.get_secret_value() if key is not None else None,
        timeout_s=settings.clean_timeout_s,
        device=settings.shadow_device,
        dtype=settings.clean_dtype,
    )


def startup_profile(settings: Settings, pair: ServedPair) -> StartupProfile:
    """The profile for the initial policy (`online.startup.pick_startup_profile`): `--profile`,
    else for the default pair the shipped `DEFAULT_PAIR_PROFILE`, else none."""
    from noisy_temp_server.online.startup import pick_startup_profile  # noqa: PLC0415

    shipped = DEFAULT_PAIR_PROFILE if serves_default_pair(settings) else None
    return pick_startup_profile(pair, profile=settings.profile, shipped=shipped)


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
        metrics.online,
        fraction=settings.shadow_fraction,
        queue_size=settings.shadow_queue_size,
        rows=rows,
        positions=settings.capture_positions,
        rows_timeout_s=settings.trace_timeout_s,
        version_of=lambda policy: policy.version,
        on_policy=metrics.online.publish_policy,
        threads=settings.shadow_threads,
        nice=settings.shadow_nice,
        cpu_share=settings.shadow_cpu_share,
        warmup_cpu_share=settings.shadow_warmup_cpu_share,
        bias_rows=settings.shadow_bias_rows if estimator.refines_bias else 0,
    )
    return estimator, shadow


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = settings_from_args(args)
    _LOGGER.info("Settings: %s", settings_as_json(settings))
    warn_if_open_without_api_key(settings)
    from noisy_temp_server.server.engine import prepare_environment  # noqa: PLC0415

    environment = prepare_environment(settings)
    from noisy_temp_server.calibration.profile import ProfileError  # noqa: PLC0415

    with contextlib.ExitStack() as stack:
        stack.callback(environment.cleanup)
        try:
            return _serve(settings, environment, args.log_level, stack)
        except ProfileError as error:
            _LOGGER.error("Refusing to serve: %s", error)
            return 1


def _starting_point(
    settings: Settings, environment: EngineEnvironment, pair: ServedPair
) -> tuple[StartupProfile, TemperaturePolicy | None]:
    """The startup profile and its policy (None: none), with the engine's bias directories
    published and the policy's bias checked against the served model (ProfileError)."""
    from noisy_temp_server.online.startup import check_served_bias  # noqa: PLC0415
    from noisy_temp_server.server.engine import publish_bias_directories  # noqa: PLC0415

    start = startup_profile(settings, pair)
    policy = None if start.profile is None else start.profile.to_policy()
    profile_dir = None if start.path is None else start.path.parent
    publish_bias_directories(settings, environment, policy, profile_dir=profile_dir)
    if policy is not None:
        check_served_bias(policy, pair)
    return start, policy


def _serve(
    settings: Settings,
    environment: EngineEnvironment,
    log_level: str,
    stack: contextlib.ExitStack[Any],
) -> int:
    """Start everything, registering its teardown on `stack`, and serve until stopped. The
    app's lifespan closes `stack` (see `create_app`'s `on_shutdown`)."""
    from prometheus_client import CollectorRegistry  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    from noisy_temp_server.engine_contract.trace_channel import TraceCollector  # noqa: PLC0415
    from noisy_temp_server.phases import logged_phase  # noqa: PLC0415
    from noisy_temp_server.server.app import create_app  # noqa: PLC0415
    from noisy_temp_server.server.engine import start_engine  # noqa: PLC0415
    from noisy_temp_server.server.metrics import ApiMetrics, serving_registry  # noqa: PLC0415

    started = time.perf_counter()
    pair = resolve_pair(settings)
    model_name = settings.served_model_name or pair.served.name
    start, startup_policy = _starting_point(settings, environment, pair)
    metrics = ApiMetrics(CollectorRegistry())  # values live in the multiprocess directory
    tokenizer = AutoTokenizer.from_pretrained(pair.served, local_files_only=True)
    collector = stack.enter_context(
        TraceCollector(
            environment.trace_endpoint,
            max_row_bytes=settings.capture_buffer_mib << 20,
            on_rows_dropped=lambda reason, n: metrics.capture_dropped_rows.labels(reason).inc(n),
        )
    )
    with logged_phase(_LOGGER, "Starting the vLLM engine"):
        engine = start_engine(settings, pair.served, model_name, pair.runtime_noise)
    stack.callback(engine.shutdown)
    estimator, shadow = _shadow(
        settings,
        pair,
        start.profile,
        metrics,
        collector,
        online_bias_dir=environment.online_bias_dir,
    )
    policy_source = _policy_source(estimator, startup_policy, start.source)
    metrics.online.publish_policy(policy_source.current_policy())
    if shadow is not None:
        stack.callback(shadow.start().close)
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
    return _run_until_stopped(settings, app, engine, log_level)


def _policy_source(
    estimator: PolicySource | None, startup_policy: TemperaturePolicy | None, source: str
) -> PolicySource:
    """The online estimator, else the startup policy (the identity without one) held fixed;
    the initial policy is logged."""
    from noisy_temp_server.online.policy_source import StaticPolicySource  # noqa: PLC0415
    from noisy_temp_server.temperature.policy import TemperaturePolicy  # noqa: PLC0415

    fixed = TemperaturePolicy.identity() if startup_policy is None else startup_policy
    policy_source = estimator or StaticPolicySource(fixed, source)
    initial = policy_source.current_policy()
    _LOGGER.info(
        "Initial policy: version %d, rule %s, from %s (%s)",
        initial.version,
        initial.rule.value,
        source,
        "online estimator" if estimator is not None else "no shadow scoring",
    )
    return policy_source


def _run_until_stopped(settings: Settings, app: Any, engine: Any, log_level: str) -> int:
    """Serve `app` until stopped: 0, or 1 when the engine failed (`EngineWatchedServer`)."""
    import uvicorn  # noqa: PLC0415

    from noisy_temp_server.server.engine_watchdog import EngineWatchedServer  # noqa: PLC0415

    server = EngineWatchedServer(
        uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level), engine
    )
    server.run()
    if server.engine_failure is not None:
        _LOGGER.error("Exiting with status 1: the engine failed; restart the server.")
        return 1
    return 0
