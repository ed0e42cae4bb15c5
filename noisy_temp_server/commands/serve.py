"""`noisy-temp-server serve`: the OpenAI-compatible server in front of vLLM.

With no arguments it serves the embedded default model (SmolLM2-135M-Instruct, converted once
into the cache) perturbed by the default spec (gaussian weight noise, 0.02 of each weight
matrix's std; written once to the cache), keeps the clean model for shadow scoring, runs on the
CPU and listens on 127.0.0.1:8000. Every setting is a flag here and an `NTS_*` environment
variable (see `noisy_temp_server.settings`).

Startup order (see `server.engine`): environment first (before vLLM and prometheus_client are
imported), then checkpoints, trace channel, engine, shadow scorer, HTTP server. Each phase is
logged with its duration.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from noisy_temp_server.settings import (
    Settings,
    add_settings_arguments,
    settings_as_json,
    settings_from_args,
)

if TYPE_CHECKING:
    from noisy_temp_server.estimation.profile import Profile
    from noisy_temp_server.pairs.perturb import PerturbationSpec
    from noisy_temp_server.server.metrics import ApiMetrics
    from noisy_temp_server.server.shadow import ShadowScorer
    from noisy_temp_server.server.temperature import PolicySource
    from noisy_temp_server.temperature.policy import TemperaturePolicy

__all__ = ["HELP", "add_arguments", "ensure_perturbed_checkpoint", "run"]

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
    from noisy_temp_server.pairs.perturb import QuantizationSpec, WeightNoiseSpec  # noqa: PLC0415
    from noisy_temp_server.pairs.perturbed_checkpoint import (  # noqa: PLC0415
        write_perturbed_checkpoint,
    )

    if not isinstance(spec, WeightNoiseSpec | QuantizationSpec):
        raise ValueError(
            f"serve can write a perturbed checkpoint for weight noise and quantization specs, "
            f"not {spec.kind}; pass --served-model (and --clean-model) instead."
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
class _Pair:
    served: Path
    clean: Path | None
    spec: PerturbationSpec | None


def _resolve_pair(settings: Settings) -> _Pair:
    from noisy_temp_server.pairs.default_model import ensure_default_model  # noqa: PLC0415
    from noisy_temp_server.pairs.perturb import ExternalPairSpec, parse_spec  # noqa: PLC0415

    if settings.served_model is not None:
        return _Pair(settings.served_model, settings.clean_model, None)
    spec = parse_spec(settings.perturbation)
    if isinstance(spec, ExternalPairSpec):
        return _Pair(spec.served_path, settings.clean_model or spec.clean_path, spec)
    with _phase("Preparing the default model (converting the embedded GGUF if needed)"):
        clean = settings.clean_model or ensure_default_model(settings.cache_dir)
    with _phase(f"Preparing the served model ({spec.label}; written once to the cache)"):
        served = ensure_perturbed_checkpoint(clean, spec, settings.cache_dir)
    return _Pair(served, clean, spec)


def _load_profile(settings: Settings) -> Profile | None:
    from noisy_temp_server.estimation.profile import Profile  # noqa: PLC0415

    return None if settings.profile is None else Profile.load(settings.profile)


def _policy_gauges(metrics: ApiMetrics) -> Any:
    from noisy_temp_server.server.temperature import describe_policy  # noqa: PLC0415

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
    settings: Settings, pair: _Pair, profile: Profile | None, metrics: ApiMetrics
) -> tuple[PolicySource | None, ShadowScorer | None]:
    """The online estimator and its shadow scorer, or (None, None) when scoring is off."""
    if pair.clean is None or settings.shadow_fraction == 0.0:
        return None, None
    from noisy_temp_server.estimation.online import OnlineEstimator  # noqa: PLC0415
    from noisy_temp_server.pairs.checkpoint import load_causal_lm  # noqa: PLC0415
    from noisy_temp_server.pairs.perturb import RuntimeLogitNoiseSpec  # noqa: PLC0415
    from noisy_temp_server.pairs.scorer import PairScorer  # noqa: PLC0415
    from noisy_temp_server.server.shadow import ShadowScorer  # noqa: PLC0415

    with _phase(
        f"Loading the clean and served models for shadow scoring on {settings.shadow_device}"
    ):
        clean_model, _ = load_causal_lm(pair.clean, device=settings.shadow_device)
        served_model, _ = load_causal_lm(pair.served, device=settings.shadow_device)
    runtime_noise = pair.spec if isinstance(pair.spec, RuntimeLogitNoiseSpec) else None
    scorer = PairScorer(
        clean_model, served_model, runtime_noise=runtime_noise, device=settings.shadow_device
    )
    estimator = OnlineEstimator(
        profile,
        min_positions=settings.shadow_min_positions,
        refit_every=settings.shadow_min_positions,
    )
    shadow = ShadowScorer(
        scorer,
        estimator,
        metrics,
        fraction=settings.shadow_fraction,
        queue_size=settings.shadow_queue_size,
        version_of=lambda policy: policy.version,
        on_policy=_policy_gauges(metrics),
    )
    return estimator, shadow


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = settings_from_args(args)
    _LOGGER.info("Settings: %s", settings_as_json(settings))
    from noisy_temp_server.server.engine import prepare_environment  # noqa: PLC0415

    environment = prepare_environment(settings)
    with contextlib.ExitStack() as stack:
        stack.callback(environment.cleanup)
        return _serve(settings, environment.trace_endpoint, args.log_level, stack)


def _serve(
    settings: Settings, trace_endpoint: str, log_level: str, stack: contextlib.ExitStack[Any]
) -> int:
    """Start everything, registering its teardown on `stack`, and serve until stopped. The
    app's lifespan closes `stack` (see `create_app`'s `on_shutdown`)."""
    import uvicorn  # noqa: PLC0415
    from prometheus_client import CollectorRegistry  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    from noisy_temp_server.server.app import create_app  # noqa: PLC0415
    from noisy_temp_server.server.engine import start_engine  # noqa: PLC0415
    from noisy_temp_server.server.metrics import ApiMetrics, serving_registry  # noqa: PLC0415
    from noisy_temp_server.server.temperature import StaticPolicySource  # noqa: PLC0415
    from noisy_temp_server.temperature.policy import TemperaturePolicy  # noqa: PLC0415
    from noisy_temp_server.vllm_plugin.trace_channel import TraceCollector  # noqa: PLC0415

    started = time.perf_counter()
    pair = _resolve_pair(settings)
    model_name = settings.served_model_name or pair.served.name
    profile = _load_profile(settings)
    metrics = ApiMetrics(CollectorRegistry())  # values live in the multiprocess directory
    estimator, shadow = _shadow(settings, pair, profile, metrics)
    policy_source: PolicySource = estimator or StaticPolicySource(
        TemperaturePolicy.identity() if profile is None else profile.to_policy(),
        "identity" if profile is None else f"profile {settings.profile}",
    )
    initial = policy_source.current_policy()
    _LOGGER.info(
        "Initial policy: version %d, rule %s (%s)",
        initial.version,
        initial.rule.value,
        "online estimator" if estimator is not None else "no shadow scoring",
    )
    _policy_gauges(metrics)(initial)
    tokenizer = AutoTokenizer.from_pretrained(pair.served, local_files_only=True)
    collector = stack.enter_context(TraceCollector(trace_endpoint))
    with _phase("Starting the vLLM engine"):
        engine = start_engine(settings, pair.served, model_name)
    stack.callback(engine.shutdown)
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
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level)
    return 0
