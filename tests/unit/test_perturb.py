"""Perturbation specs: parsing, targeting, reproducibility, quantizers, runtime noise."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from noisy_temp_server.checkpoints.perturbation import (
    ExternalPairSpec,
    PerturbationSpecError,
    QuantizationSpec,
    RuntimeLogitNoiseSpec,
    TensorTarget,
    WeightNoiseSpec,
    add_runtime_logit_noise,
    apply_perturbation,
    dequantize_fp8_e4m3,
    dequantize_groupwise_asymmetric,
    dequantize_int8_per_channel,
    parse_spec,
    select_tensors,
    spec_to_json,
)


class _Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(width, width, bias=True)
        self.o_proj = nn.Linear(width, width, bias=False)


class _Mlp(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(width, 2 * width, bias=False)
        self.down_proj = nn.Linear(2 * width, width, bias=False)


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(width)
        self.self_attn = _Attention(width)
        self.mlp = _Mlp(width)


class _Decoder(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(_Layer(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)


class _TinyLm(nn.Module):
    """Parameter names shaped like a transformers Llama (model.layers.N.self_attn.q_proj...)."""

    def __init__(self, *, tied: bool, vocab: int = 40, width: int = 8, layers: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _Decoder(vocab, width, layers)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _changed(before: dict[str, torch.Tensor], model: nn.Module) -> set[str]:
    after = dict(model.named_parameters(remove_duplicate=False))
    return {n for n, t in before.items() if not torch.equal(t, after[n])}


def test_spec_round_trips_through_json() -> None:
    specs = [
        WeightNoiseSpec(
            scale=0.01,
            distribution="laplace",
            seed=3,
            target=TensorTarget(groups=("mlp",), layers=(0, 2)),
        ),
        QuantizationSpec(format="int4", group_size=32),
        RuntimeLogitNoiseSpec(sigma=1.0, seed=7),
        ExternalPairSpec(clean_path="/a", served_path="/b"),
    ]
    for spec in specs:
        assert parse_spec(spec.model_dump_json()) == spec
        assert parse_spec(spec_to_json(spec)) == spec


@pytest.mark.parametrize(
    "bad",
    [
        '{"kind": "weight_noise", "scale": -1}',
        '{"kind": "nope"}',
        "not json",
        '{"kind": "quantization", "format": "int5"}',
        '{"kind": "weight_noise", "scale": 0.1, "target": {"layers": [3, 1]}}',
    ],
)
def test_bad_specs_raise_a_clear_error(bad: str) -> None:
    with pytest.raises(PerturbationSpecError, match="invalid perturbation spec"):
        parse_spec(bad)


def test_default_target_is_decoder_matrices_only() -> None:
    model = _TinyLm(tied=False)
    names = select_tensors(model, TensorTarget())
    assert names == [
        f"model.layers.{i}.{part}.weight"
        for i in range(3)
        for part in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")
    ]


def test_targeting_changes_only_the_named_tensors() -> None:
    model = _TinyLm(tied=False)
    before = _snapshot(model)
    target = TensorTarget(groups=("attention",), layers=(1, 3), name_patterns=("*q_proj*",))
    summary = apply_perturbation(model, WeightNoiseSpec(scale=0.1, target=target))
    expected = {"model.layers.1.self_attn.q_proj.weight", "model.layers.2.self_attn.q_proj.weight"}
    assert set(summary.tensors) == expected
    assert _changed(before, model) == expected


def test_same_spec_same_noise_and_target_does_not_change_other_tensors_noise() -> None:
    spec_all = WeightNoiseSpec(scale=0.05, seed=11)
    spec_mlp = WeightNoiseSpec(scale=0.05, seed=11, target=TensorTarget(groups=("mlp",)))
    a, b, c = _TinyLm(tied=False), _TinyLm(tied=False), _TinyLm(tied=False)
    apply_perturbation(a, spec_all)
    apply_perturbation(b, spec_all)
    apply_perturbation(c, spec_mlp)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb)
        if ".mlp." in name:
            assert torch.equal(pa, pc)
    d = _TinyLm(tied=False)
    apply_perturbation(d, WeightNoiseSpec(scale=0.05, seed=12))
    assert not torch.equal(
        a.model.layers[0].mlp.up_proj.weight, d.model.layers[0].mlp.up_proj.weight
    )


@pytest.mark.parametrize("distribution", ["gaussian", "uniform", "laplace"])
def test_noise_std_is_scale_times_tensor_std(distribution: str) -> None:
    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.up_proj = nn.Linear(400, 500, bias=False)
    wrapper = nn.Module()
    wrapper.model = nn.Module()
    wrapper.model.layers = nn.ModuleList([layer])
    weight = wrapper.model.layers[0].mlp.up_proj.weight
    clean = weight.detach().clone()
    apply_perturbation(wrapper, WeightNoiseSpec(scale=0.3, distribution=distribution))
    noise = weight.detach() - clean
    assert noise.std().item() == pytest.approx(0.3 * clean.std().item(), rel=0.02)
    assert abs(noise.mean().item()) < 0.01 * clean.std().item()


def test_tied_lm_head_is_untied_and_the_embedding_stays_clean() -> None:
    model = _TinyLm(tied=True)
    model.config = type("Config", (), {"tie_word_embeddings": True})()
    embedding = model.model.embed_tokens.weight.detach().clone()
    summary = apply_perturbation(
        model, WeightNoiseSpec(scale=0.1, target=TensorTarget(groups=("lm_head",)))
    )
    assert summary.tensors == ("lm_head.weight",)
    assert summary.untied_output_head
    assert model.config.tie_word_embeddings is False
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    assert not torch.equal(model.lm_head.weight, embedding)


def test_tied_model_stays_tied_without_lm_head() -> None:
    model = _TinyLm(tied=True)
    summary = apply_perturbation(model, WeightNoiseSpec(scale=0.1))
    assert not summary.untied_output_head
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_empty_selection_is_an_error() -> None:
    with pytest.raises(PerturbationSpecError, match="selects no tensor"):
        apply_perturbation(
            _TinyLm(tied=False),
            WeightNoiseSpec(scale=0.1, target=TensorTarget(name_patterns=("*nothing*",))),
        )


def test_int8_per_channel_by_hand() -> None:
    w = torch.tensor([[1.0, -0.5, 0.26], [0.0, 0.0, 0.0], [2.54, 1.0, -0.01]])
    # row 0: scale 1/127 -> 0.26 * 127 = 33.02 -> 33; row 2: scale 0.02 -> 1.0 / 0.02 = 50
    expected = torch.tensor([[1.0, -63.5 / 127, 33 / 127], [0.0, 0.0, 0.0], [2.54, 1.0, -0.0]])
    expected[0, 1] = round(-0.5 * 127) / 127
    assert torch.allclose(dequantize_int8_per_channel(w), expected, atol=1e-7)


def test_groupwise_asymmetric_by_hand() -> None:
    # 2 bits -> levels 0..3; group [0, 0.3, 0.6, 0.9]: scale 0.3, zero 0 -> exact.
    # group [-1, 0.1] (the short tail group): scale 1.1/3, zero round(1/(1.1/3)) = round(2.727) = 3
    w = torch.tensor([[0.0, 0.3, 0.6, 0.9, -1.0, 0.1]])
    out = dequantize_groupwise_asymmetric(w, bits=2, group_size=4)
    scale = 1.1 / 3
    tail = torch.tensor(
        [(round(-1.0 / scale) + 3 - 3) * scale, (round(0.1 / scale) + 3 - 3) * scale]
    )
    assert torch.allclose(out[0, :4], w[0, :4], atol=1e-6)
    assert torch.allclose(out[0, 4:], tail, atol=1e-6)
    constant = torch.full((2, 8), 0.7)
    assert torch.equal(dequantize_groupwise_asymmetric(constant, bits=3, group_size=4), constant)


@pytest.mark.parametrize(("bits", "group"), [(4, 128), (3, 64), (4, 7)])
def test_groupwise_error_is_within_half_a_step(bits: int, group: int) -> None:
    w = torch.randn(16, 300, generator=torch.Generator().manual_seed(0))
    out = dequantize_groupwise_asymmetric(w, bits=bits, group_size=group)
    assert len(torch.unique(out[0, :group])) <= 2**bits
    pad = (-300) % group
    lo = torch.nn.functional.pad(w, (0, pad), value=math.inf).reshape(16, -1, group).amin(-1)
    hi = torch.nn.functional.pad(w, (0, pad), value=-math.inf).reshape(16, -1, group).amax(-1)
    step = ((hi - lo) / (2**bits - 1)).repeat_interleave(group, dim=1)[:, :300]
    assert bool(((out - w).abs() <= step / 2 + step * 1e-4 + 1e-6).all())


def test_fp8_cast_keeps_representable_values_and_scales_to_448() -> None:
    w = torch.tensor([[448.0, -224.0, 1.0, 0.0]])
    assert torch.equal(dequantize_fp8_e4m3(w), w)
    small = w / 1000
    out = dequantize_fp8_e4m3(small)
    assert out[0, 0].item() == pytest.approx(0.448)
    assert (out - small).abs().max().item() <= 0.448 / 16
    assert torch.equal(dequantize_fp8_e4m3(torch.zeros(2, 2)), torch.zeros(2, 2))


def test_quantization_spec_applies_to_selected_matrices() -> None:
    model = _TinyLm(tied=False)
    before = _snapshot(model)
    apply_perturbation(model, QuantizationSpec(format="int3", group_size=4))
    weight = model.model.layers[0].mlp.up_proj.weight.detach()
    expected = dequantize_groupwise_asymmetric(before["model.layers.0.mlp.up_proj.weight"], 3, 4)
    assert torch.equal(weight, expected)
    assert _changed(before, model) == set(select_tensors(model, TensorTarget()))


def test_runtime_noise_is_fresh_seeded_and_keeps_masks() -> None:
    logits = torch.tensor([[0.0, 1.0, -math.inf], [2.0, 2.0, 2.0]])
    a = add_runtime_logit_noise(logits, 0.5, torch.Generator().manual_seed(1))
    b = add_runtime_logit_noise(logits, 0.5, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    assert a[0, 2].item() == -math.inf
    assert not torch.equal(a, logits)
    assert logits[0, 1].item() == 1.0
    assert add_runtime_logit_noise(logits, 0.0) is logits
    big = add_runtime_logit_noise(torch.zeros(200, 500), 2.0, torch.Generator().manual_seed(0))
    assert big.std().item() == pytest.approx(2.0, rel=0.01)
    with pytest.raises(ValueError, match="sigma"):
        add_runtime_logit_noise(logits, -1.0)
