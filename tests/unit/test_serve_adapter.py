"""`serve` and the profile's adapter before the engine starts: the folded checkpoint (the same
function as the served model with the adapter, cached), the LoRA path on quantized kernels, and
the refusals (one line, exit status 1)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import pytest
import torch
from adapter_helpers import adapter_profile, random_adapter
from safetensors.torch import load_file

from noisy_temp_server.adapter.folded_checkpoint import ensure_folded_checkpoint, folded_adapter_of
from noisy_temp_server.adapter.lora import (
    ADAPTER_WEIGHTS,
    AdapterError,
    adapter_folder_name,
    adapter_sha256,
    save_peft_adapter,
)
from noisy_temp_server.adapter.serving import CalibratedKl, lora_engine_rank
from noisy_temp_server.calibration.profile import Profile, ProfileError
from noisy_temp_server.checkpoints.identity import ModelIdentity
from noisy_temp_server.checkpoints.perturbation import WeightNoiseSpec
from noisy_temp_server.checkpoints.perturbed_checkpoint import ensure_perturbed_checkpoint
from noisy_temp_server.commands import serve
from noisy_temp_server.scoring.served_pair import ServedPair
from noisy_temp_server.server import engine as engine_module
from noisy_temp_server.server.launch import plan_served_adapter
from noisy_temp_server.settings import Settings

SPEC = WeightNoiseSpec(scale=0.1)


@pytest.fixture
def pair(tiny_model_dir: Path, tmp_path: Path) -> ServedPair:
    served = ensure_perturbed_checkpoint(tiny_model_dir, SPEC, tmp_path / "cache")
    return ServedPair(served, tiny_model_dir, SPEC)


def _profile(pair: ServedPair, folder: Path, **summary: object) -> tuple[Path, Profile]:
    adapter = random_adapter(pair.served, base_model=pair.served.name)
    path = adapter_profile(
        tiny := pair.clean,  # type: ignore[arg-type]
        ModelIdentity.perturbed(ModelIdentity.of_checkpoint(tiny), SPEC),
        adapter,
        folder,
        **summary,
    )
    return path, Profile.load(path)


def _plan(pair: ServedPair, path: Path, tmp_path: Path, **settings: object):  # type: ignore[no-untyped-def]
    config = Settings(cache_dir=tmp_path / "cache", **settings)  # type: ignore[arg-type]
    return plan_served_adapter(config, pair, Profile.load(path), path, "tiny")


def test_float_weights_get_the_adapter_folded_in_once(pair: ServedPair, tmp_path: Path) -> None:
    path, profile = _profile(pair, tmp_path / "profiles")
    plan = _plan(pair, path, tmp_path)
    assert plan is not None
    assert plan.path == "folded"
    assert plan.max_lora_rank is None
    assert plan.sha256 == profile.adapter.sha256  # type: ignore[union-attr]
    test = profile.adapter.test  # type: ignore[union-attr]
    assert plan.calibrated_kl == CalibratedKl(test.baseline_kl, test.mean_kl)
    assert folded_adapter_of(plan.engine_model) == plan.sha256
    adapter = random_adapter(pair.served, base_model=pair.served.name)
    served, folded = (load_file(p / "model.safetensors") for p in (pair.served, plan.engine_model))
    for name, delta in adapter.layers.items():
        expected = served[f"{name}.weight"] + delta.dense()
        torch.testing.assert_close(folded[f"{name}.weight"], expected)
    torch.testing.assert_close(folded["lm_head.weight"], served["lm_head.weight"])
    stamp = (plan.engine_model / "model.safetensors").stat().st_mtime_ns
    again = _plan(pair, path, tmp_path)
    assert again is not None
    assert again.engine_model == plan.engine_model
    assert (plan.engine_model / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(AdapterError, match="already has the adapter"):
        ensure_folded_checkpoint(plan.engine_model, adapter, tmp_path / "cache")


def test_lora_path_on_request_and_its_engine_rank(pair: ServedPair, tmp_path: Path) -> None:
    path, _ = _profile(pair, tmp_path / "profiles")
    plan = _plan(pair, path, tmp_path, adapter_serving="lora")
    assert plan is not None
    assert plan.path == "lora"
    assert plan.engine_model == pair.served
    assert plan.max_lora_rank == 8
    assert plan.lora_request.lora_path == str(plan.folder)
    assert _plan(pair, path, tmp_path, adapter_serving="none") is None
    assert [lora_engine_rank(r) for r in (1, 2, 16, 17, 300, 512)] == [1, 8, 16, 32, 320, 512]
    with pytest.raises(AdapterError, match="above vLLM's largest"):
        lora_engine_rank(513)


def test_an_adapter_the_profile_does_not_recommend_is_not_served(
    pair: ServedPair, tmp_path: Path
) -> None:
    path, _ = _profile(pair, tmp_path / "profiles", recommended=False)
    assert _plan(pair, path, tmp_path) is None


def _break_missing(folder: Path) -> None:
    for file in folder.iterdir():
        file.unlink()
    folder.rmdir()


def _break_corrupt(folder: Path) -> None:
    (folder / ADAPTER_WEIGHTS).write_bytes(b"not a safetensors file")


def _break_config(folder: Path) -> None:
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_break_missing, "not found in"),
        (_break_corrupt, "cannot be read"),
        (_break_config, "DoRA"),
    ],
)
def test_missing_or_corrupt_adapters_are_refused(
    pair: ServedPair, tmp_path: Path, damage: object, message: str
) -> None:
    path, profile = _profile(pair, tmp_path / "profiles")
    damage(path.parent / adapter_folder_name(profile.adapter.sha256))  # type: ignore[operator, union-attr]
    with pytest.raises(ProfileError, match=f"the adapter cannot be served: .*{message}"):
        _plan(pair, path, tmp_path)


@pytest.mark.parametrize(
    ("summary", "message"),
    [({"rank": 8}, "the profile names rank 8"), ({"layers": 3}, "3 layers")],
)
def test_an_adapter_other_than_the_profiles_is_refused(
    pair: ServedPair, tmp_path: Path, summary: dict[str, object], message: str
) -> None:
    path, _ = _profile(pair, tmp_path / "profiles", **summary)
    with pytest.raises(ProfileError, match=message):
        _plan(pair, path, tmp_path)


def test_an_adapter_of_another_model_is_refused(pair: ServedPair, tmp_path: Path) -> None:
    adapter = random_adapter(pair.served, base_model="SmolLM2-135M-Instruct")
    identity = ModelIdentity.perturbed(ModelIdentity.of_checkpoint(pair.clean), SPEC)  # type: ignore[arg-type]
    path = adapter_profile(pair.clean, identity, adapter, tmp_path / "other")  # type: ignore[arg-type]
    with pytest.raises(ProfileError, match="fitted for the base model 'SmolLM2-135M-Instruct'"):
        _plan(pair, path, tmp_path)
    wide = {
        name: type(delta)(down=torch.zeros(4, 2 * delta.shape[1]), up=delta.up)
        for name, delta in random_adapter(pair.served).layers.items()
    }
    misshapen = type(adapter)(layers=wide, rank=4)
    path = adapter_profile(pair.clean, identity, misshapen, tmp_path / "wide")  # type: ignore[arg-type]
    with pytest.raises(ProfileError, match="shapes do not fit the model"):
        _plan(pair, path, tmp_path)


def test_serve_refuses_a_bad_adapter_with_one_line_and_exit_status_1(
    pair: ServedPair,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path, profile = _profile(pair, tmp_path / "profiles")
    _break_corrupt(path.parent / adapter_folder_name(profile.adapter.sha256))  # type: ignore[union-attr]

    class Environment:
        trace_endpoint = "ipc://unused"
        online_bias_dir = tmp_path / "biases"

        def cleanup(self) -> None:
            pass

    started: list[object] = []
    monkeypatch.setattr(engine_module, "prepare_environment", lambda settings: Environment())
    monkeypatch.setattr(engine_module, "start_engine", lambda *a, **k: started.append(a))
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    argv = ["--served-model", str(pair.served), "--clean-model", str(pair.clean)]
    args = parser.parse_args([*argv, "--profile", str(path), "--cache-dir", str(tmp_path)])
    with caplog.at_level(logging.ERROR, logger="noisy_temp_server.serve"):
        assert serve.run(args) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "Refusing to serve: the adapter cannot be served" in errors[0]
    assert "\n" not in errors[0]
    assert started == []
    assert adapter_sha256(random_adapter(pair.served)) == profile.adapter.sha256  # type: ignore[union-attr]


def _quantized_pair(tiny_model_dir: Path, tmp_path: Path, scheme: str) -> tuple[ServedPair, Path]:
    from noisy_temp_server.checkpoints.compressed import write_compressed_checkpoint  # noqa: PLC0415

    quantized = tmp_path / scheme
    write_compressed_checkpoint(tiny_model_dir, scheme, quantized, group_size=32)
    adapter = random_adapter(quantized, base_model=tiny_model_dir.name)
    path = adapter_profile(
        tiny_model_dir, ModelIdentity.of_checkpoint(quantized), adapter, tmp_path / "profiles"
    )
    return ServedPair(quantized, tiny_model_dir, None), path


def test_quantized_kernels_get_the_lora_path_and_refuse_folding(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    pair, path = _quantized_pair(tiny_model_dir, tmp_path, "w4a16")
    plan = _plan(pair, path, tmp_path)
    assert plan is not None
    assert plan.path == "lora"
    assert plan.engine_model == pair.served
    assert plan.max_lora_rank == 8
    with pytest.raises(ProfileError, match="cannot be folded into them"):
        _plan(pair, path, tmp_path, adapter_serving="folded")


def test_w8a8_on_the_cpu_is_refused_for_lora(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.platforms import current_platform  # noqa: PLC0415

    pair, path = _quantized_pair(tiny_model_dir, tmp_path, "w8a8")
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    with pytest.raises(ProfileError, match="vLLM CPU kernel cannot take a LoRA adapter"):
        _plan(pair, path, tmp_path)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    plan = _plan(pair, path, tmp_path)
    assert plan is not None
    assert plan.path == "lora"
    assert _plan(pair, path, tmp_path, adapter_serving="none") is None


def test_an_adapter_folder_is_served_without_a_profile(pair: ServedPair, tmp_path: Path) -> None:
    adapter = random_adapter(pair.served, seed=1)
    folder = save_peft_adapter(tmp_path / "given", adapter)
    config = Settings(cache_dir=tmp_path / "cache", adapter=folder)
    plan = plan_served_adapter(config, pair, None, None, "tiny")
    assert plan is not None
    assert plan.sha256 == adapter_sha256(adapter)
    assert plan.path == "folded"
    assert plan.calibrated_kl is None  # nothing measured it
    path, _ = _profile(pair, tmp_path / "profiles")  # calibrated with another adapter
    with pytest.raises(ProfileError, match="calibrated with the adapter"):
        plan_served_adapter(config, pair, Profile.load(path), path, "tiny")


def test_an_adapter_folder_is_refused_beside_a_profile_calibrated_without_it(
    pair: ServedPair, tmp_path: Path
) -> None:
    folder = save_peft_adapter(tmp_path / "given", random_adapter(pair.served, seed=1))
    path, _ = _profile(pair, tmp_path / "profiles", recommended=False)
    with pytest.raises(ProfileError, match="calibrated without an adapter"):
        _plan(pair, path, tmp_path, adapter=folder)


def test_an_adapter_fitted_on_a_hugging_face_model_serves_on_its_snapshot() -> None:
    from noisy_temp_server.adapter import serving  # noqa: PLC0415
    from noisy_temp_server.adapter.lora import LoraAdapter, LowRankDelta  # noqa: PLC0415

    delta = LowRankDelta(up=torch.zeros(4, 8), down=torch.zeros(8, 4))
    adapter = LoraAdapter(
        layers={"model.layers.0.mlp.up_proj": delta},
        rank=8,
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
    )
    serving._check_base_model(adapter, {"HuggingFaceTB/SmolLM2-135M-Instruct", "served-int4"})
    serving._check_base_model(adapter, {"SmolLM2-135M-Instruct"})  # a plain copy of it
    with pytest.raises(AdapterError, match="fitted for the base model"):
        serving._check_base_model(adapter, {"someone/other-model", "0123abcd"})
