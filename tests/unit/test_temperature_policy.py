"""Tests for noisy_temp_server.temperature.policy: validation, JSON, overrides, evaluation."""

import dataclasses
import itertools
import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from noisy_temp_server.temperature.policy import (
    CalibratedTable,
    PolicyValidationError,
    TemperaturePolicy,
    step_bucket_labels,
)
from noisy_temp_server.temperature.policy_eval import (
    bucket_index,
    policy_temperature,
    step_temperatures,
)
from noisy_temp_server.temperature.rules import Rule, TemperatureBounds
from noisy_temp_server.temperature.stats import NonFiniteLogitsError, served_row_features

INF = float("inf")
LN3 = math.log(3.0)
EDGES = (0, 8, 32, 128, 512)


def full_policy(rule: Rule = Rule.LINEAR) -> TemperaturePolicy:
    return TemperaturePolicy(
        version=7,
        rule=rule,
        bounds=TemperatureBounds(0.5, 3.0),
        fixed_temperature=1.25,
        step_edges=EDGES,
        alpha_by_step=(0.0, 0.21, 0.44, 1.25, 8.0),
        sigma2_by_step=(0.1, 0.2, 0.3, 0.4, 0.5),
        fisher_var_floor=0.25,
        schedule_t_max=2.0,
        schedule_beta=0.5,
        calibrated=CalibratedTable(
            step_edges=(0, 16),
            entropy_edges=(0.0, 0.5),
            temperatures=(((0.8, 1.1), (0.9, 1.3)),),
        ),
    )


# ---------------------------------------------------------------- evaluation, by hand


def test_identity_policy_gives_one() -> None:
    policy = TemperaturePolicy.identity()
    assert (policy.version, policy.rule) == (0, Rule.OFF)
    assert policy_temperature(policy, torch.tensor([0, 5, 1000])).tolist() == [1.0, 1.0, 1.0]


def test_bucket_index_follows_the_edge_convention() -> None:
    steps = torch.tensor([[0, 7, 8], [31, 32, 10_000]])
    assert bucket_index(steps, torch.tensor([0, 8, 32])).tolist() == [[0, 0, 1], [1, 2, 2]]
    entropy = torch.tensor([-0.1, 0.0, 0.49, 0.5, 9.0])
    edges = torch.tensor([0.0, 0.5])
    assert bucket_index(entropy, edges).tolist() == [0, 0, 0, 1, 1]
    assert bucket_index(entropy, edges).dtype == torch.int64


def test_closed_form_rules_by_step_bucket() -> None:
    steps = torch.tensor([0, 7, 8, 31, 32, 200, 10_000])
    # buckets 0 0 1 1 2 3 4 -> alpha 0, 0, .21, .21, .44, 1.25, 8
    linear = policy_temperature(full_policy(Rule.LINEAR), steps)
    assert linear.tolist() == pytest.approx([1.0, 1.0, 1.21, 1.21, 1.44, 2.25, 3.0])  # 9 -> t_max
    sqrt = policy_temperature(full_policy(Rule.SQRT), steps)
    assert sqrt.tolist() == pytest.approx([1.0, 1.0, 1.1, 1.1, 1.2, 1.5, 3.0])
    # schedule: 2 / sqrt(1 + 0.5 step); step 6 -> 1; step 30 -> 0.5
    schedule = policy_temperature(full_policy(Rule.SCHEDULE), torch.tensor([0, 6, 30, 10_000]))
    assert schedule.tolist() == pytest.approx([2.0, 1.0, 0.5, 0.5])
    fixed = policy_temperature(full_policy(Rule.FIXED), steps[:2])
    assert fixed.tolist() == [1.25, 1.25]
    assert linear.dtype == torch.float32


def test_fisher_uses_the_served_row_variance_with_a_floor() -> None:
    # row 0: q = [1/4, 3/4] -> Var_q = 3/16 ln3^2 = 0.2263 (below the 0.25 floor)
    # row 1: q over [0, 2] -> Var_q = 0.7864 * 0.1192 * 4 = 0.4200
    served = torch.tensor([[0.0, LN3], [2.0, 0.0]])
    step = torch.tensor([0, 8])  # sigma2 0.1, 0.2
    t = policy_temperature(full_policy(Rule.FISHER), step, served)
    p = 1 / (1 + math.exp(-2))
    assert t.tolist() == pytest.approx([1 + 0.1 / 0.25, 1 + 0.2 / (4 * p * (1 - p))], rel=1e-5)


def test_calibrated_looks_up_step_and_served_entropy() -> None:
    # entropy of [0, 0] = ln2 = 0.69 (bucket 1); of [0, -inf] = 0 (bucket 0)
    served = torch.tensor([[0.0, 0.0], [0.0, -INF], [0.0, 0.0], [0.0, -INF]])
    step = torch.tensor([0, 3, 16, 400])
    t = policy_temperature(full_policy(Rule.CALIBRATED), served_logits=served, step=step)
    assert t.tolist() == pytest.approx([1.1, 0.8, 1.3, 0.9])


def test_calibrated_bands_are_picked_by_the_request_temperature() -> None:
    # bands [0, 0.6), [0.6, 0.85), [0.85, inf); step buckets [0, 4), [4, inf); no entropy split
    table = CalibratedTable(
        step_edges=(0, 4),
        temperatures=(((1.5,), (1.4,)), ((1.2,), (1.1,)), ((1.0,), (0.95,))),
        request_temperature_edges=(0.0, 0.6, 0.85),
    )
    policy = TemperaturePolicy(rule=Rule.CALIBRATED, calibrated=table)
    assert not policy.reads_served_row
    step = torch.tensor([0, 5, 0, 5, 0, 5, 2])
    request = torch.tensor([0.5, 0.5, 0.7, 0.7, 1.0, 1.2, 0.6])
    t = policy_temperature(policy, step, request_temperature=request)
    assert t.tolist() == pytest.approx([1.5, 1.4, 1.2, 1.1, 1.0, 0.95, 1.2])
    # without request temperatures every row is at T_request = 1
    assert policy_temperature(policy, step[:2]).tolist() == pytest.approx([1.0, 0.95])
    # other rules ignore it
    fixed = TemperaturePolicy(rule=Rule.FIXED, fixed_temperature=1.3)
    assert policy_temperature(fixed, step, request_temperature=request).tolist() == (
        pytest.approx([1.3] * 7)
    )
    with pytest.raises(ValueError, match=r"request_temperature must have shape \[7\]"):
        policy_temperature(policy, step, request_temperature=request[:3])


def test_a_table_by_request_temperature_serves_each_its_own_t() -> None:
    table = CalibratedTable.by_request_temperature((0.5, 1.0, 1.2), (1.6, 1.1, 1.0))
    assert table.request_temperature_edges == pytest.approx((0.0, 0.75, 1.1))
    policy = TemperaturePolicy(rule=Rule.CALIBRATED, calibrated=table)
    request = torch.tensor([0.5, 0.7, 1.0, 1.2, 2.0])
    t = policy_temperature(policy, torch.tensor([0, 9, 3, 70, 1]), request_temperature=request)
    assert t.tolist() == pytest.approx([1.6, 1.6, 1.1, 1.0, 1.0])
    with pytest.raises(PolicyValidationError, match="2 for 3 request temperatures"):
        CalibratedTable.by_request_temperature((0.5, 1.0, 1.2), (1.6, 1.1))


def test_per_row_overrides_replace_policy_values() -> None:
    policy = full_policy(Rule.FIXED)
    t = policy_temperature(
        policy,
        torch.tensor([0, 0, 0]),
        fixed=torch.tensor([0.1, 2.0, 10.0]),
        t_min=torch.tensor([0.2, 0.5, 0.5]),
        t_max=torch.tensor([1.0, 4.0, 8.0]),
    )
    assert t.tolist() == pytest.approx([0.2, 2.0, 8.0])


def test_rules_without_served_logits_ignore_them() -> None:
    step = torch.tensor([8])
    with_logits = policy_temperature(full_policy(), step, torch.full((1, 3), float("nan")))
    assert with_logits.item() == pytest.approx(1.21)


def test_served_logits_are_required_by_fisher_and_calibrated() -> None:
    for rule in (Rule.FISHER, Rule.CALIBRATED):
        with pytest.raises(ValueError, match="reads the served row; pass served_logits"):
            policy_temperature(full_policy(rule), torch.tensor([0]))


def test_precomputed_served_features_give_the_same_temperature() -> None:
    served = torch.randn(8, 30, generator=torch.Generator().manual_seed(1)) * 2
    step = torch.arange(0, 80, 10)
    features = served_row_features(served)
    for rule in (Rule.FISHER, Rule.CALIBRATED):
        from_logits = policy_temperature(full_policy(rule), step, served)
        from_features = policy_temperature(full_policy(rule), step, served_features=features)
        torch.testing.assert_close(from_features, from_logits)
    with pytest.raises(ValueError, match="not both"):
        policy_temperature(full_policy(), step, served, served_features=features)
    with pytest.raises(ValueError, match=r"served_features fields must have shape \[2\]"):
        policy_temperature(full_policy(Rule.FISHER), step[:2], served_features=features)


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match=r"step must have shape \[batch\]"):
        policy_temperature(full_policy(), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"served_logits must have shape \[2, vocab\]"):
        policy_temperature(full_policy(Rule.FISHER), torch.tensor([0, 1]), torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"t_max must have shape \[2\]"):
        policy_temperature(full_policy(), torch.tensor([0, 1]), t_max=torch.ones(3))


@pytest.mark.parametrize(
    ("rule", "good_row_t"),
    [(Rule.FISHER, 1.4), (Rule.CALIBRATED, 1.1)],  # [0, ln3]: Var_q below the floor; H = 0.56
)
def test_nan_served_logits_raise_or_fall_back_to_one(rule: Rule, good_row_t: float) -> None:
    nan = float("nan")
    served = torch.tensor([[0.0, nan], [0.0, LN3], [-INF, -INF], [nan, nan]])
    step = torch.zeros(4, dtype=torch.long)
    policy = full_policy(rule)
    with pytest.raises(NonFiniteLogitsError, match=r"rows \[0, 3\]"):
        policy_temperature(policy, step, served)
    t = policy_temperature(policy, step, served, validate=False)
    assert t.tolist() == pytest.approx([1.0, good_row_t, 1.0, 1.0])


def test_bf16_served_logits_give_the_float32_temperature() -> None:
    served = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)).bfloat16()
    step = torch.arange(6)
    for rule in (Rule.FISHER, Rule.CALIBRATED):
        policy = full_policy(rule)
        low = policy_temperature(policy, step, served)
        assert low.dtype == torch.float32
        torch.testing.assert_close(low, policy_temperature(policy, step, served.float()))


# ---------------------------------------------------------------- overrides


def test_with_overrides() -> None:
    policy = full_policy()
    changed = policy.with_overrides(rule="fixed", fixed_temperature=0.7, t_max=1.5)
    assert changed.rule is Rule.FIXED
    assert changed.fixed_temperature == 0.7
    assert changed.bounds == TemperatureBounds(0.5, 1.5)
    assert changed.version == policy.version
    assert policy.with_overrides() == policy
    with pytest.raises(PolicyValidationError, match="rule"):
        policy.with_overrides(rule="hotter")
    with pytest.raises(PolicyValidationError, match="t_min"):
        policy.with_overrides(t_min=2.0)
    with pytest.raises(PolicyValidationError, match="fixed_temperature"):
        policy.with_overrides(fixed_temperature=0.0)


# ---------------------------------------------------------------- JSON


def test_identity_json_is_tiny() -> None:
    assert TemperaturePolicy.identity().to_json() == '{"version":0,"rule":"off"}'
    assert TemperaturePolicy.from_json("{}") == TemperaturePolicy.identity()


def test_full_policy_round_trips_and_stays_small() -> None:
    policy = full_policy(Rule.CALIBRATED)
    text = policy.to_json()
    assert " " not in text
    assert len(text) < 400
    restored = TemperaturePolicy.from_json(text)
    assert restored == policy
    assert hash(restored) == hash(policy)
    assert restored.to_json() == text


def test_a_bias_travels_as_its_hash_only() -> None:
    sha = "0123456789abcdef" * 4
    policy = dataclasses.replace(full_policy(Rule.FIXED), bias=sha)
    assert TemperaturePolicy.from_json(policy.to_json()) == policy
    assert f'"bias":"{sha}"' in policy.to_json()
    assert policy.with_overrides(rule=Rule.SQRT).bias == sha
    assert '"bias"' not in full_policy(Rule.FIXED).to_json()
    for bad in ("ABCDEF" * 10 + "ABCD", "0" * 63, 12):
        with pytest.raises(PolicyValidationError, match="'bias'"):
            TemperaturePolicy(bias=bad)  # type: ignore[arg-type]


def test_a_policy_naming_a_head_map_is_refused_with_the_reason() -> None:
    """Head maps were removed: a policy written by an earlier version that names one is
    refused with one line that says so, not served without it."""
    bias, head_map = "0123456789abcdef" * 4, "fedcba9876543210" * 4
    with pytest.raises(PolicyValidationError, match=r"head map .* no longer serves; recalibrate"):
        TemperaturePolicy.from_json(f'{{"rule":"off","bias":"{bias}","head_map":"{head_map}"}}')


def test_sequences_and_integers_are_normalised() -> None:
    policy = TemperaturePolicy(
        rule="linear",  # type: ignore[arg-type]
        step_edges=[0, 4],  # type: ignore[arg-type]
        alpha_by_step=[0, 1],  # type: ignore[arg-type]
        sigma2_by_step=[0, 1],  # type: ignore[arg-type]
        fixed_temperature=2,
    )
    assert policy.rule is Rule.LINEAR
    assert policy.step_edges == (0, 4)
    assert policy.alpha_by_step == (0.0, 1.0)
    assert isinstance(policy.fixed_temperature, float)
    assert TemperaturePolicy.from_json(policy.to_json()) == policy


finite = st.floats(0.0, 50.0)
positive = st.floats(0.01, 50.0)


@st.composite
def policies(draw: st.DrawFn) -> TemperaturePolicy:
    gaps = draw(st.lists(st.integers(1, 300), min_size=0, max_size=5))
    edges = tuple(sum(gaps[:i]) for i in range(len(gaps) + 1))
    entropy_gaps = draw(st.lists(st.floats(0.01, 3.0), min_size=0, max_size=3))
    entropy_edges = tuple(float(sum(entropy_gaps[:i])) for i in range(len(entropy_gaps) + 1))
    cal_steps = draw(st.sampled_from([(0,), (0, 8), (0, 8, 64)]))
    band_edges = draw(st.sampled_from([(0.0,), (0.0, 0.85), (0.0, 0.6, 0.85, 1.1)]))
    table = draw(
        st.lists(
            st.lists(
                st.lists(positive, min_size=len(entropy_edges), max_size=len(entropy_edges)),
                min_size=len(cal_steps),
                max_size=len(cal_steps),
            ),
            min_size=len(band_edges),
            max_size=len(band_edges),
        )
    )
    return TemperaturePolicy(
        version=draw(st.integers(0, 10**9)),
        rule=draw(st.sampled_from(list(Rule))),
        bounds=TemperatureBounds(draw(st.floats(0.05, 1.0)), draw(st.floats(1.0, 20.0))),
        fixed_temperature=draw(positive),
        step_edges=edges,
        alpha_by_step=tuple(draw(finite) for _ in edges),
        sigma2_by_step=tuple(draw(finite) for _ in edges),
        fisher_var_floor=draw(positive),
        schedule_t_max=draw(positive),
        schedule_beta=draw(finite),
        calibrated=CalibratedTable(
            cal_steps, entropy_edges, tuple(tuple(map(tuple, band)) for band in table), band_edges
        ),
    )


@settings(max_examples=100, deadline=None)
@given(policy=policies())
def test_json_round_trip_is_exact(policy: TemperaturePolicy) -> None:
    assert TemperaturePolicy.from_json(policy.to_json()) == policy


@settings(max_examples=75, deadline=None)
@given(
    policy=policies(),
    seed=st.integers(0, 2**20),
    batch=st.integers(1, 6),
    vocab=st.integers(2, 16),
)
def test_temperature_is_finite_and_within_the_bounds(
    policy: TemperaturePolicy, seed: int, batch: int, vocab: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=generator) * 5
    step = torch.randint(0, 2000, (batch,), generator=generator)
    t = policy_temperature(policy, step, logits)
    assert t.shape == (batch,)
    assert torch.all(torch.isfinite(t))
    assert torch.all((t >= policy.bounds.t_min) & (t <= policy.bounds.t_max))


@pytest.mark.parametrize("rule", list(Rule))
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**20), scale=st.floats(0.01, 100.0))
def test_noise_free_parameters_give_exactly_one_under_every_rule(
    rule: Rule, seed: int, scale: float
) -> None:
    neutral = TemperaturePolicy(
        rule=rule,
        step_edges=EDGES,
        alpha_by_step=(0.0,) * len(EDGES),
        sigma2_by_step=(0.0,) * len(EDGES),
        fisher_var_floor=1e-6,
        fixed_temperature=1.0,
        schedule_t_max=1.0,
        schedule_beta=0.0,
        calibrated=CalibratedTable(
            step_edges=(0, 16), entropy_edges=(0.0, 0.5, 2.0), temperatures=(((1.0,) * 3,) * 2,)
        ),
    )
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, 33, generator=generator) * scale
    logits[0, 1:] = -INF  # one-hot: zero entropy and variance
    step = torch.randint(0, 5000, (8,), generator=generator)
    assert policy_temperature(neutral, step, logits).tolist() == [1.0] * 8


# ---------------------------------------------------------------- malformed policies


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        ("[1]", "must be an object"),
        ('{"rule":"hot"}', "'rule' must be one of: off fixed sqrt"),
        ('{"rule":3}', "'rule'"),
        ('{"version":-1}', "'version' must be an integer >= 0"),
        ('{"version":1.5}', "'version'"),
        ('{"version":true}', "'version'"),
        ('{"t_min":NaN}', "must not contain NaN"),
        ('{"fixed_temperature":Infinity}', "must not contain Infinity"),
        ('{"fixed_temperature":1e999}', "'fixed_temperature' must be a finite number > 0"),
        ('{"fixed_temperature":"2"}', "'fixed_temperature'"),
        ('{"t_min":1.5}', "t_min must satisfy 0 < t_min <= 1"),
        ('{"t_max":0.5}', "t_max must satisfy t_max >= 1"),
        ('{"colour":1}', r"unknown field\(s\) \['colour'\]"),
        ('{"alpha_by_step":[0.1,0.2]}', "'alpha_by_step' must be a list of 1 finite numbers"),
        ('{"alpha_by_step":[-0.1]}', "'alpha_by_step'"),
        ('{"sigma2_by_step":"0.1"}', "'sigma2_by_step'"),
        (
            '{"step_edges":[0,8,4],"alpha_by_step":[0,0,0],"sigma2_by_step":[0,0,0]}',
            "'step_edges' must be a non-empty list of at most 64 strictly ascending integers",
        ),
        ('{"step_edges":[1]}', "'step_edges'"),
        ('{"step_edges":[0.0]}', "'step_edges'"),
        ('{"step_edges":[]}', "'step_edges'"),
        ('{"fisher_var_floor":0}', "'fisher_var_floor'"),
        ('{"schedule_beta":-1}', "'schedule_beta' must be a finite number >= 0"),
        ('{"calibrated":[]}', "'calibrated' must be an object"),
        ('{"calibrated":{"t":1}}', r"'calibrated' has unknown field\(s\) \['t'\]"),
        (
            '{"calibrated":{"temperatures":[[[1,2]]]}}',
            "'calibrated.temperatures' must be a 1 x 1 x 1",
        ),
        ('{"calibrated":{"temperatures":[[1]]}}', "'calibrated.temperatures' must be a 1 x 1 x 1"),
        ('{"calibrated":{"temperatures":[[[0]]]}}', "'calibrated.temperatures'"),
        ('{"calibrated":{"entropy_edges":[0,0]}}', "'calibrated.entropy_edges'"),
        ('{"calibrated":{"step_edges":[0,4]}}', "'calibrated.temperatures' must be a 1 x 2 x 1"),
        (
            '{"calibrated":{"request_temperature_edges":[0,1]}}',
            "'calibrated.temperatures' must be a 2 x 1 x 1",
        ),
        (
            '{"calibrated":{"request_temperature_edges":[0.5]}}',
            "'calibrated.request_temperature_edges'",
        ),
    ],
)
def test_malformed_json_raises_naming_the_field(text: str, message: str) -> None:
    with pytest.raises(PolicyValidationError, match=message):
        TemperaturePolicy.from_json(text)


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(PolicyValidationError, match="'alpha_by_step'"):
        TemperaturePolicy(step_edges=(0, 8), alpha_by_step=(0.1,), sigma2_by_step=(0.1, 0.2))
    with pytest.raises(PolicyValidationError, match="'bounds'"):
        TemperaturePolicy(bounds=(0.5, 2.0))  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        TemperaturePolicy().version = 3  # type: ignore[misc]


def test_the_core_imports_no_serving_stack() -> None:
    code = (
        "import sys, noisy_temp_server.temperature; "
        "print([m for m in ('vllm', 'transformers', 'pydantic', 'prometheus_client') "
        "if m in sys.modules])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_only_fisher_and_entropy_dependent_tables_read_the_served_row() -> None:
    by_step_only = CalibratedTable(
        step_edges=(0, 4), entropy_edges=(0.0, 2.0), temperatures=(((0.9, 0.9), (1.1, 1.1)),)
    )
    by_entropy = CalibratedTable(
        step_edges=(0, 4), entropy_edges=(0.0, 2.0), temperatures=(((0.9, 0.9), (1.0, 1.2)),)
    )
    reads = {
        name: policy.reads_served_row
        for name, policy in {
            "fisher": TemperaturePolicy(rule="fisher"),
            "calibrated, not fitted": TemperaturePolicy(rule="calibrated"),
            "calibrated by step": TemperaturePolicy(rule="calibrated", calibrated=by_step_only),
            "calibrated by entropy": TemperaturePolicy(rule="calibrated", calibrated=by_entropy),
            "linear": TemperaturePolicy(rule="linear"),
        }.items()
    }
    assert reads == {
        "fisher": True,
        "calibrated, not fitted": False,
        "calibrated by step": False,
        "calibrated by entropy": True,
        "linear": False,
    }
    step = torch.tensor([0, 3, 4, 100])
    assert policy_temperature(
        TemperaturePolicy(rule="calibrated", calibrated=by_step_only), step
    ).tolist() == pytest.approx([0.9, 0.9, 1.1, 1.1])
    with pytest.raises(ValueError, match="reads the served row"):
        policy_temperature(TemperaturePolicy(rule="calibrated", calibrated=by_entropy), step)


@pytest.mark.parametrize(
    "rule", [Rule.OFF, Rule.FIXED, Rule.SQRT, Rule.LINEAR, Rule.SCHEDULE, Rule.CALIBRATED]
)
def test_admission_evaluation_gives_the_per_step_temperature(rule: Rule) -> None:
    policy = dataclasses.replace(
        full_policy(rule),
        calibrated=CalibratedTable(
            step_edges=(0, 4, 100),
            temperatures=(((0.75,), (1.5,), (2.5,)), ((0.9,), (1.2,), (1.1,))),
            request_temperature_edges=(0.0, 0.85),
        ),
    )
    steps = torch.arange(0, 700)
    for overrides, request_temperature in itertools.product(
        ({}, {"fixed": 2.5, "t_min": 0.8, "t_max": 2.2}), (0.7, 1.0)
    ):
        table = step_temperatures(policy, request_temperature, **overrides)
        assert table is not None
        assert set(policy.step_edges) <= set(table.step_edges)
        per_row = {name: torch.full((len(steps),), value) for name, value in overrides.items()}
        expected = policy_temperature(
            policy,
            steps,
            request_temperature=torch.full((len(steps),), request_temperature),
            **per_row,
        )
        bucket = bucket_index(steps, torch.tensor(table.step_edges))
        scale = torch.tensor(table.scale)[bucket]
        found = torch.clamp(scale * torch.rsqrt(steps * table.beta + 1.0), table.t_min, table.t_max)
        torch.testing.assert_close(found, expected)


def test_admission_evaluation_leaves_rules_that_read_the_served_row_to_each_step() -> None:
    assert step_temperatures(full_policy(Rule.FISHER), 1.0) is None
    assert step_temperatures(full_policy(Rule.CALIBRATED), 1.0) is None  # entropy buckets


@pytest.mark.parametrize(
    "edges",
    [(0, 2**31 - 1), (0, 2**40), tuple(range(65))],
    ids=["edge past 2**31 - 2", "edge past the key stride", "65 edges"],
)
def test_step_edges_are_bounded(edges: tuple[int, ...]) -> None:
    buckets = len(edges)
    with pytest.raises(PolicyValidationError, match=r"'step_edges'.*at most 64"):
        TemperaturePolicy(
            step_edges=edges, alpha_by_step=(0.1,) * buckets, sigma2_by_step=(0.0,) * buckets
        )
    with pytest.raises(PolicyValidationError, match=r"'calibrated\.step_edges'"):
        CalibratedTable(step_edges=edges, temperatures=(((1.0,),) * buckets,))
    widest = (*range(63), 2**31 - 2)
    assert (
        TemperaturePolicy(
            step_edges=widest, alpha_by_step=(0.1,) * 64, sigma2_by_step=(0.0,) * 64
        ).step_edges
        == widest
    )


def test_step_bucket_labels_name_each_bucket_by_its_steps() -> None:
    assert step_bucket_labels((0, 8, 32)) == ("0-7", "8-31", "32+")
    assert step_bucket_labels((0,)) == ("0+",)
