"""`RuntimeLogitNoiseProcessor` on hand-made batches (no engine)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState

from noisy_temp_server.engine_contract.keys import RUNTIME_NOISE_SEED_ENV, RUNTIME_NOISE_SIGMA_ENV
from noisy_temp_server.vllm_plugin.runtime_noise import RuntimeLogitNoiseProcessor, RuntimeNoiseV2


def _processor(
    monkeypatch: pytest.MonkeyPatch, sigma: str, **config: Any
) -> RuntimeLogitNoiseProcessor:
    monkeypatch.setenv(RUNTIME_NOISE_SIGMA_ENV, sigma)
    monkeypatch.setenv(RUNTIME_NOISE_SEED_ENV, "3")
    vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8), **config)
    return RuntimeLogitNoiseProcessor(vllm_config, torch.device("cpu"), False)  # type: ignore[arg-type]


def _add(
    processor: RuntimeLogitNoiseProcessor, batch: int, *rows: tuple[int, dict[str, Any] | None]
) -> None:
    added = [(row, SamplingParams(extra_args=keys), None, []) for row, keys in rows]
    processor.update_state(BatchUpdate(batch_size=batch, removed=[], added=added, moved=[]))


def test_noise_has_the_configured_scale_and_is_fresh_each_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    processor = _processor(monkeypatch, "0.5")
    assert not processor.is_argmax_invariant()
    _add(processor, 4, *[(row, None) for row in range(4)])
    logits = torch.zeros(4, 20_000)
    logits[:, 0] = -torch.inf
    first = processor.apply(logits.clone())
    second = processor.apply(logits.clone())
    assert torch.isneginf(first[:, 0]).all()
    assert first[:, 1:].std().item() == pytest.approx(0.5, rel=0.02)
    assert first[:, 1:].mean().item() == pytest.approx(0.0, abs=0.01)
    assert not torch.equal(first, second)


def test_same_seed_same_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.zeros(2, 50)
    a = _processor(monkeypatch, "1.0").apply(logits.clone())
    b = _processor(monkeypatch, "1.0").apply(logits.clone())
    assert torch.equal(a, b)


def test_request_override_of_sigma(monkeypatch: pytest.MonkeyPatch) -> None:
    processor = _processor(monkeypatch, "1.0")
    _add(
        processor,
        3,
        (0, {"nts_runtime_noise_sigma": 0}),
        (1, None),
        (2, {"nts_runtime_noise_sigma": 3.0}),
    )
    logits = torch.zeros(3, 20_000)
    out = processor.apply(logits)
    assert torch.equal(out[0], torch.zeros(20_000))
    assert out[1].std().item() == pytest.approx(1.0, rel=0.05)
    assert out[2].std().item() == pytest.approx(3.0, rel=0.05)


def test_sigma_zero_leaves_logits_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    processor = _processor(monkeypatch, "0")
    logits = torch.randn(2, 10)
    assert torch.equal(processor.apply(logits.clone()), logits)


@pytest.mark.parametrize("sigma", ["-1", "nan", "loud"])
def test_bad_environment_sigma_is_an_error(monkeypatch: pytest.MonkeyPatch, sigma: str) -> None:
    with pytest.raises(ValueError, match=RUNTIME_NOISE_SIGMA_ENV):
        _processor(monkeypatch, sigma)


def test_validate_params_rejects_negative_sigma() -> None:
    with pytest.raises(ValueError, match="nts_runtime_noise_sigma"):
        RuntimeLogitNoiseProcessor.validate_params(
            SamplingParams(extra_args={"nts_runtime_noise_sigma": -0.1})
        )


def test_model_runner_v2_noises_each_row_with_its_slot_sigma(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NTS_RUNTIME_NOISE_SIGMA", "0")
    state = LogitsProcRequestState(
        device=torch.device("cpu"),
        max_num_reqs=4,
        vocab_size=8,
        all_token_ids=None,  # type: ignore[arg-type]  (not read by this processor)
        prompt_len=None,  # type: ignore[arg-type]
        prefill_len=None,  # type: ignore[arg-type]
        total_len=None,  # type: ignore[arg-type]
    )
    processor = RuntimeLogitNoiseProcessor(SimpleNamespace(), state)
    assert isinstance(processor, RuntimeNoiseV2)
    assert processor.add_request(2, SamplingParams(extra_args={"nts_runtime_noise_sigma": 2.0}))
    assert not processor.add_request(0, SamplingParams())
    processor.apply_staged_writes()
    rows = 4000
    ctx = SimpleNamespace(expanded_idx_mapping=torch.tensor([0, 2] * (rows // 2)))
    logits = processor.apply(torch.zeros(rows, 8), ctx)  # type: ignore[arg-type]
    assert torch.equal(logits[0::2], torch.zeros(rows // 2, 8))
    assert logits[1::2].std().item() == pytest.approx(2.0, rel=0.05)
