"""Quantize the embedded default model (SmolLM2-135M-Instruct) with llm-compressor's real flows.

Issue 41: the quality benchmark compares round-to-nearest (RTN) with checkpoints made by real
quantizers at the same bits and group. This script makes them, on a CPU, in the separate
quantization venv (`.venv-quant`: llmcompressor==0.14.0.1, compressed-tensors 0.19, CPU torch;
see scripts/make_quantized_fixtures.sh for how it is built and why it is not the project's
venv). It imports nothing of noisy_temp_server. Run it through scripts/quantize_embedded.sh,
or by hand:

    .venv-quant/bin/python scripts/quantize_embedded.py SOURCE [--out DIR] [--only NAME ...]

SOURCE is the clean float checkpoint (`ensure_default_model(default_cache_dir())`, printed by
the wrapper); each checkpoint is written to DIR/<name>/ (default
~/.cache/noisy-temp-server/real-quantizers/), replacing it, as a compressed-tensors folder:
config.json with its `quantization_config`, the tokenizer, model.safetensors, and a
README.md saying how it was made and how long it took.

  gptq-w4a16-g64      GPTQ, int4 weights, symmetric, group 64
  awq-w4a16-asym-g64  AWQ (scales moved into the norms and up/o projections), then int4
                      weights, asymmetric, group 64
  fp8-dynamic         fp8 e4m3 weights per channel, dynamic per-token fp8 activations

Group 64, not the presets' 128: SmolLM2's 576 input channels do not divide by 128.
lm_head (tied to the embeddings) stays float in all three.

Calibration (GPTQ's Hessians, AWQ's activation statistics; fp8-dynamic needs none): every
prompt of noisy_temp_server/data/prompts.jsonl and experiments/data/prompts_shipped_style.jsonl
(238), formatted with the model's chat template and its generation prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from quantized_fixtures import (  # the sibling script: the same .venv-quant
    no_pin_memory,
    save_compressed,
    sha256_file,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
CALIBRATION_FILES = (
    ROOT / "noisy_temp_server" / "data" / "prompts.jsonl",
    ROOT / "experiments" / "data" / "prompts_shipped_style.jsonl",
)
DEFAULT_OUT = Path.home() / ".cache" / "noisy-temp-server" / "real-quantizers"
GROUP_SIZE = 64  # divides SmolLM2's 576 and 1536 input channels; 128 does not divide 576
MAX_SEQ_LENGTH = 256


def _int4_group(*, symmetric: bool) -> dict[str, Any]:
    """`config_groups` for int4 weights in groups of GROUP_SIZE (the W4A16 presets use 128)."""
    from compressed_tensors.quantization import (  # noqa: PLC0415
        QuantizationArgs,
        QuantizationScheme,
    )

    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=GROUP_SIZE
    )
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}


def _gptq_w4a16() -> list[Any]:
    from llmcompressor.modifiers.quantization import GPTQModifier  # noqa: PLC0415

    groups = _int4_group(symmetric=True)
    return [GPTQModifier(config_groups=groups, ignore=["lm_head"], actorder=None)]


def _awq_w4a16_asym() -> list[Any]:
    from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: PLC0415
    from llmcompressor.modifiers.transform.awq import AWQModifier  # noqa: PLC0415

    groups = _int4_group(symmetric=False)
    return [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]


def _fp8_dynamic() -> list[Any]:
    from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: PLC0415

    return [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])]


# name -> (recipe, what it is, oneshot pipeline)
CHECKPOINTS: dict[str, tuple[Callable[[], list[Any]], str, str]] = {
    "gptq-w4a16-g64": (
        _gptq_w4a16,
        "llm-compressor GPTQ, int4 weights, symmetric, group 64, no activation order",
        "sequential",
    ),
    "awq-w4a16-asym-g64": (
        _awq_w4a16_asym,
        "llm-compressor AWQ (default Llama mappings) then int4 weights, asymmetric, group 64",
        "sequential",
    ),
    "fp8-dynamic": (
        _fp8_dynamic,
        "llm-compressor FP8_DYNAMIC: fp8 e4m3 weights per channel, dynamic fp8 activations",
        "datafree",
    ),
}


def calibration_prompts() -> list[str]:
    prompts: list[str] = []
    for path in CALIBRATION_FILES:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                prompts.append(json.loads(line)["text"])
    return prompts


def _calibration(tokenizer: Any, prompts: list[str]) -> Dataset:
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        for prompt in prompts
    ]
    rows = [
        tokenizer(text, add_special_tokens=False, truncation=True, max_length=MAX_SEQ_LENGTH)
        for text in texts
    ]
    return Dataset.from_dict(
        {
            "input_ids": [row["input_ids"] for row in rows],
            "attention_mask": [row["attention_mask"] for row in rows],
        }
    )


def quantize(source: Path, out: Path, name: str, prompts: list[str]) -> tuple[Path, float]:
    from llmcompressor import oneshot  # noqa: PLC0415

    recipe, what, pipeline = CHECKPOINTS[name]
    torch.manual_seed(0)
    started = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    dataset = _calibration(tokenizer, prompts)
    oneshot(
        model=model,
        dataset=dataset,
        recipe=recipe(),
        num_calibration_samples=len(prompts),
        max_seq_length=MAX_SEQ_LENGTH,
        pipeline=pipeline,
    )
    seconds = time.monotonic() - started
    dest = out / name
    save_compressed(model, tokenizer, dest)
    calibration = (
        "none (data-free)" if pipeline == "datafree" else f"{len(prompts)} chat-formatted prompts"
    )
    (dest / "README.md").write_text(
        f"# {name}\n\n{what}.\n\nMade by `scripts/quantize_embedded.py` (noisy-temp-server) "
        f"from {source} (model.safetensors sha256 `{sha256_file(source / 'model.safetensors')}`) "
        f"with llmcompressor's oneshot on a CPU; calibration: {calibration}; quantizing took "
        f"{seconds:.0f} s.\n",
        encoding="utf-8",
    )
    return dest, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="the clean SmolLM2-135M-Instruct folder")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    parser.add_argument("--only", nargs="*", choices=sorted(CHECKPOINTS), help="these only")
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="calibrate on the first N prompts (smoke)"
    )
    args = parser.parse_args(argv)
    no_pin_memory()
    prompts = calibration_prompts()[: args.num_prompts]
    for name in args.only or CHECKPOINTS:
        dest, seconds = quantize(args.source, args.out, name, prompts)
        size = sum(path.stat().st_size for path in dest.iterdir())
        print(f"wrote {dest} ({size / 1e6:.0f} MB) in {seconds:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
