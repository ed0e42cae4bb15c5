"""Native GPTQ and AWQ checkpoints, dequantized to float on a CPU.

transformers loads a `quant_method: gptq` or `awq` folder only through gptqmodel (or autoawq)
and their kernels, which a CPU-only install lacks; vLLM serves such folders with its own
kernels. The pair scorer only needs the float model that a checkpoint stands for, so here each
quantized linear layer is unpacked and dequantized on the CPU, tensor by tensor, straight into a
float transformers model built from the folder's config without its `quantization_config`
(never the whole model twice in float).

Formats (the checkpoint's tensors per quantized layer `P`, K input and N output channels,
`pack = 32 // bits` values to an int32, least significant bits first):

- GPTQ (AutoGPTQ / GPTQModel): `P.qweight` (K/pack, N) packed along the input channels,
  `P.qzeros` (G, N/pack) packed along the output channels, `P.scales` (G, N), `P.g_idx` (K) the
  group of each input channel (present with `desc_act`, act-order; else channel // group_size).
  `W[n, k] = scales[g, n] * (q[k, n] - z[g, n])` with `g = g_idx[k]`. Zero points: the `gptq`
  (v1) checkpoint format stores `z - 1` (AutoGPTQ's `QuantLinear.pack` does `zeros -= 1`); it
  is undone as GPTQModel's `convert_gptq_v1_to_v2_format_module` does, by adding 1 to every
  packed field at once (`qzeros + 0x11111111` for 4 bits), which also inverts the borrows of
  its v2-to-v1 subtraction; `gptq_v2` stores `z`. Bits 4 and 8; group_size -1 is one group.
- AWQ GEMM (AutoAWQ's `WQLinear_GEMM.from_linear`): `P.qweight` (K, N/pack) and `P.qzeros`
  (G, N/pack) both packed along the output channels in the order [0, 2, 4, 6, 1, 3, 5, 7] (bit
  field i holds column `order[i]` of its 8), `P.scales` (G, N);
  `W[n, k] = scales[k // group_size, n] * (q[k, n] - z[k // group_size, n])`. 4 bits only.

Refused with a one-line ValueError: other bit widths, other GPTQ checkpoint formats (marlin,
bitblas, gptq_p, ...), GPTQModel's per-module `dynamic` overrides, AWQ versions other than
`gemm` (gemv, gemv_fast, llm-awq, ...), AWQ without stored zero points.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from noisy_temp_server.checkpoints.model_folder import read_config, weight_files

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "AWQ_PACK_ORDER",
    "AwqFormat",
    "GptqFormat",
    "dequantize_awq",
    "dequantize_gptq",
    "load_quantized_causal_lm",
    "quantization_config",
    "quantization_method",
    "quantizes_activations_to_int",
    "read_format",
    "unpack_int32",
]

DEQUANTIZED_METHODS = ("gptq", "awq")
# AutoAWQ's `order_map` for 4 bits: bit field i of an int32 holds column AWQ_PACK_ORDER[i].
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_GPTQ_BITS = (4, 8)
_GPTQ_FORMATS = {"gptq": True, "gptq_v2": False}  # checkpoint format -> zero points stored - 1
_QUANTIZED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class GptqFormat:
    """A GPTQ checkpoint's layout: bits, input channels per group (-1: one group), whether
    input channels are grouped by `g_idx` (act-order), symmetric, and whether stored zero points
    are the v1 `z - 1`."""

    bits: int
    group_size: int
    desc_act: bool
    sym: bool
    zeros_minus_one: bool


@dataclass(frozen=True)
class AwqFormat:
    """An AWQ GEMM checkpoint's layout: bits and input channels per group (-1: one group)."""

    bits: int
    group_size: int


def quantization_config(path: Path) -> dict[str, Any] | None:
    """The `quantization_config` of the folder's config.json (None without one);
    ModelFolderError when the config is missing or unreadable."""
    section = read_config(Path(path)).get("quantization_config")
    return section if isinstance(section, dict) else None


def quantization_method(path: Path) -> str | None:
    """The folder's `quantization_config.quant_method` in lower case ("gptq", "awq",
    "compressed-tensors", ...), or None for an unquantized folder."""
    section = quantization_config(path)
    method = section.get("quant_method") if section else None
    return str(method).lower() if method is not None else None


def quantizes_activations_to_int(path: Path) -> bool:
    """Whether the folder is a compressed-tensors checkpoint some of whose layers quantize their
    input activations to integers (W8A8 int8): the format whose kernels transformers' forward
    does not reproduce (docs/quantized_checkpoints.md)."""
    section = quantization_config(path)
    if not section or str(section.get("quant_method", "")).lower() != "compressed-tensors":
        return False
    groups = section.get("config_groups") or {}
    return any(
        isinstance(group, dict)
        and isinstance(group.get("input_activations"), dict)
        and group["input_activations"].get("type") == "int"
        for group in groups.values()
    )


def _unsupported(method: str, what: str) -> ValueError:
    return ValueError(f"unsupported {method} checkpoint: {what}")


def _group_size(section: dict[str, Any], *names: str) -> int:
    for name in names:
        if section.get(name) is not None:
            return int(section[name])
    return 128


def _gptq_format(section: dict[str, Any]) -> GptqFormat:
    bits = int(section.get("bits", 4))
    if bits not in _GPTQ_BITS:
        raise _unsupported("gptq", f"bits={bits} (dequantized here: 4 or 8)")
    name = str(section.get("checkpoint_format") or section.get("format") or "gptq").lower()
    if name not in _GPTQ_FORMATS:
        raise _unsupported("gptq", f"checkpoint format {name!r} (dequantized here: gptq, gptq_v2)")
    if section.get("dynamic"):
        raise _unsupported("gptq", "per-module `dynamic` overrides")
    pack_dtype = str(section.get("pack_dtype", "int32")).removeprefix("torch.")
    if pack_dtype != "int32":
        raise _unsupported("gptq", f"pack_dtype {pack_dtype} (dequantized here: int32)")
    return GptqFormat(
        bits=bits,
        group_size=_group_size(section, "group_size"),
        desc_act=bool(section.get("desc_act", False)),
        sym=bool(section.get("sym", True)),
        zeros_minus_one=_GPTQ_FORMATS[name],
    )


def _awq_format(section: dict[str, Any]) -> AwqFormat:
    bits = int(section.get("bits", section.get("w_bit", 4)))
    if bits != 4:
        raise _unsupported("awq", f"bits={bits} (dequantized here: 4)")
    version = str(section.get("version") or section.get("format") or "gemm").lower()
    if version != "gemm":
        raise _unsupported("awq", f"version {version!r} (dequantized here: gemm)")
    if not section.get("zero_point", True):
        raise _unsupported("awq", "zero_point=false (no stored zero points)")
    return AwqFormat(bits=bits, group_size=_group_size(section, "group_size", "q_group_size"))


def read_format(path: Path) -> GptqFormat | AwqFormat | None:
    """The folder's GPTQ or AWQ layout; None when it is neither; ValueError (one line, naming
    what is unsupported) for a variant not dequantized here."""
    section = quantization_config(path)
    method = quantization_method(path)
    if section is None or method not in DEQUANTIZED_METHODS:
        return None
    return _gptq_format(section) if method == "gptq" else _awq_format(section)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unpack int32 words along `dim` into `32 // bits` unsigned values each (int32), the
    least significant bits first: field i of word j becomes index `j * (32 // bits) + i`."""
    mask = (1 << bits) - 1
    words = packed.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    fields = (words.unsqueeze(-1) >> shifts) & mask
    return fields.flatten(-2).to(torch.int32).movedim(-1, dim).contiguous()


def _add_one_to_fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """`packed + 0b0001...0001` modulo 2**32: 1 added to every `bits`-bit field of the words."""
    ones = sum(1 << shift for shift in range(0, 32, bits))
    return ((packed.to(torch.int64) & 0xFFFFFFFF) + ones) & 0xFFFFFFFF


def _groups(in_features: int, group_size: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    if g_idx is not None:
        if g_idx.shape != (in_features,):
            raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}, expected ({in_features},)")
        return g_idx.to(torch.int64)
    size = in_features if group_size == -1 else group_size
    return torch.arange(in_features, dtype=torch.int64) // size


def _dequantize(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor
) -> torch.Tensor:
    """(K, N) values, (G, N) zero points and scales, (K) groups -> the (N, K) float32 weight."""
    if int(groups.max()) >= scales.shape[0] or int(groups.min()) < 0:
        raise ValueError(f"group index out of range for {scales.shape[0]} groups")
    if zeros.shape != scales.shape:
        raise ValueError(f"zero points {tuple(zeros.shape)} and scales {tuple(scales.shape)}")
    weight = (q - zeros[groups]).to(torch.float32) * scales.to(torch.float32)[groups]
    return weight.t().contiguous()


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    layout: GptqFormat,
) -> torch.Tensor:
    """The float32 (out, in) weight of one GPTQ layer (see the module docstring)."""
    q = unpack_int32(qweight, layout.bits, dim=0)
    if layout.zeros_minus_one:
        qzeros = _add_one_to_fields(qzeros, layout.bits)
    zeros = unpack_int32(qzeros, layout.bits, dim=1)[:, : scales.shape[1]]
    return _dequantize(q, zeros, scales, _groups(q.shape[0], layout.group_size, g_idx))


def dequantize_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, layout: AwqFormat
) -> torch.Tensor:
    """The float32 (out, in) weight of one AWQ GEMM layer (see the module docstring)."""
    pack = 32 // layout.bits
    reverse = torch.tensor([AWQ_PACK_ORDER.index(column) for column in range(pack)])

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        fields = unpack_int32(packed, layout.bits, dim=1)
        return fields.unflatten(1, (-1, pack))[:, :, reverse].flatten(1)

    q, zeros = unpack(qweight), unpack(qzeros)
    return _dequantize(q, zeros, scales, _groups(q.shape[0], layout.group_size, None))


def _weight_files(path: Path) -> dict[str, Path]:
    """Each tensor name of the folder's safetensors weights -> the file that holds it
    (`model_folder.weight_files`: ModelFolderError without weights)."""
    from safetensors import safe_open  # noqa: PLC0415

    files: dict[str, Path] = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as handle:
            files.update(dict.fromkeys(handle.keys(), file))
    return files


def _float_tensors(
    path: Path, layout: GptqFormat | AwqFormat
) -> Iterator[tuple[str, torch.Tensor]]:
    """(parameter name, float tensor) for every tensor of the folder, a quantized layer's
    tensors as its one dequantized `weight`; read one tensor (or layer) at a time."""
    from safetensors import safe_open  # noqa: PLC0415

    files = _weight_files(path)
    with ExitStack() as stack:
        handles = {
            file: stack.enter_context(safe_open(str(file), framework="pt"))
            for file in sorted(set(files.values()))
        }

        def read(name: str) -> torch.Tensor:
            return handles[files[name]].get_tensor(name)

        for name in sorted(files):
            prefix, _, suffix = name.rpartition(".")
            if suffix == "qweight":
                yield f"{prefix}.weight", _dequantize_layer(prefix, files, read, layout)
            elif suffix not in _QUANTIZED_SUFFIXES or f"{prefix}.qweight" not in files:
                yield name, read(name)


def _dequantize_layer(
    prefix: str, files: dict[str, Path], read: Any, layout: GptqFormat | AwqFormat
) -> torch.Tensor:
    missing = [f"{prefix}.{s}" for s in ("qzeros", "scales") if f"{prefix}.{s}" not in files]
    if missing:
        raise ValueError(f"quantized layer {prefix} lacks {', '.join(missing)}")
    qweight, qzeros, scales = (read(f"{prefix}.{s}") for s in ("qweight", "qzeros", "scales"))
    if isinstance(layout, AwqFormat):
        return dequantize_awq(qweight, qzeros, scales, layout)
    g_idx = read(f"{prefix}.g_idx") if f"{prefix}.g_idx" in files else None
    return dequantize_gptq(qweight, qzeros, scales, g_idx, layout)


def _empty_float_model(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The folder's architecture as a float model without `quantization_config`, its
    parameters allocated but not initialised."""
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415
    from transformers.initialization import no_init_weights  # noqa: PLC0415

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with no_init_weights():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _fill(model: PreTrainedModel, path: Path, layout: GptqFormat | AwqFormat) -> None:
    """Copy the folder's (dequantized) tensors into `model`; ValueError if a tensor has no
    parameter to go to, or a parameter is left without a tensor."""
    targets = model.state_dict(keep_vars=True)
    filled: set[int] = set()
    with torch.no_grad():
        for name, tensor in _float_tensors(path, layout):
            target = targets.get(name)
            if target is None:
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                raise ValueError(f"{path}: tensor {name} matches no parameter of the model")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{path}: tensor {name} has shape {tuple(tensor.shape)}, "
                    f"the model's {tuple(target.shape)}"
                )
            target.copy_(tensor)
            filled.add(id(target))
    missing = [name for name, target in targets.items() if id(target) not in filled]
    if missing:
        raise ValueError(f"{path}: no tensor for {', '.join(missing[:5])}")


def load_quantized_causal_lm(
    path: Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> PreTrainedModel | None:
    """The float causal LM of a native GPTQ/AWQ folder, in eval mode on `device` in `dtype`.

    None when the folder's `quant_method` is neither `gptq` nor `awq` (load it otherwise);
    ValueError naming the variant when it is one that is not dequantized here.
    """
    path = Path(path)
    layout = read_format(path)
    if layout is None:
        return None
    model = _empty_float_model(path, dtype)
    _fill(model, path, layout)
    model.tie_weights()
    torch.nn.Module.to(model, torch.device(device))
    return model.eval()
