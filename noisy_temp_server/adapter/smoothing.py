"""Smoothed pairs: the clean model rewritten in the basis of a served model whose quantizer moved
per-channel scales between layers (AWQ, SmoothQuant), so that the adapter's fit sees only the
rounding error.

Such a quantizer divides a norm's weight (or a linear layer's output rows) by scales s and
multiplies the columns of the linear layers that read it by s before rounding them: the served
model computes the same function in another basis, and its weights differ from the clean ones
by a diagonal factor that no low-rank correction can express. `served_basis` rewrites the clean
model the same way, which leaves its function unchanged: a norm takes the served norm's weight
and its readers' columns are multiplied by s = w_clean / w_served (exact: norms are never
rounded); a linear layer feeding another (a Llama's v → o and up → down) has its rows divided
and its reader's columns multiplied by the scales the two weights' norms give. The fit's targets
(the clean layers' outputs, and the clean weights its ridge leans on) are then in the served
model's basis.

A pair whose decoder norms are equal is not smoothed and is left as it is. A pair that differs
in any other tensor than the decoder's linear layers and norms (embeddings, the final norm, the
output head) is refused: the adapter corrects linear layers only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = ["MATERIAL_DIFFERENCE", "check_adaptable_pair", "served_basis"]

MATERIAL_DIFFERENCE = 0.01
"""The relative difference above which a tensor outside the decoder's linear layers and norms
counts as changed (bf16 rounds to about 0.4 %, fp16 to 0.05 %)."""

NORM_READERS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
)
"""Each decoder norm (Llama family) and the linear layers that read its output."""
LINEAR_READERS = (("self_attn.v_proj", "self_attn.o_proj"), ("mlp.up_proj", "mlp.down_proj"))
"""Linear layers whose output rows feed another's columns channel for channel (v → o only
without grouped-query attention, where their widths match)."""


def _linear_parameters(model: nn.Module, prefix: str) -> set[str]:
    return {
        f"{name}.{kind}"
        for name, module in model.named_modules()
        if name.startswith(prefix + ".") and isinstance(module, nn.Linear)
        for kind in ("weight", "bias")
    }


def _norm_parameters(prefix: str, blocks: int) -> set[str]:
    return {f"{prefix}.{i}.{norm}.weight" for i in range(blocks) for norm, _ in NORM_READERS}


@torch.no_grad()
def check_adaptable_pair(clean: nn.Module, served: nn.Module, prefix: str, blocks: int) -> None:
    """ValueError, one line naming the tensor, unless every tensor the pair does not share is a
    weight or bias of a decoder linear layer or a decoder norm's weight. Differences within a
    16-bit float's rounding (`MATERIAL_DIFFERENCE`, relative; a quantizer may store the
    unquantized tensors in another dtype) are shared."""
    adaptable = _linear_parameters(served, prefix) | _norm_parameters(prefix, blocks)
    clean_parameters = dict(clean.named_parameters())
    for name, parameter in served.named_parameters():
        reference = clean_parameters.get(name)
        if name in adaptable or reference is None or reference is parameter:
            continue  # `parameter is reference`: a served model sharing the clean tensor
        if reference.shape != parameter.shape:
            raise ValueError(
                f"the served model's {name} has the shape {tuple(parameter.shape)}, the clean "
                f"model's {tuple(reference.shape)}: no compensation adapter fits this pair"
            )
        difference = _relative_difference(reference, parameter)
        if difference > MATERIAL_DIFFERENCE:
            raise ValueError(
                f"the served model's {name} differs from the clean model's by {difference:.1%}: "
                "a compensation adapter corrects the decoder's linear layers only, so this pair "
                "gets none"
            )


def _relative_difference(reference: Tensor, other: Tensor) -> float:
    """||other - reference|| / ||reference|| (0 for two zero tensors)."""
    scale = float(reference.float().norm())
    gap = float((other.float() - reference.float()).norm())
    return gap / scale if scale > 0 else gap


def _norm_scales(clean_norm: Tensor, served_norm: Tensor) -> Tensor | None:
    """w_clean / w_served (1 where the served weight is 0), None where the two are equal."""
    if torch.equal(clean_norm, served_norm):
        return None
    safe = torch.where(served_norm == 0, clean_norm, served_norm)
    return torch.where(served_norm == 0, torch.ones_like(clean_norm), clean_norm / safe).float()


def _linear_scales(
    clean: tuple[nn.Linear, nn.Linear], served: tuple[nn.Linear, nn.Linear]
) -> Tensor | None:
    """The scales moved from `served[0]`'s output rows into `served[1]`'s columns: the geometric
    mean of the two weights' norm ratios, channel by channel; None where their widths differ."""
    if clean[0].out_features != clean[1].in_features:
        return None
    rows = clean[0].weight.float().norm(dim=1) / served[0].weight.float().norm(dim=1)
    columns = served[1].weight.float().norm(dim=0) / clean[1].weight.float().norm(dim=0)
    ratio = torch.sqrt(rows * columns)
    return torch.where(torch.isfinite(ratio) & (ratio > 0), ratio, torch.ones_like(ratio))


class _Rewrite:
    """In-place rewrites of clean parameters, each original kept to be put back."""

    def __init__(self) -> None:
        self.originals: list[tuple[Tensor, Tensor]] = []

    def keep(self, *parameters: Tensor | None) -> None:
        self.originals += [(p, p.detach().clone()) for p in parameters if p is not None]

    def restore(self) -> None:
        for parameter, original in reversed(self.originals):
            parameter.data.copy_(original)


_PROBE_ROWS = 8
_PROBE_TOLERANCE = 1e-3


def _weight(module: nn.Module) -> Tensor:
    weight = module.weight
    assert isinstance(weight, Tensor)  # a norm's or a linear layer's
    return weight


def _probe(modules: Sequence[nn.Module], width: int) -> list[Tensor]:
    """The outputs of each later module of `modules` on the first's output, for a fixed random
    input of `width` features."""
    generator = torch.Generator().manual_seed(0)
    first = modules[0]
    weight = next(first.parameters())
    x = torch.randn(_PROBE_ROWS, width, generator=generator).to(weight.device, weight.dtype)
    hidden = first(x)
    return [module(hidden).float() for module in modules[1:]]


def _check_same_function(before: list[Tensor], after: list[Tensor], what: str) -> None:
    """ValueError, one line, unless the rewrite left the probed outputs as they were."""
    for old, new in zip(before, after, strict=True):
        if not torch.allclose(old, new, rtol=_PROBE_TOLERANCE, atol=_PROBE_TOLERANCE):
            raise ValueError(
                f"the served model's {what} differs from the clean one's by more than moved "
                "scales (another kind of norm?): no compensation adapter fits this pair"
            )


@torch.no_grad()
def _rewrite_norm(
    modules: tuple[dict[str, nn.Module], dict[str, nn.Module]],
    norm: str,
    readers: Sequence[str],
    rewrite: _Rewrite,
) -> bool:
    """Move one norm's scales into its readers (module docstring); whether it had any."""
    clean_modules, served_modules = modules
    if norm not in clean_modules or norm not in served_modules:
        return False
    clean_norm, served_norm = _weight(clean_modules[norm]), _weight(served_modules[norm])
    scales = _norm_scales(clean_norm, served_norm)
    if scales is None:
        return False
    missing = [reader for reader in readers if reader not in clean_modules]
    if missing:
        raise ValueError(
            f"the served model's {norm} differs from the clean one's, but its block has no "
            f"{', '.join(missing)} to move the scales into: no compensation adapter fits it"
        )
    chain = [clean_modules[norm], *(clean_modules[reader] for reader in readers)]
    before = _probe(chain, clean_norm.shape[0])
    reader_weights = [_weight(clean_modules[reader]) for reader in readers]
    rewrite.keep(clean_norm, *reader_weights)
    clean_norm.copy_(torch.where(served_norm == 0, clean_norm, served_norm))
    for weight in reader_weights:
        weight.mul_(scales.to(weight.dtype))
    _check_same_function(before, _probe(chain, clean_norm.shape[0]), norm)
    return True


@torch.no_grad()
def _rewrite_block(clean: nn.Module, served: nn.Module, rewrite: _Rewrite) -> bool:
    """Rewrite one clean decoder block into the served one's basis; whether anything moved.
    ValueError, one line, for norms that differ otherwise than by moved scales."""
    clean_modules, served_modules = dict(clean.named_modules()), dict(served.named_modules())
    moved = [
        _rewrite_norm((clean_modules, served_modules), norm, readers, rewrite)
        for norm, readers in NORM_READERS
    ]
    if not any(moved):
        return False
    for writer, reader in LINEAR_READERS:
        if writer not in clean_modules or reader not in clean_modules:
            continue
        pair = (clean_modules[writer], clean_modules[reader])
        scales = _linear_scales(pair, (served_modules[writer], served_modules[reader]))
        if scales is None:
            continue
        rewrite.keep(pair[0].weight, pair[0].bias, pair[1].weight)
        pair[0].weight.div_(scales[:, None].to(pair[0].weight.dtype))
        if pair[0].bias is not None:
            pair[0].bias.div_(scales.to(pair[0].bias.dtype))
        pair[1].weight.mul_(scales[None, :].to(pair[1].weight.dtype))
    return True


@contextmanager
def served_basis(
    clean_blocks: Iterable[nn.Module], served_blocks: Iterable[nn.Module]
) -> Iterator[bool]:
    """Within the block, the clean decoder blocks rewritten in the served blocks' basis (module
    docstring; the clean model's function is unchanged); yields whether the pair was smoothed.
    The clean weights are put back on leaving. Blocks without a Llama's norms are left as they
    are (`check_adaptable_pair` refuses a pair whose other norms differ)."""
    rewrite = _Rewrite()
    try:
        smoothed = [
            _rewrite_block(c, s, rewrite) for c, s in zip(clean_blocks, served_blocks, strict=True)
        ]
        yield any(smoothed)
    finally:
        rewrite.restore()
