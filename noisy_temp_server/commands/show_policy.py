"""`noisy-temp-server policy`: print the temperature policy of a profile as JSON.

    noisy-temp-server policy PROFILE [--rule RULE] > policy.json

The output is the compact `TemperaturePolicy` JSON that the logits processor reads from
`NTS_POLICY_FILE`, which is how a stock vLLM server with this package installed serves a
calibrated policy (see the README). `--rule` picks another fitted rule than the profile's
recommended one. Prints the JSON on stdout and returns 0; on a bad profile or rule prints what
is wrong on stderr and returns 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from noisy_temp_server.temperature.rules import Rule

__all__ = ["HELP", "add_arguments", "run"]

HELP = "Print the temperature policy of a calibration profile (for NTS_POLICY_FILE)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", type=Path, help="profile file written by `calibrate`")
    parser.add_argument(
        "--rule",
        choices=[rule.value for rule in Rule],
        default=None,
        help="rule to serve (default: the profile's recommended rule)",
    )


def run(args: argparse.Namespace) -> int:
    from noisy_temp_server.calibration.profile import Profile, ProfileError  # noqa: PLC0415

    try:
        policy = Profile.load(args.profile).to_policy(args.rule)
    except ProfileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(policy.to_json())
    return 0
