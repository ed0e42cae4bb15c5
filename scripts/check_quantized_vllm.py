"""Which quantized fixtures vLLM's CPU build serves: a manual check, not a test.

    PYTHONPATH=. .venv/bin/python scripts/check_quantized_vllm.py [FIXTURE ...]

For each folder of tests/fixtures/quantized/ (or those named), in a fresh subprocess per try, it
starts `vllm.LLM` on the folder (eager, in-process engine core), greedily generates 8 tokens
from a prompt and compares them with the greedy tokens of the same folder loaded by
`load_causal_lm` (transformers, with our GPTQ/AWQ dequantization). It tries float32 and then,
where that fails, bfloat16, and prints one line per fixture: what ran, or the error's last line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "quantized"
PROMPT = "The capital of France is"
NEW_TOKENS = 8
TIMEOUT_S = 300

_CHILD = """
import json, sys, torch
from pathlib import Path
path, dtype, prompt, new_tokens = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
from noisy_temp_server.checkpoints.checkpoint import load_causal_lm
model, tokenizer = load_causal_lm(path, verify=False)
ids = tokenizer(prompt, return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
reference = out[0, ids.shape[1]:].tolist()
from vllm import LLM, SamplingParams
llm = LLM(model=str(path), dtype=dtype, max_model_len=256, enforce_eager=True, seed=0)
params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
served = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
print("RESULT " + json.dumps({"served": served, "reference": reference}))
"""


def _try(path: Path, dtype: str) -> tuple[bool, str]:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    try:
        run = subprocess.run(
            [sys.executable, "-c", _CHILD, str(path), dtype, PROMPT, str(NEW_TOKENS)],
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
            return True, f"served; {same}/{NEW_TOKENS} greedy tokens as transformers"
    errors = [
        line.strip()
        for line in run.stderr.splitlines()
        if "error" in line.lower() and "errors.pydantic.dev" not in line
    ]
    return False, (errors[-1] if errors else run.stderr.strip().splitlines()[-1])[:300]


def main(argv: list[str]) -> int:
    names = argv or sorted(path.name for path in FIXTURES.iterdir() if path.is_dir())
    for name in names:
        outcome = ""
        for dtype in ("float32", "bfloat16"):
            ok, message = _try(FIXTURES / name, dtype)
            outcome += f" {dtype}: {message};"
            if ok:
                break
        print(f"{name}:{outcome}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
