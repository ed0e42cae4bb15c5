"""The per-token logit bias in the processor, under both runners' real interface objects."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from test_processor_v2 import _Batch, _ctx
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate

from noisy_temp_server.correction.files import bias_sha256, save_bias_file
from noisy_temp_server.engine_contract.bias_files import bias_directories, load_bias
from noisy_temp_server.engine_contract.keys import BIAS_DIR_ENV, POLICY_FILE_ENV, TRACE_ENDPOINT_ENV
from noisy_temp_server.temperature.policy import CalibratedTable, TemperaturePolicy
from noisy_temp_server.temperature.policy_eval import policy_temperature
from noisy_temp_server.temperature.rules import Rule
from noisy_temp_server.vllm_plugin.processor import NoisyTemperatureLogitsProcessor
from noisy_temp_server.vllm_plugin.processor_v1 import NoisyTemperatureV1
from noisy_temp_server.vllm_plugin.processor_v2 import NoisyTemperatureV2

VOCAB = 13
SLOTS = 6
LINEAR = TemperaturePolicy(
    rule=Rule.LINEAR, step_edges=(0, 3), alpha_by_step=(0.5, 0.25), sigma2_by_step=(0.0, 0.0)
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRACE_ENDPOINT_ENV, raising=False)
    monkeypatch.delenv(POLICY_FILE_ENV, raising=False)
    monkeypatch.delenv(BIAS_DIR_ENV, raising=False)
    if not torch.cuda.is_available():
        monkeypatch.setattr("vllm.v1.worker.gpu.buffer_utils.is_uva_available", lambda: False)


def _vector(seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def bias_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(BIAS_DIR_ENV, str(tmp_path))
    return tmp_path


def _bias(folder: Path, seed: int = 0) -> tuple[torch.Tensor, str]:
    vector = _vector(seed)
    save_bias_file(folder, vector)
    return vector, bias_sha256(vector)


def _policy(sha: str) -> str:
    return dataclasses.replace(LINEAR, bias=sha).to_json()


def _params(temperature: float = 1.0, **keys: Any) -> SamplingParams:
    return SamplingParams(temperature=temperature, extra_args=keys or None)


def _v1(vocab: int = VOCAB) -> NoisyTemperatureV1:
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=SLOTS),
        model_config=SimpleNamespace(get_vocab_size=lambda: vocab),
    )
    processor = NoisyTemperatureLogitsProcessor(
        config, torch.device("cpu"), False, registry=CollectorRegistry()
    )
    assert isinstance(processor, NoisyTemperatureV1)
    return processor


def _v2(batch: _Batch) -> NoisyTemperatureV2:
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=SLOTS))
    processor = NoisyTemperatureLogitsProcessor(config, batch.state, registry=CollectorRegistry())
    assert isinstance(processor, NoisyTemperatureV2)
    return processor


def _add_v1(processor: NoisyTemperatureV1, *rows: tuple[int, SamplingParams]) -> None:
    added = [(row, params, None, []) for row, params in rows]
    processor.update_state(BatchUpdate(batch_size=SLOTS, removed=[], added=added, moved=[]))


def _logits(rows: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_v1_is_argmax_invariant_only_without_a_bias_directory(bias_dir: Path) -> None:
    assert not _v1().is_argmax_invariant()
    assert bias_directories() == (bias_dir,)


def test_the_bias_directory_is_a_search_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The profile's folder, then the online biases' one: a vector is found in either."""
    profiles, online = tmp_path / "profiles", tmp_path / "online"
    monkeypatch.setenv(BIAS_DIR_ENV, f"{profiles}{os.pathsep}{online}{os.pathsep}")
    assert bias_directories() == (profiles, online)
    profiles.mkdir()
    online.mkdir()
    first, sha_first = _bias(profiles, seed=1)
    second, sha_second = _bias(online, seed=2)
    assert torch.equal(load_bias(sha_first), first)
    assert torch.equal(load_bias(sha_second), second)
    with pytest.raises(ValueError, match="not available to this engine: no bias file"):
        load_bias("ab" * 32)


def test_policy_file_folder_is_the_bias_directory_only_when_it_names_a_bias(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy_file = tmp_path / "policy.json"
    policy_file.write_text(LINEAR.to_json())
    monkeypatch.setenv(POLICY_FILE_ENV, str(policy_file))
    assert bias_directories() == ()
    assert _v1().is_argmax_invariant()


def test_v1_and_v2_serve_the_same_biased_distribution(bias_dir: Path) -> None:
    """softmax((z~ + b) / (T_req * T*)) under both runners: both see z~ (V1 because it is
    not argmax-invariant), add b, divide by T*; vLLM divides by T_req afterwards."""
    vector, sha = _bias(bias_dir)
    params = _params(temperature=0.7, nts_policy=_policy(sha))
    v1, v2 = _v1(), _v2(_Batch([1] * SLOTS))
    _add_v1(v1, (0, params))
    v2.add_request(0, params)
    v2.apply_staged_writes()
    served = _logits(1)
    out_v1 = v1.apply(served.clone()) / 0.7
    out_v2 = v2.apply(served.clone(), _ctx([(0, 0)])) / 0.7
    t_star = policy_temperature(LINEAR, torch.tensor([0]))
    expected = (served + vector) / (0.7 * t_star)
    torch.testing.assert_close(out_v1.log_softmax(-1), expected.log_softmax(-1))
    torch.testing.assert_close(out_v2.log_softmax(-1), expected.log_softmax(-1))


def test_both_runners_serve_the_bias_with_the_band_of_each_request_temperature(
    bias_dir: Path,
) -> None:
    """How a profile serves its bias: rule `calibrated`, one band per request temperature."""
    vector, sha = _bias(bias_dir)
    table = CalibratedTable.by_request_temperature((0.5, 1.0), (1.6, 1.1))
    policy = TemperaturePolicy(rule=Rule.CALIBRATED, calibrated=table, bias=sha).to_json()
    rows = [(0, _params(0.5, nts_policy=policy)), (1, _params(1.0, nts_policy=policy))]
    v1, v2 = _v1(), _v2(_Batch([1] * SLOTS))
    _add_v1(v1, *rows)
    for slot, params in rows:
        assert v2.add_request(slot, params)
    v2.apply_staged_writes()
    served = _logits(2)
    expected = (served + vector) / torch.tensor([[1.6], [1.1]])  # vLLM then divides by T_r
    torch.testing.assert_close(v1.apply(served.clone()), expected)
    torch.testing.assert_close(v2.apply(served.clone(), _ctx([(0, 0), (1, 0)])), expected)


def test_greedy_rows_get_the_bias_and_no_temperature(bias_dir: Path) -> None:
    vector, sha = _bias(bias_dir)
    greedy = _params(temperature=0.0, nts_policy=_policy(sha))
    v1, v2 = _v1(), _v2(_Batch([1] * SLOTS))
    _add_v1(v1, (0, greedy))
    assert v2.add_request(0, greedy)
    v2.apply_staged_writes()
    served = _logits(1)
    assert torch.equal(v1.apply(served.clone()), served + vector)
    assert torch.equal(v2.apply(served.clone(), _ctx([(0, 0)])), served + vector)
    assert v1.tuning.summaries()[:, 1].sum() == 0  # no T* counted for a greedy request


def test_nts_bias_false_and_nts_tune_false_get_no_bias(bias_dir: Path) -> None:
    _, sha = _bias(bias_dir)
    policy = _policy(sha)
    v2 = _v2(_Batch([1] * SLOTS))
    assert v2.add_request(0, _params(nts_policy=policy, nts_bias=False))  # T* only
    assert not v2.add_request(1, _params(temperature=0.0, nts_policy=policy, nts_bias="false"))
    assert not v2.add_request(2, _params(nts_policy=policy, nts_tune=False))
    v2.apply_staged_writes()
    served = _logits(3)
    out = v2.apply(served.clone(), _ctx([(0, 0), (1, 0), (2, 0)]))
    t_star = policy_temperature(LINEAR, torch.tensor([0]))
    torch.testing.assert_close(out[0], served[0] / t_star)
    assert torch.equal(out[1:], served[1:])


def test_rows_without_a_bias_are_bitwise_unchanged(bias_dir: Path) -> None:
    _, sha = _bias(bias_dir)
    v1 = _v1()
    _add_v1(v1, (0, _params(temperature=0.0, nts_policy=_policy(sha))), (1, _params(0.0)))
    served = _logits(2)
    served[1, :3] = torch.tensor([float("-inf"), float("inf"), float("nan")])
    out = v1.apply(served.clone())
    assert out[1].numpy().tobytes() == served[1].numpy().tobytes()
    assert not torch.equal(out[0], served[0])
    served[1, 3] = -0.0  # may come out as +0.0: the same value
    assert torch.equal(v1.apply(served.clone())[1, 3:], served[1, 3:])


def test_a_recycled_slot_drops_the_old_bias(bias_dir: Path) -> None:
    vector, sha = _bias(bias_dir)
    batch = _Batch([1] * SLOTS)
    v2 = _v2(batch)
    v2.add_request(3, _params(temperature=0.0, nts_policy=_policy(sha)))
    v2.apply_staged_writes()
    served = _logits(1)
    assert torch.equal(v2.apply(served.clone(), _ctx([(3, 0)])), served + vector)
    v2.add_request(3, _params(nts_rule="fixed", nts_t=2.0))
    v2.apply_staged_writes()
    assert torch.equal(v2.apply(served.clone(), _ctx([(3, 0)])), served / 2.0)
    assert v2.tuning.bias.biased_slots == 0

    v1 = _v1()
    _add_v1(v1, (2, _params(temperature=0.0, nts_policy=_policy(sha))))
    v1.update_state(
        BatchUpdate(batch_size=SLOTS, removed=[2], added=[(2, _params(0.0), None, [])], moved=[])
    )
    served = _logits(3)
    assert torch.equal(v1.apply(served.clone()), served)


def test_each_bias_version_is_one_table_row_reused_once_free(bias_dir: Path) -> None:
    first, sha_first = _bias(bias_dir, seed=1)
    _, sha_second = _bias(bias_dir, seed=2)
    third, sha_third = _bias(bias_dir, seed=3)
    v2 = _v2(_Batch([1] * SLOTS))
    for slot in (0, 1):
        v2.add_request(slot, _params(0.0, nts_policy=_policy(sha_first)))
    v2.add_request(2, _params(0.0, nts_policy=_policy(sha_second)))
    assert v2.tuning.bias.table.shape == (3, VOCAB)  # row 0 and one row per version
    v2.add_request(2, _params(0.0, nts_policy=_policy(sha_third)))  # second's row is free
    v2.apply_staged_writes()
    assert v2.tuning.bias.table.shape == (3, VOCAB)
    served = _logits(2)
    out = v2.apply(served.clone(), _ctx([(1, 0), (2, 0)]))
    assert torch.equal(out, served + torch.stack((first, third)))


@pytest.mark.parametrize(
    ("make_dir", "message"),
    [(False, "no bias directory"), (True, "not available")],
)
def test_validate_params_refuses_a_bias_the_engine_does_not_have(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_dir: bool, message: str
) -> None:
    if make_dir:
        monkeypatch.setenv(BIAS_DIR_ENV, str(tmp_path))
    unknown = _params(nts_policy=_policy("ab" * 32))
    with pytest.raises(ValueError, match=message):
        NoisyTemperatureLogitsProcessor.validate_params(unknown)
    NoisyTemperatureLogitsProcessor.validate_params(
        _params(nts_policy=_policy("ab" * 32), nts_bias=False)
    )


def test_validate_params_accepts_a_bias_in_the_directory(bias_dir: Path) -> None:
    _, sha = _bias(bias_dir)
    NoisyTemperatureLogitsProcessor.validate_params(_params(0.0, nts_policy=_policy(sha)))
    with pytest.raises(ValueError, match="nts_bias must be a boolean"):
        NoisyTemperatureLogitsProcessor.validate_params(_params(nts_bias="maybe"))


def test_a_bias_of_another_vocabulary_is_refused_at_admission(
    bias_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, sha = _bias(bias_dir)
    v1 = _v1(vocab=VOCAB + 1)
    with caplog.at_level(logging.ERROR):
        _add_v1(v1, (0, _params(0.0, nts_policy=_policy(sha))))
    assert "13 entries but the engine has a vocabulary of 14 tokens" in caplog.text
    assert v1.tuning.bias.biased_slots == 0
    served = torch.randn(1, VOCAB + 1)
    assert torch.equal(v1.apply(served.clone()), served)


def _count_bias_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts ``addcmul_`` calls (one per bias version added to the logits) from now on."""
    calls = [0]
    addcmul = torch.Tensor.addcmul_

    def counting(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return addcmul(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "addcmul_", counting)
    return calls


def test_v2_adds_only_the_versions_its_batch_slots_hold(
    bias_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Model Runner V2 never says a request finished: four slots whose requests finished under
    four bias versions still hold them, but a step whose rows hold none adds none, and a step
    adds each version of its own rows once."""
    vectors, shas = zip(*(_bias(bias_dir, seed=seed) for seed in range(1, 5)), strict=True)
    v2 = _v2(_Batch([1] * SLOTS))
    for slot, sha in enumerate(shas):
        v2.add_request(slot, _params(1.0, nts_policy=_policy(sha)))
    v2.add_request(5, _params(1.0, nts_rule="fixed", nts_t=2.0))
    v2.apply_staged_writes()
    passes = _count_bias_passes(monkeypatch)
    served = _logits(3)
    out = v2.apply(served[:1].clone(), _ctx([(5, 0)]))
    assert passes[0] == 0
    assert torch.equal(out, served[:1] / 2.0)
    out = v2.apply(served.clone(), _ctx([(2, 0), (5, 0), (2, 1)]))
    assert passes[0] == 1
    t_star = policy_temperature(LINEAR, torch.tensor([0, 1])).unsqueeze(1)
    torch.testing.assert_close(out[[0, 2]], (served[[0, 2]] + vectors[2]) / t_star)
    torch.testing.assert_close(out[1], served[1] / 2.0)


def test_a_version_no_slot_holds_leaves_the_table(
    bias_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reusing the slots of finished requests releases their versions: the next admission wave
    drops the versions no slot holds from the device table, and keeps the others' vectors."""
    vectors, shas = zip(*(_bias(bias_dir, seed=seed) for seed in range(1, 5)), strict=True)
    v2 = _v2(_Batch([1] * SLOTS))
    for slot, sha in enumerate(shas):
        v2.add_request(slot, _params(0.0, nts_policy=_policy(sha)))
    v2.apply_staged_writes()
    assert v2.tuning.bias.table.shape == (5, VOCAB)
    for slot in (0, 2):
        v2.add_request(slot, _params(nts_rule="fixed", nts_t=2.0))
    v2.apply_staged_writes()
    assert v2.tuning.bias.table.shape == (3, VOCAB)  # row 0 and the versions of slots 1, 3
    assert v2.tuning.bias.biased_slots == 2
    passes = _count_bias_passes(monkeypatch)
    served = _logits(4)
    out = v2.apply(served.clone(), _ctx([(0, 0), (1, 0), (2, 0), (3, 0)]))
    assert passes[0] == 2
    torch.testing.assert_close(out[[0, 2]], served[[0, 2]] / 2.0)
    assert torch.equal(out[[1, 3]], served[[1, 3]] + torch.stack((vectors[1], vectors[3])))
    for slot in (1, 3):
        v2.add_request(slot, _params(0.0))
    v2.add_request(4, _params(0.0, nts_policy=_policy(shas[0])))  # a dropped version returns
    v2.apply_staged_writes()
    assert v2.tuning.bias.table.shape == (2, VOCAB)
    passes[0] = 0
    out = v2.apply(served[:2].clone(), _ctx([(1, 0), (4, 0)]))
    assert torch.equal(out, served[:2] + torch.stack((torch.zeros(VOCAB), vectors[0])))
    assert passes[0] == 1
    assert torch.equal(v2.apply(served[:1].clone(), _ctx([(1, 0)])), served[:1])
    assert passes[0] == 1  # the one version held, not by this batch
