"""Per-slot tuning state on the device: the part of the T* processor both vLLM runners share.

A *slot* is a request's place in a fixed-size table of ``capacity + 1`` entries (Model Runner
V2: vLLM's persistent request slot; V1 runner: a slot the V1 adapter assigns at admission, so
batch moves never touch the device). The last entry is a sentinel that is never tuned (the V1
adapter maps untuned rows there). Per step, the runner adapter hands `SlotTuning.tune` the
logits rows, the slot of each row and the generation step of each row (all device tensors);
everything else happens on the device:

- T* per row: `policy_temperature` (the torch-only core) once per *live policy* (usually one or
  two) over the whole batch, selected per row by the slot's policy id. Untuned rows get T* = 1
  (``x / 1 == x`` bitwise), bad rows (NaN/+inf logits, all masked, non-finite T*) too;
- the per-slot summary (sum, min, max, count of T*, bad rows) and the ``nts_step_temperature``
  histogram counts accumulate in device tensors (no per-row host work, no device→host sync);
- the per-step trace of traced slots and a snapshot of the summaries travel to the host by
  asynchronous copies that `reports.Reporter` (a background thread) reads and sends.

Admission (`stage`) only writes host-side staging lists; `flush_staged` copies them to the
device in one go (V2: ``apply_staged_writes``; V1: the end of ``update_state``).

``fisher`` with a request temperature T_req ≠ 1 takes the variance under the distribution being
corrected, softmax(z̃ / T_req) (kl-optimal-temperature-derivation.md with z/T_req as the clean
logits and noise σ²/T_req²): T* = 1 + σ² / Var_{softmax(z̃/T_req)}(z̃). The calibrated table's
entropy is read from the served row z̃, as in calibration.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from prometheus_client import CollectorRegistry
from vllm import SamplingParams

from noisy_temp_server.temperature.policy import TemperaturePolicy, policy_temperature
from noisy_temp_server.temperature.rules import Rule
from noisy_temp_server.temperature.stats import ServedRowFeatures, served_row_features
from noisy_temp_server.vllm_plugin.metrics import (
    STEP_TEMPERATURE_BUCKETS,
    step_bucket_labels,
    step_temperature_metrics,
)
from noisy_temp_server.vllm_plugin.reports import MAX_LABELS, Reporter, StateLayout
from noisy_temp_server.vllm_plugin.request_args import (
    RequestTuning,
    default_policy_json,
    parse_request_args,
    resolve_request,
)
from noisy_temp_server.vllm_plugin.runners import reports_on_this_rank
from noisy_temp_server.vllm_plugin.trace_channel import TraceSender

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["SUMMARY_INIT", "SlotTuning", "build_slot_tuning", "request_tuning", "validate_request"]

_LOGGER = logging.getLogger(__name__)
_INSTANCES: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()

# Summary columns: sum and count of the counted T*, their min and max.
SUMMARY_INIT = (0.0, 0.0, float("inf"), float("-inf"))
_PARAM_INIT = (1.0, 1.0, 1.0, 1.0)  # request temperature, fixed T, t_min, t_max
_NO_POLICY = -1


@dataclass
class _LivePolicy:
    """A policy some slot uses, with its device tables for the histogram labels."""

    policy_id: int
    policy: TemperaturePolicy
    step_edges: torch.Tensor  # [K] int64, device
    labels: torch.Tensor  # [K] int64 histogram label id of each step bucket, device
    slots: int = 0


class SlotTuning:
    """The device-side tuning table of one processor (see the module docstring).

    ``logits_scaled``: whether ``tune`` sees logits already divided by the request temperature
    (V1 runner) or the unscaled served logits z̃ (V2). ``reporter``: None on ranks that do not
    report (tensor parallelism: only the first rank does), else where traces and summaries go.
    ``keep_last``: remember each slot's last uncounted row so `commit_last` can count it later
    (the V1 runner learns only a step late which row was a request's first token).
    """

    def __init__(
        self,
        capacity: int,
        device: torch.device,
        *,
        logits_scaled: bool,
        reporter: Reporter | None,
        pin_memory: bool = False,
        keep_last: bool = False,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"slot capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.sentinel = capacity
        self.device = torch.device(device)
        self.logits_scaled = logits_scaled
        self.reporter = reporter
        self._pin = pin_memory
        n = capacity + 1
        self.params = torch.tensor([_PARAM_INIT] * n, device=self.device)
        self.policy_id = torch.full((n,), _NO_POLICY, dtype=torch.int64, device=self.device)
        self.traced = torch.zeros(n, dtype=torch.bool, device=self.device)
        self.layout = StateLayout(slots=n)
        # Cumulative reported state, one flat float64 tensor (one host copy per step).
        self.state = torch.zeros(self.layout.size, dtype=torch.float64, device=self.device)
        self.summary, self.histogram_counts, self.histogram_sums, self.bad_rows = self.layout.split(
            self.state
        )
        self.summary.copy_(torch.tensor(SUMMARY_INIT))
        self.last = torch.zeros(n, 3, device=self.device) if keep_last else None
        self._t_bounds = torch.tensor(STEP_TEMPERATURE_BUCKETS, device=self.device)
        # Host mirrors, written at admission only.
        self.host_policy_id = np.full(n, _NO_POLICY, dtype=np.int64)
        self.occupants: list[tuple[str | None, int]] = [(None, 0)] * n
        self._serial = 0
        self.n_traced = 0
        self._host_traced = np.zeros(n, dtype=bool)
        self._policies: dict[int, _LivePolicy] = {}
        self._policy_ids: dict[TemperaturePolicy, int] = {}
        self._labels: dict[tuple[str, str], int] = {}
        self._staged: list[tuple[int, RequestTuning | None, float]] = []

    # -- admission -------------------------------------------------------------------------

    def stage(self, slot: int, resolved: RequestTuning | None, request_temperature: float) -> None:
        """Give ``slot`` to a new occupant (``resolved``; None: untuned) from the next
        `flush_staged` on; the previous occupant's state is dropped (its summary has been
        reported up to the last snapshot)."""
        self._release(slot)
        if resolved is not None:
            entry = self._live_policy(resolved.policy)
            entry.slots += 1
            self.host_policy_id[slot] = entry.policy_id
            self._serial += 1
            self.occupants[slot] = (resolved.trace_id, self._serial)
            traced = resolved.trace and resolved.trace_id is not None
            self._host_traced[slot] = traced
            self.n_traced += traced
        self._staged.append((slot, resolved, request_temperature))

    def _release(self, slot: int) -> None:
        policy_id = int(self.host_policy_id[slot])
        if policy_id != _NO_POLICY:
            entry = self._policies[policy_id]
            entry.slots -= 1
            if entry.slots == 0:
                del self._policies[policy_id]
                del self._policy_ids[entry.policy]
        self.host_policy_id[slot] = _NO_POLICY
        self.occupants[slot] = (None, 0)
        self.n_traced -= bool(self._host_traced[slot])
        self._host_traced[slot] = False

    def _live_policy(self, policy: TemperaturePolicy) -> _LivePolicy:
        policy_id = self._policy_ids.get(policy)
        if policy_id is not None:
            return self._policies[policy_id]
        policy_id = next(i for i in range(len(self._policies) + 1) if i not in self._policies)
        labels = [
            self._label(label, policy.rule) for label in step_bucket_labels(policy.step_edges)
        ]
        entry = _LivePolicy(
            policy_id=policy_id,
            policy=policy,
            step_edges=torch.tensor(policy.step_edges, dtype=torch.int64, device=self.device),
            labels=torch.tensor(labels, dtype=torch.int64, device=self.device),
        )
        self._policies[policy_id] = entry
        self._policy_ids[policy] = policy_id
        return entry

    def _label(self, step_label: str, rule: Rule) -> int:
        key = (step_label, rule.value)
        label = self._labels.get(key)
        if label is None:
            label = min(len(self._labels), MAX_LABELS - 1)  # the last id is shared overflow
            self._labels[key] = label
            if self.reporter is not None:
                self.reporter.name_label(label, key)
        return label

    def flush_staged(self) -> None:
        """Write the staged admissions to the device: one host→device copy per column."""
        if not self._staged:
            return
        latest = {slot: (resolved, temperature) for slot, resolved, temperature in self._staged}
        self._staged.clear()
        slots = list(latest)
        params, policy_ids, traced = [], [], []
        for slot in slots:
            resolved, temperature = latest[slot]
            if resolved is None:
                params.append(_PARAM_INIT)
                traced.append(False)
            else:
                params.append((temperature, resolved.fixed_t, resolved.t_min, resolved.t_max))
                traced.append(resolved.trace and resolved.trace_id is not None)
            policy_ids.append(int(self.host_policy_id[slot]))
        index = self._upload(torch.tensor(slots, dtype=torch.int64))
        self.params.index_copy_(0, index, self._upload(torch.tensor(params)))
        self.policy_id.index_copy_(0, index, self._upload(torch.tensor(policy_ids)))
        self.traced.index_copy_(0, index, self._upload(torch.tensor(traced)))
        fresh = torch.tensor([SUMMARY_INIT] * len(slots), dtype=torch.float64)
        self.summary.index_copy_(0, index, self._upload(fresh))
        if self.reporter is not None:
            self.reporter.set_occupants(tuple(self.occupants))

    def _upload(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._pin:
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    @property
    def any_tuned(self) -> bool:
        """Whether some slot holds a tuned request (host-side, no sync)."""
        return bool(self._policies)

    # -- per step --------------------------------------------------------------------------

    def tune(
        self, logits: torch.Tensor, slots: torch.Tensor, steps: torch.Tensor, counted: torch.Tensor
    ) -> torch.Tensor:
        """Divide each row of ``logits`` ([R, V] float32, in place) by its T* and account it.

        ``slots``/``steps``: [R] int64 slot and generation step of each row. ``counted``: [R]
        bool, rows whose sample the engine keeps (they enter the summaries and the histogram).
        Returns T* per row ([R], 1 for untuned and bad rows). No host sync.
        """
        params = self.params[slots]  # [R, 4]
        request_temperature, fixed, t_min, t_max = params.unbind(1)
        policy_of_row = self.policy_id[slots]
        temperature = torch.ones_like(request_temperature)
        labels = torch.zeros_like(policy_of_row)
        features: dict[Rule, ServedRowFeatures] = {}
        for entry in self._policies.values():
            served = self._features(entry.policy, logits, request_temperature, features)
            value = policy_temperature(
                entry.policy,
                steps,
                served_features=served,
                fixed=fixed,
                t_min=t_min,
                t_max=t_max,
                validate=False,
            )
            mine = policy_of_row == entry.policy_id
            temperature = torch.where(mine, value, temperature)
            if self.reporter is not None:
                bucket = (torch.bucketize(steps, entry.step_edges, right=True) - 1).clamp_(min=0)
                labels = torch.where(mine, entry.labels[bucket], labels)
        tuned = policy_of_row != _NO_POLICY
        ok = torch.isfinite(logits.amax(dim=1)) & torch.isfinite(temperature) & (temperature > 0)
        temperature = torch.where(ok, temperature, 1.0)
        logits.div_(temperature.unsqueeze(1))
        if self.reporter is not None:
            self._account(
                slots=slots,
                steps=steps,
                temperature=temperature,
                counted=tuned & counted,
                bad=tuned & ~ok,
                labels=labels,
            )
        return temperature

    def _features(
        self,
        policy: TemperaturePolicy,
        logits: torch.Tensor,
        request_temperature: torch.Tensor,
        cache: dict[Rule, ServedRowFeatures],
    ) -> ServedRowFeatures | None:
        """The served-row features ``policy`` reads (None for step-only policies), computed once
        per step and rule over the whole batch."""
        if not policy.reads_served_row:
            return None
        rule = policy.rule
        if rule not in cache:
            scale = request_temperature.unsqueeze(1)
            if rule is Rule.FISHER:
                # Var under softmax(z~ / T_req), in units of z~.
                corrected = logits if self.logits_scaled else logits / scale
                found = served_row_features(corrected, validate=False)
                cache[rule] = replace(found, var_q=found.var_q * request_temperature.square())
            else:
                served = logits * scale if self.logits_scaled else logits
                cache[rule] = served_row_features(served, validate=False, need_variance=False)
        return cache[rule]

    def _account(
        self,
        *,
        slots: torch.Tensor,
        steps: torch.Tensor,
        temperature: torch.Tensor,
        counted: torch.Tensor,
        bad: torch.Tensor,
        labels: torch.Tensor,
    ) -> None:
        """Summaries, histogram counts and (when some slot is traced) the step's trace."""
        assert self.reporter is not None
        self.bad_rows.add_(bad.sum())
        self.accumulate(slots, temperature, counted.to(torch.float64), labels)
        if self.last is not None:
            last = torch.stack((temperature, labels.to(temperature.dtype), counted.float()), dim=1)
            self.last.index_copy_(0, slots, last)
        if self.n_traced:
            dtype = temperature.dtype
            rows = (slots.to(dtype), steps.to(dtype), temperature, self.traced[slots].to(dtype))
            self.reporter.stage_trace(torch.stack(rows))
        self.reporter.stage_snapshot(self.state)

    def commit_last(self, slots: torch.Tensor) -> None:
        """Count the last row of each of ``slots`` if it was not counted (needs ``keep_last``).
        Call before the slots' next `tune`."""
        if self.last is None or self.reporter is None:
            return
        temperature, labels, counted = self.last[slots].unbind(1)
        weight = (1 - counted).to(torch.float64)
        self.accumulate(slots, temperature, weight, labels.long())
        self.reporter.stage_snapshot(self.state)

    def accumulate(
        self,
        slots: torch.Tensor,
        temperature: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
    ) -> None:
        """Add rows (float64 ``weight`` 1 = counted, 0 = not) to their slots' summaries and to
        the histogram counts of their labels. Device ops only."""
        value = temperature.to(torch.float64)
        self.summary[:, :2].index_add_(0, slots, torch.stack((value * weight, weight), dim=1))
        counted = weight > 0
        self.summary[:, 2].scatter_reduce_(0, slots, torch.where(counted, value, torch.inf), "amin")
        self.summary[:, 3].scatter_reduce_(
            0, slots, torch.where(counted, value, -torch.inf), "amax"
        )
        t_bucket = torch.bucketize(temperature, self._t_bounds)
        width = self.histogram_counts.shape[1]
        self.histogram_counts.view(-1).index_add_(0, labels * width + t_bucket, weight)
        self.histogram_sums.index_add_(0, labels, value * weight)


def request_tuning(params: SamplingParams) -> RequestTuning | None:
    """What the processor applies to a request (None: untouched). The one place the processors
    read the request keys."""
    return resolve_request(parse_request_args(params.extra_args), params.temperature)


def validate_request(params: SamplingParams) -> None:
    """Raise ValueError (HTTP 400 in vLLM's server) when the ``nts_*`` keys are invalid."""
    parse_request_args(params.extra_args)


def build_slot_tuning(
    owner: object,
    vllm_config: VllmConfig,
    capacity: int,
    device: torch.device,
    *,
    logits_scaled: bool,
    registry: CollectorRegistry | None,
    keep_last: bool = False,
) -> tuple[bool, SlotTuning]:
    """(duplicate, tuning) for a processor ``owner`` of ``vllm_config``: checks the default
    policy (ValueError at startup when ``NTS_POLICY_FILE`` is invalid), marks a second instance
    for the same config as a duplicate, and reports only on the first tensor-parallel rank."""
    default_policy_json()
    duplicate = _INSTANCES.setdefault(id(vllm_config), owner) is not owner
    if duplicate:
        _LOGGER.warning(
            "%s is loaded twice into one engine (it is an installed entry point; do not also "
            "pass it in logits_processors). The second instance does nothing.",
            type(owner).__name__,
        )
    device = torch.device(device)
    reporter = None
    if not duplicate and reports_on_this_rank(vllm_config):
        reporter = Reporter(
            TraceSender.from_env(),
            step_temperature_metrics(registry),
            layout=StateLayout(slots=capacity + 1),
        )
    tuning = SlotTuning(
        capacity,
        device,
        logits_scaled=logits_scaled,
        reporter=reporter,
        pin_memory=device.type == "cuda",
        keep_last=keep_last,
    )
    return duplicate, tuning
