"""vLLM (CPU) loads our checkpoint folders and generates what transformers generates.

Greedy decoding in vLLM and in a plain transformers loop must give the same tokens. For the
default model that proves vLLM reads the configuration as transformers does, rope_theta
included; `test_a_wrong_rope_theta_would_be_caught` shows the comparison is sensitive to it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from vllm_helpers import start_llm, stop_llm

from noisy_temp_server.checkpoints.checkpoint import load_causal_lm

pytestmark = pytest.mark.vllm

NEW_TOKENS = 12
DEFAULT_MODEL_PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "def add(a, b):\n    return",
    "The three primary colours are red,",
]
TINY_MODEL_PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):"]


def greedy_with_transformers(
    model: PreTrainedModel, prompt_ids: list[int], new_tokens: int
) -> list[int]:
    """Plain argmax decoding with the KV cache, never stopping early (like `ignore_eos`)."""
    generated: list[int] = []
    step_input = torch.tensor([prompt_ids])
    past = None
    with torch.no_grad():
        for _ in range(new_tokens):
            output = model(step_input, past_key_values=past, use_cache=True)
            past = output.past_key_values
            generated.append(int(output.logits[0, -1].argmax()))  # logits: [1, seq, vocab]
            step_input = torch.tensor([[generated[-1]]])
    return generated


def greedy_with_vllm(llm: Any, prompts_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams  # noqa: PLC0415 (vLLM is imported by start_llm)

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts_ids], params)
    return [list(output.outputs[0].token_ids) for output in outputs]


# Engines live as long as the test class that uses them (one engine at a time). Each
# transformers reference is computed before its engine starts: an in-process vLLM engine
# drops the process to one torch thread.


@pytest.fixture(scope="class")
def tiny_reference(tiny_model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, transformers' greedy continuation) per tiny-model prompt."""
    model, tokenizer = load_causal_lm(tiny_model_dir)
    prompts_ids = [tokenizer.encode(prompt) for prompt in TINY_MODEL_PROMPTS]
    return prompts_ids, [greedy_with_transformers(model, ids, NEW_TOKENS) for ids in prompts_ids]


@pytest.fixture(scope="class")
def tiny_llm(
    tiny_model_dir: Path, tiny_reference: tuple[list[list[int]], list[list[int]]]
) -> Iterator[Any]:
    engine = start_llm(tiny_model_dir)
    yield engine
    stop_llm(engine)


@pytest.fixture(scope="class")
def default_reference(default_model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, transformers' greedy continuation) per default-model prompt."""
    model, tokenizer = load_causal_lm(default_model_dir, verify=False)
    prompts_ids = [tokenizer.encode(prompt) for prompt in DEFAULT_MODEL_PROMPTS]
    return prompts_ids, [greedy_with_transformers(model, ids, NEW_TOKENS) for ids in prompts_ids]


@pytest.fixture(scope="class")
def default_llm(
    default_model_dir: Path, default_reference: tuple[list[list[int]], list[list[int]]]
) -> Iterator[Any]:
    engine = start_llm(default_model_dir)
    yield engine
    stop_llm(engine)


class TestTinyModel:
    def test_generates_requested_number_of_tokens(self, tiny_llm: Any) -> None:
        from vllm import SamplingParams  # noqa: PLC0415

        params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=1)
        outputs = tiny_llm.generate(TINY_MODEL_PROMPTS, params)
        assert [len(output.outputs[0].token_ids) for output in outputs] == [8] * 3
        assert all(output.outputs[0].text for output in outputs)

    def test_greedy_matches_transformers(
        self, tiny_llm: Any, tiny_reference: tuple[list[list[int]], list[list[int]]]
    ) -> None:
        prompts_ids, expected = tiny_reference
        assert greedy_with_vllm(tiny_llm, prompts_ids, NEW_TOKENS) == expected

    def test_chat_uses_the_chat_template(self, tiny_llm: Any) -> None:
        from vllm import SamplingParams  # noqa: PLC0415

        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        output = tiny_llm.chat([{"role": "user", "content": "Hi"}], params)[0]
        assert output.prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        assert len(output.outputs[0].token_ids) == 4


@pytest.mark.default_model
class TestDefaultModel:
    def test_engine_reads_rope_theta(self, default_llm: Any) -> None:
        hf_config = default_llm.llm_engine.model_config.hf_config
        assert hf_config.rope_parameters["rope_theta"] == 100000.0

    def test_greedy_matches_transformers(
        self, default_llm: Any, default_reference: tuple[list[list[int]], list[list[int]]]
    ) -> None:
        prompts_ids, expected = default_reference
        assert greedy_with_vllm(default_llm, prompts_ids, NEW_TOKENS) == expected

    def test_text_is_sensible(self, default_llm: Any) -> None:
        from vllm import SamplingParams  # noqa: PLC0415

        params = SamplingParams(temperature=0.0, max_tokens=8)
        output = default_llm.generate(["The capital of France is"], params)[0]
        assert "Paris" in output.outputs[0].text

    def test_a_wrong_rope_theta_would_be_caught(
        self, default_model_dir: Path, default_reference: tuple[list[list[int]], list[list[int]]]
    ) -> None:
        prompts_ids, expected = default_reference
        wrong = AutoModelForCausalLM.from_pretrained(
            default_model_dir,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            local_files_only=True,
        ).eval()
        assert wrong.config.rope_parameters["rope_theta"] == 10000.0
        continuations = [greedy_with_transformers(wrong, ids, NEW_TOKENS) for ids in prompts_ids]
        assert continuations != expected
