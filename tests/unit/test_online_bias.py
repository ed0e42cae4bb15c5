"""The per-token bias refined online: the streaming fit, its held-out gate, and its publication
by the online estimator in versioned policies."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from profile_helpers import sample_bias, sample_profile

from noisy_temp_server.calibration.profile import Profile
from noisy_temp_server.calibration.settings import CalibrationSettings
from noisy_temp_server.correction.bias import fit_bias_at_penalty
from noisy_temp_server.correction.files import (
    bias_file_name,
    bias_sha256,
    find_bias_file,
    load_bias_file,
    save_bias_file,
)
from noisy_temp_server.correction.paired_rows import LogitBias, PairedRows, evaluate_bias
from noisy_temp_server.correction.request_bands import (
    BandedBias,
    at_request_temperature,
    best_temperature,
)
from noisy_temp_server.correction.streaming_bias import StreamingBias
from noisy_temp_server.online import estimator as online
from noisy_temp_server.online.bias import OnlineBias
from noisy_temp_server.online.estimator import OnlineEstimator
from noisy_temp_server.scoring.records import PositionRecords
from noisy_temp_server.temperature.rules import Rule

VOCAB = 200
SHIFT = torch.randn(VOCAB, generator=torch.Generator().manual_seed(99)) * 1.5
PENALTY = 1e-3


def _logits(request: int, rows: int = 24, noise: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """Clean logits and served ones pushed by the same per-token `SHIFT` every time (what a
    bias can learn) plus fresh noise (what it cannot)."""
    generator = torch.Generator().manual_seed(request)
    clean = torch.randn(rows, VOCAB, generator=generator) * 2.5
    return clean, clean + SHIFT + noise * torch.randn(rows, VOCAB, generator=generator)


def _rows(request: int) -> PairedRows:
    return PairedRows.from_logits(*_logits(request), request)


def _mean_kl(rows: PairedRows, correction: LogitBias) -> float:
    return float(evaluate_bias(rows, correction).kl.mean())


def test_the_streaming_fit_approaches_the_batch_fit_with_o_v_state() -> None:
    held_out = PairedRows.concat([_rows(1000 + i) for i in range(4)])
    identity = LogitBias.identity(VOCAB)
    stream = StreamingBias(identity, PENALTY)
    for request in range(60):
        stream.update(_rows(request))
    batch = fit_bias_at_penalty(PairedRows.concat([_rows(r) for r in range(60)]), PENALTY)
    start, online = _mean_kl(held_out, identity), _mean_kl(held_out, stream.correction)
    best = _mean_kl(held_out, batch.correction)
    assert online < 0.2 * start  # most of the systematic drift removed
    assert online - best < 0.1 * (start - best)
    assert stream.rows_seen == 60 * 24
    assert stream._x.shape == stream._curvature.shape == (VOCAB + 1,)


def _peaked_rows(request: int, shift: torch.Tensor) -> PairedRows:
    """8 rows as peaked as a language model's (a few tokens carry each row's mass, different
    ones in each row), served with a fixed per-token `shift` and fresh noise."""
    generator = torch.Generator().manual_seed(request)
    clean = torch.randn(8, shift.numel(), generator=generator) * 4.0
    served = clean + shift + torch.randn(clean.shape, generator=generator)
    return PairedRows.from_logits(clean, served, request)


def test_the_streaming_fit_does_not_walk_off_on_small_batches_of_peaked_rows() -> None:
    """A token carries mass in one small batch and none in the next: a constant step followed
    each batch's noise and ended far worse than its start (held-out KL 0.46 -> 7.6 here); the
    shrinking step ends at the batch fit's quality."""
    shift = torch.randn(1000, generator=torch.Generator().manual_seed(5)) * 0.5
    held_out = PairedRows.concat([_peaked_rows(10_000 + i, shift) for i in range(8)])
    identity = LogitBias.identity(1000)
    stream = StreamingBias(identity, 1e-4)
    for request in range(150):
        stream.update(_peaked_rows(request, shift))
    batch = fit_bias_at_penalty(
        PairedRows.concat([_peaked_rows(r, shift) for r in range(150)]), 1e-4
    )
    start, online = _mean_kl(held_out, identity), _mean_kl(held_out, stream.correction)
    best = _mean_kl(held_out, batch.correction)
    assert best < start
    assert online - best < 0.1 * (start - best)


def test_past_its_memory_the_streaming_fit_follows_new_traffic() -> None:
    """Traffic changes after a long stream: with a short memory the fit learns the new shift;
    with an unbounded one, one batch in a thousand is worth a thousandth of a step."""
    old, new = _rows(0), PairedRows.from_logits(*_flipped_logits(1), 1)
    remembering = StreamingBias(LogitBias.identity(VOCAB), PENALTY, memory_rows=10**9)
    forgetting = StreamingBias(LogitBias.identity(VOCAB), PENALTY, memory_rows=24 * 4)
    for stream in (remembering, forgetting):
        for _ in range(40):
            stream.update(old)
        for _ in range(8):
            stream.update(new)
    assert _mean_kl(new, forgetting.correction) < 0.5 * _mean_kl(new, remembering.correction)


def _flipped_logits(request: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As `_logits`, with the shift reversed."""
    clean, served = _logits(request)
    return clean, 2 * clean - served


def test_streaming_in_the_heads_span_learns_a_drift_there_from_fewer_rows() -> None:
    """The drift is W g for an output head W [V, 8]: the span steps learn 8 numbers from every
    token's gradient, where the per-token steps learn each of V tokens from its own."""
    generator = torch.Generator().manual_seed(7)
    head = torch.randn(1000, 8, generator=generator)
    shift = head @ torch.randn(8, generator=generator) * 0.3
    held_out = PairedRows.concat([_peaked_rows(10_000 + i, shift) for i in range(8)])
    identity = LogitBias.identity(1000)
    per_token = StreamingBias(identity, 1e-3, prior_rows=64)
    in_span = StreamingBias(identity, 1e-3, basis=head, head_penalty=1e-3, prior_rows=64)
    for request in range(12):
        rows = _peaked_rows(request, shift)
        per_token.update(rows)
        in_span.update(rows)
    start = _mean_kl(held_out, identity)
    exact = _mean_kl(held_out, LogitBias(bias=-(shift - shift.mean()), temperature=1.0))
    assert in_span.steps_in_head_span
    assert not per_token.steps_in_head_span
    assert _mean_kl(held_out, in_span.correction) - exact < 0.1 * (start - exact)
    assert _mean_kl(held_out, per_token.correction) - exact > 0.3 * (start - exact)


def test_the_head_span_steps_use_the_hessian_of_the_rows_seen() -> None:
    """H = W^T (mean diag p - mean p p^T) W + head_penalty I over every row seen, against a
    dense float64 reference."""
    head = torch.randn(300, 6, generator=torch.Generator().manual_seed(3))
    stream = StreamingBias(LogitBias.identity(300), 1e-3, basis=head, head_penalty=0.5)
    batches = [_peaked_rows(request, torch.zeros(300)) for request in range(3)]
    for rows in batches:
        stream.update(rows)
    p = PairedRows.concat(batches).clean_prob.double()
    w = head.double()
    expected = w.T @ (torch.diag(p.mean(0)) - p.T @ p / len(p)) @ w + 0.5 * torch.eye(6)
    assert stream._head is not None
    torch.testing.assert_close(stream._head.hessian(0.5), expected, rtol=1e-5, atol=1e-7)


def test_the_anchor_to_the_start_weakens_as_the_rows_seen_outnumber_its_own() -> None:
    """A start fitted on 72 rows at a strong penalty under-corrects the shift. Its penalty
    weighs as its rows do among all the rows seen, as in a batch fit of every row, so after 20
    times its rows the streamed fit has gone more than half the way from the batch fit of all
    rows at the start's penalty to the one at the penalty so weakened (with the penalty held at
    full strength: 16 %, held-out KL 0.60 against the start's 0.68 and the weakened fit's 0.19).
    The 1/rows steps average targets of penalties weakening as they came, so it lags."""
    strong = 0.05
    prior = PairedRows.concat([_rows(request) for request in range(3)])
    start = fit_bias_at_penalty(prior, strong).correction
    stream = StreamingBias(start, strong, prior_rows=len(prior))
    for request in range(3, 63):
        stream.update(_rows(request))
    every = PairedRows.concat([_rows(request) for request in range(63)])
    held_out = PairedRows.concat([_rows(1000 + i) for i in range(4)])
    weakened = _mean_kl(held_out, fit_bias_at_penalty(every, strong / 21).correction)
    full_strength = _mean_kl(held_out, fit_bias_at_penalty(every, strong).correction)
    assert stream.anchor_share == pytest.approx(1 / 21)
    assert weakened < 0.5 * full_strength
    assert full_strength - _mean_kl(held_out, stream.correction) > 0.5 * (full_strength - weakened)


def test_the_anchor_never_weighs_more_than_the_start_s_own_penalty() -> None:
    """A start fitted on more rows than the memory holds: its rows fill the memory, a = 1,
    until traffic displaces them; without prior rows the penalty stays whole."""
    long_memory = StreamingBias(LogitBias.identity(VOCAB), PENALTY, prior_rows=96, memory_rows=48)
    long_memory.update(_rows(0))
    assert long_memory.anchor_share == 1.0
    no_prior = StreamingBias(LogitBias.identity(VOCAB), PENALTY)
    no_prior.update(_rows(0))
    assert no_prior.anchor_share == 1.0
    seen = StreamingBias(LogitBias.identity(VOCAB), PENALTY, prior_rows=24, memory_rows=60)
    seen.update(_rows(0))
    assert seen.anchor_share == pytest.approx(0.5)
    seen.update(_rows(1))
    assert seen.anchor_share == pytest.approx(24 / 60)


def test_the_streaming_temperature_stays_in_its_bounds() -> None:
    start = LogitBias(bias=torch.zeros(VOCAB), temperature=3.9)
    stream = StreamingBias(start, PENALTY)
    for request in range(5):
        clean, served = _logits(request)
        stream.update(PairedRows.from_logits(clean, served * 20, request))  # wants T >> 4
    assert stream.correction.temperature == pytest.approx(stream.bounds.t_max)


def test_a_streamed_band_tends_to_the_best_t_at_its_request_temperature() -> None:
    # as served: the bias and its band calibrated on earlier rows (the prior), then streamed
    prior = PairedRows.concat([_rows(500 + i) for i in range(20)])
    start = fit_bias_at_penalty(prior, PENALTY).correction
    band = best_temperature(at_request_temperature(prior, 0.5), start.bias / 0.5)
    stream = StreamingBias(start, PENALTY, band_temperatures={0.5: band}, prior_rows=len(prior))
    batches = [_rows(request) for request in range(120)]
    for rows in batches:
        stream.update(rows)
    banded = stream.banded
    assert list(banded.band_temperatures) == [0.5, 1.0]
    assert banded.band_temperatures[1.0] == banded.correction.temperature
    seen = at_request_temperature(PairedRows.concat([prior, *batches]), 0.5)
    best = best_temperature(seen, banded.correction.bias / 0.5)
    moved = abs(banded.band_temperatures[0.5] - best) / abs(band - best)
    assert moved < 0.5, moved


def test_the_change_is_measured_from_the_calibrated_bias_up_to_a_constant() -> None:
    """A calibrated start that already undoes `SHIFT` (stored with an offset softmax ignores)
    reports no change at first and little after traffic agrees with it; the identity start
    reports the shift it learns."""
    calibrated = LogitBias(bias=-SHIFT + 3.0, temperature=1.0)
    agreeing = OnlineBias(calibrated, PENALTY, holdout_every=2)
    learning = OnlineBias(LogitBias.identity(VOCAB), PENALTY, holdout_every=2)
    assert agreeing.status()["max_change_from_calibrated"] == 0.0
    for request in range(30):
        agreeing.add(_rows(request))
        learning.add(_rows(request))
    largest_shift = float((SHIFT - SHIFT.mean()).abs().max())
    assert agreeing.status()["max_change_from_calibrated"] < 0.2 * largest_shift
    assert learning.status()["max_change_from_calibrated"] > 0.5 * largest_shift


def test_a_candidate_needs_significance_on_held_out_requests() -> None:
    online = OnlineBias(LogitBias.identity(VOCAB), PENALTY, holdout_every=2, holdout_rows=240)
    for request in range(6):  # 3 held out: fewer than min_holdout_requests
        online.add(_rows(request))
    assert online.candidate() is None
    for request in range(6, 40):
        online.add(_rows(request))
    status = online.status()
    assert status["holdout_rows"] <= 240 + 24  # bounded: whole requests, the most recent
    assert status["holdout_requests"] == status["holdout_rows"] // 24
    assert status["rows_fitted"] == 20 * 24
    assert status["anchor_share"] == 1.0  # no prior rows: the penalty stays whole
    current = online.fit.correction.bias
    assert status["max_change_from_calibrated"] == pytest.approx(
        float((current - current.mean()).abs().max())  # the start is all zeros
    )
    largest_shift = float((SHIFT - SHIFT.mean()).abs().max())
    assert status["max_change_from_calibrated"] > 0.5 * largest_shift  # the shift is learned
    candidate = online.candidate()
    assert candidate is not None
    online.published = candidate
    assert online.candidate() is None  # no better than itself


def test_the_status_shows_the_anchor_weakening_as_rows_come() -> None:
    online = OnlineBias(LogitBias.identity(VOCAB), PENALTY, prior_rows=48, holdout_every=2)
    for request in range(1, 6, 2):  # odd ids: three fitted requests of 24 rows
        online.add(_rows(request))
    assert online.status()["anchor_share"] == pytest.approx(48 / (48 + 72))


def test_the_choices_of_a_request_are_held_out_together() -> None:
    """Three choices per request (one sequence id): whole requests are held out, those whose id
    is a multiple of `holdout_every`. (Every 3rd choice was held out: each request's third,
    whose twins the fit had trained on.)"""
    online = OnlineBias(LogitBias.identity(VOCAB), PENALTY, holdout_every=3, holdout_rows=10**4)
    for request in range(9):
        for choice in range(3):
            online.add(PairedRows.from_logits(*_logits(10 * request + choice), request))
    status = online.status()
    assert status["holdout_requests"] == 3  # requests 0, 3 and 6
    assert status["holdout_rows"] == 3 * 3 * 24
    assert status["rows_fitted"] == 6 * 3 * 24
    assert status["requests"] == 27


def test_no_candidate_when_there_is_nothing_to_learn() -> None:
    online = OnlineBias(LogitBias.identity(VOCAB), PENALTY, holdout_every=2)
    for request in range(40):
        clean, _ = _logits(request)
        online.add(PairedRows.from_logits(clean, clean, request))  # served == clean
    assert online.candidate() is None


def _biased_profile(folder: Path) -> tuple[Profile, str]:
    vector = torch.zeros(VOCAB)
    save_bias_file(folder, vector)
    profile = sample_profile(Rule.CALIBRATED)
    summary = sample_bias(profile, bias_sha256(vector), VOCAB, penalty=PENALTY)
    return profile.model_copy(update={"bias": summary}), summary.sha256


SETTINGS = CalibrationSettings(step_edges=(0, 20), entropy_buckets=1, min_cell_positions=40)


def _estimator(profile: Profile, folder: Path, **options: Any) -> OnlineEstimator:
    """The online estimator of `profile`, its bias file in `folder`, refitting every 20
    requests of `_feed`, publishing online biases to `folder / "online"`."""
    return OnlineEstimator(
        profile,
        settings=SETTINGS,
        min_positions=480,
        refit_every=480,
        bias_dirs=(folder,),
        online_bias_dir=folder / "online",
        **options,
    )


def _feed(estimator: OnlineEstimator, requests: range) -> None:
    for request in requests:
        clean, served = _logits(request)
        records = PositionRecords.from_logits(
            clean, served, step=torch.arange(len(clean)), sequence_id=request
        )
        estimator.add(records, PairedRows.from_logits(clean, served, request))


def test_the_estimator_publishes_a_better_bias_in_a_new_version(tmp_path: Path) -> None:
    profile, first_sha = _biased_profile(tmp_path)
    estimator = _estimator(profile, tmp_path)
    assert estimator.refines_bias
    assert not OnlineEstimator(profile, bias_dirs=(tmp_path,)).refines_bias  # nowhere to publish
    _feed(estimator, range(60))
    policy = estimator.current_policy()
    assert policy.version >= 1
    assert policy.rule is Rule.FIXED
    assert policy.bias not in (None, first_sha)
    assert policy.bias is not None
    served_bias = load_bias_file(tmp_path / "online", policy.bias)
    assert [p.name for p in tmp_path.glob("bias-*")] == [bias_file_name(first_sha)]
    held_out = PairedRows.concat([_rows(1000 + i) for i in range(4)])
    published = LogitBias(bias=served_bias, temperature=policy.fixed_temperature)
    assert _mean_kl(held_out, published) < 0.5 * _mean_kl(held_out, LogitBias.identity(VOCAB))
    assert estimator.status()["bias"]["requests"] == 60


def test_a_bias_served_in_bands_has_its_bands_refined_and_published_with_it(
    tmp_path: Path,
) -> None:
    profile, first_sha = _biased_profile(tmp_path)
    assert profile.settings.request_temperatures == (0.7, 1.0)
    assert profile.bias is not None
    profile = profile.model_copy(
        update={
            "bias": profile.bias.model_copy(
                update={"band_temperatures": (2.0, 1.0), "fitted_rows": 24}  # a weak prior
            )
        }
    )
    estimator = _estimator(profile, tmp_path)
    start = estimator.current_policy()
    assert (start.rule, start.bias) == (Rule.CALIBRATED, first_sha)
    _feed(estimator, range(60))
    policy = estimator.current_policy()
    assert policy.rule is Rule.CALIBRATED
    assert policy.bias not in (None, first_sha)
    assert policy.bias is not None
    assert policy.calibrated.request_temperature_edges == start.calibrated.request_temperature_edges
    ((t_07,),), ((t_1,),) = policy.calibrated.temperatures
    assert t_1 == policy.fixed_temperature  # the T fitted with the bias, under nts_rule=fixed too
    # the T_r = 0.7 band learnt on the rows taken to 0.7: near the best T there for the
    # published bias on unseen rows, far from its start
    bias = load_bias_file(tmp_path / "online", policy.bias)
    held_out = at_request_temperature(PairedRows.concat([_rows(1000 + i) for i in range(8)]), 0.7)
    best = best_temperature(held_out, bias / 0.7)
    assert abs(t_07 - best) < 0.2 * abs(2.0 - best)


def test_a_candidate_worse_at_another_request_temperature_is_not_published(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    online = OnlineBias(
        LogitBias.identity(VOCAB),
        PENALTY,
        band_temperatures={0.7: 1.0},
        holdout_every=2,
        holdout_rows=10**4,
    )
    for request in range(40):
        online.add(_rows(request))
    assert online.candidate() is not None
    far_off = property(lambda fit: BandedBias(fit.correction, {0.7: 40.0, 1.0: 1.0}))
    monkeypatch.setattr(StreamingBias, "banded", far_off)  # its T_r = 1 part is as good
    assert online.candidate() is None


def test_the_estimator_refines_in_the_span_of_a_clean_head_that_fits(tmp_path: Path) -> None:
    profile, _ = _biased_profile(tmp_path)
    profile = profile.model_copy(
        update={"bias": profile.bias.model_copy(update={"head_penalty": 1e-3})}
    )

    def head_span(head: torch.Tensor | None) -> int:
        estimator = OnlineEstimator(
            profile, bias_dirs=(tmp_path,), online_bias_dir=tmp_path, head_basis=head
        )
        return int(estimator.status()["bias"]["head_span"])

    assert head_span(torch.randn(VOCAB, 4)) == 1
    assert head_span(torch.randn(VOCAB + 1, 4)) == 0  # another vocabulary: per token only
    assert head_span(None) == 0


def test_rows_of_another_vocabulary_are_refused_before_any_step() -> None:
    online = OnlineBias(LogitBias.identity(VOCAB + 1), PENALTY)
    with pytest.raises(ValueError, match=rf"{VOCAB + 1} entries but the shadow-scored model"):
        online.add(_rows(0))
    assert online.requests == 0
    assert online.fit.rows_seen == 0


def test_refining_keeps_what_the_start_already_corrects() -> None:
    """The streaming penalty is on the change from the start: a start that already removes the
    systematic shift (as a head-span fit may, with a penalty of its own) is not shrunk back
    towards b = 0 by a strong per-token penalty."""
    start = LogitBias(bias=-(SHIFT - SHIFT.mean()), temperature=1.0)
    stream = StreamingBias(start, penalty=1.0)
    for request in range(30):
        stream.update(_rows(request))
    drift = (stream.correction.bias - start.bias).norm() / start.bias.norm()
    assert drift < 0.05


def test_a_bias_step_waits_for_a_refit_reading_the_fit_in_another_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`refit` called from another thread reads the streaming fit and the held-out reservoir
    (`OnlineBias.candidate`); the shadow thread's `add` must not change them meanwhile. (The
    step ran outside any lock.)"""
    profile, _ = _biased_profile(tmp_path)
    estimator = _estimator(profile, tmp_path)
    _feed(estimator, range(10))  # below the first refit
    reading, release = threading.Event(), threading.Event()
    overlapped: list[bool] = []

    def slow_candidate(self: OnlineBias) -> None:
        reading.set()
        release.wait(5.0)

    original_add = OnlineBias.add

    def recorded_add(self: OnlineBias, rows: PairedRows) -> None:
        overlapped.append(reading.is_set() and not release.is_set())
        original_add(self, rows)

    monkeypatch.setattr(OnlineBias, "candidate", slow_candidate)
    monkeypatch.setattr(OnlineBias, "add", recorded_add)
    refit = threading.Thread(target=estimator.refit)
    refit.start()
    assert reading.wait(5.0)
    adding = threading.Thread(target=_feed, args=(estimator, range(10, 11)))
    adding.start()
    adding.join(0.3)
    assert adding.is_alive()  # waits for the refit
    release.set()
    refit.join(5.0)
    adding.join(5.0)
    assert overlapped == [False]


def test_a_bias_that_cannot_be_written_still_publishes_the_version_and_shows_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only folder (EROFS, as a ConfigMap mount): the refit publishes its version
    without the new bias, the estimator says why and counts it; once a write succeeds it is
    healthy again. (The failed write escaped `add`, and no version was published.)"""
    profile, first_sha = _biased_profile(tmp_path)
    estimator = _estimator(profile, tmp_path)

    def read_only(folder: Path, bias: torch.Tensor) -> Path:
        raise OSError(errno.EROFS, "Read-only file system", str(folder))

    monkeypatch.setattr(online, "save_bias_file", read_only)
    _feed(estimator, range(60))
    policy, status = estimator.current_policy(), estimator.status()
    assert policy.version == 3  # one per 20 requests
    assert policy.bias == first_sha
    assert policy.fixed_temperature == profile.bias.temperature
    assert policy.alpha_by_step != profile.to_policy().alpha_by_step  # refitted
    assert not status["healthy"]
    assert "cannot write the online bias" in status["last_error"]
    assert "Read-only file system" in status["last_error"]
    assert status["bias"]["write_failures"] == 2  # the first refit had too few held-out rows
    monkeypatch.undo()
    _feed(estimator, range(60, 80))
    policy, status = estimator.current_policy(), estimator.status()
    assert policy.version == 4
    assert policy.bias not in (None, first_sha)
    assert (status["healthy"], status["last_error"]) == (True, None)
    assert status["bias"]["folder"] == str(tmp_path / "online")


def _published(vectors: list[torch.Tensor]) -> Iterator[BandedBias]:
    for vector in vectors:
        yield BandedBias(LogitBias(bias=vector, temperature=1.0), {1.0: 1.0})


def _publishing(
    profile: Profile,
    folder: Path,
    online_bias_dir: Path,
    *,
    vectors: list[torch.Tensor],
    kept_bias_seconds: float,
    now: list[float],
    monkeypatch: pytest.MonkeyPatch,
) -> OnlineEstimator:
    """An estimator of `profile` (its bias in `folder`) whose refits, only when called, each
    publish the next of `vectors` to `online_bias_dir`, keeping 2 files, at the time `now[0]`;
    fed 20 requests."""
    candidates = _published(vectors)
    monkeypatch.setattr(OnlineBias, "candidate", lambda self: next(candidates))
    estimator = OnlineEstimator(
        profile,
        settings=SETTINGS,
        min_positions=480,
        refit_every=10**6,
        bias_dirs=(folder,),
        online_bias_dir=online_bias_dir,
        kept_bias_files=2,
        kept_bias_seconds=kept_bias_seconds,
        clock=lambda: now[0],
    )
    _feed(estimator, range(20))
    return estimator


def test_only_the_last_published_bias_files_are_kept_never_the_profiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every refit publishes a new bias (the candidates are given), a minute apart: the folder
    keeps the files of the last two (their successors are older than `kept_bias_seconds`), and
    the profile's own file even when it is published again in between."""
    profile, first_sha = _biased_profile(tmp_path)
    vectors = [torch.full((VOCAB,), float(k)) for k in (1, 2)]
    vectors += [torch.zeros(VOCAB)]  # the profile's vector, published again
    vectors += [torch.full((VOCAB,), float(k)) for k in (3, 4, 5)]
    now = [0.0]
    # the profile's folder itself
    estimator = _publishing(
        profile,
        tmp_path,
        tmp_path,
        vectors=vectors,
        kept_bias_seconds=30.0,
        now=now,
        monkeypatch=monkeypatch,
    )
    published = []
    for _ in vectors:
        now[0] += 60.0
        assert estimator.refit()
        published.append(estimator.current_policy().bias)
        files = {p.name for p in tmp_path.glob("bias-*")}
        assert bias_file_name(first_sha) in files
        assert len(files - {bias_file_name(first_sha)}) <= 2
    assert published == [bias_sha256(vector) for vector in vectors]
    expected = {bias_file_name(sha) for sha in (first_sha, *published[-2:])}
    assert {p.name for p in tmp_path.iterdir()} == expected


def test_a_bias_file_stays_while_a_request_may_still_wait_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of versions published within `kept_bias_seconds` deletes none of their files (a
    request that pinned the first may still be waiting for the engine); once the next version
    is that old, the files beyond `kept_bias_files` go. (Files were deleted by count alone.)"""
    profile, _ = _biased_profile(tmp_path)
    vectors = [torch.full((VOCAB,), float(k)) for k in range(1, 8)]
    now = [0.0]
    online_dir = tmp_path / "online"
    estimator = _publishing(
        profile,
        tmp_path,
        online_dir,
        vectors=vectors,
        kept_bias_seconds=600.0,
        now=now,
        monkeypatch=monkeypatch,
    )
    for _ in range(6):
        now[0] += 10.0
        assert estimator.refit()
    online_files = {p.name for p in (tmp_path / "online").iterdir()}
    assert online_files == {bias_file_name(bias_sha256(v)) for v in vectors[:6]}
    now[0] += 600.0
    assert estimator.refit()
    online_files = {p.name for p in (tmp_path / "online").iterdir()}
    assert online_files == {bias_file_name(bias_sha256(v)) for v in vectors[5:]}


def test_a_bias_file_is_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails half way leaves no file (a reader would take a partial file for a
    corrupt bias); one that succeeds leaves only the bias file."""
    vector = torch.randn(VOCAB)

    def disk_full(descriptor: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_bias_file(tmp_path, vector)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    written = save_bias_file(tmp_path, vector)
    assert list(tmp_path.iterdir()) == [written]
    assert torch.equal(load_bias_file(tmp_path, bias_sha256(vector)), vector)


def test_a_bias_file_is_readable_as_any_file_the_process_creates(tmp_path: Path) -> None:
    """The umask's permissions (safetensors' `save_file` made it 0600: a calibrated bias in a
    folder mounted into the Docker image, whose user is not the file's owner, was unreadable)."""
    reference = tmp_path / "reference"
    reference.write_bytes(b"")
    written = save_bias_file(tmp_path, torch.randn(VOCAB))
    assert stat.S_IMODE(written.stat().st_mode) == stat.S_IMODE(reference.stat().st_mode)
    old_umask = os.umask(0o022)
    try:
        written = save_bias_file(tmp_path, torch.randn(VOCAB))
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(written.stat().st_mode) == 0o644


def test_a_bias_is_never_written_to_a_folder_that_is_gone(tmp_path: Path) -> None:
    """The server removes its runtime folder at shutdown while a late refit may still write: the
    write fails with an OSError (as the estimator expects of a failed write) and the folder
    stays gone. (It was created again, parents and all.)"""
    with pytest.raises(OSError, match="No such file or directory"):
        save_bias_file(tmp_path / "runtime" / "biases", torch.randn(VOCAB))
    assert list(tmp_path.iterdir()) == []


def test_a_refit_after_the_online_folder_was_removed_counts_a_failed_write(
    tmp_path: Path,
) -> None:
    """The estimator creates its folder once, at construction; a refit after the server's
    cleanup removed it fails to write (counted) and creates nothing."""
    profile, first_sha = _biased_profile(tmp_path)
    estimator = _estimator(profile, tmp_path)
    assert (tmp_path / "online").is_dir()
    shutil.rmtree(tmp_path / "online")
    _feed(estimator, range(60))
    assert not (tmp_path / "online").exists()
    assert estimator.status()["bias"]["write_failures"] >= 1
    assert estimator.current_policy().bias == first_sha


def test_a_bias_file_is_found_in_the_first_folder_of_a_search_path_that_has_it(
    tmp_path: Path,
) -> None:
    vector = torch.randn(VOCAB)
    (tmp_path / "second").mkdir()
    save_bias_file(tmp_path / "second", vector)
    folders = (tmp_path / "first", tmp_path / "second")
    assert torch.equal(find_bias_file(folders, bias_sha256(vector)), vector)
    with pytest.raises(ValueError, match=r"no bias file bias-.* in .*first, .*second"):
        find_bias_file(folders, "ab" * 32)
    with pytest.raises(ValueError, match="in no folder"):
        find_bias_file((), bias_sha256(vector))
