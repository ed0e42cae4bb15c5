"""Serving: the startup of `noisy-temp-server serve`, from its settings to a running server.

`serve(settings)` serves the pair the settings name (`scoring.served_pair`), started from the
profile, its checks, the estimator and the shadow scorer of `online.startup`, with the profile's
compensation adapter (`plan_served_adapter`: which adapter, `calibration.served_adapter`; how,
`adapter.serving`), the engine and the HTTP app of this package. Startup order (see
`server.engine`): environment first (before vLLM and prometheus_client are imported), then
checkpoints, trace channel, engine, shadow scorer, HTTP server. Each phase is logged with its
duration. Imports are function-local: prometheus_client must be imported only after
`prepare_environment`.

It returns 0 after a normal shutdown, 1 when the engine died (`server.engine_watchdog`: the
server then shuts down within a bounded time, for a supervisor to restart it) or a profile does
not match the served pair or names a bias or an adapter that cannot be served.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from noisy_temp_server.checkpoints.model_folder import display_name
from noisy_temp_server.settings import Settings

if TYPE_CHECKING:
    from vllm.parser.abstract_parser import Parser

    from noisy_temp_server.adapter.serving import ServedAdapter
    from noisy_temp_server.calibration.profile import Profile
    from noisy_temp_server.online.policy_source import PolicySource
    from noisy_temp_server.online.startup import StartupProfile
    from noisy_temp_server.scoring.served_pair import ServedPair
    from noisy_temp_server.server.engine import EngineEnvironment
    from noisy_temp_server.temperature.policy import TemperaturePolicy

__all__ = [
    "int4_stack_settings", "plan_served_adapter", "resolve_pair", "serve", "uvicorn_config",
]  # fmt: skip

_LOGGER = logging.getLogger("noisy_temp_server.serve")
_INT4_STACK_CONFLICTS = ("served_model", "clean_model", "profile", "adapter")


def serve(settings: Settings, log_level: str = "info") -> int:
    """Serve until stopped (module docstring): the exit status."""
    from noisy_temp_server.calibration.profile import ProfileError  # noqa: PLC0415
    from noisy_temp_server.checkpoints.checkpoint import CorruptCheckpointError  # noqa: PLC0415
    from noisy_temp_server.checkpoints.model_folder import ModelFolderError  # noqa: PLC0415
    from noisy_temp_server.server.engine import prepare_environment  # noqa: PLC0415

    try:
        environment = prepare_environment(settings)
    except ValueError as error:  # an invalid engine variable (NTS_*) in the environment
        _LOGGER.error("Refusing to serve: %s", error)
        return 1
    with contextlib.ExitStack() as stack:
        stack.callback(environment.cleanup)
        try:
            return _serve(settings, environment, log_level, stack)
        except (ProfileError, ModelFolderError, CorruptCheckpointError) as error:
            _LOGGER.error("Refusing to serve: %s", error)
            return 1


def resolve_pair(settings: Settings) -> ServedPair:
    """The served/clean pair the settings name (`scoring.served_pair.resolve_served_pair`)."""
    from noisy_temp_server.scoring.served_pair import resolve_served_pair  # noqa: PLC0415

    return resolve_served_pair(
        served_model=settings.served_model,
        clean_model=settings.clean_model,
        perturbation=settings.perturbation,
        cache_dir=settings.cache_dir,
    )


def _chat_template(settings: Settings) -> str | None:
    """`settings.chat_template` read as vLLM's ``--chat-template`` reads it (a file, or the
    template itself); None when not given. ProfileError, one line, when it cannot be read."""
    if settings.chat_template is None:
        return None
    from vllm.exceptions import VLLMClientError  # noqa: PLC0415
    from vllm.renderers.chat_utils import load_chat_template  # noqa: PLC0415

    from noisy_temp_server.calibration.profile import ProfileError  # noqa: PLC0415

    try:
        return load_chat_template(settings.chat_template)
    except (OSError, ValueError, VLLMClientError) as error:
        raise ProfileError(f"--chat-template: {error}") from error


def _check_vllm_flags(settings: Settings) -> None:
    """ProfileError, one line, for vLLM flags (``vllm_args``) that `build_engine_args` or the
    app would refuse, before anything is loaded (`server.vllm_flags`)."""
    from noisy_temp_server.calibration.profile import ProfileError  # noqa: PLC0415
    from noisy_temp_server.server.vllm_flags import frontend_options  # noqa: PLC0415

    try:
        frontend_options(settings.vllm_args)  # refuses alike for the engine's flags
    except ValueError as error:
        raise ProfileError(str(error)) from error


def _output_parser(settings: Settings, tokenizer: Any, model_name: str) -> type[Parser] | None:
    """vLLM's parser class for `--tool-call-parser` and ``--reasoning-parser``
    (`server.tools`); ProfileError, one line (vLLM's, naming the flag), for a parser vLLM does
    not know or the tokenizer cannot serve."""
    from noisy_temp_server.calibration.profile import ProfileError  # noqa: PLC0415
    from noisy_temp_server.server.tools import output_parser_class  # noqa: PLC0415
    from noisy_temp_server.server.vllm_flags import frontend_options  # noqa: PLC0415

    reasoning_parser = frontend_options(settings.vllm_args).reasoning_parser
    try:
        return output_parser_class(settings, reasoning_parser, tokenizer, model_name)
    except (TypeError, KeyError, ValueError) as error:
        raise ProfileError(str(error).splitlines()[0]) from error


def int4_stack_settings(settings: Settings) -> Settings:
    """`settings` with the int4 stack's served model, clean model and profile filled in
    (`calibration.int4_stack`; returned unchanged unless `settings.int4_stack`). ProfileError
    when they name a pair or a profile of their own (the stack is its own pair), or when
    calibrating it fails."""
    from noisy_temp_server.calibration.int4_stack import ensure_int4_stack  # noqa: PLC0415
    from noisy_temp_server.calibration.profile import ProfileError  # noqa: PLC0415

    if not settings.int4_stack:
        return settings
    given = [name for name in _INT4_STACK_CONFLICTS if getattr(settings, name) is not None]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ProfileError(f"--int4-stack serves its own pair and profile; drop {flags}")
    try:
        stack = ensure_int4_stack(settings.cache_dir)
    except (ValueError, OSError) as error:
        raise ProfileError(f"calibrating the int4 stack failed: {error}") from error
    return settings.model_copy(
        update={"served_model": stack.served, "clean_model": stack.clean, "profile": stack.profile}
    )


def plan_served_adapter(
    settings: Settings,
    pair: ServedPair,
    profile: Profile | None,
    profile_path: Path | None,
    model_name: str,
) -> ServedAdapter | None:
    """How `serve` serves its adapter on `pair`: `settings.adapter` when given, else the one
    `profile` (loaded from `profile_path`) names and recommends; None when there is none to
    serve or ``adapter_serving`` is ``none``. Every check, and the folded checkpoint's writing,
    happen before the engine starts. Raises ProfileError with one line naming the problem."""
    from noisy_temp_server.adapter.lora import AdapterError  # noqa: PLC0415
    from noisy_temp_server.adapter.serving import plan_serving  # noqa: PLC0415
    from noisy_temp_server.calibration.profile import ProfileError  # noqa: PLC0415
    from noisy_temp_server.calibration.served_adapter import (  # noqa: PLC0415
        adapter_to_serve,
        calibrated_kl,
    )
    from noisy_temp_server.checkpoints.checkpoint import CorruptCheckpointError  # noqa: PLC0415
    from noisy_temp_server.checkpoints.model_folder import ModelFolderError  # noqa: PLC0415

    if settings.adapter_serving == "none":
        if profile is not None and profile.adapter is not None and profile.adapter.recommended:
            _LOGGER.warning(
                "--adapter-serving none: the profile's T* and bias were fitted on the model "
                "with its adapter %s..., and are served without it",
                profile.adapter.sha256[:16],
            )
        return None
    try:
        found = adapter_to_serve(profile, profile_path, settings.adapter)
        if found is None:
            return None
        folder, adapter = found
        names = {display_name(pair.served)}
        if pair.clean is not None:
            names.add(display_name(pair.clean))
        if profile is not None:
            names |= {profile.clean.name, profile.served.name}
        return plan_serving(
            adapter, folder,
            served=pair.served, serving=settings.adapter_serving, cache_dir=settings.cache_dir,
            model_name=model_name, pair_names=names, calibrated_kl=calibrated_kl(profile),
        )  # fmt: skip
    except (AdapterError, CorruptCheckpointError, ModelFolderError, OSError) as error:
        raise ProfileError(f"the adapter cannot be served: {error}") from error


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

    from noisy_temp_server.online.startup import start_online_learning  # noqa: PLC0415
    from noisy_temp_server.phases import logged_phase  # noqa: PLC0415
    from noisy_temp_server.server.app import create_app  # noqa: PLC0415
    from noisy_temp_server.server.engine import start_engine  # noqa: PLC0415
    from noisy_temp_server.server.metrics import ApiMetrics, serving_registry  # noqa: PLC0415
    from noisy_temp_server.server.responses import mount_responses  # noqa: PLC0415
    from noisy_temp_server.server.trace_collector import TraceCollector  # noqa: PLC0415

    started = time.perf_counter()
    _check_vllm_flags(settings)
    chat_template = _chat_template(settings)
    settings = int4_stack_settings(settings)
    pair = resolve_pair(settings)
    model_name = settings.served_model_name or display_name(pair.served)
    start, startup_policy = _starting_point(settings, environment, pair)
    adapter = plan_served_adapter(settings, pair, start.profile, start.path, model_name)
    metrics = ApiMetrics(CollectorRegistry())  # values live in the multiprocess directory
    tokenizer = AutoTokenizer.from_pretrained(pair.served, local_files_only=True)
    tokenizer.chat_template = chat_template or tokenizer.chat_template
    output_parser = _output_parser(settings, tokenizer, model_name)
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
            adapter.engine_model if adapter and adapter.engine_model else pair.served,
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
        adapter=adapter,
        output_parser=output_parser,
        sampling_defaults=_sampling_defaults(engine),
        on_shutdown=stack.close,
    )
    mount_responses(app, engine, settings, model_name=model_name, chat_template=chat_template)
    _LOGGER.info("Serving %s (startup took %.1f s)", model_name, time.perf_counter() - started)
    return _run_until_stopped(settings, app, engine, log_level)


def _sampling_defaults(engine: Any) -> dict[str, Any]:
    """The model's sampling defaults as vLLM's OpenAI server reads them at startup (its
    `generation_config.json` under ``--generation-config auto``), logged as vLLM logs them."""
    defaults: dict[str, Any] = engine.model_config.get_diff_sampling_param()
    if defaults:
        _LOGGER.info("Using default sampling params from the model: %s", defaults)
    return defaults


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


def uvicorn_config(settings: Settings, app: Any, log_level: str) -> Any:
    """uvicorn's configuration of the HTTP server, with vllm serve's HTTP flags as it passes
    them: the log level, access log and TLS settings, and from ``vllm_args``
    (`server.vllm_flags.FrontendOptions`) the unix socket (host and port then unused), the TLS
    ciphers, the h11 limits and the access log's left-out paths."""
    import uvicorn  # noqa: PLC0415

    from noisy_temp_server.server.vllm_flags import frontend_options  # noqa: PLC0415

    frontend = frontend_options(settings.vllm_args)
    uvicorn_log_level = settings.uvicorn_log_level or log_level
    logging_kwargs: dict[str, Any] = {}  # none: uvicorn's own logging configuration
    if frontend.disable_access_log_for_endpoints:
        from vllm.logging_utils import create_uvicorn_log_config  # noqa: PLC0415

        paths = frontend.disable_access_log_for_endpoints.split(",")
        logging_kwargs["log_config"] = create_uvicorn_log_config(
            excluded_paths=[path.strip() for path in paths if path.strip()],
            log_level=uvicorn_log_level,
        )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        uds=frontend.uds,
        log_level=uvicorn_log_level,
        access_log=not settings.disable_uvicorn_access_log,
        ssl_keyfile=settings.ssl_keyfile,
        ssl_certfile=settings.ssl_certfile,
        ssl_ca_certs=settings.ssl_ca_certs,
        ssl_cert_reqs=settings.ssl_cert_reqs,
        ssl_ciphers=frontend.ssl_ciphers,
        h11_max_incomplete_event_size=frontend.h11_max_incomplete_event_size,
        **logging_kwargs,
    )
    config.h11_max_header_count = frontend.h11_max_header_count  # type: ignore[attr-defined]
    return config


def _run_until_stopped(settings: Settings, app: Any, engine: Any, log_level: str) -> int:
    """Serve `app` until stopped: 0, or 1 when the engine failed (`EngineWatchedServer`)."""

    from noisy_temp_server.server.engine_watchdog import EngineWatchedServer  # noqa: PLC0415

    server = EngineWatchedServer(uvicorn_config(settings, app, log_level), engine)
    if server.config.uds is not None:
        _LOGGER.info("Listening on unix:%s", server.config.uds)
    else:
        scheme = "https" if settings.ssl_certfile else "http"
        _LOGGER.info("Listening on %s://%s:%d", scheme, settings.host, settings.port)
    server.run()
    if server.engine_failure is not None:
        _LOGGER.error("Exiting with status 1: the engine failed; restart the server.")
        return 1
    return 0
