"""Typed perturbation specs and their application to a torch model.

A perturbation turns the clean model into the served one. Each kind is a frozen pydantic model
with a `kind` discriminator, so a spec is recorded as JSON beside the checkpoint it produced and
parsed back with `parse_spec`:

- `WeightNoiseSpec`: iid noise added to weights, its standard deviation `scale` times each
  tensor's own standard deviation (gaussian, uniform or laplace; all three have that std);
- `QuantizationSpec`: round-to-nearest quantisation; what is served is the dequantised weight
  (int8 symmetric per output channel, int4/int3 asymmetric per group of `group_size` inputs,
  fp8 e4m3 with a per-tensor scale);
- `RuntimeLogitNoiseSpec`: fresh iid gaussian noise of std `sigma` (logit units) on the served
  logits at every step; the weights are untouched (`add_runtime_logit_noise` is the one
  implementation, used by the pair scorer and by the serving processor);
- `ExternalPairSpec`: the served checkpoint was made elsewhere (clean path + served path).

Targeting (`TensorTarget`): by default every weight matrix inside the decoder layers (attention
and MLP) is perturbed; norms, embeddings and biases are skipped unless asked for. Groups
(`attention`, `mlp`, `lm_head`), a half-open range of decoder layer indices and fnmatch name
patterns narrow the selection; all given filters must hold.

Tied output head: when `lm_head` shares its storage with the input embedding (SmolLM2 sets
`tie_word_embeddings`), `lm_head` still means the output projection only. Perturbing it unties
the two: the model gets its own perturbed `lm_head.weight`, `config.tie_word_embeddings` is set to
False, and the input embedding stays clean. Without `lm_head` in the selection a tied model stays
tied.

Reproducibility: each tensor's noise comes from its own CPU generator seeded from
(spec seed, tensor name), so the same spec gives bit-identical weights, and changing the target
does not change the noise drawn for the tensors that stay selected.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from torch import nn

__all__ = [
    "ExternalPairSpec",
    "PerturbationSpec",
    "PerturbationSpecError",
    "PerturbationSummary",
    "QuantizationSpec",
    "RuntimeLogitNoiseSpec",
    "TensorTarget",
    "WeightNoiseSpec",
    "add_runtime_logit_noise",
    "apply_perturbation",
    "dequantize_fp8_e4m3",
    "dequantize_groupwise_asymmetric",
    "dequantize_int8_per_channel",
    "load_spec",
    "parse_spec",
    "select_tensors",
    "spec_to_json",
    "tensor_generator",
]

Group = Literal["attention", "mlp", "lm_head"]

_LAYER_INDEX = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")
_ATTENTION_PARTS = (".self_attn.", ".attn.", ".attention.")
_MLP_PARTS = (".mlp.", ".feed_forward.", ".ffn.")
_FP8_E4M3_MAX = 448.0


class PerturbationSpecError(ValueError):
    """A spec that cannot be parsed, or that selects nothing in the given model."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorTarget(_Frozen):
    """Which weight tensors a perturbation touches (every given filter must hold).

    `groups=None` lifts the group filter; `layers=(start, stop)` keeps decoder layers
    start <= i < stop (and so excludes `lm_head`); `name_patterns` are fnmatch patterns on the
    parameter name, e.g. `"*.q_proj.weight"`.
    """

    groups: tuple[Group, ...] | None = ("attention", "mlp")
    layers: tuple[int, int] | None = None
    name_patterns: tuple[str, ...] | None = None
    include_norms: bool = False
    include_embeddings: bool = False
    include_biases: bool = False

    @model_validator(mode="after")
    def _check(self) -> TensorTarget:
        if self.layers is not None and not 0 <= self.layers[0] < self.layers[1]:
            raise ValueError(f"layers must be a range 0 <= start < stop, got {self.layers}")
        if self.groups is not None and not self.groups:
            raise ValueError("groups must name at least one group, or be null for any group")
        return self

    def selects(self, name: str, tensor: torch.Tensor, is_output_head: bool) -> bool:
        """Whether the parameter `name` (the output head iff `is_output_head`) is selected."""
        lowered = name.lower()
        is_bias = lowered.endswith(".bias")
        is_norm = not is_bias and ("norm" in lowered or tensor.ndim < 2)
        is_embedding = not is_output_head and ("embed" in lowered or ".wte." in lowered)
        if (
            (is_bias and not self.include_biases)
            or (is_norm and not self.include_norms)
            or (is_embedding and not self.include_embeddings)
        ):
            return False
        layer_match = _LAYER_INDEX.search(name)
        if self.layers is not None:
            if layer_match is None:
                return False
            if not self.layers[0] <= int(layer_match.group(1)) < self.layers[1]:
                return False
        if self.groups is not None:
            in_layer = layer_match is not None
            member = {
                "attention": in_layer and any(p in name for p in _ATTENTION_PARTS),
                "mlp": in_layer and any(p in name for p in _MLP_PARTS),
                "lm_head": is_output_head,
            }
            if not any(member[g] for g in self.groups):
                return False
        if self.name_patterns is not None:
            return any(fnmatch.fnmatchcase(name, p) for p in self.name_patterns)
        return True


class WeightNoiseSpec(_Frozen):
    """Additive iid weight noise with std `scale` x (the tensor's std)."""

    kind: Literal["weight_noise"] = "weight_noise"
    distribution: Literal["gaussian", "uniform", "laplace"] = "gaussian"
    scale: float = Field(ge=0.0, allow_inf_nan=False)
    seed: int = 0
    target: TensorTarget = TensorTarget()

    @property
    def label(self) -> str:
        return f"{self.distribution} weight noise {self.scale:g}"


class QuantizationSpec(_Frozen):
    """Round-to-nearest quantisation; the dequantised weights are served.

    `int8`: symmetric, one scale per output channel (row); `int4`/`int3`: asymmetric (scale and
    zero point) per group of `group_size` consecutive inputs of a row, the last group of a row
    may be shorter; `fp8_e4m3`: cast to float8 e4m3 after scaling the tensor's absolute maximum
    to 448 (per-tensor scale, as fp8 serving does).
    """

    kind: Literal["quantization"] = "quantization"
    format: Literal["int8", "int4", "int3", "fp8_e4m3"]
    group_size: int = Field(default=128, ge=1)
    target: TensorTarget = TensorTarget()

    @property
    def label(self) -> str:
        grouped = self.format in ("int4", "int3")
        return f"{self.format} RTN" + (f" (group {self.group_size})" if grouped else "")


class RuntimeLogitNoiseSpec(_Frozen):
    """Fresh iid gaussian noise of std `sigma` (logit units) on every served logit row."""

    kind: Literal["runtime_logit_noise"] = "runtime_logit_noise"
    sigma: float = Field(ge=0.0, allow_inf_nan=False)
    seed: int = 0

    @property
    def label(self) -> str:
        return f"runtime logit noise sigma={self.sigma:g}"


class ExternalPairSpec(_Frozen):
    """A served checkpoint produced outside this tool, paired with its clean checkpoint."""

    kind: Literal["external"] = "external"
    clean_path: Path
    served_path: Path

    @property
    def label(self) -> str:
        return f"external pair {self.served_path.name}"


PerturbationSpec = Annotated[
    WeightNoiseSpec | QuantizationSpec | RuntimeLogitNoiseSpec | ExternalPairSpec,
    Field(discriminator="kind"),
]
_SPEC_ADAPTER: TypeAdapter[PerturbationSpec] = TypeAdapter(PerturbationSpec)


def parse_spec(data: str | bytes | dict[str, object]) -> PerturbationSpec:
    """Parse a spec from JSON text or a dict; raises `PerturbationSpecError` on bad input."""
    try:
        if isinstance(data, dict):
            return _SPEC_ADAPTER.validate_python(data)
        return _SPEC_ADAPTER.validate_json(data)
    except ValidationError as error:
        raise PerturbationSpecError(
            f"invalid perturbation spec: {error}. A spec is a JSON object whose 'kind' is one of "
            "weight_noise, quantization, runtime_logit_noise, external."
        ) from error


def load_spec(path: Path) -> PerturbationSpec:
    """Read a spec from a JSON file (`parse_spec` on its content)."""
    try:
        text = path.read_text()
    except OSError as error:
        raise PerturbationSpecError(f"cannot read perturbation spec {path}: {error}") from error
    return parse_spec(text)


def spec_to_json(spec: PerturbationSpec) -> dict[str, object]:
    """The JSON-compatible dict that `parse_spec` reads back."""
    return spec.model_dump(mode="json")


def tensor_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded from (seed, name) alone, the same on every machine and run."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return generator


def add_runtime_logit_noise(
    logits: torch.Tensor, sigma: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """`logits + sigma * N(0, 1)`, fresh iid noise per entry; `logits` is not modified.

    logits: [..., vocab], any float dtype, on any device; the noise is drawn in float32 on the
    logits' device (`generator`, if given, must live on that device) and the result has the
    logits' dtype. Masked entries (-inf) stay -inf. `sigma == 0` returns `logits` itself.
    """
    if not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"runtime noise sigma must be finite and >= 0, got {sigma}")
    if sigma == 0:
        return logits
    noise = torch.randn(
        logits.shape, generator=generator, device=logits.device, dtype=torch.float32
    )
    return (logits.float() + noise * sigma).to(logits.dtype)


def _weight_noise(
    shape: torch.Size, distribution: str, std: float, generator: torch.Generator
) -> torch.Tensor:
    """float32 CPU noise of the given std."""
    if distribution == "gaussian":
        return torch.randn(shape, generator=generator) * std
    if distribution == "uniform":
        return (torch.rand(shape, generator=generator) - 0.5) * (2.0 * math.sqrt(3.0) * std)
    # laplace with scale b has std b * sqrt(2); inverse CDF on u in [-1/2, 1/2)
    u = torch.rand(shape, generator=generator) - 0.5
    b = std / math.sqrt(2.0)
    return -b * torch.sign(u) * torch.log1p(-2.0 * u.abs())


def dequantize_int8_per_channel(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 RTN with one scale per row (output channel): [out, in] -> float32 [out, in].

    scale = max|w_row| / 127, q = clamp(round(w / scale), -127, 127); all-zero rows stay zero.
    """
    w = weight.float().reshape(weight.shape[0], -1)
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(w / scale).clamp(-127, 127) * scale).reshape(weight.shape)


def dequantize_groupwise_asymmetric(
    weight: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """Asymmetric RTN per group of `group_size` consecutive inputs of each row -> float32.

    Per group: scale = (max - min) / (2^bits - 1), zero = round(-min / scale),
    q = clamp(round(w / scale) + zero, 0, 2^bits - 1), served w = (q - zero) * scale. A row whose
    length is not a multiple of `group_size` ends in a shorter group. Constant groups are exact.
    """
    rows = weight.shape[0]
    w = weight.float().reshape(rows, -1)
    columns = w.shape[1]
    n_groups = -(-columns // group_size)
    pad = n_groups * group_size - columns
    grouped_low = torch.nn.functional.pad(w, (0, pad), value=math.inf).reshape(rows, n_groups, -1)
    grouped_high = torch.nn.functional.pad(w, (0, pad), value=-math.inf).reshape(rows, n_groups, -1)
    low = grouped_low.amin(dim=2, keepdim=True)  # [rows, groups, 1]
    high = grouped_high.amax(dim=2, keepdim=True)
    levels = 2**bits - 1
    scale = (high - low) / levels
    constant = scale <= 0
    scale = torch.where(constant, torch.ones_like(scale), scale)
    zero = torch.round(-low / scale)
    padded = torch.nn.functional.pad(w, (0, pad)).reshape(rows, n_groups, -1)
    q = (torch.round(padded / scale) + zero).clamp(0, levels)
    served = torch.where(constant, low.expand_as(padded), (q - zero) * scale)
    return served.reshape(rows, -1)[:, :columns].reshape(weight.shape)


def dequantize_fp8_e4m3(weight: torch.Tensor) -> torch.Tensor:
    """Cast to float8 e4m3 with a per-tensor scale (max|w| -> 448) and back -> float32."""
    w = weight.float()
    amax = w.abs().amax()
    scale = amax / _FP8_E4M3_MAX if amax > 0 else torch.ones_like(amax)
    return (w / scale).to(torch.float8_e4m3fn).float() * scale


def _dequantized(weight: torch.Tensor, spec: QuantizationSpec) -> torch.Tensor:
    if weight.ndim < 2:
        raise PerturbationSpecError(
            f"quantization needs weight matrices, got a tensor of shape {tuple(weight.shape)}; "
            "leave norms and biases out of the target"
        )
    if spec.format == "int8":
        return dequantize_int8_per_channel(weight)
    if spec.format == "fp8_e4m3":
        return dequantize_fp8_e4m3(weight)
    bits = 4 if spec.format == "int4" else 3
    return dequantize_groupwise_asymmetric(weight, bits, spec.group_size)


def output_head(model: nn.Module) -> nn.Parameter | None:
    """The output projection's weight [V, d] (`get_output_embeddings`, else `lm_head`), or
    None when the model has no such parameter."""
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    return weight if isinstance(weight, nn.Parameter) else None


def _named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    yield from model.named_parameters(remove_duplicate=False)


def select_tensors(model: nn.Module, target: TensorTarget) -> list[str]:
    """Names of the parameters `target` selects, in `named_parameters` order.

    Tied aliases are listed under each name that is selected. Raises `PerturbationSpecError`
    when nothing is selected.
    """
    head = output_head(model)
    names = [
        name
        for name, param in _named_parameters(model)
        if target.selects(name, param, is_output_head=param is head and "embed" not in name)
    ]
    if not names:
        raise PerturbationSpecError(
            f"the target {target.model_dump_json()} selects no tensor of this model; "
            "check the groups, layer range and name patterns"
        )
    return names


class PerturbationSummary(BaseModel):
    """What `apply_perturbation` changed: tensor names, element count, whether lm_head untied."""

    model_config = ConfigDict(frozen=True)

    tensors: tuple[str, ...]
    elements: int
    untied_output_head: bool


def _untie(model: nn.Module, selected: set[str]) -> bool:
    """Give every selected parameter that aliases an unselected one its own storage.

    Returns whether anything was untied; sets `config.tie_word_embeddings = False` if so.
    """
    owners: dict[int, list[str]] = {}
    for name, param in _named_parameters(model):
        owners.setdefault(id(param), []).append(name)
    untied = False
    for names in owners.values():
        chosen = [n for n in names if n in selected]
        if chosen and len(chosen) < len(names):
            for name in chosen:
                module_name, _, attr = name.rpartition(".")
                module = model.get_submodule(module_name)
                original = getattr(module, attr)
                own = nn.Parameter(original.detach().clone(), original.requires_grad)
                setattr(module, attr, own)
            untied = True
    if untied:
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "tie_word_embeddings"):
            config.tie_word_embeddings = False
    return untied


@torch.no_grad()
def apply_perturbation(
    model: nn.Module, spec: WeightNoiseSpec | QuantizationSpec
) -> PerturbationSummary:
    """Perturb the selected weights of `model` in place (see the module docstring).

    Each selected tensor is computed in float32 on the CPU and written back in its own dtype and
    device. Runtime noise and external pairs do not change weights: pass those to the scorer.
    Raises `PerturbationSpecError` when the target selects nothing or a quantizer meets a
    non-matrix tensor.
    """
    names = select_tensors(model, spec.target)
    untied = _untie(model, set(names))
    params = dict(_named_parameters(model))
    done: set[int] = set()
    elements = 0
    for name in names:
        param = params[name]
        if id(param) in done:
            continue
        done.add(id(param))
        weight = param.detach().float().cpu()
        if isinstance(spec, WeightNoiseSpec):
            std = weight.std().item() if weight.numel() > 1 else 0.0
            noise = _weight_noise(
                weight.shape, spec.distribution, spec.scale * std, tensor_generator(spec.seed, name)
            )
            served = weight + noise
        else:
            served = _dequantized(weight, spec)
        param.copy_(served.to(dtype=param.dtype, device=param.device))
        elements += param.numel()
    return PerturbationSummary(tensors=tuple(names), elements=elements, untied_output_head=untied)
