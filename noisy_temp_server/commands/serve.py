"""`noisy-temp-server serve`: the OpenAI-compatible server in front of vLLM.

With no arguments it serves the embedded default model (SmolLM2-135M-Instruct, converted once
into the cache) with the default perturbation (runtime logit noise, sigma = 1), starts it from
the calibration profile shipped for that pair (`online.startup.DEFAULT_PAIR_PROFILE`), keeps
the clean model for shadow scoring, runs on the CPU and listens on 127.0.0.1:8000.
`--perturbation` serves another pair (started at T = 1 unless `--profile` is given). A runtime
logit noise spec (`--perturbation`, or recorded in the manifest of `--served-model`) serves
unchanged weights and adds the noise in the engine (`RuntimeLogitNoiseProcessor`) and in the
shadow scorer. Every setting is a flag here and an `NTS_*` environment variable (see
`noisy_temp_server.settings`); `server.launch.serve` does the rest.

Exit status: 0 after a normal shutdown, 1 when the engine died or the settings, the profile or
its adapter cannot be served (`server.launch`).
"""

from __future__ import annotations

import argparse
import logging

from noisy_temp_server.server.exposure import warn_if_open_without_api_key
from noisy_temp_server.settings import add_settings_arguments, settings_as_json, settings_from_args

__all__ = ["HELP", "add_arguments", "run"]

HELP = "Serve a (perturbed) model over the OpenAI API with tuned temperatures."

_LOGGER = logging.getLogger("noisy_temp_server.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser)
    parser.set_defaults(takes_vllm_args=True)  # the flags it does not have: vLLM's engine's
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = settings_from_args(args)
    _LOGGER.info("Settings: %s", settings_as_json(settings))
    warn_if_open_without_api_key(settings)
    from noisy_temp_server.server.launch import serve  # noqa: PLC0415

    return serve(settings, args.log_level)
