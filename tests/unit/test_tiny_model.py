"""The tiny random Llama: deterministic, loadable, shaped for vLLM's CPU backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_model import TINY_VOCAB_SIZE, build_tiny_llama

from noisy_temp_server.checkpoints.checkpoint import (
    MANIFEST_FILENAME,
    load_causal_lm,
    read_manifest,
)

VLLM_CPU_HEAD_SIZES = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}


def _file_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_same_seed_gives_identical_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    rebuilt = build_tiny_llama(tmp_path / "again", seed=0)
    assert _file_bytes(rebuilt) == _file_bytes(tiny_model_dir)


def test_other_seed_changes_only_the_weights(tmp_path: Path, tiny_model_dir: Path) -> None:
    other = _file_bytes(build_tiny_llama(tmp_path / "seed1", seed=1))
    same = _file_bytes(tiny_model_dir)
    differing = {name for name in same if same[name] != other[name]}
    assert differing == {"model.safetensors", MANIFEST_FILENAME}
    assert read_manifest(tmp_path / "seed1").metadata["seed"] == 1


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_llama(tmp_path / "tiny", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_config_suits_vllm_cpu(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["head_dim"] in VLLM_CPU_HEAD_SIZES
    assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"]
    assert config["max_position_embeddings"] >= 512
    assert config["vocab_size"] == TINY_VOCAB_SIZE
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_tokenizer_round_trips_and_has_chat_template(tiny_model_dir: Path) -> None:
    _, tokenizer = load_causal_lm(tiny_model_dir)
    text = "The capital of France is Paris. Ünïcödé 🙂"
    ids = tokenizer.encode(text)
    assert max(ids) < TINY_VOCAB_SIZE
    assert len(ids) < len(text.encode())
    assert tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]


def test_logits_are_spread_like_a_trained_model(tiny_model_dir: Path) -> None:
    model, tokenizer = load_causal_lm(tiny_model_dir)
    ids = torch.tensor([tokenizer.encode("Once upon a time there was a little robot")])
    with torch.no_grad():
        logits = model(ids).logits  # [1, seq, vocab]
    assert logits.shape == (1, ids.shape[1], TINY_VOCAB_SIZE)
    spread = logits.std(dim=-1)
    assert bool(torch.all((spread > 0.5) & (spread < 20.0)))


def test_build_refuses_an_existing_destination(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError):
        build_tiny_llama(tmp_path / "taken")
