"""The `noisy-temp-server` command line.

Each subcommand lives in its own module under `noisy_temp_server.commands`, imported only when
that subcommand runs, so `noisy-temp-server --help` stays fast and import-light. A command
module provides `HELP: str`, `add_arguments(parser)` and `run(args) -> int`. A command whose
parser defaults ``takes_vllm_args`` to true (`serve`) takes the flags it does not have as vLLM's
engine flags (the setting ``vllm_args``); any other command refuses them.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from collections.abc import Sequence

from noisy_temp_server import __version__

# subcommand name -> module under noisy_temp_server.commands
COMMANDS: dict[str, str] = {
    "model": "model",
    "perturb": "perturb",
    "quantize": "quantize",
    "calibrate": "calibrate",
    "policy": "show_policy",
    "kld": "kld",
    "serve": "serve",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="noisy-temp-server",
        description="Serve a noisy LLM at the temperature closest to its clean model.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"noisy_temp_server.commands.{module_name}")
        sub = subparsers.add_parser(
            name, help=module.HELP, description=module.HELP, allow_abbrev=False
        )
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if not getattr(args, "takes_vllm_args", False):
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        given = getattr(args, "setting_vllm_args", "")
        args.setting_vllm_args = " ".join(filter(None, (given, shlex.join(unknown))))
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
