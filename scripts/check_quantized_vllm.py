"""Which quantized fixtures vLLM's CPU build serves: a manual check, not a test.

    PYTHONPATH=. .venv/bin/python scripts/check_quantized_vllm.py [--clean DIR] [FIXTURE ...]

For each folder of tests/fixtures/quantized/ (or those named), in a fresh subprocess per try, it
starts `vllm.LLM` on the folder (eager, in-process engine core), greedily generates 8 tokens
from a prompt and compares them with the greedy tokens of the same folder loaded by
`load_causal_lm` (transformers, with our GPTQ/AWQ dequantization). It tries float32 and then,
where that fails, bfloat16, and prints one line per fixture: what ran, or the error's last line.

Where vLLM serves it, it also scores a fixed text teacher-forced both ways and prints how far
vLLM's kernels are from the transformers forward the scorer uses: the mean |Δ log p| of the
text's tokens between vLLM's prompt logprobs and transformers in vLLM's dtype (the kernel's
gap), beside the same between transformers in float32 and in that dtype (the dtype's own gap)
and, with `--clean DIR` (the fixtures' source: `build_tiny_llama(DIR, seed=0)`), between the
clean model and the quantized one in float32 (the quantization's own effect).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "quantized"
PROMPT = "The capital of France is"
TEXT = (
    "def add(a, b):\n    return a + b\n\nThe quick brown fox jumps over the lazy dog, "
    "and the cat sat on the mat while the rain fell on the roof of the old house."
)
NEW_TOKENS = 8
TIMEOUT_S = 300

_CHILD = """
import json, sys, torch
from pathlib import Path
path, dtype, prompt, new_tokens = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
text, clean = sys.argv[5], sys.argv[6]
from noisy_temp_server.checkpoints.checkpoint import load_causal_lm
model, tokenizer = load_causal_lm(path, verify=False)
ids = tokenizer(prompt, return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
reference = out[0, ids.shape[1]:].tolist()
text_ids = tokenizer(text).input_ids

def teacher_forced(model):
    with torch.no_grad():
        logits = model(torch.tensor([text_ids])).logits[0, :-1].float()
    picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(text_ids[1:])[:, None])
    return picked[:, 0].tolist()

hf_float32 = teacher_forced(model)
hf_clean = teacher_forced(load_causal_lm(Path(clean))[0]) if clean else None
hf_dtype = teacher_forced(model.to(getattr(torch, dtype)))
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=str(path), dtype=dtype, max_model_len=256, enforce_eager=True, seed=0)
params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
served = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
scored = llm.generate(
    [TokensPrompt(prompt_token_ids=text_ids)], SamplingParams(max_tokens=1, prompt_logprobs=0)
)[0].prompt_logprobs
vllm_dtype = [entry[token].logprob for entry, token in zip(scored[1:], text_ids[1:])]
print("RESULT " + json.dumps({"served": served, "reference": reference, "hf_float32": hf_float32,
      "hf_dtype": hf_dtype, "vllm": vllm_dtype, "hf_clean": hf_clean}))
"""


def _mean_gap(first: list[float], second: list[float]) -> float:
    return sum(abs(a - b) for a, b in zip(first, second, strict=True)) / len(first)


def _try(path: Path, dtype: str, clean: str) -> tuple[bool, str]:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    try:
        run = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path), dtype, PROMPT, str(NEW_TOKENS), TEXT, clean],
            capture_output=True,
            text=True,
            env=env,
            timeout=TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False, f"timed out after {TIMEOUT_S} s"
    for line in run.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line.removeprefix("RESULT "))
            same = sum(a == b for a, b in zip(result["served"], result["reference"], strict=True))
            kernel = _mean_gap(result["vllm"], result["hf_dtype"])
            rounding = _mean_gap(result["hf_dtype"], result["hf_float32"])
            clean_gap = (
                None
                if result["hf_clean"] is None
                else _mean_gap(result["hf_float32"], result["hf_clean"])
            )
            quantization = "" if clean_gap is None else f", quantized - clean {clean_gap:.4f}"
            return True, (
                f"served; {same}/{NEW_TOKENS} greedy tokens as transformers; mean |Δ log p| "
                f"vLLM - transformers {kernel:.4f}, transformers {dtype} - float32 {rounding:.4f}"
                + quantization
            )
    errors = [
        line.strip()
        for line in run.stderr.splitlines()
        if "error" in line.lower() and "errors.pydantic.dev" not in line
    ]
    return False, (errors[-1] if errors else run.stderr.strip().splitlines()[-1])[:300]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clean", default="", help="the fixtures' clean source folder")
    parser.add_argument("fixtures", nargs="*", help="fixture folder names (default: all)")
    args = parser.parse_args(argv)
    names = args.fixtures or sorted(path.name for path in FIXTURES.iterdir() if path.is_dir())
    for name in names:
        outcome = ""
        for dtype in ("float32", "bfloat16"):
            ok, message = _try(FIXTURES / name, dtype, args.clean)
            outcome += f" {dtype}: {message};"
            if ok:
                break
        print(f"{name}:{outcome}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
