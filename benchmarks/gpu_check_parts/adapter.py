"""The compensation adapter's device work at an 8B Llama's shapes, without vLLM: the adapter
part of `gpu_check.py`.

Two measurements, on random weights of one decoder block's shapes (`BlockShape`):

- `check_fit`: the ``propagated`` fit of every projection of one block
  (`adapter.deltas.propagated_delta`, what calibration runs per layer) on the device:
  seconds and peak device memory per projection, and for the smallest one the delta the CPU
  fits from the same tensors, which the device's must equal;
- `check_lora_decode`: the device time of one block's linear layers on a decode batch, as vLLM
  fuses them (q, k, v in one product; gate and up in another), without an adapter (which is
  also the cost with a folded one: the same products on other weights) and with an unmerged
  LoRA adapter added by two skinny products per fused layer (shrink x Aᵀ, expand into each
  output slice), all captured in one CUDA graph: the floor of what the LoRA path's arithmetic
  costs, not vLLM's own kernels (Triton, with indexing for many adapters), which need vLLM.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from noisy_temp_server.adapter.deltas import propagated_delta

from .timing import synchronize, timed

PROPAGATED_RIDGE = 10.0
"""The ridge of the timed fits: the middle of the ones calibration tries for ``propagated``
(the cost does not depend on it)."""
FIT_TOLERANCE = 1e-5
"""||device delta - CPU delta|| <= this * ||CPU delta|| (Frobenius), both fitted in float64
from the same float32 tensors."""
FOLD_TOLERANCE = 1e-4
"""max |(x Wᵀ + x Aᵀ Bᵀ) - x (W + B A)ᵀ| <= this * max |x (W + B A)ᵀ|, in float32."""


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """A Llama decoder block's linear shapes: hidden size, MLP width, and the width of the key
    and value projections (heads of the keys and values times the head size)."""

    hidden: int
    mlp: int
    kv: int

    def projections(self) -> dict[str, tuple[int, int]]:
        """Each perturbed projection's weight shape (out, in), as the adapter targets them."""
        d, f, kv = self.hidden, self.mlp, self.kv
        return {
            "k_proj": (kv, d),  # the smallest first: the CPU's fit is compared on it
            "v_proj": (kv, d),
            "q_proj": (d, d),
            "o_proj": (d, d),
            "gate_proj": (f, d),
            "up_proj": (f, d),
            "down_proj": (d, f),
        }

    def fused(self) -> dict[str, tuple[tuple[int, ...], int]]:
        """vLLM's fused linear layers: (output slices, input width) of each."""
        d, f, kv = self.hidden, self.mlp, self.kv
        return {
            "qkv_proj": ((d, kv, kv), d),
            "o_proj": ((d,), d),
            "gate_up_proj": ((f, f), d),
            "down_proj": ((d,), f),
        }

    def parameters(self) -> int:
        """The block's linear parameters."""
        return sum(out * inp for out, inp in self.projections().values())


def _idle() -> None:
    """Nothing to reset between timed calls."""


@dataclasses.dataclass(frozen=True)
class AdapterSizes:
    """What the adapter part of the check measures: the block's shape, the LoRA ranks and
    decode batches of `check_lora_decode` over ``blocks`` blocks, the fit's rank and tokens."""

    shape: BlockShape
    lora_ranks: tuple[int, ...]
    decode_batches: tuple[int, ...]
    blocks: int
    fit_rank: int
    fit_tokens: int


LLAMA_8B = BlockShape(hidden=4096, mlp=14336, kv=1024)
FULL_SIZES = AdapterSizes(LLAMA_8B, (16, 64), (1, 32, 256), blocks=8, fit_rank=64, fit_tokens=4096)
QUICK_SIZES = AdapterSizes(
    BlockShape(hidden=64, mlp=224, kv=16), (4, 8), (1, 8), blocks=2, fit_rank=8, fit_tokens=256
)


def _fit_inputs(
    out: int, inp: int, tokens: int, generator: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """(clean weight, served weight, A = X_sᵀX_s/n, B = X_sᵀX_c/n) in float32 on ``device``:
    clean weights of variance 1/in, served = clean plus 5 % noise, served inputs with feature
    scales spread over four decades, clean inputs within 10 % of them."""

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device)

    clean = normal(out, inp) / inp**0.5
    served = clean + 0.05 * normal(out, inp) / inp**0.5
    order = torch.randperm(inp, generator=generator, device=device)
    scales = torch.logspace(0, -4, inp, device=device)[order]
    served_inputs = normal(tokens, inp) * scales
    clean_inputs = served_inputs + 0.1 * normal(tokens, inp) * scales
    second = served_inputs.T @ served_inputs / tokens
    cross = served_inputs.T @ clean_inputs / tokens
    return clean, served, second, cross


def _fit(tensors: tuple[torch.Tensor, ...], rank: int) -> torch.Tensor:
    clean, served, second, cross = tensors
    return propagated_delta(clean, served, second, cross, rank=rank, ridge=PROPAGATED_RIDGE).dense()


def check_fit(
    shape: BlockShape,
    rank: int,
    tokens: int,
    device: torch.device,
    *,
    seed: int,
    deadline: float,
) -> dict[str, Any]:
    """The ``propagated`` fit of each of ``shape``'s projections at ``rank`` from ``tokens``
    calibration tokens, on ``device``: per projection its seconds and the peak device memory
    above what was allocated before it (CUDA only; null on a CPU), then the block's total;
    ``matches_cpu`` and ``relative_error`` compare the smallest projection's delta with the
    CPU's from the same tensors (`FIT_TOLERANCE`). Projections not begun by ``deadline`` (a
    `time.perf_counter` reading) are listed in ``skipped``."""
    cuda = device.type == "cuda"
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    comparison: dict[str, Any] = {"projection": None, "relative_error": None, "matches_cpu": False}
    for index, (name, (out, inp)) in enumerate(shape.projections().items()):
        if time.perf_counter() > deadline:
            skipped.append(name)
            continue
        generator = torch.Generator(device=device).manual_seed(seed + index)
        tensors = _fit_inputs(out, inp, tokens, generator, device)
        if cuda:
            synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if cuda else 0
        started = time.perf_counter()
        delta = _fit(tensors, rank)
        synchronize(device)
        seconds = time.perf_counter() - started
        peak = torch.cuda.max_memory_allocated(device) - before if cuda else None
        row = {"projection": name, "out": out, "in": inp, "seconds": round(seconds, 3)}
        rows.append(row | {"peak_bytes": peak})
        if index == 0:
            reference = _fit(tuple(t.cpu() for t in tensors), rank)
            error = float((delta.cpu() - reference).norm() / reference.norm())
            comparison = {"projection": name, "relative_error": error}
            comparison["matches_cpu"] = error <= FIT_TOLERANCE
        del tensors, delta
    return {
        "shape": dataclasses.asdict(shape),
        "rank": rank,
        "tokens": tokens,
        "ridge": PROPAGATED_RIDGE,
        "projections": rows,
        "skipped": skipped,
        "block_seconds": round(sum(row["seconds"] for row in rows), 3),
        "block_peak_bytes": max((row["peak_bytes"] for row in rows), default=0) if cuda else None,
        "cpu_comparison": comparison,
    }


@dataclasses.dataclass
class _FusedLayer:
    """One fused linear layer's weight [Σ out, in] and, for a LoRA rank, its stacked down
    factors [slices · r, in] and each slice's up factor, transposed [r, out]."""

    weight: torch.Tensor
    slices: tuple[int, ...]
    down: torch.Tensor | None = None
    ups: tuple[torch.Tensor, ...] = ()

    @classmethod
    def random(
        cls,
        slices: tuple[int, ...],
        inp: int,
        rank: int | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> _FusedLayer:
        def normal(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, device=device) / inp**0.5).to(dtype)

        layer = cls(weight=normal(sum(slices), inp), slices=slices)
        if rank is not None:
            layer.down = normal(len(slices) * rank, inp)
            layer.ups = tuple(normal(rank, out) for out in slices)
        return layer

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out = x Wᵀ, plus each slice's (x Aᵢᵀ) Bᵢᵀ where the layer has an adapter."""
        torch.mm(x, self.weight.T, out=out)
        if self.down is None:
            return
        shrunk = x @ self.down.T
        rank, start = self.ups[0].shape[0], 0
        for index, up in enumerate(self.ups):
            width = up.shape[1]
            out[:, start : start + width].addmm_(shrunk[:, index * rank : (index + 1) * rank], up)
            start += width

    def folded(self) -> torch.Tensor:
        """W + B A: the weight that computes the same function with no adapter."""
        if self.down is None:
            return self.weight
        rank = self.ups[0].shape[0]
        deltas = [
            up.T @ self.down[index * rank : (index + 1) * rank] for index, up in enumerate(self.ups)
        ]
        return self.weight + torch.cat(deltas)


def _block(
    shape: BlockShape, rank: int | None, dtype: torch.dtype, device: torch.device
) -> list[tuple[_FusedLayer, int]]:
    return [
        (_FusedLayer.random(slices, inp, rank, dtype, device), inp)
        for slices, inp in shape.fused().values()
    ]


def _decode_runner(
    blocks: list[list[tuple[_FusedLayer, int]]],
    batch: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Callable[[], None]:
    """A call that runs every fused layer of ``blocks`` on one decode batch (inputs and outputs
    preallocated); on CUDA the replay of one graph capturing them."""
    inputs = {inp: torch.randn(batch, inp, device=device).to(dtype) for _, inp in blocks[0]}
    outputs = [
        [torch.empty(batch, sum(layer.slices), device=device, dtype=dtype) for layer, _ in block]
        for block in blocks
    ]

    def run() -> None:
        for block, block_outputs in zip(blocks, outputs, strict=True):
            for (layer, inp), out in zip(block, block_outputs, strict=True):
                layer.forward(inputs[inp], out)

    if device.type != "cuda":
        return run
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()  # the warm-up graphs need: cuBLAS picks and allocates its workspace
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def folding_error(shape: BlockShape, rank: int, batch: int, device: torch.device) -> float:
    """The largest relative difference, over ``shape``'s fused layers in float32, between the
    layer with an unmerged rank-``rank`` adapter and the same layer with it folded in."""
    worst = 0.0
    for layer, inp in _block(shape, rank, torch.float32, device):
        x = torch.randn(batch, inp, device=device)
        unmerged = torch.empty(batch, sum(layer.slices), device=device)
        layer.forward(x, unmerged)
        folded = x @ layer.folded().T
        worst = max(worst, float((unmerged - folded).abs().max() / folded.abs().max()))
    return worst


def check_lora_decode(
    shape: BlockShape,
    *,
    ranks: tuple[int, ...],
    batches: tuple[int, ...],
    blocks: int,
    repeats: int,
    device: torch.device,
) -> dict[str, Any]:
    """Per decode batch and rank: the device µs per block of ``blocks`` blocks' fused linear
    layers without an adapter and with an unmerged one (bf16 on CUDA, float32 on a CPU), their
    ratio, and the base's weight bandwidth; ``folding`` checks that folding the adapter computes
    the same function (`FOLD_TOLERANCE`)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weight_bytes = shape.parameters() * torch.finfo(dtype).bits // 8
    rows = []
    for rank in ranks:
        adapted = [_block(shape, rank, dtype, device) for _ in range(blocks)]
        base = [
            [(dataclasses.replace(layer, down=None, ups=()), inp) for layer, inp in block]
            for block in adapted
        ]
        for batch in batches:
            base_us, _ = timed(_decode_runner(base, batch, dtype, device), _idle, device, repeats)
            lora_us, _ = timed(
                _decode_runner(adapted, batch, dtype, device), _idle, device, repeats
            )
            rows.append(
                {
                    "batch": batch,
                    "rank": rank,
                    "base_us_per_block": round(base_us / blocks, 2),
                    "lora_us_per_block": round(lora_us / blocks, 2),
                    "lora_over_base": round(lora_us / base_us, 3),
                    "base_weight_gb_s": round(weight_bytes * blocks / (base_us * 1e-6) / 1e9, 1),
                }
            )
        del adapted, base
    error = max(folding_error(shape, rank, 8, device) for rank in ranks)
    return {
        "shape": dataclasses.asdict(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "blocks": blocks,
        "weight_bytes_per_block": weight_bytes,
        "cuda_graph": device.type == "cuda",
        "rows": rows,
        "folding": {"max_relative_error": error, "matches": error <= FOLD_TOLERANCE},
    }
