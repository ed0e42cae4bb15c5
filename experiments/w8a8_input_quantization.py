"""Does emulating W8A8's input quantization bring the scored forward nearer to what vLLM serves?

    PYTHONPATH=. VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \\
        .venv/bin/python experiments/w8a8_input_quantization.py --served DIR

DIR: a W8A8 int8 compressed-tensors checkpoint of the embedded model (`noisy-temp-server
quantize --format w8a8 --out DIR`). transformers decompresses its weights and runs its layers on
float inputs, while its scheme also quantizes each layer's input per token. This scores six
formal prompts teacher-forced in bfloat16 four ways: vLLM's prompt logprobs (its CPU kernels),
transformers as loaded (weight-only), transformers with each layer's input quantized as the
scheme says (compressed-tensors' own `forward_quantize`, in a forward pre-hook), and the clean
model; it prints the mean |Δ log p| of the prompts' tokens between each pair, as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.quantization.lifecycle.forward import forward_quantize
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from noisy_temp_server.checkpoints.checkpoint import load_causal_lm
from noisy_temp_server.checkpoints.default_model import ensure_default_model
from noisy_temp_server.settings import Settings

PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "prompts_formal.jsonl"


def _token_logprobs(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    picked = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
            targets = torch.tensor(ids[1:])[:, None]
            picked.append(torch.log_softmax(logits, -1).gather(1, targets)[:, 0])
    return torch.cat(picked)


def _quantize_input(module: torch.nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    args = module.quantization_scheme.input_activations
    return (forward_quantize(module, inputs[0], "input", args), *inputs[1:])


def _vllm_logprobs(served: Path, prompts: list[list[int]]) -> torch.Tensor:
    llm = LLM(str(served), dtype="bfloat16", enforce_eager=True, max_model_len=512, seed=0)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids) for ids in prompts],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
    )
    return torch.tensor(
        [
            row[ids[position]].logprob
            for output, ids in zip(outputs, prompts, strict=True)
            for position, row in enumerate(output.prompt_logprobs[1:], start=1)
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--served", type=Path, required=True, help="a W8A8 int8 checkpoint")
    parser.add_argument("--prompts", type=int, default=6)
    args = parser.parse_args()
    texts = [json.loads(line)["text"] for line in PROMPTS.read_text().splitlines()]
    model, tokenizer = load_causal_lm(args.served, dtype=torch.bfloat16, verify=False)
    prompts = [tokenizer(text).input_ids for text in texts[: args.prompts]]
    weight_only = _token_logprobs(model, prompts)
    hooked = [
        module.register_forward_pre_hook(_quantize_input)
        for module in model.modules()
        if getattr(getattr(module, "quantization_scheme", None), "input_activations", None)
    ]
    emulated = _token_logprobs(model, prompts)
    clean_model, _ = load_causal_lm(
        ensure_default_model(Settings().cache_dir), dtype=torch.bfloat16
    )
    clean = _token_logprobs(clean_model, prompts)
    served = _vllm_logprobs(args.served, prompts)
    rows = {"vllm": served, "weight_only": weight_only, "emulated": emulated, "clean": clean}
    names = list(rows)
    gaps = {
        f"{a} - {b}": round(float((rows[a] - rows[b]).abs().mean()), 4)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    print(json.dumps({"tokens": len(served), "layers_hooked": len(hooked), **gaps}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
