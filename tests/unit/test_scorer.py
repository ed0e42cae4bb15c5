"""Pair scorer: statistics against a float64 reference, chunking, runtime noise, records."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from kl_reference import kl_to_clean
from transformers import PreTrainedModel

from noisy_temp_server.checkpoints.checkpoint import load_causal_lm
from noisy_temp_server.checkpoints.perturbation import (
    RuntimeLogitNoiseSpec,
    WeightNoiseSpec,
    apply_perturbation,
)
from noisy_temp_server.correction.paired_rows import PairedRows
from noisy_temp_server.scoring.clean_backend import InProcessModel, RemoteClean
from noisy_temp_server.scoring.records import KL_CURVE_TEMPERATURES, PositionRecords, interpolate_kl
from noisy_temp_server.scoring.scorer import LiveScores, PairScorer, ServedRows
from noisy_temp_server.scoring.sequence import ScoringSequence
from noisy_temp_server.temperature.oracle import kl_curve


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> tuple[PreTrainedModel, PreTrainedModel]:
    clean, _ = load_causal_lm(tiny_model_dir)
    served = copy.deepcopy(clean)
    apply_perturbation(served, WeightNoiseSpec(scale=0.3, seed=1))
    return clean, served


def _sequences() -> list[ScoringSequence]:
    generator = torch.Generator().manual_seed(0)
    return [
        ScoringSequence(torch.randint(3, 500, (n,), generator=generator).tolist(), p, i)
        for i, (n, p) in enumerate([(30, 9), (12, 11), (21, 5)])
    ]


def _reference(
    clean: PreTrainedModel, served: PreTrainedModel, sequence: ScoringSequence
) -> dict[str, torch.Tensor]:
    """Plain float64 formulas on full-sequence logits; the oracle by a fine grid search."""
    ids = torch.tensor([list(sequence.token_ids)])
    rows = slice(sequence.prompt_length - 1, len(sequence.token_ids) - 1)
    with torch.no_grad():
        z = copy.deepcopy(clean).double()(ids).logits[0, rows]
        zs = copy.deepcopy(served).double()(ids).logits[0, rows]
    p, log_p = z.softmax(-1), z.log_softmax(-1)
    q, log_q = zs.softmax(-1), zs.log_softmax(-1)
    var_p = (p * (z - (p * z).sum(-1, keepdim=True)) ** 2).sum(-1)
    var_q = (q * (zs - (q * zs).sum(-1, keepdim=True)) ** 2).sum(-1)
    grid = torch.exp(torch.linspace(math.log(0.25), math.log(4.0), 4001, dtype=torch.float64))
    curves = torch.stack([(p * (log_p - (zs / t).log_softmax(-1))).sum(-1) for t in grid], -1)
    best = curves.argmin(-1)
    return {
        "tau2": z.var(-1, unbiased=False),
        "sigma2": (zs - z).var(-1, unbiased=False),
        "alpha": (zs - z).var(-1, unbiased=False) / z.var(-1, unbiased=False),
        "var_p_clean": var_p,
        "kl_at_one": (p * (log_p - log_q)).sum(-1),
        "oracle_t": grid[best],
        "oracle_kl": curves.gather(-1, best[:, None])[:, 0],
        "served_entropy": -(q * log_q).sum(-1),
        "served_var": var_q,
        "served_top_prob": q.amax(-1),
        "same_top": z.argmax(-1) == zs.argmax(-1),
    }


def test_scorer_matches_float64_reference(pair: tuple[PreTrainedModel, PreTrainedModel]) -> None:
    clean, served = pair
    sequences = _sequences()
    records = PairScorer(clean, served, chunk_positions=4).score(sequences)
    assert len(records) == sum(len(s.token_ids) - s.prompt_length for s in sequences)
    references = [_reference(clean, served, s) for s in sequences]
    for name in references[0]:
        expected = torch.cat([r[name] for r in references])
        actual = getattr(records, name)
        if name == "same_top":
            assert torch.equal(actual, expected)
        elif name == "oracle_t":
            assert torch.allclose(actual.double(), expected, rtol=2e-3), name
        else:
            assert torch.allclose(actual.double(), expected, rtol=1e-4, atol=1e-5), name
    assert float(records.kl_at_one.mean()) > 0.01  # the perturbation is visible
    assert records.step.tolist()[:3] == [0, 1, 2]
    assert records.sequence_id.tolist().count(1) == 1


def test_chunk_size_does_not_change_records(
    pair: tuple[PreTrainedModel, PreTrainedModel],
) -> None:
    clean, served = pair
    one = PairScorer(clean, served, chunk_positions=1).score(_sequences())
    many = PairScorer(clean, served, chunk_positions=1000).score(_sequences())
    for name in PositionRecords._row_fields():
        # the oracle solver stops at its own tolerance, which depends on the rows batched together
        rtol = 1e-4 if name == "oracle_t" else 1e-5
        assert torch.allclose(
            getattr(one, name).double(), getattr(many, name).double(), rtol=rtol, atol=1e-6
        ), name


def test_runtime_noise_is_seeded_and_has_its_variance(
    pair: tuple[PreTrainedModel, PreTrainedModel],
) -> None:
    clean, _ = pair
    spec = RuntimeLogitNoiseSpec(sigma=1.5, seed=4)
    a = PairScorer(clean, clean, runtime_noise=spec).score(_sequences())
    b = PairScorer(clean, clean, runtime_noise=spec).score(_sequences())
    assert torch.equal(a.kl_curve, b.kl_curve)
    assert float(a.sigma2.mean()) == pytest.approx(1.5**2, rel=0.05)
    noiseless = PairScorer(clean, clean).score(_sequences())
    assert float(noiseless.kl_at_one.abs().max()) < 1e-5


def test_interpolated_kl_is_close_to_exact() -> None:
    """The documented interpolation error: below 2e-3 relative + 1e-5 absolute on real rows."""
    generator = torch.Generator().manual_seed(0)
    clean = torch.randn(64, 2000, generator=generator) * 3
    served = 0.8 * clean + torch.randn(64, 2000, generator=generator) * 1.5
    curves = kl_curve(clean, served, KL_CURVE_TEMPERATURES)
    temperatures = torch.exp(
        torch.empty(64).uniform_(math.log(0.25), math.log(4.0), generator=generator)
    )
    approx = interpolate_kl(curves, KL_CURVE_TEMPERATURES, temperatures)
    exact = kl_to_clean(clean, served, temperatures)
    assert torch.allclose(approx, exact, rtol=2e-3, atol=1e-5)
    on_grid = interpolate_kl(curves, KL_CURVE_TEMPERATURES, KL_CURVE_TEMPERATURES[5].expand(64))
    assert torch.allclose(on_grid, curves[:, 5])


def test_records_concat_select_save_load(
    pair: tuple[PreTrainedModel, PreTrainedModel], tmp_path: Path
) -> None:
    clean, served = pair
    records = PairScorer(clean, served).score(_sequences())
    both = PositionRecords.concat([records, records])
    assert len(both) == 2 * len(records)
    picked = both.select(both.sequence_id == 0)
    assert len(picked) == 2 * 21
    records.save(tmp_path / "r.safetensors")
    loaded = PositionRecords.load(tmp_path / "r.safetensors")
    for name in PositionRecords._row_fields():
        assert torch.equal(getattr(loaded, name), getattr(records, name))
    assert len(PositionRecords.concat([])) == 0


def test_sequence_without_completion_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        ScoringSequence([1, 2, 3], 3, 0)


def _captured(served: PreTrainedModel, sequence: ScoringSequence) -> ServedRows:
    """What the engine captures of `sequence`: the served model's row of every generated step."""
    rows = torch.cat(list(InProcessModel(served).completion_rows(sequence, 64)))
    return ServedRows(torch.arange(rows.shape[0]), rows)


def test_live_scores_of_some_captured_steps_are_those_steps_of_the_full_scores(
    pair: tuple[PreTrainedModel, PreTrainedModel],
) -> None:
    """Steps the engine dropped or did not capture (past its positions bound) are left out;
    the others score as if every step had come (the clean pass runs up to the last one)."""
    clean, served = pair
    sequence = _sequences()[0]  # 21 completion positions
    captured = _captured(served, sequence)
    kept = torch.tensor([0, 1, 2, 4, 5, 9, 10, 11])  # 3, 6-8 dropped; 12+ beyond the bound
    subset = ServedRows(captured.steps[kept], captured.rows[kept])
    trace = [1.2] * 10
    scorer = PairScorer(clean, chunk_positions=4)
    some = scorer.score_live(sequence, trace, subset, request_temperature=1.0)
    every = scorer.score_live(sequence, trace, captured, request_temperature=1.0)
    assert some.records.step.tolist() == kept.tolist()
    for name in PositionRecords._row_fields():
        actual, expected = getattr(some.records, name), getattr(every.records, name)[kept]
        torch.testing.assert_close(actual, expected, equal_nan=True)
    assert some.at_served.step.tolist() == [0, 1, 2, 4, 5, 9]  # T* known for steps < 10
    torch.testing.assert_close(some.at_one.kld, every.at_one.kld[kept])
    beyond = ServedRows(torch.tensor([21]), captured.rows[:1])
    with pytest.raises(ValueError, match="beyond"):
        scorer.score_live(sequence, trace, beyond, request_temperature=1.0)
    assert every.rows is None  # paired rows only when asked for (the online bias)
    paired = scorer.score_live(sequence, trace, captured, max_rows=5, request_temperature=1.0).rows
    assert paired is not None
    assert paired.sequence_id.tolist() == [sequence.sequence_id] * 5  # steps 0, 5, 10, 15, 20
    reference = PairScorer(clean, served, chunk_positions=64)
    (_, clean_rows, served_rows), *_ = reference.logit_chunks(sequence)
    steps = torch.tensor([0, 5, 10, 15, 20])
    expected = PairedRows.from_logits(clean_rows[steps], served_rows[steps], 0)
    torch.testing.assert_close(paired.clean_prob, expected.clean_prob, rtol=1e-4, atol=1e-6)


def test_live_records_without_kl_curves_are_the_same_records_less_the_curves(
    pair: tuple[PreTrainedModel, PreTrainedModel],
) -> None:
    clean, served = pair
    sequence = _sequences()[0]
    captured = _captured(served, sequence)
    scorer = PairScorer(clean, chunk_positions=4)
    full = scorer.score_live(sequence, [1.2] * 21, captured, request_temperature=1.0)
    lean = scorer.score_live(
        sequence, [1.2] * 21, captured, request_temperature=1.0, kl_curve=False
    )
    assert lean.records.kl_curve.shape == (21, 0)
    assert lean.records.curve_temperatures.shape == (0,)
    for name in PositionRecords._row_fields():
        if name != "kl_curve":
            expected = getattr(full.records, name)
            torch.testing.assert_close(getattr(lean.records, name), expected, equal_nan=True)
    torch.testing.assert_close(lean.at_served.kld, full.at_served.kld)


@pytest.mark.parametrize("request_temperature", [1.0, 0.5])
def test_live_scores_match_the_reference_without_the_oracle(
    pair: tuple[PreTrainedModel, PreTrainedModel], request_temperature: float
) -> None:
    """A request sampled at T_r is judged against the clean model at T_r: untuned
    KL(softmax(z/T_r) || softmax(z~/T_r)), as served KL(softmax(z/T_r) || softmax(z~/(T_r T*)));
    its records stay those of T_r = 1 (what the estimator's fits read)."""
    clean, served = pair
    sequence = _sequences()[0]  # 21 completion positions
    trace = [1.0 + 0.05 * s for s in range(15)]  # the engine's T* of the first 15 steps
    live = PairScorer(clean, chunk_positions=4).score_live(
        sequence, trace, _captured(served, sequence), request_temperature=request_temperature
    )
    full = PairScorer(clean, served, chunk_positions=4).score_sequence(sequence)
    for name in PositionRecords._row_fields():
        actual, expected = getattr(live.records, name), getattr(full, name)
        if name in ("oracle_t", "oracle_kl"):
            assert bool(actual.isnan().all()), name  # not computed online
        else:
            assert torch.allclose(actual.double(), expected.double(), rtol=1e-5, atol=1e-6), name
    assert len(live.at_one) == 21
    assert len(live.at_served) == 15
    assert live.at_served.step.tolist() == list(range(15))
    ids = torch.tensor([list(sequence.token_ids)])
    rows = slice(sequence.prompt_length - 1, len(sequence.token_ids) - 1)
    with torch.no_grad():
        z = copy.deepcopy(clean).double()(ids).logits[0, rows] / request_temperature
        zs = copy.deepcopy(served).double()(ids).logits[0, rows] / request_temperature
    torch.testing.assert_close(live.at_one.kld, kl_to_clean(z, zs, 1.0), rtol=1e-4, atol=1e-5)
    z, zs = z[:15], zs[:15]
    t = torch.tensor(trace, dtype=torch.float64)
    torch.testing.assert_close(live.at_served.kld, kl_to_clean(z, zs, t), rtol=1e-4, atol=1e-5)
    tokens = ids[0, sequence.prompt_length : sequence.prompt_length + 15]
    log_q = (zs / t[:, None]).log_softmax(-1)
    log_ratio = (
        z.log_softmax(-1).gather(1, tokens[:, None])[:, 0] - log_q.gather(1, tokens[:, None])[:, 0]
    )
    torch.testing.assert_close(live.at_served.log_ratio, log_ratio, rtol=1e-4, atol=1e-5)
    top = z.argmax(-1, keepdim=True)
    delta_p = log_q.exp().gather(1, top)[:, 0] - z.softmax(-1).gather(1, top)[:, 0]
    torch.testing.assert_close(live.at_served.delta_p, delta_p, rtol=1e-4, atol=1e-6)


def test_a_live_request_temperature_must_be_positive(
    pair: tuple[PreTrainedModel, PreTrainedModel],
) -> None:
    clean, served = pair
    sequence = _sequences()[0]
    with pytest.raises(ValueError, match="request_temperature"):
        PairScorer(clean).score_live(
            sequence, [], _captured(served, sequence), request_temperature=0.0
        )


@pytest.mark.parametrize("request_temperature", [1.0, 0.5])
def test_live_scores_with_a_bias_are_those_of_the_biased_served_logits(
    pair: tuple[PreTrainedModel, PreTrainedModel], request_temperature: float
) -> None:
    """As served: softmax((z~ + b) / (T_r T*)); untuned (the T* = 1 baseline) stays
    softmax(z~ / T_r), without the bias, as the records and rows do."""
    clean, served = pair
    sequence = _sequences()[0]
    captured = _captured(served, sequence)
    bias = torch.randn(captured.rows.shape[1], generator=torch.Generator().manual_seed(4))
    trace = [1.3] * 21
    scorer = PairScorer(clean, chunk_positions=4)

    def score(rows: ServedRows, bias: torch.Tensor | None = None) -> LiveScores:
        return scorer.score_live(
            sequence, trace, rows, request_temperature=request_temperature, bias=bias
        )

    plain = score(captured)
    biased = score(captured, bias)
    reference = score(ServedRows(captured.steps, captured.rows + bias))
    for name in ("kld", "delta_p", "log_ratio", "same_top"):
        torch.testing.assert_close(
            getattr(biased.at_served, name), getattr(reference.at_served, name)
        )
        torch.testing.assert_close(getattr(biased.at_one, name), getattr(plain.at_one, name))
    assert not torch.allclose(biased.at_served.kld, plain.at_served.kld)
    torch.testing.assert_close(biased.records.kl_at_one, plain.records.kl_at_one)


def test_the_clean_head_is_the_in_process_models_own(
    pair: tuple[PreTrainedModel, PreTrainedModel],
) -> None:
    clean, served = pair
    head = PairScorer(clean, served).clean_head()
    assert head is not None
    assert head.data_ptr() == clean.get_output_embeddings().weight.data_ptr()
    assert not head.requires_grad


def test_a_remote_clean_model_has_no_head_here() -> None:
    remote = RemoteClean("http://127.0.0.1:9", "clean", 16, timeout_s=0.1)
    assert PairScorer(remote).clean_head() is None
