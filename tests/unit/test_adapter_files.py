"""The compensation adapter's files (PEFT LoRA, safetensors only), hash and folding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from noisy_temp_server.adapter.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    LoraAdapter,
    LowRankDelta,
    adapter_sha256,
    find_adapter,
    fold_adapter,
    load_peft_adapter,
    save_peft_adapter,
)


def _adapter(rank: int = 2, seed: int = 0) -> LoraAdapter:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"model.layers.0.self_attn.q_proj": (6, 4), "model.layers.0.mlp.down_proj": (4, 8)}
    layers = {
        name: LowRankDelta(
            down=torch.randn(rank, cols, generator=generator),
            up=torch.randn(rows, rank, generator=generator),
        )
        for name, (rows, cols) in shapes.items()
    }
    return LoraAdapter(layers=layers, rank=rank, base_model="tiny")


def test_round_trip_keeps_numbers_hash_and_peft_names(tmp_path: Path) -> None:
    adapter = _adapter()
    folder = save_peft_adapter(tmp_path, adapter)
    assert folder.name == f"adapter-{adapter_sha256(adapter)[:16]}"
    keys = set(load_file(str(folder / ADAPTER_WEIGHTS)))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in keys
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    assert config["r"] == config["lora_alpha"] == 2
    assert config["target_modules"] == ["down_proj", "q_proj"]
    loaded = load_peft_adapter(folder)
    assert adapter_sha256(loaded) == adapter_sha256(adapter)
    assert find_adapter([tmp_path / "elsewhere", tmp_path], adapter_sha256(adapter))[0] == folder


def test_lora_alpha_scale_is_folded_into_up(tmp_path: Path) -> None:
    adapter = _adapter()
    folder = save_peft_adapter(tmp_path, adapter)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    config["lora_alpha"] = 4  # scale 2
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config))
    loaded = load_peft_adapter(folder)
    name = "model.layers.0.self_attn.q_proj"
    torch.testing.assert_close(loaded.layers[name].dense(), 2 * adapter.layers[name].dense())


def test_fold_adds_up_down_in_place_and_refuses_misfits() -> None:
    adapter = _adapter()
    weights = {
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(6, 4),
        "model.layers.0.mlp.down_proj.weight": torch.ones(4, 8, dtype=torch.bfloat16),
    }
    q_weight = weights["model.layers.0.self_attn.q_proj.weight"]
    fold_adapter(weights, adapter)
    torch.testing.assert_close(q_weight, adapter.layers["model.layers.0.self_attn.q_proj"].dense())
    assert weights["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    before = q_weight.clone()
    with pytest.raises(AdapterError, match="shapes do not fit"):
        fold_adapter({**weights, "model.layers.0.mlp.down_proj.weight": torch.ones(4, 9)}, adapter)
    with pytest.raises(AdapterError, match="does not have"):
        fold_adapter({"model.layers.0.self_attn.q_proj.weight": q_weight}, adapter)
    torch.testing.assert_close(q_weight, before)  # nothing changed by a refused fold


def test_refuses_pickle_only_corrupt_and_unpaired(tmp_path: Path) -> None:
    folder = save_peft_adapter(tmp_path, _adapter())
    (folder / ADAPTER_WEIGHTS).rename(folder / "adapter_model.bin")
    with pytest.raises(AdapterError, match="pickle"):
        load_peft_adapter(folder)
    (folder / ADAPTER_WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(AdapterError, match="cannot be read"):
        load_peft_adapter(folder)
    with pytest.raises(AdapterError, match="no adapter_config"):
        load_peft_adapter(tmp_path)
    with pytest.raises(AdapterError, match="not found"):
        find_adapter([tmp_path], "0" * 64)
    with pytest.raises(AdapterError, match="rank"):
        LoraAdapter(layers={"a": LowRankDelta(torch.ones(2, 3), torch.ones(3, 2))}, rank=3)


def test_refuses_peft_features_it_would_not_serve_alike(tmp_path: Path) -> None:
    folder = save_peft_adapter(tmp_path, _adapter())
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    (folder / ADAPTER_CONFIG).write_text(json.dumps({**config, "rank_pattern": {"q_proj": 4}}))
    with pytest.raises(AdapterError, match="rank_pattern"):
        load_peft_adapter(folder)
    (folder / ADAPTER_CONFIG).write_text(json.dumps({**config, "bias": "all"}))
    with pytest.raises(AdapterError, match="bias"):
        load_peft_adapter(folder)
