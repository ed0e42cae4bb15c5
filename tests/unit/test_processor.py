"""`NoisyTemperatureLogitsProcessor` on hand-made batches (no engine)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from noisy_temp_server.engine_contract.keys import POLICY_FILE_ENV, TRACE_ENDPOINT_ENV
from noisy_temp_server.server.trace_collector import TraceCollector
from noisy_temp_server.temperature.policy import CalibratedTable, TemperaturePolicy
from noisy_temp_server.temperature.policy_eval import policy_temperature
from noisy_temp_server.temperature.rules import Rule
from noisy_temp_server.temperature.stats import served_row_features
from noisy_temp_server.vllm_plugin.processor import NoisyTemperatureLogitsProcessor

VOCAB = 11
LINEAR = TemperaturePolicy(
    rule=Rule.LINEAR, step_edges=(0, 4), alpha_by_step=(0.5, 0.25), sigma2_by_step=(0.0, 0.0)
)


def _config(max_num_seqs: int = 8, **extra: Any) -> Any:
    return SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs), **extra)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRACE_ENDPOINT_ENV, raising=False)
    monkeypatch.delenv(POLICY_FILE_ENV, raising=False)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def _processor(registry: CollectorRegistry, **config: Any) -> NoisyTemperatureLogitsProcessor:
    return NoisyTemperatureLogitsProcessor(
        _config(**config), torch.device("cpu"), False, registry=registry
    )


def _params(temperature: float = 1.0, **keys: Any) -> SamplingParams:
    return SamplingParams(temperature=temperature, extra_args=keys or None)


def _linear(**keys: Any) -> dict[str, Any]:
    return {"nts_policy": LINEAR.to_json(), **keys}


def _add(
    processor: NoisyTemperatureLogitsProcessor,
    batch_size: int,
    *requests: tuple[int, SamplingParams, list[int]],
) -> None:
    added = [(row, params, None, outputs) for row, params, outputs in requests]
    processor.update_state(BatchUpdate(batch_size=batch_size, removed=[], added=added, moved=[]))


def _reported(processor: Any) -> Any:
    """The processor after its reporter delivered everything staged so far."""
    processor.tuning.reporter.flush()
    return processor


def _fisher_t(policy: TemperaturePolicy, served: torch.Tensor, t_request: float) -> torch.Tensor:
    """Reference fisher T*: Var under softmax(z~ / T_req), in units of z~."""
    found = served_row_features(served / t_request)
    features = dataclasses.replace(found, var_q=found.var_q * t_request**2)
    steps = torch.zeros(served.shape[0], dtype=torch.int64)
    return policy_temperature(policy, steps, served_features=features)


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_divides_exactly_the_tuned_rows_by_the_policy_temperature(
    registry: CollectorRegistry,
) -> None:
    processor = _processor(registry)
    _add(
        processor,
        4,
        (0, _params(0.7, **_linear()), [1, 2]),  # step 2 -> bucket 0: T = 1.5
        (1, _params(0.0, **_linear()), []),  # greedy: never tuned
        (2, _params(1.0), []),  # identity policy: not tuned
        (3, _params(1.0, **_linear()), [0] * 5),  # step 5 -> bucket 1: T = 1.25
    )
    logits = _logits(4)
    before = logits.clone()
    out = processor.apply(logits)
    assert out is logits
    torch.testing.assert_close(out[0], before[0] / 1.5, rtol=0, atol=0)
    torch.testing.assert_close(out[3], before[3] / 1.25, rtol=0, atol=0)
    assert torch.equal(out[1], before[1])
    assert torch.equal(out[2], before[2])


def test_step_follows_the_live_output_list(registry: CollectorRegistry) -> None:
    processor = _processor(registry)
    outputs: list[int] = [0, 0, 0]
    _add(processor, 1, (0, _params(**_linear()), outputs))
    logits = _logits(1)
    torch.testing.assert_close(processor.apply(logits.clone()), logits / 1.5)
    outputs.append(7)  # step 4: second bucket
    processor.update_state(None)
    torch.testing.assert_close(processor.apply(logits.clone()), logits / 1.25)


def test_a_prefilling_request_is_counted_once_its_first_token_is_kept(
    registry: CollectorRegistry,
) -> None:
    """Beside a decoding request, a request whose prompt takes several chunked-prefill steps is
    sampled at its first step each time and counted once, when its first token shows; the batch
    then grows, and both steps advance."""
    processor = _processor(registry)
    decoding, prefilling = [0] * 3, []
    _add(processor, 1, (0, _params(**_linear()), decoding))
    _add(processor, 2, (1, _params(nts_rule="fixed", nts_t=2.0), prefilling))
    for decoding_t in (1.5, 1.25, 1.25):  # two prompt chunks, then the last one
        logits = _logits(2)
        out = processor.apply(logits.clone())
        torch.testing.assert_close(out, logits / torch.tensor([[decoding_t], [2.0]]))
        decoding.append(0)
        processor.update_state(None)
    prefilling.append(5)
    processor.update_state(None)
    _add(processor, 3, (2, _params(nts_rule="fixed", nts_t=4.0), [0]))
    for _ in range(2):
        processor.apply(_logits(3))
        for outputs in (decoding, prefilling):
            outputs.append(0)
        processor.update_state(None)
    summaries = processor.tuning.summaries()
    assert summaries[:3, 1].tolist() == [5, 3, 0]  # steps 3..7; steps 0..2; still waiting
    assert summaries[0, 0] == pytest.approx(1.5 * 1 + 1.25 * 4)
    assert summaries[1, 0] == pytest.approx(2.0 * 3)


def test_returns_early_when_no_row_is_tuned(registry: CollectorRegistry) -> None:
    processor = _processor(registry)
    _add(processor, 2, (0, _params(1.0), []), (1, _params(1.0, nts_tune=False, **_linear()), []))
    logits = _logits(2)
    before = logits.clone()
    assert processor.apply(logits) is logits
    assert torch.equal(logits, before)
    assert (
        registry.get_sample_value(
            "nts_step_temperature_count", {"step_bucket": "0-3", "rule": "linear"}
        )
        is None
    )


def test_request_overrides_rule_fixed_t_and_bounds(registry: CollectorRegistry) -> None:
    processor = _processor(registry)
    _add(
        processor,
        3,
        (0, _params(nts_rule="fixed", nts_t=2.0), []),
        (1, _params(nts_rule="fixed", nts_t=3.0, nts_t_max=2.5), []),
        (2, _params(**_linear(nts_t_max=1.1)), []),
    )
    logits = _logits(3)
    out = processor.apply(logits.clone())
    torch.testing.assert_close(out, logits / torch.tensor([[2.0], [2.5], [1.1]]))


def test_fisher_takes_the_variance_under_the_request_temperature(
    registry: CollectorRegistry,
) -> None:
    policy = TemperaturePolicy(rule=Rule.FISHER, sigma2_by_step=(0.5,), fisher_var_floor=1e-3)
    processor = _processor(registry)
    _add(
        processor,
        2,
        (0, _params(0.5, nts_policy=policy.to_json()), []),
        (1, _params(1.0, nts_policy=policy.to_json()), []),
    )
    served = _logits(2)
    scaled = served.clone()
    scaled[0] /= 0.5  # what vLLM hands over: z~ / T_request
    out = processor.apply(scaled.clone())
    torch.testing.assert_close(out[0], served[0] / 0.5 / _fisher_t(policy, served[:1], 0.5)[0])
    torch.testing.assert_close(out[1], served[1] / _fisher_t(policy, served[1:], 1.0)[0])


def test_scattered_tuned_rows_read_their_own_served_rows(registry: CollectorRegistry) -> None:
    policy = TemperaturePolicy(rule=Rule.FISHER, sigma2_by_step=(0.5,), fisher_var_floor=1e-3)
    processor = _processor(registry)
    _add(
        processor,
        4,
        (0, _params(1.0), []),  # untuned, with NaN logits: neither touched nor counted
        (1, _params(0.5, nts_policy=policy.to_json()), []),
        (2, _params(1.0), []),
        (3, _params(2.0, nts_policy=policy.to_json()), []),
    )
    served = _logits(4)
    served[0, 3] = math.nan
    handed = served / torch.tensor([[1.0], [0.5], [1.0], [2.0]])
    out = processor.apply(handed.clone())
    expected_t = torch.cat(
        [_fisher_t(policy, served[1:2], 0.5), _fisher_t(policy, served[3:4], 2.0)]
    )
    torch.testing.assert_close(out[[1, 3]], handed[[1, 3]] / expected_t.unsqueeze(1))
    assert torch.equal(out[2], handed[2])
    assert torch.equal(out[0].nan_to_num(), handed[0].nan_to_num())
    assert _reported(processor).bad_rows == 0


def test_rows_with_nan_logits_keep_their_logits_and_are_counted(
    registry: CollectorRegistry,
) -> None:
    policy = TemperaturePolicy(rule=Rule.FISHER, sigma2_by_step=(0.5,))
    processor = _processor(registry)
    _add(processor, 3, *[(row, _params(nts_policy=policy.to_json()), []) for row in range(3)])
    logits = _logits(3)
    logits[1, 4] = math.nan
    logits[2, 0] = math.inf
    before = logits.clone()
    out = processor.apply(logits)
    assert torch.equal(out[1].isnan(), before[1].isnan())
    assert torch.equal(out[1].nan_to_num(), before[1].nan_to_num())
    assert torch.equal(out[2], before[2])
    assert not torch.equal(out[0], before[0])
    assert _reported(processor).bad_rows == 2


def test_calibrated_rows_without_an_entropy_keep_their_logits_and_are_counted(
    registry: CollectorRegistry,
) -> None:
    table = CalibratedTable(entropy_edges=(0.0, 1.0), temperatures=(((2.0, 3.0),),))
    policy = TemperaturePolicy(rule=Rule.CALIBRATED, calibrated=table)
    processor = _processor(registry)
    outputs: list[list[int]] = [[], [], []]
    _add(
        processor,
        3,
        *[(row, _params(nts_policy=policy.to_json()), outputs[row]) for row in range(3)],
    )
    logits = _logits(3)
    logits[0] = math.nan  # NaN entropy: the calibrated table must not be read
    logits[1] = -math.inf  # every token masked: no entropy either
    before = logits.clone()
    out = processor.apply(logits)
    assert out[0].isnan().all()
    assert torch.equal(out[1], before[1])
    torch.testing.assert_close(out[2], before[2] / 3.0, rtol=0, atol=0)  # H(11 tokens) > 1
    for row_outputs in outputs:
        row_outputs.append(1)  # the first tokens were kept: their rows count
    processor.update_state(None)
    assert _reported(processor).bad_rows == 2
    assert registry.get_sample_value(
        "nts_step_temperature_sum", {"step_bucket": "0+", "rule": "calibrated"}
    ) == pytest.approx(1.0 + 1.0 + 3.0)


def test_moves_carry_the_row_state(registry: CollectorRegistry) -> None:
    processor = _processor(registry)
    _add(
        processor,
        3,
        (0, _params(nts_rule="fixed", nts_t=2.0), []),
        (2, _params(nts_rule="fixed", nts_t=4.0), []),
    )
    processor.update_state(
        BatchUpdate(
            batch_size=2, removed=[0], added=[], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)]
        )
    )
    logits = _logits(2)
    out = processor.apply(logits.clone())
    torch.testing.assert_close(out[0], logits[0] / 4.0)
    assert torch.equal(out[1], logits[1])
    processor.update_state(
        BatchUpdate(
            batch_size=2,
            removed=[],
            added=[(1, _params(nts_rule="fixed", nts_t=2.0), None, [])],
            moved=[(0, 1, MoveDirectionality.SWAP)],
        )
    )
    out = processor.apply(logits.clone())
    torch.testing.assert_close(out, logits / torch.tensor([[2.0], [4.0]]))


def test_observes_the_step_temperature_histogram(registry: CollectorRegistry) -> None:
    processor = _processor(registry)
    first, resumed = [], [0] * 9
    _add(processor, 2, (0, _params(**_linear()), first), (1, _params(**_linear()), resumed))
    processor.apply(_logits(2))
    first.append(1)
    resumed.append(1)
    processor.update_state(None)
    _reported(processor)
    sample = registry.get_sample_value
    assert sample("nts_step_temperature_count", {"step_bucket": "0-3", "rule": "linear"}) == 1
    assert sample("nts_step_temperature_sum", {"step_bucket": "4+", "rule": "linear"}) == 1.25


def test_sends_the_trace_of_rows_with_a_trace_id(
    registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/trace.sock"
    with TraceCollector(endpoint) as collector:
        monkeypatch.setenv(TRACE_ENDPOINT_ENV, endpoint)
        processor = _processor(registry)
        outputs: list[int] = []
        _add(
            processor,
            2,
            (0, _params(**_linear(nts_trace_id="req-1", nts_trace=True)), outputs),
            (1, _params(**_linear(nts_trace_id="req-2")), []),
        )
        for _ in range(5):
            processor.apply(_logits(2))
            outputs.append(1)
            processor.update_state(None)
        traced = asyncio.run(collector.wait_for("req-1", 5, timeout=5.0, want_trace=True))
        assert traced.trace == (1.5,) * 4 + (1.25,)
        assert (traced.steps, traced.t_min, traced.t_max) == (5, 1.25, 1.5)
        assert traced.t_mean == pytest.approx((4 * 1.5 + 1.25) / 5)
        untraced = asyncio.run(collector.wait_for("req-2", 1, timeout=0.5))
        assert untraced.trace == ()  # summary only: its first token was never kept
        reporter = processor.tuning.reporter
        reporter.close()
        assert reporter.sender is not None
        reporter.sender.close()


def test_default_policy_comes_from_the_policy_file(
    registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "policy.json"
    path.write_text(TemperaturePolicy(rule=Rule.FIXED, fixed_temperature=2.0).to_json())
    monkeypatch.setenv(POLICY_FILE_ENV, str(path))
    processor = _processor(registry)
    _add(processor, 1, (0, _params(), []))
    logits = _logits(1)
    torch.testing.assert_close(processor.apply(logits.clone()), logits / 2.0)


def test_bad_policy_file_fails_at_startup(
    registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "policy.json"
    path.write_text('{"rule": "lukewarm"}')
    monkeypatch.setenv(POLICY_FILE_ENV, str(path))
    with pytest.raises(ValueError, match="NTS_POLICY_FILE"):
        _processor(registry)


def test_second_instance_for_one_engine_is_inert(registry: CollectorRegistry) -> None:
    config = _config()
    first = NoisyTemperatureLogitsProcessor(config, torch.device("cpu"), False, registry=registry)
    second = NoisyTemperatureLogitsProcessor(config, torch.device("cpu"), False, registry=registry)
    assert (first.duplicate, second.duplicate) == (False, True)
    for processor in (first, second):
        _add(processor, 1, (0, _params(nts_rule="fixed", nts_t=2.0), []))
    logits = _logits(1)
    torch.testing.assert_close(second.apply(first.apply(logits.clone())), logits / 2.0)


def test_is_argmax_invariant(registry: CollectorRegistry) -> None:
    assert _processor(registry).is_argmax_invariant()


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"nts_rule": "hot"}, "not a rule"),
        ({"nts_t": 0}, "nts_t must be > 0"),
        ({"nts_t": "inf"}, "finite"),
        ({"nts_t_min": 0.9, "nts_t_max": 0.8}, "greater than"),
        ({"nts_policy": "{"}, "not a valid temperature policy"),
        ({"nts_tmin": 0.5}, "Unknown"),
        ({"nts_policy": '{"rule": "linear", "step_edges": [0, 1099511627776]}'}, "step_edges"),
    ],
)
def test_validate_params_rejects_bad_keys(keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NoisyTemperatureLogitsProcessor.validate_params(SamplingParams(extra_args=keys))


@pytest.mark.parametrize("by_entropy", [False, True], ids=["step table", "entropy table"])
def test_calibrated_bands_follow_each_request_temperature(
    registry: CollectorRegistry, by_entropy: bool
) -> None:
    # bands [0, 0.6) -> T* 2, [0.6, 0.85) -> 1.5, [0.85, inf) -> 1.25; with an entropy split
    # the served row is read per step (its entropy is above 1 nat: the second column)
    low_entropy = 0.5 if by_entropy else None
    table = CalibratedTable(
        entropy_edges=(0.0, 1.0),
        temperatures=tuple(((low_entropy or t, t),) for t in (2.0, 1.5, 1.25)),
        request_temperature_edges=(0.0, 0.6, 0.85),
    )
    policy = TemperaturePolicy(rule=Rule.CALIBRATED, calibrated=table)
    assert policy.reads_served_row is by_entropy
    processor = _processor(registry)
    request_temperatures = (0.5, 0.7, 1.2)
    _add(
        processor,
        3,
        *[
            (row, _params(t, nts_policy=policy.to_json()), [])
            for row, t in enumerate(request_temperatures)
        ],
    )
    logits = _logits(3)
    before = logits.clone()
    out = processor.apply(logits)
    for row, expected in enumerate((2.0, 1.5, 1.25)):
        torch.testing.assert_close(out[row], before[row] / expected, rtol=1e-6, atol=1e-6)


def test_entropy_tables_read_each_row_at_its_request_temperature(
    registry: CollectorRegistry,
) -> None:
    # The V1 processor sees z~ / T_req; the table's entropy is that of z~. The edge lies between
    # H(z~) and H(z~ / 0.5), so a row read at the wrong scale lands in the other bucket. Rows at
    # T_req = 1 need no rescaling; while a row at 0.5 holds a slot, the rows are rescaled.
    served = torch.linspace(0.0, 3.0, VOCAB)
    entropy = served_row_features(served.unsqueeze(0)).entropy.item()
    sharper = served_row_features((served / 0.5).unsqueeze(0)).entropy.item()
    table = CalibratedTable(
        entropy_edges=(0.0, (entropy + sharper) / 2), temperatures=(((2.0, 3.0),),)
    )
    policy = TemperaturePolicy(rule=Rule.CALIBRATED, calibrated=table).to_json()
    processor = _processor(registry)
    _add(processor, 1, (0, _params(1.0, nts_policy=policy), []))
    assert processor.tuning.n_rescaled == 0
    out = processor.apply(served.unsqueeze(0).clone())
    torch.testing.assert_close(out[0], served / 3.0)
    _add(processor, 2, (1, _params(0.5, nts_policy=policy), []))
    assert processor.tuning.n_rescaled == 1
    out = processor.apply(torch.stack((served, served / 0.5)))
    torch.testing.assert_close(out, torch.stack((served / 3.0, served / 0.5 / 3.0)))
    processor.update_state(BatchUpdate(batch_size=1, removed=[1], added=[], moved=[]))
    assert processor.tuning.n_rescaled == 0
    out = processor.apply(served.unsqueeze(0).clone())
    torch.testing.assert_close(out[0], served / 3.0)
