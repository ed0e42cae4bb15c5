"""Peak resident memory of `calibrate --adapter-rank 16` against model size, on random Llamas.

For each size of ``--sizes`` (``tiny``: about 0.14 B parameters, ``small``: 0.26 B, ``1b``:
1.07 B; shapes
in `SIZES`, Llama 3's proportions: grouped-query attention with 4 query heads per key/value
head, an untied output head) the script builds, locally and without a network:

- the clean model: a `LlamaForCausalLM` with random weights (seed 0), saved in bf16 as sharded
  safetensors (``max_shard_size`` 500 MB) with the embedded SmolLM2's tokenizer (49 152 tokens);
- its compressed-tensors W4A16 copy, by the product's own ``noisy-temp-server quantize --format
  w4a16`` (round-to-nearest, groups of 128, output head left in float).

Both are kept under ``--work-dir`` and reused when present. Then it runs ``noisy-temp-server
calibrate --clean C --served Q --adapter-rank 16`` under ``/usr/bin/time -v`` with tiny prompt
counts (``--num-prompts``, ``--max-new-tokens``), so that each run takes minutes on one core,
and reads its peak resident set size (``--served-weights packed`` measures the lean served
model, ``float`` the served model loaded whole). ``--package-root`` runs another tree's package
(e.g. an export of an older commit) to compare. Beside each peak it prints the parts the formula of
docs/adapter.md ("Peak memory") adds up: the clean model in float32 (4 bytes a parameter), the
served checkpoint's packed bytes, one layer's float32 weight, and the runtime (Python, torch,
transformers) measured as the RSS of a process that imported them.

Results: a table on stdout, and JSON + markdown under ``benchmarks/results/`` (``--name``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fit_memory.py --sizes small,1b \
        --method svd --served-weights packed
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

# name -> hidden size, MLP width, decoder blocks, query heads (key/value heads: a quarter)
SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (768, 2688, 8, 12),
    "small": (1024, 3584, 12, 16),
    "1b": (2048, 7168, 16, 32),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_PEAK = re.compile(r"Maximum resident set size \(kbytes\): (\d+)")
_SAMPLE_S = 0.5
_VOCAB = 49_152  # the embedded SmolLM2's tokenizer
_MARGIN = 2_000_000_000  # bytes beyond the float copies a run is let start with
_IMPORTS = (
    "import resource, torch, transformers, compressed_tensors, noisy_temp_server.cli; "
    "from transformers import LlamaForCausalLM; "
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
)


def _environment(package_root: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(package_root), HF_HUB_OFFLINE="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def build_clean(folder: Path, size: str) -> None:
    """The random bf16 Llama of `size`, sharded, with the embedded model's tokenizer."""
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    from noisy_temp_server.checkpoints.default_model import ensure_default_model  # noqa: PLC0415
    from noisy_temp_server.files import default_cache_dir  # noqa: PLC0415

    hidden, mlp, blocks, heads = SIZES[size]
    tokenizer_folder = ensure_default_model(default_cache_dir())
    vocab = json.loads((tokenizer_folder / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=blocks,
        num_attention_heads=heads,
        num_key_value_heads=heads // 4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no float32 copy on the way
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial, max_shard_size="500MB")
    for name in _TOKENIZER_FILES:
        source = tokenizer_folder / name
        if source.is_file():
            (partial / name).write_bytes(source.read_bytes())
    partial.rename(folder)


def _parameters(folder: Path) -> int:
    from safetensors import safe_open  # noqa: PLC0415

    count = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                count += _numel(handle.get_slice(name).get_shape())
    return count


def _numel(shape: list[int]) -> int:
    total = 1
    for side in shape:
        total *= side
    return total


def _bytes(folder: Path) -> int:
    return sum(file.stat().st_size for file in folder.glob("*.safetensors"))


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return 1024 * int(line.split()[1])
    raise SystemExit("no MemAvailable in /proc/meminfo")


def _rss_kib(pid: int) -> int:
    """The process's resident set now (kB; 0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(r"VmRSS:\s+(\d+) kB", status)
    return int(match.group(1)) if match else 0


def _run_sampled(command: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    """Run `command` under ``/usr/bin/time -v`` (its output and the command's in `log`),
    sampling the command's RSS every `_SAMPLE_S` seconds. Returns its peak RSS (time's figure),
    the wall time, and the log line last printed before the largest sample (the phase at the
    peak)."""
    started = time.monotonic()
    largest, phase, last_line = 0, "", ""
    with log.open("w") as out:
        process = subprocess.Popen(
            ["/usr/bin/time", "-v", *command], env=env, stdout=out, stderr=subprocess.STDOUT
        )
        while process.poll() is None:
            time.sleep(_SAMPLE_S)
            children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
            pids = children.read_text().split() if children.exists() else []
            rss = sum(_rss_kib(int(pid)) for pid in pids)
            lines = [line for line in log.read_text().splitlines() if line.startswith("INFO")]
            last_line = lines[-1] if lines else last_line
            if rss > largest:
                largest, phase = rss, last_line
    text = log.read_text()
    match = _PEAK.search(text)
    killed = "Command terminated by signal 9" in text  # the kernel's out-of-memory killer
    if match is None or (process.returncode and not killed):
        raise SystemExit(f"{' '.join(command[:4])} ... failed ({process.returncode}); see {log}")
    return {
        "peak_rss_bytes": 1024 * int(match.group(1)),
        "wall_s": round(time.monotonic() - started, 1),
        "phase_at_peak": phase,
        **({"killed": "out of memory (signal 9): the peak is where it stopped"} if killed else {}),
    }


def measure(size: str, args: argparse.Namespace) -> dict[str, Any]:
    """Build (or reuse) the pair of `size` and measure calibrate's peak RSS on it."""
    clean, served = args.work_dir / f"llama-{size}", args.work_dir / f"llama-{size}-w4a16"
    env = _environment(args.package_root)
    cli = [sys.executable, "-m", "noisy_temp_server.cli"]
    cache = ["--cache-dir", str(args.work_dir / "cache")]
    hidden, mlp, blocks, _ = SIZES[size]
    estimate = blocks * (2 * hidden * hidden * 5 // 4 + 3 * hidden * mlp) + 2 * _VOCAB * hidden
    copies = 1 if args.served_weights == "packed" else 2
    needed, available = copies * 4 * estimate + _MARGIN, _available_bytes()
    if available < needed:  # a shared machine: never push another's processes out of memory
        print(f"{size}: skipped, needs about {needed / 1e9:.1f} GB, {available / 1e9:.1f} free")
        return {"size": size, "parameters": estimate, "skipped": "not enough free memory"}
    if not clean.is_dir():
        build_clean(clean, size)
    if not served.is_dir():
        subprocess.run(
            [*cli, "quantize", "--format", "w4a16", "--clean", str(clean), "--out", str(served),
             *cache], env=_environment(REPO), check=True,
        )  # fmt: skip
    out = args.work_dir / f"profile-{size}-{args.name}.json"
    command = [
        *cli, "calibrate", "--clean", str(clean), "--served", str(served), "--out", str(out),
        "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
        "--adapter-rank", "16", "--adapter-method", args.method, "--bias-rows", "64",
        "--request-temperatures", "1.0", "--min-quality-positions", "1",
        "--min-cell-positions", "1", *cache,
    ]  # fmt: skip
    if args.served_weights is not None:
        command += ["--served-weights", args.served_weights]
    parameters = _parameters(clean)
    sampled = _run_sampled(command, env, args.work_dir / f"calibrate-{size}-{args.name}.log")
    return {
        "size": size,
        "shape": dict(zip(("hidden", "mlp", "blocks", "heads"), SIZES[size], strict=True)),
        "parameters": parameters,
        "clean_float32_bytes": 4 * parameters,
        "clean_bf16_file_bytes": _bytes(clean),
        "served_file_bytes": _bytes(served),
        "largest_layer_float32_bytes": 4 * hidden * mlp,
        **sampled,
    }


def _runtime_bytes(package_root: Path) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _IMPORTS], env=_environment(package_root), capture_output=True,
        text=True, check=True,
    )  # fmt: skip
    return 1024 * int(done.stdout.strip().splitlines()[-1])


def _markdown(result: dict[str, Any]) -> str:
    gb = 1e9
    lines = [
        f"# calibrate --adapter-rank 16 --adapter-method {result['method']} "
        f"--served-weights {result['served_weights']}: peak RSS ({result['name']})",
        "",
        f"{result['date']}, {result['machine']}; {result['num_prompts']} prompts × "
        f"{result['max_new_tokens']} tokens; runtime after imports "
        f"{result['runtime_bytes'] / gb:.2f} GB.",
        "",
        "| model | parameters | clean float32 | served files (W4A16) | peak RSS "
        "| peak − clean float32 − runtime | wall | last log line before the largest sample |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for row in result["rows"]:
        if "skipped" in row:
            lines.append(f"| {row['size']} | {row['parameters'] / 1e9:.3f} B | {row['skipped']} |")
            continue
        rest = row["peak_rss_bytes"] - row["clean_float32_bytes"] - result["runtime_bytes"]
        phase = row["phase_at_peak"].partition(": ")[2]  # the message, without the logger
        lines.append(
            f"| {row['size']} | {row['parameters'] / 1e9:.3f} B | "
            f"{row['clean_float32_bytes'] / gb:.2f} GB | {row['served_file_bytes'] / gb:.2f} GB | "
            f"{row['peak_rss_bytes'] / gb:.2f} GB | {rest / gb:.2f} GB | {row['wall_s']:.0f} s | "
            f"{phase}{' (killed: out of memory)' if 'killed' in row else ''} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,1b", help=f"comma-separated: {', '.join(SIZES)}")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/nts-fit-memory"))
    parser.add_argument(
        "--package-root", type=Path, default=REPO, help="tree to run calibrate from"
    )
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--method", default="propagated", choices=("eora", "propagated", "svd"))
    parser.add_argument(
        "--served-weights",
        choices=("auto", "packed", "float"),
        default=None,
        help="calibrate's --served-weights (not given: its default; a tree from before the "
        "option has none)",
    )
    parser.add_argument("--name", default="fit_memory", help="results file stem")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "name": args.name,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "package_root": str(args.package_root),
        "method": args.method,
        "served_weights": args.served_weights,
        "num_prompts": args.num_prompts,
        "max_new_tokens": args.max_new_tokens,
        "runtime_bytes": _runtime_bytes(args.package_root),
        "rows": [],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    for size in args.sizes.split(","):  # saved after each size: a later one may not finish
        result["rows"].append(measure(size, args))
        text = _markdown(result)
        (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
        (RESULTS / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
