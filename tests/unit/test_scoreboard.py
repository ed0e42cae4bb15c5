"""The KL scoreboard's statistics against a float64 reference, merging, sampling and refusal."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from noisy_temp_server.correction.files import bias_sha256
from noisy_temp_server.scoring.position_scores import (
    PositionScores,
    position_scores,
    scores_at_temperatures,
)
from noisy_temp_server.scoring.scoreboard import (
    SCOREBOARD_PERCENTILES,
    LiveScoreboard,
    PairScoreboard,
    ScoreAccumulator,
    ScoreboardResult,
    TooFewPositionsError,
)
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule
from noisy_temp_server.temperature.stats import PairTerms

VOCAB = 50


@dataclass
class Corpus:
    """Random logits of several sequences, flattened: row i belongs to sequence_id[i]."""

    clean: Tensor
    served: Tensor
    tokens: Tensor
    sequence_id: Tensor
    step: Tensor


def _corpus(lengths: list[int], seed: int = 0, noise: float = 0.7) -> Corpus:
    generator = torch.Generator().manual_seed(seed)
    rows = sum(lengths)
    clean = 3 * torch.randn(rows, VOCAB, generator=generator)
    # a per-sequence offset makes positions of one sequence correlated (clustering matters)
    offsets = torch.cat(
        [noise * torch.randn(1, VOCAB, generator=generator).expand(n, -1) for n in lengths]
    )
    served = clean + offsets + 0.3 * torch.randn(rows, VOCAB, generator=generator)
    tokens = torch.randint(0, VOCAB, (rows,), generator=generator)
    ids = torch.cat([torch.full((n,), 10 + 3 * i) for i, n in enumerate(lengths)])
    steps = torch.cat([torch.arange(n) for n in lengths])
    return Corpus(clean, served, tokens, ids, steps)


def _accumulate(
    corpus: Corpus, rows: Tensor, temperature: float, **kwargs: int
) -> ScoreAccumulator:
    accumulator = ScoreAccumulator(**kwargs)
    for chunk in torch.split(rows, 37):  # chunks cut across sequences
        accumulator.update(
            position_scores(
                corpus.clean[chunk],
                corpus.served[chunk],
                corpus.tokens[chunk],
                temperature,
                sequence_id=corpus.sequence_id[chunk],
                step=corpus.step[chunk],
            )
        )
    return accumulator


def _cluster_se(values: np.ndarray, ids: np.ndarray) -> float:
    mean = values.mean()
    groups = np.unique(ids)
    sums = np.array([(values[ids == g] - mean).sum() for g in groups])
    return math.sqrt(len(groups) / (len(groups) - 1) * (sums**2).sum()) / len(values)


def _reference(corpus: Corpus, temperature: float) -> dict[str, Any]:
    clean = corpus.clean.double().numpy()
    served = corpus.served.double().numpy() / temperature
    log_p = clean - np.log(np.exp(clean - clean.max(1, keepdims=True)).sum(1, keepdims=True))
    log_p -= clean.max(1, keepdims=True)
    log_q = served - np.log(np.exp(served - served.max(1, keepdims=True)).sum(1, keepdims=True))
    log_q -= served.max(1, keepdims=True)
    kld = (np.exp(log_p) * (log_p - log_q)).sum(1)
    rows = np.arange(len(clean))
    top = clean.argmax(1)
    delta_p = np.exp(log_q[rows, top]) - np.exp(log_p[rows, top])
    tokens = corpus.tokens.numpy()
    log_ratio = log_p[rows, tokens] - log_q[rows, tokens]
    same = (top == served.argmax(1)).astype(float)
    ids = corpus.sequence_id.numpy()
    rate = same.mean()
    return {
        "kld_mean": kld.mean(),
        "kld_stderr": _cluster_se(kld, ids),
        "kld_percentiles": np.percentile(kld, SCOREBOARD_PERCENTILES),
        "same_top_rate": rate,
        "same_top_stderr": math.sqrt(rate * (1 - rate) / len(same)),
        "delta_p_mean": delta_p.mean(),
        "delta_p_stderr": _cluster_se(delta_p, ids),
        "delta_p_rms": math.sqrt((delta_p**2).mean()),
        "delta_p_percentiles": np.percentile(delta_p, SCOREBOARD_PERCENTILES),
        "ln_ppl_ratio": log_ratio.mean(),
        "ln_ppl_ratio_stderr": _cluster_se(log_ratio, ids),
        "ppl_ratio": math.exp(log_ratio.mean()),
    }


def _assert_matches(result: ScoreboardResult, reference: dict[str, Any]) -> None:
    for name, expected in reference.items():
        actual = getattr(result, name)
        if isinstance(actual, dict):
            actual = list(actual.values())
        np.testing.assert_allclose(actual, expected, rtol=2e-4, atol=1e-6, err_msg=name)


LENGTHS = [40, 7, 63, 25, 1, 90, 33, 18]


@pytest.mark.parametrize("temperature", [1.0, 0.8, 1.7])
def test_statistics_match_a_float64_reference(temperature: float) -> None:
    corpus = _corpus(LENGTHS)
    result = _accumulate(corpus, torch.arange(sum(LENGTHS)), temperature).result()
    assert result.positions == sum(LENGTHS)
    assert result.sequences == len(LENGTHS)
    assert result.exact_percentiles
    assert list(result.kld_percentiles) == ["99.9", "99", "90", "50", "10", "5", "1"]
    _assert_matches(result, _reference(corpus, temperature))


def test_clustered_stderr_exceeds_the_independent_one_for_correlated_positions() -> None:
    corpus = _corpus(LENGTHS, noise=2.0)
    result = _accumulate(corpus, torch.arange(sum(LENGTHS)), 1.0).result()
    kld = position_scores(
        corpus.clean, corpus.served, corpus.tokens, 1.0, sequence_id=0, step=corpus.step
    ).kld
    independent = float(kld.std()) / math.sqrt(len(kld))
    assert result.kld_stderr > 1.5 * independent


@pytest.mark.parametrize("capacity", [10_000, 120])
def test_two_halves_merged_equal_the_whole(capacity: int) -> None:
    corpus = _corpus(LENGTHS, seed=3)
    rows = torch.randperm(sum(LENGTHS), generator=torch.Generator().manual_seed(1))
    half = len(rows) // 2  # a random split: most sequences land in both halves
    whole = _accumulate(corpus, torch.arange(sum(LENGTHS)), 1.3, capacity=capacity)
    first = _accumulate(corpus, rows[:half], 1.3, capacity=capacity)
    first.merge(_accumulate(corpus, rows[half:], 1.3, capacity=capacity))
    merged, expected = first.result(), whole.result()
    assert merged.exact_percentiles == (capacity >= len(rows))
    for name, value in expected.to_dict().items():
        got = merged.to_dict()[name]
        if isinstance(value, dict):
            assert got == pytest.approx(value, rel=1e-12), name
        else:
            assert got == pytest.approx(value, rel=1e-12, abs=1e-15), name


def test_percentiles_beyond_capacity_come_from_a_uniform_sample() -> None:
    lengths = [100] * 40
    corpus = _corpus(lengths, seed=5)
    exact = _accumulate(corpus, torch.arange(4000), 1.0).result()
    sampled = _accumulate(corpus, torch.arange(4000), 1.0, capacity=1000).result()
    assert not sampled.exact_percentiles
    assert sampled.kld_mean == pytest.approx(exact.kld_mean, rel=1e-12)  # means stay exact
    for level in ("90", "50", "10"):
        # a quarter of 4000 positions: the median's sampling error is a few % of its spread
        spread = exact.kld_percentiles["99"] - exact.kld_percentiles["1"]
        error = abs(sampled.kld_percentiles[level] - exact.kld_percentiles[level])
        assert error < 0.05 * spread, level


def test_refuses_too_few_positions() -> None:
    corpus = _corpus([60, 39])
    accumulator = _accumulate(corpus, torch.arange(99), 1.0)
    with pytest.raises(TooFewPositionsError, match=r"only 99 scored positions.*at least 100"):
        accumulator.result()
    corpus = _corpus([60, 40])
    assert _accumulate(corpus, torch.arange(100), 1.0).result().positions == 100


def test_positions_with_infinite_kl_are_counted_and_left_out() -> None:
    corpus = _corpus([80, 80])
    served = corpus.served.clone()
    top = corpus.clean[:5].argmax(dim=-1)
    served[torch.arange(5), top] = -math.inf  # the served model masks the clean top token
    corpus.served = served
    result = _accumulate(corpus, torch.arange(160), 1.0).result()
    assert result.infinite_positions == 5
    assert result.positions == 155
    assert math.isfinite(result.kld_mean)


def _fill(board: PairScoreboard, corpus: Corpus) -> None:
    for chunk in torch.split(torch.arange(len(corpus.step)), 50):
        board.update(
            corpus.clean[chunk],
            corpus.served[chunk],
            corpus.tokens[chunk],
            step=corpus.step[chunk],
            sequence_id=corpus.sequence_id[chunk],
        )


def test_pair_scoreboard_scores_t_one_and_the_policy_temperature() -> None:
    corpus = _corpus(LENGTHS, seed=7)
    policy = TemperaturePolicy(rule=Rule.FIXED, fixed_temperature=1.6)
    board = PairScoreboard(policy)
    _fill(board, corpus)
    results = board.result()
    _assert_matches(results["T=1"], _reference(corpus, 1.0))
    _assert_matches(results["T*"], _reference(corpus, 1.6))
    assert board.mean_temperature() == pytest.approx(1.6)


def test_with_a_bias_the_served_column_is_softmax_of_biased_logits_over_t() -> None:
    corpus = _corpus(LENGTHS, seed=5)
    bias = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2))
    policy = TemperaturePolicy(rule=Rule.FIXED, fixed_temperature=1.3, bias=bias_sha256(bias))
    board = PairScoreboard(policy, bias=bias)
    _fill(board, corpus)
    results = board.result()
    biased = dataclasses.replace(corpus, served=corpus.served + bias)
    _assert_matches(results["T=1"], _reference(corpus, 1.0))
    _assert_matches(results["T*"], _reference(biased, 1.3))
    assert results["T*"].kld_mean != pytest.approx(_reference(corpus, 1.3)["kld_mean"], rel=1e-2)


def test_a_bias_must_be_the_policys_and_fit_the_vocabulary() -> None:
    bias = torch.randn(VOCAB)
    policy = TemperaturePolicy(rule=Rule.FIXED, fixed_temperature=1.3, bias=bias_sha256(bias))
    with pytest.raises(ValueError, match="names a per-token bias vector: give it"):
        PairScoreboard(policy)
    with pytest.raises(ValueError, match="bias vector was given for a policy without one"):
        PairScoreboard(TemperaturePolicy.identity(), bias=bias)
    with pytest.raises(ValueError, match="not the policy's"):
        PairScoreboard(policy, bias=bias + 1)
    corpus = _corpus([4])
    clean, served = (torch.cat([x, x[:, :1]], dim=1) for x in (corpus.clean, corpus.served))
    with pytest.raises(ValueError, match=f"the served model has a vocabulary of {VOCAB + 1}"):
        PairScoreboard(policy, bias=bias).update(
            clean, served, corpus.tokens, step=corpus.step, sequence_id=0
        )


def test_scores_at_several_temperatures_equal_one_temperature_at_a_time() -> None:
    corpus = _corpus([12])
    clean, served = corpus.clean, corpus.served
    tokens, steps = corpus.tokens, corpus.step
    t_row = torch.linspace(0.5, 2.0, 12)
    together = scores_at_temperatures(
        PairTerms.from_logits(clean, served), tokens, [1.0, t_row], sequence_id=3, step=steps
    )
    for temperature, scores in zip([1.0, t_row], together, strict=True):
        alone = position_scores(clean, served, tokens, temperature, sequence_id=3, step=steps)
        for name in ("kld", "delta_p", "log_ratio", "same_top", "step", "sequence_id"):
            assert torch.equal(getattr(scores, name), getattr(alone, name)), name
    assert not torch.equal(together[0].kld, together[1].kld)


def test_live_scoreboard_rolls_over_to_the_recent_epochs() -> None:
    live = LiveScoreboard(epoch_positions=100, capacity=1000)

    def request(sequence_id: int, kld: float) -> PositionScores:
        count = 60
        return PositionScores(
            sequence_id=torch.full((count,), sequence_id),
            step=torch.arange(count),
            kld=torch.full((count,), kld, dtype=torch.float64),
            same_top=torch.ones(count, dtype=torch.bool),
            delta_p=torch.zeros(count, dtype=torch.float64),
            log_ratio=torch.zeros(count, dtype=torch.float64),
        )

    live.update(request(0, 1.0), PositionScores.concat([]))
    early = live.result()
    assert early["T=1"] == {"positions": 60, "error": early["T=1"]["error"]}
    assert "at least 100" in early["T*"]["error"]
    for sequence_id in range(1, 6):  # epochs of >= 100 positions: 2 requests each
        live.update(request(sequence_id, 2.0), request(sequence_id, 0.5))
    result = live.result()
    # request 0 (KL 1.0) has rolled out: the window holds the last two epochs only
    assert result["T=1"]["kld_mean"] == pytest.approx(2.0)
    assert result["T=1"]["positions"] in (120, 180)
    assert result["T*"]["kld_mean"] == pytest.approx(0.5)
