"""The compensation adapter's fit, one decoder block at a time, on token sequences.

`fit_compensation_adapter` walks the served model's decoder blocks in order. The hidden states
entering the first block are captured once per sequence (the forward stops there); then each
block's perturbed linear layers (weights that differ from the clean model's) are fitted at the
adapter's rank (`adapter.deltas`) from their inputs, gathered by forward hooks, and
the block is run again with its corrections applied by hooks to give the next block's inputs:
later blocks are fitted on the inputs the compensated model gives them. Two activation-aware
methods:

- ``eora``: each layer's own error W_clean - W_served, weighted by its input second moment
  X_s^T X_s / n, all of a block's layers from one pass;
- ``propagated``: the clean model's hidden states are carried alongside, and each layer is
  fitted to give the clean layer's outputs on the clean model's inputs
  (`adapter.deltas.propagated_error`), so it also corrects what reaches it from the
  layers before; a block is fitted in stages (q, k, v; o; gate, up; down), each on the inputs
  its earlier stages' corrections give it.

The served model's weights are never written (the caller folds the adapter it keeps,
`adapter.lora.fold_adapter`). Where the served model was smoothed, each clean block is rewritten
in its basis (`adapter.smoothing.served_basis`) while that block is fitted and run, and put back
after: one block's originals are kept at a time. Peak memory is stated in docs/adapter.md.

A quantized served model is either loaded whole (transformers decompresses its weights) or
lean (`checkpoints.lean_served`: its layers packed, each weight dequantized when read); either
way a served layer's `weight` reads as floats and the error is their difference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from noisy_temp_server.adapter.deltas import eora_delta, propagated_delta, svd_delta
from noisy_temp_server.adapter.lora import LoraAdapter, LowRankDelta
from noisy_temp_server.adapter.smoothing import check_adaptable_pair, served_basis
from noisy_temp_server.scoring.sequence import ScoringSequence

__all__ = [
    "DEFAULT_ADAPTER_RANK",
    "AdapterMethod",
    "adapter_targets",
    "applied_deltas",
    "decoder_blocks",
    "fit_compensation_adapter",
    "perturbed_linears",
    "reads_inputs",
]

DEFAULT_ADAPTER_RANK = 64
"""The rank an adapter is fitted at unless told (the choice is measured in docs/adapter.md)."""
AdapterMethod = Literal["eora", "propagated", "svd"]


def reads_inputs(method: AdapterMethod) -> bool:
    """Whether a fit `method` reads the layers' inputs (``eora``, ``propagated``), so that more
    sequences can change it; ``svd`` reads the weights alone."""
    return method != "svd"


logger = logging.getLogger(__name__)


class _ForwardStoppedError(Exception):
    """Raised by a hook to end a forward pass once the block inputs it needs are captured."""


@dataclass
class _BlockInput:
    """One sequence's hidden states entering a block, with the keyword arguments (rotary
    tables, mask, positions) the model passes every block."""

    hidden: Tensor
    kwargs: dict[str, Any]


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The module path and list of a causal LM's decoder blocks (``model.layers`` of a Llama).
    ValueError for a model without one."""
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList) and len(module):
            return name, module
    raise ValueError(f"{type(model).__name__} has no list of decoder blocks to fit an adapter on")


@torch.no_grad()
def _decompress(model: nn.Module) -> None:
    """Make a compressed-tensors model's weights plain floats: transformers leaves them
    compressed until the first forward pass, whose hook decompresses them; one token runs it
    (a no-op for a float model)."""
    if getattr(model.config, "quantization_config", None) is None:
        return
    device = next(model.parameters()).device
    model(input_ids=torch.zeros(1, 1, dtype=torch.int64, device=device), use_cache=False)


def perturbed_linears(clean: nn.Module, served: nn.Module) -> list[str]:
    """Module paths of the served decoder blocks' linear layers whose weight differs from the
    clean model's (the output head and embeddings are left out), compared after decompressing
    a compressed-tensors model's weights (`_decompress`). Empty when the served model is the
    clean one."""
    if clean is served:
        return []
    _decompress(clean)
    _decompress(served)
    prefix, _ = decoder_blocks(served)
    clean_modules = dict(clean.named_modules())
    names = []
    for name, module in served.named_modules():
        if not (name.startswith(prefix + ".") and isinstance(module, nn.Linear)):
            continue
        reference = clean_modules.get(name)
        if not isinstance(reference, nn.Linear) or reference.weight.shape != module.weight.shape:
            raise ValueError(f"the clean model has no linear layer {name} of the served shape")
        if not torch.equal(reference.weight, module.weight):
            names.append(name)
    return names


def adapter_targets(clean: nn.Module, served: nn.Module, rank: int) -> list[str]:
    """The layers a rank-`rank` adapter of the pair corrects (`perturbed_linears`). ValueError
    when there are none (runtime noise serves the clean weights: nothing for an adapter to
    correct), or when `rank` is below 1 or above a layer's smallest side, naming the layer."""
    names = perturbed_linears(clean, served)
    if not names:
        raise ValueError(
            "the served weights equal the clean ones (e.g. runtime logit noise): there is no "
            "weight error for an adapter to correct"
        )
    modules = dict(served.named_modules())
    narrowest = min(names, key=lambda name: min(modules[name].weight.shape))
    shape = tuple(modules[narrowest].weight.shape)
    if not 1 <= rank <= min(shape):
        raise ValueError(
            f"adapter rank {rank} must be between 1 and {min(shape)}, the smallest side of the "
            f"perturbed layer {narrowest} ({shape[0]} × {shape[1]})"
        )
    return names


@torch.no_grad()
def _first_block_inputs(
    model: nn.Module, blocks: nn.ModuleList, sequences: Sequence[ScoringSequence]
) -> list[_BlockInput]:
    captured: list[_BlockInput] = []

    def capture(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        captured.append(
            _BlockInput(hidden, {k: v for k, v in kwargs.items() if k != "hidden_states"})
        )
        raise _ForwardStoppedError

    device = next(model.parameters()).device
    handle = blocks[0].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        for sequence in sequences:
            ids = torch.tensor([sequence.token_ids], dtype=torch.int64, device=device)
            with suppress(_ForwardStoppedError):
                model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    return captured


@contextmanager
def _hooked(modules: dict[str, nn.Module], hook: Callable[..., Any]) -> Iterator[None]:
    handles = [
        module.register_forward_hook(lambda m, i, o, name=name: hook(name, i[0], o))
        for name, module in modules.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def _second_moments(
    block: nn.Module, linears: dict[str, nn.Module], inputs: Sequence[_BlockInput]
) -> dict[str, Tensor]:
    sums: dict[str, Tensor] = {}
    counts: dict[str, int] = dict.fromkeys(linears, 0)

    def accumulate(name: str, x: Tensor, _: Tensor) -> None:
        rows = x.reshape(-1, x.shape[-1]).float()
        sums[name] = sums[name] + rows.T @ rows if name in sums else rows.T @ rows
        counts[name] += rows.shape[0]

    with _hooked(linears, accumulate):
        for item in inputs:
            block(item.hidden, **item.kwargs)
    return {name: sums[name] / counts[name] for name in linears}


@contextmanager
def applied_deltas(model: nn.Module, deltas: Mapping[str, LowRankDelta]) -> Iterator[None]:
    """Within the block, each linear layer of `model` named in `deltas` (module path -> delta)
    computes (W + up @ down) x, by a forward hook; the weights are not written. KeyError for a
    name `model` lacks."""
    modules = dict(model.named_modules())
    handles = []

    def hook(delta: LowRankDelta) -> Callable[..., Tensor]:
        def correct(_: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
            x = inputs[0]
            return output + (x @ delta.down.to(x).T) @ delta.up.to(x).T

        return correct

    try:
        for name, delta in deltas.items():
            handles.append(modules[name].register_forward_hook(hook(delta)))
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def _next_inputs(
    model: nn.Module,
    block: nn.Module,
    deltas: Mapping[str, LowRankDelta],
    inputs: Sequence[_BlockInput],
) -> list[_BlockInput]:
    outputs = []
    with applied_deltas(model, deltas):
        for item in inputs:
            hidden = block(item.hidden, **item.kwargs)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
            outputs.append(_BlockInput(hidden, item.kwargs))
    return outputs


def _stages(block: nn.Module, linears: dict[str, nn.Module], item: _BlockInput) -> list[list[str]]:
    """`linears` in the order a forward pass of `block` calls them, those called on the same
    input tensor grouped (q, k, v; o; gate, up; down in a Llama block): a stage's inputs
    depend only on the stages before it."""
    calls: list[tuple[list[str], Tensor]] = []

    def record(name: str, x: Tensor, _: Tensor) -> None:
        if calls and calls[-1][1] is x:
            calls[-1][0].append(name)
        else:
            calls.append(([name], x))

    with torch.no_grad(), _hooked(linears, record):
        block(item.hidden, **item.kwargs)
    return [names for names, _ in calls]


def _captured_inputs(
    block: nn.Module, linears: dict[str, nn.Module], item: _BlockInput
) -> dict[str, Tensor]:
    inputs: dict[str, Tensor] = {}

    def keep(name: str, x: Tensor, _: Tensor) -> None:
        inputs[name] = x.reshape(-1, x.shape[-1]).float()

    with _hooked(linears, keep):
        block(item.hidden, **item.kwargs)
    return inputs


@torch.no_grad()
def _paired_moments(
    blocks: tuple[nn.Module, nn.Module],
    linears: tuple[dict[str, nn.Module], dict[str, nn.Module]],
    inputs: tuple[Sequence[_BlockInput], Sequence[_BlockInput]],
) -> dict[str, tuple[Tensor, Tensor]]:
    """{name: (X_s^T X_s / n, X_s^T X_c / n)} for each layer of the (clean, served) `linears`,
    X_c its inputs in the clean block, X_s in the served block, at the same positions."""
    (clean_block, served_block), (clean_linears, served_linears) = blocks, linears
    device = next(served_block.parameters()).device
    sums = {
        name: (
            torch.zeros(module.in_features, module.in_features, device=device),
            torch.zeros(module.in_features, module.in_features, device=device),
        )
        for name, module in served_linears.items()
        if isinstance(module, nn.Linear)
    }
    count = 0
    for clean_item, served_item in zip(*inputs, strict=True):
        clean_x = _captured_inputs(clean_block, clean_linears, clean_item)
        served_x = _captured_inputs(served_block, served_linears, served_item)
        for name, x in served_x.items():
            moment, cross = sums[name]
            moment.addmm_(x.T, x)
            cross.addmm_(x.T, clean_x[name])
        count += len(next(iter(served_x.values())))
    return {name: (moment / count, cross / count) for name, (moment, cross) in sums.items()}


def _layer_delta(
    clean: nn.Module,
    served: nn.Module,
    moment: Tensor | None,
    rank: int,
    ridge: float,
) -> LowRankDelta:
    clean_weight, served_weight = clean.weight, served.weight
    assert isinstance(clean_weight, Tensor)
    assert isinstance(served_weight, Tensor)
    error = clean_weight.detach().double() - served_weight.detach().double()
    if moment is None:
        return svd_delta(error, rank)
    return eora_delta(error, moment, rank, ridge)


@torch.no_grad()
def _propagated_block_deltas(
    models: tuple[nn.Module, nn.Module],
    blocks: tuple[nn.Module, nn.Module],
    names: Sequence[str],
    inputs: tuple[Sequence[_BlockInput], Sequence[_BlockInput]],
    *,
    rank: int,
    ridge: float,
) -> dict[str, LowRankDelta]:
    """The deltas of one block's perturbed layers `names`, fitted stage by stage (`_stages`)
    so that each stage sees the served inputs its earlier stages' deltas give it, each to
    reproduce the clean layer's outputs on the clean block's inputs (`propagated_delta`)."""
    clean_model, served_model = models
    clean_modules, served_modules = (
        dict(clean_model.named_modules()),
        dict(served_model.named_modules()),
    )
    fitted: dict[str, LowRankDelta] = {}
    for stage in _stages(blocks[1], {n: served_modules[n] for n in names}, inputs[1][0]):
        stage_linears = (
            {n: clean_modules[n] for n in stage},
            {n: served_modules[n] for n in stage},
        )
        with applied_deltas(served_model, fitted):
            moments = _paired_moments(blocks, stage_linears, inputs)
        for name in stage:
            moment, cross = moments[name]
            clean_weight, served_weight = clean_modules[name].weight, served_modules[name].weight
            assert isinstance(clean_weight, Tensor)
            assert isinstance(served_weight, Tensor)
            fitted[name] = propagated_delta(
                clean_weight.detach(), served_weight.detach(), moment, cross, rank=rank, ridge=ridge
            )
    return fitted


def _fit_blocks(
    models: tuple[nn.Module, nn.Module],
    names: Sequence[str],
    sequences: Sequence[ScoringSequence],
    *,
    method: AdapterMethod,
    rank: int,
    ridge: float,
    progress: Callable[[int, int], None] | None,
) -> dict[str, LowRankDelta]:
    """The deltas of the layers `names`, block by block (`fit_compensation_adapter`)."""
    clean_model, served_model = models
    prefix, blocks = decoder_blocks(served_model)
    _, clean_blocks = decoder_blocks(clean_model)
    clean_modules = dict(clean_model.named_modules())
    served_modules = dict(served_model.named_modules())
    uses_inputs = reads_inputs(method)
    inputs = _first_block_inputs(served_model, blocks, sequences) if uses_inputs else []
    clean_inputs = (
        _first_block_inputs(clean_model, clean_blocks, sequences) if method == "propagated" else []
    )
    layers: dict[str, LowRankDelta] = {}
    smoothed = False
    for index, block in enumerate(blocks):
        block_names = [n for n in names if n.startswith(f"{prefix}.{index}.")]
        # the clean block in the served one's basis while it is fitted and run, then put back
        with served_basis([clean_blocks[index]], [block]) as moved:
            smoothed |= moved
            if method == "propagated" and block_names:
                deltas = _propagated_block_deltas(
                    models,
                    (clean_blocks[index], block),
                    block_names,
                    (clean_inputs, inputs),
                    rank=rank,
                    ridge=ridge,
                )
            else:
                linears = {n: served_modules[n] for n in block_names}
                moments = _second_moments(block, linears, inputs) if uses_inputs and linears else {}
                deltas = {
                    name: _layer_delta(clean_modules[name], module, moments.get(name), rank, ridge)
                    for name, module in linears.items()
                }
            layers.update(deltas)
            if uses_inputs and index + 1 < len(blocks):
                inputs = _next_inputs(served_model, block, deltas, inputs)
                if method == "propagated":
                    clean_inputs = _next_inputs(clean_model, clean_blocks[index], {}, clean_inputs)
        if progress is not None:
            progress(index + 1, len(blocks))
    if smoothed:
        logger.info("the served model is smoothed: fitted in its basis")
    return layers


def fit_compensation_adapter(
    clean_model: nn.Module,
    served_model: nn.Module,
    sequences: Sequence[ScoringSequence],
    *,
    rank: int,
    method: AdapterMethod = "propagated",
    ridge: float = 10.0,
    base_model: str = "",
    progress: Callable[[int, int], None] | None = None,
) -> LoraAdapter:
    """The rank-`rank` adapter correcting every perturbed linear layer of `served_model`
    towards `clean_model` (`perturbed_linears`), fitted block by block on the inputs of
    `sequences` as the module docstring describes (``svd``: plain SVD, inputs unused;
    ``propagated``: each layer fitted to give the clean layer's outputs on the clean model's
    inputs, `_propagated_block_deltas`), in the served model's basis where its quantizer
    smoothed it (`adapter.smoothing.served_basis`). `progress(done, total)` after each block.
    Leaves both models' weights as they were. ValueError for no sequences, as `adapter_targets`
    (no layer differs, or a rank outside a layer's sides) and for a pair that differs beyond the
    decoder's linear layers and norms (`check_adaptable_pair`)."""
    names = adapter_targets(clean_model, served_model, rank)
    if not sequences:
        raise ValueError("an adapter is fitted on token sequences; got none")
    prefix, blocks = decoder_blocks(served_model)
    check_adaptable_pair(clean_model, served_model, prefix, len(blocks))
    layers = _fit_blocks(
        (clean_model, served_model),
        names,
        sequences,
        method=method,
        rank=rank,
        ridge=ridge,
        progress=progress,
    )
    return LoraAdapter(layers=layers, rank=rank, base_model=base_model)
