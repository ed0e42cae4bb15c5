"""`noisy-temp-server quantize`: write a real quantized (compressed-tensors) checkpoint.

    noisy-temp-server quantize --format {w8a8,w4a16,fp8} --out DIR [--clean PATH]
        [--group-size N] [--cache-dir DIR] [--replace]

Unlike `perturb`'s quantization spec (a simulation: weights rounded and stored back as float),
the output stores quantized weights and a compressed-tensors `quantization_config`, which vLLM
serves with its own quantized kernels (see `noisy_temp_server.checkpoints.compressed`; on CPU:
w8a8 and w4a16; fp8 needs a GPU). `calibrate --served DIR` and `kld --served DIR` score it
against its clean model. Prints the output folder and returns 0, or 1 with what is wrong.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from noisy_temp_server.commands.perturb import clean_folder

__all__ = ["HELP", "add_arguments", "run"]

HELP = "Write a real quantized checkpoint (compressed-tensors w8a8/w4a16/fp8) for vLLM's kernels."
_FORMATS = ("w8a8", "w4a16", "fp8")  # the keys of checkpoints.compressed.COMPRESSED_SCHEMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", required=True, choices=_FORMATS, help="quantization scheme")
    parser.add_argument("--out", type=Path, required=True, help="output checkpoint folder")
    parser.add_argument(
        "--clean", type=Path, default=None, help="clean checkpoint (default: embedded SmolLM2)"
    )
    parser.add_argument(
        "--group-size", type=int, default=128, help="input channels per scale group (w4a16)"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="the product's cache: the default model, folder identities",
    )
    parser.add_argument("--replace", action="store_true", help="overwrite --out if it exists")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from noisy_temp_server.checkpoints.checkpoint import CorruptCheckpointError  # noqa: PLC0415
    from noisy_temp_server.checkpoints.compressed import write_compressed_checkpoint  # noqa: PLC0415

    if args.group_size < 1:
        print(f"error: --group-size must be >= 1, got {args.group_size}", file=sys.stderr)
        return 1
    try:
        clean = clean_folder(args.clean, args.cache_dir)
        write_compressed_checkpoint(
            clean, args.format, args.out, group_size=args.group_size, replace=args.replace,
            cache_dir=args.cache_dir,
        )  # fmt: skip
    except (CorruptCheckpointError, FileExistsError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(args.out)
    return 0
