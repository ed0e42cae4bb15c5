"""`noisy-temp-server perturb`: write a perturbed copy of a checkpoint.

    noisy-temp-server perturb --spec SPEC --out DIR [--clean PATH] [--cache-dir DIR] [--replace]

SPEC is a JSON file or inline JSON (see `noisy_temp_server.checkpoints.perturbation`), e.g.
`'{"kind": "weight_noise", "scale": 0.02}'` or `'{"kind": "quantization", "format": "int4"}'`.
The clean checkpoint defaults to the embedded SmolLM2-135M-Instruct. The output folder is a
checkpoint (safetensors, config, tokenizer) that transformers and vLLM both load; its manifest
records the spec and the clean model's identity (name, weights sha256). The same spec on the
same clean model gives byte-identical weights. A runtime-logit-noise spec writes the clean
weights unchanged, with the spec recorded for the server's runtime noise processor.

Prints the output folder on stdout and returns 0; on bad input prints what is wrong on stderr
and returns 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from noisy_temp_server.checkpoints.perturbation import PerturbationSpec

__all__ = ["HELP", "add_arguments", "clean_folder", "read_spec_argument", "run"]

HELP = (
    "Write a perturbed (noisy, or quantisation-simulated: stored as float) copy of a checkpoint, "
    "with its spec recorded; `quantize` writes real quantized checkpoints."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec", required=True, help="perturbation spec: a JSON file, or inline JSON"
    )
    parser.add_argument("--out", type=Path, required=True, help="output checkpoint folder")
    parser.add_argument(
        "--clean",
        type=Path,
        default=None,
        help="clean checkpoint folder (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache folder of the default model (default: NTS_CACHE_DIR, else ~/.cache/...)",
    )
    parser.add_argument("--replace", action="store_true", help="overwrite --out if it exists")


def read_spec_argument(value: str) -> PerturbationSpec:
    """The spec of a `--spec` argument: inline JSON if it starts with `{`, else a file path.

    Raises `PerturbationSpecError` (with what to fix) for unreadable or invalid specs.
    """
    from noisy_temp_server.checkpoints.perturbation import load_spec, parse_spec  # noqa: PLC0415

    return parse_spec(value) if value.lstrip().startswith("{") else load_spec(Path(value))


def clean_folder(given: Path | None, cache_dir: Path | None) -> Path:
    """The clean model's folder: `given` (a folder or a Hugging Face id in the local cache,
    `resolve_model_folder`), else the embedded default model's (converted on first use into
    the cache: `cache_dir`, else the settings')."""
    from noisy_temp_server.checkpoints.default_model import ensure_default_model  # noqa: PLC0415
    from noisy_temp_server.checkpoints.model_folder import resolve_model_folder  # noqa: PLC0415
    from noisy_temp_server.settings import Settings  # noqa: PLC0415

    if given is not None:
        return resolve_model_folder(given)
    settings = Settings() if cache_dir is None else Settings(cache_dir=cache_dir)
    return ensure_default_model(settings.cache_dir)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from noisy_temp_server.checkpoints.checkpoint import CorruptCheckpointError  # noqa: PLC0415
    from noisy_temp_server.checkpoints.perturbed_checkpoint import (  # noqa: PLC0415
        write_perturbed_checkpoint,
    )

    try:
        spec = read_spec_argument(args.spec)
        if args.out.exists() and not args.replace:
            raise FileExistsError(f"{args.out} exists; pass --replace to overwrite it")
        clean_path = clean_folder(args.clean, args.cache_dir)
        manifest = write_perturbed_checkpoint(
            clean_path,
            spec,
            args.out,
            source=f"noisy-temp-server perturb --spec '{args.spec}'",
            replace=args.replace,
            cache_dir=args.cache_dir,
        )
    except (CorruptCheckpointError, FileExistsError, ValueError) as error:  # bad input: ValueError
        print(f"error: {error}", file=sys.stderr)
        return 1
    logging.getLogger(__name__).info("weights sha256 %s", manifest.weights_sha256)
    print(args.out)
    return 0
