"""`BatchRows` against a dict reference model under random add/remove/move sequences.

The sequences follow vLLM's persistent batch (V1 InputBatch): finished requests leave holes,
new requests fill the lowest holes first, then the batch is condensed by one-way moves from the
tail into the remaining holes, and the scheduler may swap rows.
"""

from __future__ import annotations

import random

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from noisy_temp_server.vllm_plugin.batch_rows import BatchRows

CAPACITY = 16


class _Table:
    """A BatchRows with one array column (a value) and one object column (the request id)."""

    def __init__(self) -> None:
        self.rows = BatchRows(CAPACITY)
        _, self.value = self.rows.array(torch.float32)
        self.request_id = self.rows.objects()

    def admit(self, row: int, params: SamplingParams, output_ids: list[int]) -> bool:
        request_id, value = params.extra_args["id"], params.extra_args["value"]
        if value < 0:  # a request that needs no state
            return False
        self.value[row] = value
        self.request_id[row] = request_id
        return True

    def state(self) -> dict[int, tuple[int, float]]:
        return {
            row: (self.request_id[row], float(self.value[row]))
            for row in range(CAPACITY)
            if self.rows.active[row]
        }


def _random_step(
    rng: random.Random, batch: list[tuple[int, float] | None], next_id: int
) -> tuple[BatchUpdate, int]:
    """Mutate the reference ``batch`` (index -> (id, value) or None for a hole) like vLLM's
    InputBatch does in one step, and return the matching BatchUpdate."""
    occupied = [i for i, r in enumerate(batch) if r is not None]
    removed = rng.sample(occupied, k=rng.randint(0, len(occupied)))
    for i in removed:
        batch[i] = None
    added: list[tuple[int, SamplingParams, list[int] | None, list[int]]] = []
    for _ in range(rng.randint(0, 4)):
        holes = [i for i, r in enumerate(batch) if r is None]
        if holes:
            index = holes[0]
        elif len(batch) < CAPACITY:
            batch.append(None)
            index = len(batch) - 1
        else:
            break
        value = rng.choice([-1.0, float(rng.randint(1, 100))])
        params = SamplingParams(extra_args={"id": next_id, "value": value})
        batch[index] = (next_id, value)
        added.append((index, params, None, []))
        next_id += 1
    moved: list[tuple[int, int, MoveDirectionality]] = []
    # Condense: move the last occupied rows into the lowest holes.
    while True:
        holes = [i for i, r in enumerate(batch) if r is None]
        last = max((i for i, r in enumerate(batch) if r is not None), default=-1)
        if not holes or holes[0] > last:
            break
        batch[holes[0]], batch[last] = batch[last], None
        moved.append((last, holes[0], MoveDirectionality.UNIDIRECTIONAL))
    while batch and batch[-1] is None:
        batch.pop()
    for _ in range(rng.randint(0, 2)):
        if len(batch) >= 2:
            a, b = rng.sample(range(len(batch)), 2)
            batch[a], batch[b] = batch[b], batch[a]
            moved.append((a, b, MoveDirectionality.SWAP))
    return BatchUpdate(batch_size=len(batch), removed=removed, added=added, moved=moved), next_id


@pytest.mark.parametrize("seed", range(50))
def test_batch_rows_follow_the_reference_model(seed: int) -> None:
    rng = random.Random(seed)
    table = _Table()
    batch: list[tuple[int, float] | None] = []
    next_id = 0
    for _ in range(40):
        update, next_id = _random_step(rng, batch, next_id)
        before = table.state()
        changed = table.rows.update(update, table.admit)
        expected = {i: r for i, r in enumerate(batch) if r is not None and r[1] >= 0}
        assert table.state() == expected
        assert table.rows.n_active == len(expected)
        if not changed:
            assert table.state() == before


def test_none_update_changes_nothing() -> None:
    table = _Table()
    assert not table.rows.update(None, table.admit)
    assert table.rows.n_active == 0


def test_added_request_without_state_frees_a_replaced_row() -> None:
    table = _Table()
    first = SamplingParams(extra_args={"id": 1, "value": 5.0})
    table.rows.update(BatchUpdate(1, [], [(0, first, None, [])], []), table.admit)
    assert table.state() == {0: (1, 5.0)}
    untuned = SamplingParams(extra_args={"id": 2, "value": -1.0})
    assert table.rows.update(BatchUpdate(1, [], [(0, untuned, None, [])], []), table.admit)
    assert table.state() == {}
    assert table.request_id[0] is None


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        BatchRows(0)
