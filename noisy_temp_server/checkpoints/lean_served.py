"""A quantized served model loaded beside its clean model without a second float copy.

`load_lean_served` builds the served model's architecture without allocating it (on the meta
device) and fills it from the served folder's safetensors, one tensor at a time:

- each quantized linear layer becomes a `PackedLinear`: its stored tensors stay packed (int4
  words, int8 or fp8 values, scales, zero points, group indices) and its float weight is made
  afresh each time it is read, one layer at a time (a forward pass, the fit's comparison), then
  freed. compressed-tensors layers (formats ``pack-quantized``, ``int-quantized``,
  ``float-quantized``, ``naive-quantized``) are dequantized by the compressed-tensors library's
  own compressors, GPTQ and AWQ layers by `quantized_formats.dequantize_gptq` /
  `dequantize_awq`;
  Only weight-only schemes are packed: a compressed-tensors scheme that also quantizes
  activations (W8A8, FP8-dynamic) is loaded whole, so that its forward pass quantizes them as
  transformers' does;
- every other tensor equal to the clean model's tensor of the same name (embeddings, the output
  head, norms) *is* that tensor (the same `Parameter` object, not a copy); one that differs (an
  AWQ-smoothed norm) gets its own copy; non-persistent buffers (rotary tables) are the clean
  model's.

So the pair holds one float copy (the clean model's), the served model's packed bytes and the
served tensors that differ. The served model computes what the whole-loaded one computes
(`checkpoint.load_causal_lm`, transformers decompressing every layer to float) logit for logit.

A folder this does not cover is loaded whole (the caller falls back when this returns None): a
float folder, another quantization method (native ``fp8``), a compressed-tensors folder with
several quantization groups, sparsity, transforms or quantized activations, a config that
differs from the clean one beyond its quantization (so the rotary tables could differ).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from noisy_temp_server.checkpoints.model_folder import weight_files
from noisy_temp_server.checkpoints.quantized_formats import (
    AwqFormat,
    GptqFormat,
    dequantize_awq,
    dequantize_gptq,
    quantization_config,
    quantization_method,
    read_format,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["PackedLinear", "load_lean_served"]

Dequantize = Callable[[dict[str, Tensor]], Tensor]
_COMPRESSED_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
_GPTQ_AWQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
_CONFIG_KEYS_IGNORED = (
    "quantization_config",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "_name_or_path",
)


class _RecomputedLinear(torch.autograd.Function):
    """x @ W^T whose backward dequantizes W again rather than keeping it (so a backward pass
    through the served model holds one layer's float weight at a time, not all of them)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, layer: PackedLinear) -> Tensor:
        ctx.layer = layer
        return nn.functional.linear(x, layer.weight.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad @ ctx.layer.weight.to(grad.dtype), None


class PackedLinear(nn.Linear):
    """A linear layer whose weight is stored quantized (`packed`, its checkpoint tensors under
    their local names) and dequantized by `dequantize` to `dtype` at every read of `weight`;
    nothing float is kept between reads. It is an `nn.Linear` (in_features, out_features,
    bias, forward) whose `weight` is not a parameter: it is read, never written."""

    def __init__(
        self,
        packed: dict[str, Tensor],
        dequantize: Dequantize,
        shape: tuple[int, int],
        dtype: torch.dtype,
        bias: nn.Parameter | None,
    ) -> None:
        nn.Module.__init__(self)
        self.out_features, self.in_features = shape
        self.dtype = dtype
        self._dequantize = dequantize
        self._packed_names = tuple(packed)
        for name, tensor in packed.items():
            self.register_buffer(f"packed_{name}", tensor, persistent=False)
        self.register_parameter("bias", bias)

    @property
    def weight(self) -> Tensor:  # type: ignore[override]
        packed = {name: getattr(self, f"packed_{name}") for name in self._packed_names}
        weight = self._dequantize(packed).to(self.dtype)
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"a packed layer dequantized to {tuple(weight.shape)}")
        return weight

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if not (torch.is_grad_enabled() and x.requires_grad):
            return nn.functional.linear(x, self.weight.to(x.dtype), bias)
        output = _RecomputedLinear.apply(x, self)
        return output if bias is None else output + bias


def _compressed_dequantizer(path: Path) -> Dequantize | None:
    """The dequantization of a compressed-tensors folder with one weight-only quantization
    group in a format decompressed here; None otherwise."""
    from compressed_tensors.compressors import (  # type: ignore[import-untyped]  # noqa: PLC0415
        BaseCompressor,
    )
    from compressed_tensors.quantization import (  # type: ignore[import-untyped]  # noqa: PLC0415
        QuantizationConfig,
    )

    section = quantization_config(path)
    if section is None or section.get("sparsity_config") or section.get("transform_config"):
        return None
    config = QuantizationConfig.model_validate(section)
    if len(config.config_groups) != 1:
        return None
    (scheme,) = config.config_groups.values()
    storage = str(scheme.format or config.format)
    weight_only = scheme.input_activations is None and scheme.output_activations is None
    if storage not in _COMPRESSED_FORMATS or scheme.weights is None or not weight_only:
        return None
    compressor = BaseCompressor.get_value_from_registry(storage)
    return lambda packed: compressor.decompress(packed, scheme)["weight"]


def _gptq_awq_dequantizer(layout: GptqFormat | AwqFormat) -> Dequantize:
    if isinstance(layout, AwqFormat):
        return lambda p: dequantize_awq(p["qweight"], p["qzeros"], p["scales"], layout)
    return lambda p: dequantize_gptq(p["qweight"], p["qzeros"], p["scales"], p.get("g_idx"), layout)


def _same_config(clean: Path, served: Path) -> bool:
    """Whether the two folders' configs, as transformers reads them, agree beyond quantization
    and dtype (so the clean model's rotary tables are the served model's)."""
    from transformers import AutoConfig  # noqa: PLC0415

    def essential(path: Path) -> dict[str, Any]:
        config = AutoConfig.from_pretrained(path, local_files_only=True).to_dict()
        return {k: v for k, v in config.items() if k not in _CONFIG_KEYS_IGNORED}

    return essential(clean) == essential(served)


@contextmanager
def _tensor_reader(path: Path) -> Iterator[tuple[dict[str, Path], Callable[[str], Tensor]]]:
    """(tensor name -> file, read(name)) over the folder's safetensors files, kept open."""
    from safetensors import safe_open  # noqa: PLC0415

    with ExitStack() as stack:
        handles = {
            file: stack.enter_context(safe_open(str(file), framework="pt"))
            for file in weight_files(path)
        }
        files = {name: file for file, handle in handles.items() for name in handle.keys()}  # noqa: SIM118
        yield files, lambda name: handles[files[name]].get_tensor(name)


def _empty_model(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The folder's architecture on the meta device, without `quantization_config`, with the
    folder's generation config (its end-of-sequence tokens) where it has one."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig  # noqa: PLC0415

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    return model


def _quantized_layers(
    path: Path, files: dict[str, Path]
) -> tuple[Dequantize, tuple[str, ...], str] | None:
    """(dequantize, the local names of a quantized layer's tensors, the name marking one) of a
    quantized folder covered here; None for any other."""
    layout = read_format(path)
    if layout is not None:
        return _gptq_awq_dequantizer(layout), _GPTQ_AWQ_SUFFIXES, "qweight"
    if quantization_method(path) != "compressed-tensors":
        return None
    dequantize = _compressed_dequantizer(path)
    if dequantize is None:
        return None
    local = tuple(sorted({n.rpartition(".")[2] for n in files if ".weight_" in n} | {"weight"}))
    return dequantize, local, "weight_scale"


def _shared_or_own(
    name: str, tensor: Tensor, clean: dict[str, Tensor], dtype: torch.dtype, shareable: bool
) -> nn.Parameter:
    """The clean model's parameter `name` when `shareable` and equal to `tensor` in `dtype`,
    else `tensor` in `dtype` as a parameter of its own."""
    reference = clean.get(name)
    value = tensor.to(reference.dtype if reference is not None else dtype)
    if (
        shareable
        and isinstance(reference, nn.Parameter)
        and reference.shape == value.shape
        and torch.equal(reference.detach().cpu(), value)
    ):
        return reference
    device = reference.device if reference is not None else torch.device("cpu")
    return nn.Parameter(value.to(device), requires_grad=False)


@torch.no_grad()
def load_lean_served(
    path: Path, clean_path: Path, clean_model: nn.Module, dtype: torch.dtype = torch.float32
) -> PreTrainedModel | None:
    """The served causal LM of the quantized folder `path` built as the module docstring says,
    sharing `clean_model`'s (loaded from `clean_path`, in `dtype`) equal tensors, in eval mode
    on the clean model's device. None for a folder not covered here (load it whole).
    ValueError when a tensor of the folder has no place in the model or a parameter none."""
    path = Path(path)
    if not _same_config(Path(clean_path), path):
        return None
    with _tensor_reader(path) as (files, read):
        scheme = _quantized_layers(path, files)
        if scheme is None:
            return None
        dequantize, local_names, marker = scheme
        model = _empty_model(path, dtype)
        clean = {**dict(clean_model.named_parameters()), **dict(clean_model.named_buffers())}
        device = next(clean_model.parameters()).device
        used = _fill_lean(model, (files, read), (dequantize, local_names, marker), clean, device)
    unused = [n for n in files if n not in used and not n.endswith("rotary_emb.inv_freq")]
    if unused:
        raise ValueError(f"{path}: tensor {unused[0]} matches no parameter of the model")
    model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"{path}: no tensor for {', '.join(left[:5])}")
    return model.eval()


def _fill_lean(
    model: PreTrainedModel,
    reader: tuple[dict[str, Path], Callable[[str], Tensor]],
    scheme: tuple[Dequantize, tuple[str, ...], str],
    clean: dict[str, Tensor],
    device: torch.device,
) -> set[str]:
    """Put the folder's tensors into `model` (meta), packed layers as `PackedLinear`, the rest
    shared with `clean` where equal; returns the tensor names used."""
    (files, read), (dequantize, local_names, marker) = reader, scheme
    head = model.get_output_embeddings()
    used: set[str] = set()
    for module_name, module in list(model.named_modules()):
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, nn.Linear) and f"{prefix}{marker}" in files:
            names = [n for n in local_names if f"{prefix}{n}" in files]
            used.update(f"{prefix}{n}" for n in names)
            packed = {n: read(f"{prefix}{n}").to(device) for n in names}
            bias = None
            if module.bias is not None:
                used.add(f"{prefix}bias")
                bias = _shared_or_own(
                    f"{prefix}bias", read(f"{prefix}bias"), clean, module.bias.dtype, False
                )
            layer = PackedLinear(
                packed,
                dequantize,
                (module.out_features, module.in_features),
                module.weight.dtype,
                bias,
            )
            parent, _, child = module_name.rpartition(".")
            setattr(model.get_submodule(parent), child, layer)
            continue
        shareable = not isinstance(module, nn.Linear) or module is head
        for local, parameter in list(module._parameters.items()):
            name = f"{prefix}{local}"
            if parameter is None or name not in files:
                continue
            used.add(name)
            module._parameters[local] = _shared_or_own(
                name, read(name), clean, parameter.dtype, shareable
            )
        for local in list(module._buffers):
            name = f"{prefix}{local}"
            if name not in clean:
                raise ValueError(f"the clean model has no buffer {name} to share")
            module._buffers[local] = clean[name]
    return used
