"""`noisy-temp-server model`: prepare the default model, verify a folder.

    noisy-temp-server model prepare [--cache-dir DIR] [--full-verify]
    noisy-temp-server model verify PATH [--fast]

Each prints the checkpoint folder's path on stdout (progress goes to stderr) and returns 0, or
prints what is wrong and what to run on stderr and returns 1. Heavy imports happen in `run`, so
building the CLI parser stays cheap.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

__all__ = ["HELP", "add_arguments", "run"]

HELP = "Prepare the default model or verify a checkpoint folder."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="model_action", required=True, metavar="ACTION")

    prepare = actions.add_parser(
        "prepare",
        help="convert the embedded SmolLM2-135M-Instruct once (or verify it) and print its path",
    )
    prepare.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache folder (default: NTS_CACHE_DIR, else ~/.cache/noisy-temp-server)",
    )
    prepare.add_argument(
        "--full-verify",
        action="store_true",
        help="recompute the sha256 of every file of an existing conversion",
    )

    verify = actions.add_parser("verify", help="check a checkpoint folder against its manifest")
    verify.add_argument("path", type=Path, metavar="PATH")
    verify.add_argument(
        "--fast", action="store_true", help="check file sizes only, do not recompute sha256"
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Imported here, not at the top: they pull in torch and transformers (see the docstring).
    from noisy_temp_server.checkpoints.checkpoint import (  # noqa: PLC0415
        CorruptCheckpointError,
        verify_checkpoint,
    )
    from noisy_temp_server.checkpoints.default_model import (  # noqa: PLC0415
        DefaultModelMissingError,
        ensure_default_model,
    )
    from noisy_temp_server.settings import Settings  # noqa: PLC0415

    try:
        if args.model_action == "prepare":
            settings = Settings() if args.cache_dir is None else Settings(cache_dir=args.cache_dir)
            path = ensure_default_model(settings.cache_dir, full_verify=args.full_verify)
        else:
            manifest = verify_checkpoint(args.path, full=not args.fast)
            path = args.path
            print(f"ok: {manifest.kind}: {manifest.description}", file=sys.stderr)
    except (CorruptCheckpointError, DefaultModelMissingError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0
