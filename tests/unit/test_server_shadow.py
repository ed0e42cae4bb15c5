"""The shadow scoring loop: sampling, bounded queue, drop counting, policy publication."""

from __future__ import annotations

import json
import math
import os
import random
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from server_fakes import (
    FakeEstimator,
    FakeScorer,
    FakeTraces,
)

from noisy_temp_server.correction.files import bias_sha256, save_bias_file
from noisy_temp_server.engine_contract.keys import BIAS_DIR_ENV
from noisy_temp_server.engine_contract.request_args import LogitCorrection
from noisy_temp_server.online.cpu_budget import CpuBudget
from noisy_temp_server.online.metrics import OnlineMetrics
from noisy_temp_server.online.shadow import ShadowScorer, request_sequence_id
from noisy_temp_server.scoring.scorer import LiveScores, ServedRows
from noisy_temp_server.scoring.sequence import ScoringSequence


class Setup:
    def __init__(
        self,
        scorer: FakeScorer,
        *,
        fraction: float = 1.0,
        queue_size: int = 8,
        every: int = 4,
        threads: int | None = None,
        nice: int = 0,
        bias_rows: int = 0,
        **budget: float,
    ) -> None:
        self.registry = CollectorRegistry()
        self.published: list[int] = []
        self.estimator = FakeEstimator(every)
        self.scorer = scorer
        self.shadow = ShadowScorer(
            scorer,
            self.estimator,
            OnlineMetrics(self.registry),
            fraction=fraction,
            queue_size=queue_size,
            rows=FakeTraces(1.0),
            positions=128,
            version_of=int,
            on_policy=self.published.append,
            rng=random.Random(0),
            threads=threads,
            nice=nice,
            bias_rows=bias_rows,
            **budget,  # type: ignore[arg-type]
        )

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


def _offer(
    shadow: ShadowScorer,
    prompt: list[int],
    completion: list[int],
    temperatures: list[float],
    *,
    request_temperature: float = 1.0,
    request_id: str = "request",
) -> bool:
    """Admit a choice and, when sampled, submit it finished: whether it was queued."""
    return shadow.admit("trace", len(completion)) and shadow.submit(
        prompt,
        completion,
        temperatures,
        "trace",
        request_id=request_id,
        request_temperature=request_temperature,
    )


def test_scored_requests_feed_the_estimator_and_publish_versions() -> None:
    setup = Setup(FakeScorer(), every=4)
    setup.shadow.start()
    try:
        for _ in range(3):
            assert _offer(setup.shadow, [1, 2, 3], [4, 5, 6], [1.5, 1.5, 1.5])
        assert setup.shadow.wait_idle(5)
    finally:
        setup.shadow.close()
    assert [s.prompt_length for s in setup.scorer.sequences] == [3, 3, 3]
    assert list(setup.scorer.sequences[0].token_ids) == [1, 2, 3, 4, 5, 6]
    assert setup.published == [1, 2]
    assert setup.value("nts_shadow_requests_scored_total") == 3
    assert setup.value("nts_shadow_tokens_scored_total") == 9
    assert setup.value("nts_shadow_score_seconds_count") == 3
    assert setup.value("nts_shadow_kl_nats_count", temperature="one") == 9
    assert setup.value("nts_shadow_kl_nats_count", temperature="served") == 9
    status = setup.shadow.status()
    assert status["scored"] == 3
    assert status["tokens"] == 9
    seconds = setup.value("nts_shadow_score_seconds_sum")
    assert status["score_seconds_total"] == pytest.approx(seconds)
    assert status["seconds_per_scored_token"] == pytest.approx(seconds / 9)
    assert status["capture_dropped_rows"] == {"rows_per_step": 0}  # the rows source's counts
    assert status["cpu_seconds_total"] > 0
    assert status["estimation_seconds_total"] > 0


def test_the_choices_of_one_request_are_scored_as_one_sequence() -> None:
    """The n choices of a request share its prompt (their first rows are identical): one
    cluster for the standard errors and one unit of the held-out split. (Each choice was a
    sequence of its own.)"""
    setup = Setup(FakeScorer(), every=100)
    setup.shadow.start()
    try:
        for request_id in ("a", "a", "b", "a"):
            assert _offer(setup.shadow, [1, 2], [3, 4], [1.0] * 2, request_id=request_id)
        assert setup.shadow.wait_idle(5)
    finally:
        setup.shadow.close()
    ids = [sequence.sequence_id for sequence in setup.scorer.sequences]
    assert ids[0] == ids[1] == ids[3] == request_sequence_id("a")
    assert ids[2] == request_sequence_id("b") != ids[0]
    assert ids[0] >= 0


@pytest.mark.parametrize("reads", [True, False])
def test_kl_curves_are_computed_only_when_the_estimator_reads_them(reads: bool) -> None:
    setup = Setup(FakeScorer())
    setup.estimator.reads_kl_curves = reads
    setup.shadow.start()
    try:
        assert _offer(setup.shadow, [1, 2], [3, 4, 5], [1.0] * 3)
        assert setup.shadow.wait_idle(30)
    finally:
        setup.shadow.close()
    assert setup.scorer.kl_curves == [reads]


@pytest.mark.parametrize("bias_rows", [0, 2])
def test_paired_rows_reach_the_estimator_only_for_the_online_bias(bias_rows: int) -> None:
    setup = Setup(FakeScorer(), bias_rows=bias_rows)
    setup.shadow.start()
    try:
        assert _offer(setup.shadow, [1, 2], [3, 4, 5], [1.0] * 3)
        assert setup.shadow.wait_idle(5)
    finally:
        setup.shadow.close()
    (rows,) = setup.estimator.rows
    assert (0 if rows is None else len(rows)) == bias_rows


def test_partial_trace_scores_kl_at_served_t_only_where_known() -> None:
    setup = Setup(FakeScorer())
    setup.shadow.start()
    try:
        _offer(setup.shadow, [1], [2, 3, 4, 5], [1.2])
        assert setup.shadow.wait_idle(5)
    finally:
        setup.shadow.close()
    assert setup.value("nts_shadow_kl_nats_count", temperature="one") == 4
    assert setup.value("nts_shadow_kl_nats_count", temperature="served") == 1


def test_fraction_zero_samples_nothing_and_fraction_samples_about_that_share() -> None:
    none = Setup(FakeScorer(), fraction=0.0)
    assert not any(_offer(none.shadow, [1], [2], [1.0]) for _ in range(50))
    some = Setup(FakeScorer(), fraction=0.3, queue_size=1000)
    sampled = sum(_offer(some.shadow, [1], [2], [1.0]) for _ in range(1000))
    assert 230 < sampled < 370
    assert some.shadow.status()["offered"] == 1000


def test_full_queue_drops_and_counts_without_blocking() -> None:
    gate = threading.Event()
    setup = Setup(FakeScorer(gate), queue_size=2)
    setup.shadow.start()
    try:
        results = [_offer(setup.shadow, [1], [2, 3], [1.0, 1.0]) for _ in range(6)]
        # one item may already be in the scorer's hands; the queue holds two more
        assert results.count(False) >= 3
        assert setup.value(
            "nts_shadow_requests_dropped_total", reason="queue_full"
        ) == results.count(False)
        gate.set()
        assert setup.shadow.wait_idle(5)
    finally:
        setup.shadow.close()
    assert setup.shadow.status()["dropped_queue_full"] == results.count(False)


def test_scoring_errors_are_counted_and_the_loop_survives() -> None:
    scorer = FakeScorer(fail=True)
    setup = Setup(scorer)
    setup.shadow.start()
    try:
        _offer(setup.shadow, [1], [2], [1.0])
        assert setup.shadow.wait_idle(5)
        scorer.fail = False
        _offer(setup.shadow, [1], [2], [1.0])
        assert setup.shadow.wait_idle(5)
    finally:
        setup.shadow.close()
    assert setup.value("nts_shadow_requests_dropped_total", reason="error") == 1
    assert setup.value("nts_shadow_requests_scored_total") == 1


def test_sampling_is_drawn_at_admission_and_empty_completions_are_not_queued() -> None:
    setup = Setup(FakeScorer())
    assert setup.shadow.admit("trace", 16)
    assert not setup.shadow.submit([1, 2], [], [], "trace", request_id="r", request_temperature=1.0)
    status = setup.shadow.status()
    assert (status["offered"], status["sampled"], status["queue_depth"]) == (1, 1, 0)


@pytest.mark.parametrize(("fraction", "size"), [(-0.1, 4), (1.1, 4), (0.5, 0)])
def test_bad_configuration_is_refused(fraction: float, size: int) -> None:
    with pytest.raises(ValueError, match="shadow"):
        Setup(FakeScorer(), fraction=fraction, queue_size=size)


def test_the_live_scoreboard_is_on_the_status_and_in_the_gauges() -> None:
    setup = Setup(FakeScorer())
    setup.shadow.start()
    try:
        for request in range(4):  # 4 x 40 positions, T* known for the first 30 of each
            _offer(setup.shadow, [1, 2], list(range(3, 43)), [1.3] * 30)
            if request == 1:
                assert setup.shadow.wait_idle(5)
                early = setup.shadow.status()["scoreboard"]
        assert setup.shadow.wait_idle(5)
    finally:
        setup.shadow.close()
    assert early["T*"] == {"positions": 60, "error": early["T*"]["error"]}
    assert setup.value("nts_scoreboard_positions", temperature="served") == 120
    board = setup.shadow.status()["scoreboard"]
    assert (board["T=1"]["positions"], board["T*"]["positions"]) == (160, 120)
    for label, temperature in (("T=1", "one"), ("T*", "served")):
        result = board[label]
        assert set(result["kld_percentiles"]) == {"99.9", "99", "90", "50", "10", "5", "1"}
        assert setup.value("nts_scoreboard_kld_mean", temperature=temperature) == pytest.approx(
            result["kld_mean"]
        )
        assert setup.value(
            "nts_scoreboard_kld_quantile", temperature=temperature, quantile="99"
        ) == pytest.approx(result["kld_percentiles"]["99"])
        assert setup.value("nts_scoreboard_ppl_ratio", temperature=temperature) == pytest.approx(
            result["ppl_ratio"]
        )
    assert board["T=1"]["kld_mean"] != pytest.approx(board["T*"]["kld_mean"])


class BudgetProbe(FakeScorer):
    """Records the torch threads and the nice value the scoring thread runs with."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int]] = []

    def score_live(
        self,
        sequence: ScoringSequence,
        served_temperatures: Sequence[float],
        served: ServedRows,
        max_rows: int = 0,
        *,
        request_temperature: float,
        kl_curve: bool = True,
        bias: torch.Tensor | None = None,
    ) -> LiveScores:
        thread = threading.get_native_id()
        self.seen.append((torch.get_num_threads(), os.getpriority(os.PRIO_PROCESS, thread)))
        return super().score_live(
            sequence, served_temperatures, served, request_temperature=request_temperature
        )


def test_the_scoring_thread_runs_with_its_own_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # An in-process vLLM CPU engine of an earlier test replaces torch.set_num_threads for the
    # whole process with a no-op (vllm/v1/worker/cpu_worker.py); `serve` runs its engine in
    # another process, so the API process keeps torch's own.
    monkeypatch.setattr(torch, "set_num_threads", torch._C.set_num_threads)
    threads_before = torch.get_num_threads()
    process_nice = os.getpriority(os.PRIO_PROCESS, 0)
    probe = BudgetProbe()
    setup = Setup(probe, threads=1, nice=5, every=4)
    setup.shadow.start()
    try:
        for _ in range(3):  # the estimator publishes after the second
            _offer(setup.shadow, [1], [2, 3], [1.0])
            assert setup.shadow.wait_idle(5)
    finally:
        setup.shadow.close()
        torch.set_num_threads(threads_before)
    lowered = min(19, process_nice + 5)  # once the first policy is out, not in the warm-up
    assert probe.seen == [(1, process_nice), (1, process_nice), (1, lowered)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == process_nice


def test_the_status_stays_json_while_the_window_holds_a_single_request() -> None:
    setup = Setup(FakeScorer())
    setup.shadow.start()
    try:
        _offer(setup.shadow, [1], list(range(2, 152)), [1.1] * 150)  # one request, 150 positions
        assert setup.shadow.wait_idle(60)  # ~1.5 s alone, many times that on busy shared cores
    finally:
        setup.shadow.close()
    board = setup.shadow.status()["scoreboard"]
    assert board["T=1"]["positions"] == 150
    assert board["T=1"]["kld_stderr"] is None  # one cluster: no standard error
    assert board["T=1"]["kld_mean"] > 0
    json.dumps(setup.shadow.status(), allow_nan=False)
    assert setup.value("nts_scoreboard_kld_stderr", temperature="one") == math.inf


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_cpu_budget_is_a_bucket_whose_debt_time_repays() -> None:
    clock = Clock()
    budget = CpuBudget(0.25, 2, horizon_s=2.0, clock=clock)  # 0.5 CPU-s per s, holds 1.0
    assert budget.credit == 1.0
    assert budget.take(3.0)  # any credit left: taken, into debt
    assert not budget.take(0.1)
    clock.now = 4.0  # +2.0: the debt is repaid, no credit yet
    assert not budget.take(0.1)
    clock.now = 100.0
    assert budget.take(0.1)
    assert budget.credit == pytest.approx(0.9)  # it held no more than the horizon's worth
    budget.give(5.0)
    assert budget.credit == 1.0
    unlimited = CpuBudget(1.0, 2, clock=clock)
    assert all(unlimited.take(10.0) for _ in range(5))


def test_sampling_keeps_to_the_cpu_budget_and_settles_what_scoring_cost() -> None:
    clock = Clock()
    setup = Setup(
        FakeScorer(),
        every=1000,
        cpu_share=0.5,
        warmup_cpu_share=0.005,  # 10 s worth (the warm-up's horizon): 0.05
        cores=1,
        cost_per_position_s=0.01,
        clock=clock,
    )
    shadow = setup.shadow
    assert shadow.admit("a", 10)  # 0.05 of credit: 0.1 reserved, into debt
    assert not shadow.admit("b", 10)
    clock.now = 10.0  # + 0.05: the debt is repaid, no credit yet
    assert not shadow.admit("c", 10)
    shadow.cancel("a")  # its reservation comes back
    assert shadow.admit("d", 500)  # reserves 128 positions (the capture bound): 1.28
    status = shadow.status()
    assert (status["sampled"], status["skipped_budget"]) == (2, 2)
    assert status["budget"]["credit_s"] == pytest.approx(0.05 - 1.28)
    assert status["budget"] == {**status["budget"], "cpu_share": 0.005, "warm_up": True}
    shadow.start()
    try:
        assert shadow.submit(
            [1], list(range(2, 12)), [1.0] * 10, "d", request_id="r", request_temperature=1.0
        )
        assert shadow.wait_idle(5)
    finally:
        shadow.close()
    budget = shadow.status()["budget"]
    spent = shadow.status()["cpu_seconds_total"]
    assert budget["credit_s"] == pytest.approx(0.05 - spent)  # 1.28 reserved, `spent` spent
    assert budget["cost_per_position_s"] == pytest.approx(0.01 + 0.25 * (spent / 10 - 0.01))


def test_the_warm_up_budget_ends_with_the_first_policy() -> None:
    setup = Setup(FakeScorer(), every=4, cpu_share=0.02, warmup_cpu_share=0.5, cores=2)
    setup.shadow.start()
    try:
        assert _offer(setup.shadow, [1], [2, 3, 4], [1.0] * 3)
        assert setup.shadow.wait_idle(5)
        warm_up = setup.shadow.status()["budget"]
        assert _offer(setup.shadow, [1], [2, 3, 4], [1.0] * 3)  # version 1 after it
        assert setup.shadow.wait_idle(5)
    finally:
        setup.shadow.close()
    assert (warm_up["cpu_share"], warm_up["horizon_s"], warm_up["warm_up"]) == (0.5, 10.0, True)
    steady = setup.shadow.status()["budget"]
    assert (steady["cpu_share"], steady["horizon_s"], steady["warm_up"]) == (0.02, 1.0, False)
    assert setup.published == [1]


def _submit_one(
    setup: Setup, correction: LogitCorrection | None, *, request_temperature: float = 1.0
) -> None:
    """Admit and submit one choice served with `correction` (trace "trace")."""
    assert setup.shadow.admit("trace", 3)
    assert setup.shadow.submit(
        [1, 2],
        [3, 4, 5],
        [1.0] * 3,
        "trace",
        request_id="r",
        request_temperature=request_temperature,
        correction=correction,
    )


def test_a_request_served_with_a_bias_is_scored_with_its_vector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BIAS_DIR_ENV, str(tmp_path))
    vector = torch.randn(16)
    save_bias_file(tmp_path, vector)
    setup = Setup(FakeScorer(), every=100)
    setup.shadow.start()
    try:
        _submit_one(setup, LogitCorrection(bias_sha256(vector)), request_temperature=0.7)
        assert _offer(setup.shadow, [1, 2], [3, 4, 5], [1.0] * 3)
        assert setup.shadow.wait_idle(5)
    finally:
        setup.shadow.close()
    with_bias, without = setup.scorer.biases
    assert with_bias is not None
    assert torch.equal(with_bias, vector)
    assert without is None
    assert setup.scorer.request_temperatures == [0.7, 1.0]  # each choice's own T_r


def test_a_request_whose_bias_is_gone_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine refuses such a request at admission; should its file go after, scoring it
    fails and drops it (counted)."""
    monkeypatch.setenv(BIAS_DIR_ENV, str(tmp_path))
    setup = Setup(FakeScorer(), every=100)
    setup.shadow.start()
    try:
        _submit_one(setup, LogitCorrection("cd" * 32))
        assert setup.shadow.wait_idle(5)
    finally:
        setup.shadow.close()
    assert setup.scorer.sequences == []
    assert setup.shadow.status()["dropped_error"] == 1
