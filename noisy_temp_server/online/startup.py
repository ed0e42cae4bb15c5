"""The policy the server starts from: a calibration profile checked against the served pair.

`pick_startup_profile` picks the profile (an explicit one, else the one shipped for the default
pair, else none: T = 1 until the estimator learns); `load_profile_for_pair` refuses a profile
calibrated for another pair (`pair_identities`); `check_served_bias` refuses a policy whose
per-token bias the engine could not serve. Each refusal is a `ProfileError` naming the file
and the mismatch.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

from noisy_temp_server.calibration.profile import ModelIdentity, Profile, ProfileError
from noisy_temp_server.correction.files import check_bias_vocabulary, check_head_map_vocabulary
from noisy_temp_server.pairs.checkpoint import CorruptCheckpointError
from noisy_temp_server.pairs.served_pair import ServedPair
from noisy_temp_server.step.logit_bias import load_bias, load_head_map
from noisy_temp_server.temperature.policy import TemperaturePolicy

__all__ = [
    "StartupProfile",
    "check_served_bias",
    "load_profile_for_pair",
    "pair_identities",
    "pick_startup_profile",
]

_LOGGER = logging.getLogger(__name__)


class StartupProfile(NamedTuple):
    """The profile the server starts from (None: none), the file it was loaded from (its
    folder holds the profile's bias file) and where it came from, in words."""

    profile: Profile | None
    path: Path | None
    source: str


def pick_startup_profile(
    pair: ServedPair, *, profile: Path | None, shipped: Path | None
) -> StartupProfile:
    """The profile for the initial policy: `profile` when given (one that does not fit the pair
    raises ProfileError); else `shipped`, the profile shipped for the pair when it is the
    default pair (if it does not fit, e.g. a differently converted default model, a warning and
    no profile); else none ("identity": T = 1 until the estimator learns)."""
    if profile is not None:
        return StartupProfile(load_profile_for_pair(profile, pair), profile, f"profile {profile}")
    if shipped is None:
        return StartupProfile(None, None, "identity")
    try:
        loaded = load_profile_for_pair(shipped, pair)
    except ProfileError as error:
        _LOGGER.warning(
            "Starting at T = 1: the shipped default-pair profile does not fit (%s)", error
        )
        return StartupProfile(None, None, "identity")
    return StartupProfile(loaded, shipped, "the shipped profile of the default pair")


def pair_identities(pair: ServedPair) -> tuple[ModelIdentity | None, ModelIdentity]:
    """The identities a profile must match to serve `pair`: (clean, served); clean is None
    when the pair has no clean model.

    Each folder's identity comes from its manifest. Runtime logit noise on a folder whose
    manifest does not record it (the clean weights served as they are) makes the served identity
    `ModelIdentity.perturbed(clean, spec)`; a runtime-noise checkpoint that is its own clean
    reference has, as the clean model, its weights without the noise. Raises ProfileError when
    a folder has no readable manifest (its weights cannot be identified).
    """

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


def load_profile_for_pair(path: Path, pair: ServedPair) -> Profile:
    """The profile at `path`, checked against `pair` (`pair_identities`); ProfileError naming
    the file and the mismatch otherwise. Without a clean model only the served model is
    checked (logged as a warning)."""
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
    head map under it if any, load from the engine's bias directories
    (`step.logit_bias.load_bias`; `server.engine.prepare_environment` sets them) and fit the
    served model's vocabulary. The engine would otherwise answer 400 to every request naming
    them, or serve them without the bias."""
    if policy.bias is None:
        return
    vocab_size = pair.served_vocab_size()
    where = f"the served model {pair.served}"
    try:
        check_bias_vocabulary(load_bias(policy.bias), vocab_size, where)
        if policy.head_map is not None:
            check_head_map_vocabulary(load_head_map(policy.head_map), vocab_size, where)
    except ValueError as error:
        raise ProfileError(f"the policy's per-token bias cannot be served: {error}") from error
