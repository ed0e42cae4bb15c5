"""CPU time of one online bias step (`StreamingBias.update`) per shadow-scored request, with and
without request-temperature bands, and with the step in the output head's span too.

The shadow scorer hands the online bias the paired rows of each scored request (at most
`Settings().shadow_bias_rows`, 32); each is one `update`: the step in the head's span when the
bias has a part there (as calibration fits it, and the shipped default-pair profile's has; here
a random orthonormal basis of `--head-dim` columns, the embedded model's hidden size), the
per-token stochastic Newton step, then, when the bias is served in bands, one step per band
other than T_r = 1. The rows here
are synthetic (clean logits of scale 3, served = clean + unit noise) at the embedded model's
vocabulary; the cost does not depend on their values. Per configuration: `--repeats` timed
updates after one warm-up, min / median / max milliseconds. Saved as JSON under
experiments/results/.

    .venv/bin/python experiments/streaming_bias_cost.py [--vocab 49152] [--rows 32]
        [--bands 0.5,0.7,1.2] [--head-dim 576] [--repeats 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from noisy_temp_server.correction.paired_rows import LogitBias, PairedRows
from noisy_temp_server.correction.streaming_bias import StreamingBias

RESULTS = Path(__file__).resolve().parent / "results"


def _batches(count: int, rows: int, vocab: int) -> list[PairedRows]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for request in range(count):
        clean = 3 * torch.randn(rows, vocab, generator=generator)
        served = clean + torch.randn(rows, vocab, generator=generator)
        batches.append(PairedRows.from_logits(clean, served, request))
    return batches


def _milliseconds(
    bands: dict[float, float], batches: list[PairedRows], basis: torch.Tensor | None
) -> list[float]:
    """Wall time of each update after the first (a warm-up), in ms; with `basis`, each steps in
    its span too."""
    vocab = batches[0].vocab_size
    stream = StreamingBias(
        LogitBias.identity(vocab),
        1e-3,
        band_temperatures=bands,
        prior_rows=2048,
        basis=basis,
        head_penalty=None if basis is None else 1e-3,
    )
    stream.update(batches[0])
    times = []
    for rows in batches[1:]:
        started = time.perf_counter()
        stream.update(rows)
        times.append(1e3 * (time.perf_counter() - started))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", type=int, default=32, help="rows per request")
    parser.add_argument(
        "--bands", default="0.5,0.7,1.2", help="request temperatures other than 1 with a band"
    )
    parser.add_argument(
        "--head-dim", type=int, default=576, help="columns of the head basis (0: no head span)"
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = _batches(args.repeats + 1, args.rows, args.vocab)
    band_temperatures = [float(t) for t in args.bands.split(",") if t.strip()]
    bands = dict.fromkeys(band_temperatures, 1.2)
    configurations: dict[str, tuple[dict[float, float], torch.Tensor | None]] = {
        "per-token step only": ({}, None),
        f"with {len(bands)} bands": (bands, None),
    }
    if args.head_dim:
        generator = torch.Generator().manual_seed(1)
        gaussian = torch.randn(args.vocab, args.head_dim, generator=generator)
        basis = torch.linalg.qr(gaussian).Q
        configurations[f"head span ({args.head_dim}) and {len(bands)} bands"] = (bands, basis)
    results = []
    for name, (bands_of_run, basis_of_run) in configurations.items():
        times = _milliseconds(bands_of_run, batches, basis_of_run)
        figures = {
            "configuration": name,
            "min_ms": min(times),
            "median_ms": statistics.median(times),
            "max_ms": max(times),
        }
        results.append(figures)
        print(
            f"{name}: {figures['median_ms']:.1f} ms per request (min {figures['min_ms']:.1f}, "
            f"max {figures['max_ms']:.1f}); {args.rows} rows, V = {args.vocab}, "
            f"{args.threads} thread(s)",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "streaming_bias_cost.json").write_text(
        json.dumps({"settings": vars(args) | {"out": str(args.out)}, "results": results}, indent=2)
        + "\n",
        encoding="utf-8",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
