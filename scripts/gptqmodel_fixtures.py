"""Quantize the tiny test Llama with GPTQModel into native `gptq` / `awq` checkpoints (fixtures).

Run by `scripts/make_quantized_fixtures.sh` inside its own virtual env (`.venv-gptq`, with
gptqmodel==7.4.0 and CPU torch 2.13; gptqmodel >= 7.5 requires torch >= 2.14.1, whose PyPI
build is a CUDA one). It imports nothing of noisy_temp_server.

    python scripts/gptqmodel_fixtures.py SOURCE OUT

SOURCE is the clean tiny model, OUT the fixtures folder; each fixture goes to OUT/<name>/.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import torch

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

# name -> (QuantizeConfig keyword arguments, what it is)
FIXTURES: dict[str, tuple[dict[str, Any], str]] = {
    "gptq-4bit-g32-actorder": (
        {"bits": 4, "group_size": 32, "desc_act": True, "sym": True, "format": "gptq"},
        "native GPTQ (v1 `gptq` format), 4 bits, symmetric, group 32, desc_act (g_idx)",
    ),
    "gptq-4bit-g32": (
        {"bits": 4, "group_size": 32, "desc_act": False, "sym": True, "format": "gptq"},
        "native GPTQ (v1 `gptq` format), 4 bits, symmetric, group 32, no act-order: the variant "
        "vLLM 0.32 serves",
    ),
    "gptq-8bit-perchannel-v2": (
        {
            "bits": 8,
            "group_size": -1,
            "desc_act": False,
            "act_group_aware": False,
            "sym": False,
            "format": "gptq_v2",
        },
        "native GPTQ (`gptq_v2` format), 8 bits, asymmetric, one group per row (group_size -1)",
    ),
    "awq-gemm-4bit-g32": (
        {"bits": 4, "group_size": 32, "sym": False, "quant_method": "awq", "format": "gemm"},
        "native AWQ GEMM, 4 bits, zero point, group 32 (without the clipping search)",
    ),
}


def _import_gptqmodel() -> Any:
    """Import gptqmodel without torchvision.

    gptqmodel imports torchvision at import time (for its InternVL definition only); PyPI's
    torchvision is a CUDA build that fails against CPU torch, so stand-in modules take its place
    while gptqmodel is imported, after transformers has decided that torchvision is absent.
    """
    import transformers.modeling_utils  # noqa: F401, PLC0415

    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    stubs = {name: types.ModuleType(name) for name in names}
    stubs["torchvision"].transforms = stubs["torchvision.transforms"]  # type: ignore[attr-defined]
    stubs["torchvision.transforms"].functional = stubs[names[2]]  # type: ignore[attr-defined]
    stubs[names[2]].InterpolationMode = None  # type: ignore[attr-defined]
    sys.modules.update(stubs)
    try:
        import gptqmodel  # noqa: PLC0415
    finally:
        for name in names:
            sys.modules.pop(name, None)
    _no_awq_clip_search()
    return gptqmodel


def _no_awq_clip_search() -> None:
    """Skip AWQ's weight-clipping search (AutoAWQ's `apply_clip=False`): GPTQModel's asserts
    that a layer's output channels are a multiple of 64, and the tiny model's k/v projections
    have 32. The scale search, quantization and GEMM packing are unchanged."""
    from gptqmodel.looper.awq_processor import AWQProcessor  # noqa: PLC0415

    original_init = AWQProcessor.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self.apply_clip = False

    AWQProcessor.__init__ = init  # type: ignore[method-assign]


def make_fixture(source: Path, out: Path, name: str) -> Path:
    gptqmodel = _import_gptqmodel()
    from transformers import AutoTokenizer  # noqa: PLC0415

    kwargs, what = FIXTURES[name]
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(source)
    # offload_to_disk would record a random temporary path in the checkpoint's config
    config = gptqmodel.QuantizeConfig(**kwargs, offload_to_disk=False)
    model = gptqmodel.GPTQModel.load(str(source), config, device="cpu")
    calibration = [dict(tokenizer(p, add_special_tokens=False)) for p in CALIBRATION_PROMPTS]
    # AWQ's default packing kernel (AwqGEMMLinear) refuses a CPU; its torch kernel packs the
    # same GEMM layout on a CPU
    backend = "awq_torch" if kwargs.get("quant_method") == "awq" else "auto"
    model.quantize(calibration, tokenizer=tokenizer, calibration_data_min_length=1, backend=backend)
    dest = out / name
    shutil.rmtree(dest, ignore_errors=True)
    model.save(str(dest))
    tokenizer.save_pretrained(dest)
    (dest / "quant_log.csv").unlink(missing_ok=True)  # per-layer losses and timings
    quant = json.loads((dest / "config.json").read_text(encoding="utf-8"))["quantization_config"]
    print(f"{name}: quantization_config {json.dumps(quant)}", file=sys.stderr)
    source_sha = hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()
    (dest / "README.md").write_text(
        f"# {name}\n\n{what}.\n\nMade by `scripts/make_quantized_fixtures.sh` (GPTQModel "
        f"{gptqmodel.__version__}, CPU) from the tiny random Llama (`tests/tiny_model.py: "
        f"build_tiny_llama(dest, seed=0)`, model.safetensors sha256 `{source_sha}`); do not "
        f"edit by hand.\n",
        encoding="utf-8",
    )
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="the clean tiny model folder")
    parser.add_argument("out", type=Path, help="the fixtures folder")
    parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES), help="these fixtures only")
    args = parser.parse_args(argv)
    for name in args.only or FIXTURES:
        dest = make_fixture(args.source, args.out, name)
        size = sum(path.stat().st_size for path in dest.iterdir() if path.is_file())
        print(f"wrote {dest} ({size} bytes)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
