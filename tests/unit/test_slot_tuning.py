"""`SlotTuning`'s per-step bookkeeping against a plain-Python reference: T* per row, per-request
summaries (sum, count, min, max), the step histogram and the bad-row count, over random steps
with several rows per request (speculative decoding), uncounted rows, requests spanning several
step buckets and slots reused by new requests."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from vllm import SamplingParams

from noisy_temp_server.step.engine_metrics import step_temperature_metrics
from noisy_temp_server.step.reports import Reporter
from noisy_temp_server.step.slot_tuning import STEP_STRIDE, SlotTuning
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.policy_eval import policy_temperature
from noisy_temp_server.temperature.rules import Rule
from noisy_temp_server.vllm_plugin.processor_common import admitted_request

SLOTS = 5
VOCAB = 7
EDGES = (0, 3, 7, 12)
POLICIES = (
    TemperaturePolicy(
        rule=Rule.SCHEDULE,
        step_edges=EDGES,
        alpha_by_step=(0.0,) * 4,
        sigma2_by_step=(0.0,) * 4,
        schedule_t_max=2.0,
        schedule_beta=0.3,
    ),
    TemperaturePolicy(rule=Rule.SCHEDULE, schedule_t_max=1.7, schedule_beta=0.05),
    TemperaturePolicy(
        rule=Rule.SQRT,
        step_edges=EDGES,
        alpha_by_step=(0.6, 0.4, 0.2, 0.1),
        sigma2_by_step=(0.0,) * 4,
    ),
    TemperaturePolicy(rule=Rule.FIXED, fixed_temperature=1.3),
)


@dataclass
class _Occupancy:
    """The reference of one request in a slot: its policy, next step and counted T*."""

    policy: TemperaturePolicy
    step: int = 0
    counted: list[float] = field(default_factory=list)

    def summary(self) -> list[float]:
        if not self.counted:
            return [0.0, 0.0, np.inf, -np.inf]
        return [sum(self.counted), len(self.counted), min(self.counted), max(self.counted)]


def _reference_t(policy: TemperaturePolicy, steps: list[int]) -> torch.Tensor:
    return policy_temperature(policy, torch.tensor(steps))


def _admit(tuning: SlotTuning, slot: int, policy: TemperaturePolicy) -> _Occupancy:
    admitted = admitted_request(
        SamplingParams(temperature=1.0, extra_args={"nts_policy": policy.to_json()})
    )
    tuning.stage(slot, admitted.tuning, 1.0)
    return _Occupancy(policy)


def _histogram_totals(registry: CollectorRegistry) -> tuple[float, float]:
    count = total = 0.0
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == "nts_step_temperature_count":
                count += sample.value
            elif sample.name == "nts_step_temperature_sum":
                total += sample.value
    return count, total


@pytest.mark.parametrize("seed", range(4))
def test_bookkeeping_follows_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    registry = CollectorRegistry()
    reporter = Reporter(None, step_temperature_metrics(registry), slots=SLOTS + 1)
    tuning = SlotTuning(SLOTS, torch.device("cpu"), logits_scaled=False, reporter=reporter)
    occupancies = {slot: _admit(tuning, slot, rng.choice(POLICIES)) for slot in range(SLOTS)}
    tuning.flush_staged()
    every_counted: list[float] = []
    bad_rows = 0
    for _ in range(40):
        if rng.random() < 0.15:  # a request finishes; its slot goes to a new one
            slot = rng.randrange(SLOTS)
            np.testing.assert_allclose(tuning.summaries()[slot], occupancies[slot].summary())
            occupancies[slot] = _admit(tuning, slot, rng.choice(POLICIES))
            tuning.flush_staged()
        slots, steps, counted, expected = [], [], [], []
        for slot in rng.sample(range(SLOTS), rng.randint(1, SLOTS)):
            occupancy = occupancies[slot]
            drafts = rng.randint(1, 3)  # rows of consecutive steps, as speculative decoding
            row_steps = list(range(occupancy.step, occupancy.step + drafts))
            row_counted = [rng.random() < 0.85 for _ in row_steps]
            row_t = _reference_t(occupancy.policy, row_steps).tolist()
            occupancy.counted += [t for t, kept in zip(row_t, row_counted, strict=True) if kept]
            every_counted += [t for t, kept in zip(row_t, row_counted, strict=True) if kept]
            occupancy.step += rng.randint(1, drafts)  # the verifier accepts some of them
            slots += [slot] * drafts
            steps += row_steps
            counted += row_counted
            expected += row_t
        logits = torch.randn(len(slots), VOCAB)
        bad = [rng.random() < 0.1 for _ in slots]
        logits[torch.tensor(bad)] = float("nan")
        bad_rows += sum(bad)
        served = logits.clone()
        slot_tensor = torch.tensor(slots)
        tuning.tune(
            logits,
            slot_tensor,
            slot_tensor * STEP_STRIDE + torch.tensor(steps),
            torch.tensor(counted),
            all_rows_tuned=True,
        )
        torch.testing.assert_close(
            logits, served / torch.tensor(expected).unsqueeze(1), equal_nan=True
        )
    summaries = tuning.summaries()
    for slot, occupancy in occupancies.items():
        np.testing.assert_allclose(summaries[slot], occupancy.summary())
    reporter.flush()
    count, total = _histogram_totals(registry)
    assert count == len(every_counted)
    assert total == pytest.approx(sum(every_counted))
    assert reporter.bad_rows == bad_rows
    reporter.close()
