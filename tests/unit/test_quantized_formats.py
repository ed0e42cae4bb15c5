"""Native GPTQ/AWQ dequantization (`checkpoints.quantized_formats`) and the quantized fixtures.

The references here are written from the formats' published code, independently of the module:
packing as AutoGPTQ's `QuantLinear.pack` (auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py) and
AutoAWQ's `WQLinear_GEMM.from_linear` (awq/modules/linear/gemm.py) do it, word by word in
numpy; dequantization as AutoGPTQ's forward (`zeros + 1` then masked, for the v1 format) and
AutoAWQ's `dequantize_gemm` (awq/utils/packing_utils.py, reverse order [0, 4, 1, 5, 2, 6, 3, 7])
do it. The fixtures (tests/fixtures/quantized/, made by scripts/make_quantized_fixtures.sh with
llm-compressor and GPTQModel) are checked against the clean tiny model they were made from.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from noisy_temp_server.checkpoints.checkpoint import load_causal_lm
from noisy_temp_server.checkpoints.quantized_formats import (
    AwqFormat,
    GptqFormat,
    dequantize_awq,
    dequantize_gptq,
    load_quantized_causal_lm,
    quantization_method,
)
from noisy_temp_server.files import sha256_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quantized"
COMPRESSED = {  # fixture -> bound on the logits' relative error against the clean model
    "ct-gptq-w4a16": 0.6,
    "ct-gptq-w4a16-actorder": 0.6,
    "ct-awq-w4a16-asym": 0.6,
    "ct-fp8-dynamic": 0.3,
    "ct-w8a8-int8": 0.1,
}
NATIVE = {
    "gptq-4bit-g32": 0.6,
    "gptq-4bit-g32-actorder": 0.6,
    "gptq-8bit-perchannel-v2": 0.1,
    "awq-gemm-4bit-g32": 0.6,
}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


# --- references from the published code ---------------------------------------------------


def autogptq_pack(intweight: np.ndarray, zeros: np.ndarray, bits: int, v1: bool) -> tuple:
    """AutoGPTQ `QuantLinear.pack` on integer values: intweight (K, N), zeros (G, N)."""
    per_word = 32 // bits
    intweight = intweight.astype(np.uint32)
    qweight = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + per_word):
            qweight[row] |= intweight[j] << (bits * (j - i))
        i += per_word
        row += 1
    zeros = (zeros - 1 if v1 else zeros).astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 32 * bits), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + per_word):
            qzeros[:, col] |= zeros[:, j] << (bits * (j - i))
        i += per_word
        col += 1
    return torch.from_numpy(qweight.astype(np.int32)), torch.from_numpy(qzeros.astype(np.int32))


def autoawq_pack(values: np.ndarray) -> torch.Tensor:
    """AutoAWQ `WQLinear_GEMM.from_linear`'s packing of (rows, N) 4-bit values."""
    values = values.astype(np.int64)
    packed = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.int64)
    for col in range(values.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return torch.from_numpy(packed.astype(np.uint32).astype(np.int32))


def autogptq_dequantize(qweight, qzeros, scales, g_idx, *, bits: int, v1: bool) -> np.ndarray:
    """AutoGPTQ's forward: unpack, `zeros + 1` masked (v1), `scales[g] * (q - zeros[g])`."""
    maxq = (1 << bits) - 1
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    words = qweight.numpy().astype(np.uint32)
    q = ((words[:, None, :] >> shifts[None, :, None]) & maxq).reshape(-1, words.shape[1])
    zwords = qzeros.numpy().astype(np.uint32)
    zeros = ((zwords[:, :, None] >> shifts[None, None, :]) & maxq).reshape(zwords.shape[0], -1)
    if v1:
        zeros = (zeros + 1) & maxq
    g = g_idx.numpy().astype(np.int64)
    weight = scales.float().numpy()[g] * (q.astype(np.float32) - zeros[g])
    return weight.T


def autoawq_dequantize(qweight, qzeros, scales, group_size: int) -> np.ndarray:
    """AutoAWQ's `dequantize_gemm`: unpack, reverse the AWQ order, `(q - z) * s`."""

    def unpack(packed: torch.Tensor) -> np.ndarray:
        words = packed.numpy().astype(np.uint32)
        fields = (words[:, :, None] >> np.arange(0, 32, 4, dtype=np.uint32)) & 15
        return fields[:, :, AWQ_REVERSE_ORDER].reshape(words.shape[0], -1)

    q, zeros = unpack(qweight), unpack(qzeros)
    groups = np.arange(q.shape[0]) // (q.shape[0] if group_size == -1 else group_size)
    weight = (q.astype(np.float32) - zeros[groups]) * scales.float().numpy()[groups]
    return weight.T


# --- random packed tensors -------------------------------------------------------------------


def _g_idx(in_features: int, group_size: int, act_order: bool, rng: np.random.Generator):
    size = in_features if group_size == -1 else group_size
    if not act_order:
        return np.arange(in_features) // size
    order = rng.permutation(in_features)  # the order GPTQ visited the channels in
    g_idx = np.empty(in_features, dtype=np.int64)
    g_idx[order] = np.arange(in_features) // size
    return g_idx


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [-1, 32, 64])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("v1", [True, False])
def test_gptq_dequantization_matches_autogptq(
    bits: int, group_size: int, act_order: bool, v1: bool
) -> None:
    rng = np.random.default_rng(bits * 1000 + group_size + 10 * act_order + v1)
    in_features, out_features = 128, 64
    groups = 1 if group_size == -1 else in_features // group_size
    maxq = (1 << bits) - 1
    q = rng.integers(0, maxq + 1, size=(in_features, out_features))
    # v1 stores z - 1, which AutoGPTQ's OR-packing garbles for z = 0: such zeros start at 1
    zeros = rng.integers(1 if v1 else 0, maxq + 1, size=(groups, out_features))
    scales = torch.from_numpy(rng.uniform(0.01, 0.1, size=(groups, out_features))).half()
    g_idx = _g_idx(in_features, group_size, act_order, rng)
    qweight, qzeros = autogptq_pack(q, zeros, bits, v1)
    g_idx_tensor = torch.from_numpy(g_idx.astype(np.int32))
    layout = GptqFormat(bits, group_size, act_order, sym=False, zeros_minus_one=v1)

    ours = dequantize_gptq(qweight, qzeros, scales, g_idx_tensor if act_order else None, layout)

    reference = autogptq_dequantize(qweight, qzeros, scales, g_idx_tensor, bits=bits, v1=v1)
    formula = (scales.float().numpy()[g_idx] * (q - zeros[g_idx])).T
    np.testing.assert_allclose(ours.numpy(), reference, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ours.numpy(), formula, rtol=1e-6, atol=1e-6)


def test_gptq_v1_zero_points_undo_gptqmodels_packed_subtraction() -> None:
    """GPTQModel writes v1 by subtracting 0x11111111 from the packed v2 words (borrowing
    across fields where a zero point is 0); adding it back restores every zero point."""
    zeros = np.tile([0, 3, 0, 15, 8, 0, 1, 0], 4)[None, :]  # (1 group, 32 output channels)
    _, v2_words = autogptq_pack(np.zeros((32, 32), dtype=np.int64), zeros, 4, v1=False)
    v1_words = ((v2_words.to(torch.int64) - 0x11111111) & 0xFFFFFFFF).to(torch.int32)
    qweight = torch.zeros((4, 32), dtype=torch.int32)  # q = 0 everywhere: W = -z * s
    scales = torch.ones((1, 32), dtype=torch.float16)
    layout = GptqFormat(4, -1, desc_act=False, sym=False, zeros_minus_one=True)

    weight = dequantize_gptq(qweight, v1_words, scales, None, layout)

    np.testing.assert_array_equal(-weight[:, 0].numpy(), zeros[0])


@pytest.mark.parametrize("group_size", [-1, 32, 128])
def test_awq_dequantization_matches_autoawq(group_size: int) -> None:
    rng = np.random.default_rng(group_size + 7)
    in_features, out_features = 128, 64
    groups = 1 if group_size == -1 else in_features // group_size
    q = rng.integers(0, 16, size=(in_features, out_features))
    zeros = rng.integers(0, 16, size=(groups, out_features))
    scales = torch.from_numpy(rng.uniform(0.01, 0.1, size=(groups, out_features))).half()
    qweight, qzeros = autoawq_pack(q), autoawq_pack(zeros)

    ours = dequantize_awq(qweight, qzeros, scales, AwqFormat(4, group_size))

    reference = autoawq_dequantize(qweight, qzeros, scales, group_size)
    g = np.arange(in_features) // (in_features if group_size == -1 else group_size)
    formula = ((q - zeros[g]) * scales.float().numpy()[g]).T
    np.testing.assert_allclose(ours.numpy(), reference, rtol=0, atol=1e-6)
    np.testing.assert_allclose(ours.numpy(), formula, rtol=1e-6, atol=1e-6)


# --- the committed fixtures --------------------------------------------------------------------


def _quantized_layers(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    layers: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not a mapping)
            prefix, _, suffix = name.rpartition(".")
            if suffix in {"qweight", "qzeros", "scales", "g_idx"}:
                layers.setdefault(prefix, {})[suffix] = handle.get_tensor(name)
    return layers


def _quantization_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text(encoding="utf-8"))["quantization_config"]


@pytest.mark.parametrize(
    "name", ["gptq-4bit-g32", "gptq-4bit-g32-actorder", "gptq-8bit-perchannel-v2"]
)
def test_gptq_fixture_layers_dequantize_as_autogptq_does(name: str) -> None:
    folder = FIXTURES / name
    config = _quantization_config(folder)
    v1 = config["checkpoint_format"] == "gptq"
    layout = GptqFormat(config["bits"], config["group_size"], config["desc_act"], config["sym"], v1)
    layers = _quantized_layers(folder)
    assert len(layers) == 14  # 7 linear layers in each of 2 decoder layers
    if config["desc_act"]:  # the act-order fixture's groups are not contiguous
        g_idx = layers["model.layers.0.mlp.down_proj"]["g_idx"]
        assert not torch.equal(g_idx, torch.arange(128, dtype=torch.int32) // 32)
    for prefix, t in layers.items():
        ours = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], layout)
        reference = autogptq_dequantize(
            t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits=config["bits"], v1=v1
        )
        np.testing.assert_allclose(ours.numpy(), reference, rtol=0, atol=1e-6, err_msg=prefix)


def test_awq_fixture_layers_dequantize_as_autoawq_does() -> None:
    folder = FIXTURES / "awq-gemm-4bit-g32"
    config = _quantization_config(folder)
    assert (config["version"], config["zero_point"], config["bits"]) == ("gemm", True, 4)
    layers = _quantized_layers(folder)
    assert len(layers) == 14
    for prefix, t in layers.items():
        ours = dequantize_awq(t["qweight"], t["qzeros"], t["scales"], AwqFormat(4, 32))
        reference = autoawq_dequantize(t["qweight"], t["qzeros"], t["scales"], 32)
        np.testing.assert_allclose(ours.numpy(), reference, rtol=0, atol=1e-6, err_msg=prefix)


@pytest.fixture(scope="module")
def clean_logits(tiny_model_dir: Path) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The clean tiny model's logits on a prompt, the prompt, and its named parameters."""
    readme = (FIXTURES / "ct-gptq-w4a16" / "README.md").read_text(encoding="utf-8")
    recorded = re.search(r"sha256 `([0-9a-f]{64})`", readme)
    assert recorded, "the fixture README records its source's sha256"
    assert sha256_file(tiny_model_dir / "model.safetensors") == recorded.group(1), (
        "build_tiny_llama(seed=0) no longer makes the model the fixtures were quantized from; "
        "rerun scripts/make_quantized_fixtures.sh"
    )
    model, tokenizer = load_causal_lm(tiny_model_dir, verify=False)
    text = "The capital of France is Paris. Once upon a time there was a little robot."
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    return ids, logits, {k: v.detach().clone() for k, v in model.named_parameters()}


def _relative_error(model: torch.nn.Module, clean: tuple) -> float:
    ids, reference, _ = clean
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    assert logits.shape == reference.shape
    return float((logits - reference).norm() / reference.norm())


@pytest.mark.parametrize("name", sorted(COMPRESSED))
def test_compressed_tensors_fixture_loads_close_to_the_clean_model(name: str, clean_logits) -> None:
    folder = FIXTURES / name
    assert quantization_method(folder) == "compressed-tensors"
    assert load_quantized_causal_lm(folder) is None  # transformers + compressed-tensors load it

    model, tokenizer = load_causal_lm(folder, verify=False)

    assert tokenizer.eos_token == "<|im_end|>"
    error = _relative_error(model, clean_logits)
    assert 0 < error < COMPRESSED[name], error


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_native_fixture_loads_through_load_causal_lm(name: str, clean_logits) -> None:
    folder = FIXTURES / name
    assert quantization_method(folder) == name.split("-", maxsplit=1)[0]

    model, tokenizer = load_causal_lm(folder, verify=False)

    assert type(model).__name__ == "LlamaForCausalLM"
    assert not hasattr(model.config, "quantization_config")
    assert model.dtype == torch.float32
    assert not model.training
    assert tokenizer.eos_token == "<|im_end|>"
    error = _relative_error(model, clean_logits)
    assert 0 < error < NATIVE[name], error
    if name.startswith("gptq"):  # GPTQ leaves the float weights in place, rounded: compare them
        bound = 0.2 if "4bit" in name else 0.02
        clean = clean_logits[2]["model.layers.1.mlp.down_proj.weight"]
        served = model.model.layers[1].mlp.down_proj.weight.detach()
        assert float((served - clean).norm() / clean.norm()) < bound


def test_a_clean_folder_has_no_quantization(tiny_model_dir: Path) -> None:
    assert quantization_method(tiny_model_dir) is None
    assert load_quantized_causal_lm(tiny_model_dir) is None


def test_a_sharded_native_folder_loads_in_bfloat16(tmp_path: Path, clean_logits) -> None:
    source = FIXTURES / "gptq-8bit-perchannel-v2"
    folder = tmp_path / "sharded"
    shutil.copytree(source, folder)
    (folder / "model.safetensors").unlink()
    with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
        names = sorted(handle.keys())
        tensors = {name: handle.get_tensor(name) for name in names}
    weight_map = {}
    for index, part in enumerate((names[::2], names[1::2])):  # a layer's tensors split up
        file = f"model-{index + 1:05d}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    index_file = folder / "model.safetensors.index.json"
    index_file.write_text(json.dumps({"weight_map": weight_map}), encoding="utf-8")

    model = load_quantized_causal_lm(folder, dtype=torch.bfloat16)

    assert model is not None
    assert model.dtype == torch.bfloat16
    assert _relative_error(model.float(), clean_logits) < NATIVE[source.name]


def _write_config(folder: Path, quantization: dict) -> Path:
    folder.mkdir()
    config = {"model_type": "llama", "quantization_config": quantization}
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
        ({"quant_method": "gptq", "bits": 2, "group_size": 128}, "bits=2"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "gptq", "bits": 4, "format": "gptq_p"}, "'gptq_p'"),
        ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*": {}}}, "dynamic"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'gemv'"),
        ({"quant_method": "awq", "bits": 4, "version": "exllama"}, "'exllama'"),
        ({"quant_method": "awq", "bits": 8, "version": "gemm"}, "bits=8"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point=false"),
    ],
)
def test_unsupported_variants_are_refused_in_one_line(
    tmp_path: Path, quantization: dict, named: str
) -> None:
    folder = _write_config(tmp_path / "model", quantization)

    with pytest.raises(ValueError, match=re.escape(named)) as raised:
        load_causal_lm(folder, verify=False)

    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"unsupported {quantization['quant_method']} checkpoint: ")


def test_a_tensor_without_a_parameter_is_an_error(tmp_path: Path) -> None:
    folder = tmp_path / "extra"
    shutil.copytree(FIXTURES / "awq-gemm-4bit-g32", folder)
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2)
    save_file(tensors, str(path))

    with pytest.raises(ValueError, match=r"model\.layers\.9\.mlp\.up_proj\.weight matches no"):
        load_quantized_causal_lm(folder)
