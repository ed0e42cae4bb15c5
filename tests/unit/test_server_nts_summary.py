"""The response's `nts` object: a choice's summary and the request's over its choices (values
worked out by hand)."""

from __future__ import annotations

import pytest

from noisy_temp_server.engine_contract.request_args import LogitCorrection, RequestTuning
from noisy_temp_server.server.nts_summary import choice_summary, combine_summaries, mean_alpha
from noisy_temp_server.server.response_bodies import NtsSummary
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule

# alpha 0.2 for steps 0..3, 0.6 from step 4 on
TWO_BUCKETS = TemperaturePolicy(
    version=4,
    rule=Rule.SQRT,
    step_edges=(0, 4),
    alpha_by_step=(0.2, 0.6),
    sigma2_by_step=(0.1, 0.1),
)
TUNED = RequestTuning(policy=TWO_BUCKETS, fixed_t=1.0, t_min=0.5, t_max=2.0, trace_id="x")


@pytest.mark.parametrize(
    ("steps", "expected"),
    [(0, None), (2, 0.2), (4, 0.2), (6, (4 * 0.2 + 2 * 0.6) / 6), (10, (4 * 0.2 + 6 * 0.6) / 10)],
)
def test_mean_alpha_weights_each_bucket_by_its_steps(steps: int, expected: float | None) -> None:
    assert mean_alpha(TWO_BUCKETS, steps) == pytest.approx(expected)


def test_a_tuned_choice_reports_its_rule_alpha_and_t_statistics() -> None:
    summary = choice_summary(TWO_BUCKETS, TUNED, [1.0, 1.5, 2.0], steps=3, with_trace=True)
    assert summary.alpha == pytest.approx(0.2)
    assert summary == NtsSummary(
        rule="sqrt",
        policy_version=4,
        alpha=summary.alpha,
        t_mean=1.5,
        t_min=1.0,
        t_max=2.0,
        steps=3,
        trace=[1.0, 1.5, 2.0],
    )


def test_the_bias_a_request_was_served_with_is_reported() -> None:
    sha = "ab" * 32
    correction = LogitCorrection(sha)
    greedy = choice_summary(TWO_BUCKETS, None, [], steps=2, with_trace=False, correction=correction)
    assert (greedy.rule, greedy.bias) == ("off", sha)
    assert combine_summaries(TWO_BUCKETS, None, [greedy], correction).bias == sha
    plain = choice_summary(TWO_BUCKETS, TUNED, [1.0], steps=1, with_trace=False)
    assert plain.bias is None


def test_an_untuned_choice_reports_off_and_no_alpha() -> None:
    summary = choice_summary(TWO_BUCKETS, None, [1.0, 1.0], steps=2, with_trace=False)
    assert (summary.rule, summary.policy_version, summary.alpha) == ("off", 4, None)
    assert (summary.t_mean, summary.trace) == (1.0, None)


def test_an_incomplete_trace_gives_statistics_of_what_arrived_and_none_of_nothing() -> None:
    partial = choice_summary(TWO_BUCKETS, TUNED, [1.2], steps=5, with_trace=False)
    assert (partial.t_mean, partial.steps) == (1.2, 5)
    empty = choice_summary(TWO_BUCKETS, TUNED, [], steps=5, with_trace=True)
    assert (empty.t_mean, empty.t_min, empty.t_max, empty.trace) == (None, None, None, [])


def test_the_request_summary_weights_choices_by_their_steps() -> None:
    short = choice_summary(TWO_BUCKETS, TUNED, [1.0], steps=1, with_trace=True)
    long = choice_summary(TWO_BUCKETS, TUNED, [2.0] * 5 + [0.5], steps=6, with_trace=True)
    combined = combine_summaries(TWO_BUCKETS, TUNED, [short, long])
    assert combined.steps == 7
    assert combined.t_mean == pytest.approx((1.0 + 5 * 2.0 + 0.5) / 7)
    assert (combined.t_min, combined.t_max) == (0.5, 2.0)
    # alpha: 0.2 for short's step and long's first four, 0.6 for long's last two
    assert combined.alpha == pytest.approx((5 * 0.2 + 2 * 0.6) / 7)
    assert combined.trace is None  # each choice carries its own
    assert combine_summaries(TWO_BUCKETS, TUNED, [long]).trace == long.trace
