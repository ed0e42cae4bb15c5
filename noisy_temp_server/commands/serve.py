"""`noisy-temp-server serve`: the OpenAI-compatible server in front of vLLM.

With no arguments it serves the embedded default model (SmolLM2-135M-Instruct, converted once
into the cache) with the default perturbation (runtime logit noise, sigma = 1), starts it from
the calibration profile shipped for that pair (`online.startup.DEFAULT_PAIR_PROFILE`), keeps
the clean model for shadow scoring, runs on the CPU and listens on 127.0.0.1:8000.
`--perturbation` serves another pair (started at T = 1 unless `--profile` is given). A runtime
logit noise spec (`--perturbation`, or recorded in the manifest of `--served-model`) serves
unchanged weights and adds the noise in the engine (`RuntimeLogitNoiseProcessor`) and in the
shadow scorer. Every setting is a flag here and an `NTS_*` environment variable (see
`noisy_temp_server.settings`).

This module turns the settings into calls: the pair is `pairs.served_pair`'s, the starting
profile, its checks, the estimator and the shadow scorer `online.startup`'s, the engine and the
HTTP app `server`'s. Startup order (see `server.engine`): environment first
(before vLLM and prometheus_client are imported), then checkpoints, trace channel, engine,
shadow scorer, HTTP server. Each phase is logged with its duration.

Imports are function-local: `noisy-temp-server --help` imports every command module, and
torch, transformers and vLLM would make it slow; prometheus_client must be imported only after
`prepare_environment`.

Exit status: 0 after a normal shutdown, 1 when the engine died (`server.engine_watchdog`: the
server then shuts down within a bounded time, for a supervisor to restart it) or a profile does
not match the served pair or names a bias or an adapter that cannot be served
(`commands.serve_adapter`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from noisy_temp_server.server.exposure import warn_if_open_without_api_key
from noisy_temp_server.settings import (
    Settings,
    add_settings_arguments,
    settings_as_json,
    settings_from_args,
)

if TYPE_CHECKING:
    from noisy_temp_server.online.policy_source import PolicySource
    from noisy_temp_server.online.startup import StartupProfile
    from noisy_temp_server.pairs.served_pair import ServedPair
    from noisy_temp_server.server.engine import EngineEnvironment
    from noisy_temp_server.temperature.policy import TemperaturePolicy

__all__ = [
    "HELP",
    "add_arguments",
    "resolve_pair",
    "run",
]

HELP = "Serve a (perturbed) model over the OpenAI API with tuned temperatures."

_LOGGER = logging.getLogger("noisy_temp_server.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser)
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
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


def _starting_point(
    settings: Settings, environment: EngineEnvironment, pair: ServedPair
) -> tuple[StartupProfile, TemperaturePolicy | None]:
    """The startup profile and its policy (None: none), with the engine's bias directories
    published and the policy's bias checked against the served model (ProfileError)."""
    from noisy_temp_server.online.startup import check_served_bias, startup_profile  # noqa: PLC0415
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

    from noisy_temp_server.commands.serve_adapter import plan_served_adapter  # noqa: PLC0415
    from noisy_temp_server.commands.serve_stack import stack_settings  # noqa: PLC0415
    from noisy_temp_server.online.startup import start_online_learning  # noqa: PLC0415
    from noisy_temp_server.phases import logged_phase  # noqa: PLC0415
    from noisy_temp_server.server.app import create_app  # noqa: PLC0415
    from noisy_temp_server.server.engine import start_engine  # noqa: PLC0415
    from noisy_temp_server.server.metrics import ApiMetrics, serving_registry  # noqa: PLC0415
    from noisy_temp_server.server.trace_collector import TraceCollector  # noqa: PLC0415

    started = time.perf_counter()
    settings = stack_settings(settings)
    pair = resolve_pair(settings)
    model_name = settings.served_model_name or pair.served.name
    start, startup_policy = _starting_point(settings, environment, pair)
    adapter = plan_served_adapter(settings, pair, start.profile, start.path, model_name)
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
        engine = start_engine(
            settings,
            pair.served if adapter is None else adapter.engine_model,
            model_name,
            pair.runtime_noise,
            max_lora_rank=None if adapter is None else adapter.max_lora_rank,
        )
    stack.callback(engine.shutdown)
    estimator, shadow = start_online_learning(
        settings,
        pair,
        start.profile,
        metrics.online,
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
        adapter=None if adapter is None else adapter.adapter,
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
