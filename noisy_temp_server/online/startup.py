"""What the server starts its policy with, from the settings: a calibration profile checked
against the served pair, and the online estimator with its shadow scorer.

`startup_profile` picks the profile (an explicit one, else the one shipped for the default
pair, else none: T = 1 until the estimator learns); `load_profile_for_pair` refuses a profile
calibrated for another pair (`pair_identities`); `check_served_bias` refuses a policy whose
per-token bias the engine could not serve. Each refusal is a `ProfileError` naming the file
and the mismatch. `start_online_learning` builds the estimator and the shadow scorer (on the
clean side's scorer, `pair_scorer`) from the `shadow_*` and `clean_*` settings.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

from noisy_temp_server.calibration.profile import ModelIdentity, Profile, ProfileError
from noisy_temp_server.checkpoints.checkpoint import CorruptCheckpointError
from noisy_temp_server.checkpoints.model_folder import ModelFolderError
from noisy_temp_server.checkpoints.perturbation import parse_spec
from noisy_temp_server.correction.files import check_bias_vocabulary
from noisy_temp_server.engine_contract.bias_files import bias_directories, load_bias
from noisy_temp_server.engine_contract.trace_channel import TraceSource
from noisy_temp_server.online.estimator import OnlineEstimator
from noisy_temp_server.online.heap import fix_mmap_threshold
from noisy_temp_server.online.metrics import OnlineMetrics
from noisy_temp_server.online.shadow import ShadowScorer
from noisy_temp_server.scoring.scorer import PairScorer
from noisy_temp_server.scoring.served_pair import ServedPair, clean_pair_scorer
from noisy_temp_server.settings import DEFAULT_PERTURBATION, Settings
from noisy_temp_server.temperature.policy import TemperaturePolicy

__all__ = [
    "DEFAULT_PAIR_PROFILE",
    "StartupProfile",
    "check_served_bias",
    "load_profile_for_pair",
    "pair_identities",
    "pair_scorer",
    "serves_default_pair",
    "start_online_learning",
    "startup_profile",
]

_LOGGER = logging.getLogger(__name__)


class StartupProfile(NamedTuple):
    """The profile the server starts from (None: none), the file it was loaded from (its
    folder holds the profile's bias file) and where it came from, in words."""

    profile: Profile | None
    path: Path | None
    source: str


DEFAULT_PAIR_PROFILE = Path(__file__).resolve().parent.parent / "data" / "default-pair.profile.json"
"""The profile of the default pair (the embedded model with `DEFAULT_PERTURBATION`), made by
`benchmarks/quality.py --families logit-noise --profiles DIR` and shipped in the package."""


def serves_default_pair(settings: Settings) -> bool:
    """Whether `settings` name the default pair: no served or clean model given and the default
    perturbation (compared as a parsed spec, so spelling does not matter)."""
    return (
        settings.served_model is None
        and settings.clean_model is None
        and parse_spec(settings.perturbation) == parse_spec(DEFAULT_PERTURBATION)
    )


def startup_profile(settings: Settings, pair: ServedPair) -> StartupProfile:
    """The profile for the initial policy: `settings.profile` when given (one that does not
    fit the pair raises ProfileError); else, for the default pair (`serves_default_pair`), the
    shipped `DEFAULT_PAIR_PROFILE` (if it does not fit, e.g. a differently converted default
    model, a warning and no profile); else none ("identity": T = 1 until the estimator
    learns)."""
    if settings.profile is not None:
        profile = load_profile_for_pair(settings.profile, pair, settings.cache_dir)
        return StartupProfile(profile, settings.profile, f"profile {settings.profile}")
    if not serves_default_pair(settings):
        return StartupProfile(None, None, "identity")
    try:
        profile = load_profile_for_pair(DEFAULT_PAIR_PROFILE, pair, settings.cache_dir)
    except ProfileError as error:
        _LOGGER.warning(
            "Starting at T = 1: the shipped default-pair profile does not fit (%s)", error
        )
        return StartupProfile(None, None, "identity")
    return StartupProfile(profile, DEFAULT_PAIR_PROFILE, "the shipped profile of the default pair")


def pair_identities(
    pair: ServedPair, cache_dir: Path | None = None
) -> tuple[ModelIdentity | None, ModelIdentity]:
    """The identities a profile must match to serve `pair`: (clean, served); clean is None
    when the pair has no clean model.

    Each folder's identity comes from its manifest, or for a plain folder from its weights'
    content hash (`ModelIdentity.of_checkpoint`, cached in `settings.cache_dir`). Runtime logit
    noise on a folder whose
    manifest does not record it (the clean weights served as they are) makes the served identity
    `ModelIdentity.perturbed(clean, spec)`; a runtime-noise checkpoint that is its own clean
    reference has, as the clean model, its weights without the noise. Raises ProfileError when
    a folder's weights cannot be identified (a damaged checkpoint, no weights).
    """

    def identity(path: Path) -> ModelIdentity:
        try:
            return ModelIdentity.of_checkpoint(path, cache_dir)
        except (CorruptCheckpointError, ModelFolderError) as error:
            raise ProfileError(f"cannot check the profile against {path}: {error}") from error

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


def load_profile_for_pair(path: Path, pair: ServedPair, cache_dir: Path | None = None) -> Profile:
    """The profile at `path`, checked against `pair` (`pair_identities`); ProfileError naming
    the file and the mismatch otherwise. Without a clean model only the served model is
    checked (logged as a warning)."""
    clean, served = pair_identities(pair, cache_dir)
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
    """ProfileError unless the per-token bias `policy` names (None: nothing to check) loads
    from the engine's bias directories (`engine_contract.bias_files.load_bias`;
    `server.engine.prepare_environment` sets them) and fits the served model's vocabulary. The
    engine would otherwise answer 400 to every request naming it, or serve them without the
    bias."""
    if policy.bias is None:
        return
    vocab_size = pair.served_vocab_size()
    where = f"the served model {pair.served}"
    try:
        check_bias_vocabulary(load_bias(policy.bias), vocab_size, where)
    except ValueError as error:
        raise ProfileError(f"the policy's per-token bias cannot be served: {error}") from error


def pair_scorer(settings: Settings, pair: ServedPair) -> PairScorer:
    """The shadow scorer's `PairScorer` for `pair`, of its clean side only, from the
    `clean_*` settings and `shadow_device` (`scoring.served_pair.clean_pair_scorer`)."""
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


def start_online_learning(
    settings: Settings,
    pair: ServedPair,
    profile: Profile | None,
    metrics: OnlineMetrics,
    rows: TraceSource,
    *,
    online_bias_dir: Path,
) -> tuple[OnlineEstimator | None, ShadowScorer | None]:
    """The online estimator and its shadow scorer (not started), or (None, None) when scoring
    is off (`shadow_fraction` 0, or no clean model in process); the scorer takes the engine's
    captured served rows from `rows` and publishes each new policy to `metrics`; the estimator
    finds the profile's bias in the engine's bias directories and publishes online biases to
    `online_bias_dir` (one of them, `server.engine.publish_bias_directories`)."""
    if settings.shadow_fraction == 0.0:
        return None, None
    if pair.clean is None and settings.clean_backend == "in_process":
        return None, None
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
        on_policy=metrics.publish_policy,
        threads=settings.shadow_threads,
        nice=settings.shadow_nice,
        cpu_share=settings.shadow_cpu_share,
        warmup_cpu_share=settings.shadow_warmup_cpu_share,
        bias_rows=settings.shadow_bias_rows if estimator.refines_bias else 0,
    )
    return estimator, shadow
