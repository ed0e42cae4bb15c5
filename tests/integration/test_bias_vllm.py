"""The per-token logit bias inside a real vLLM engine (CPU V1 runner, tiny model).

The engine's bias directory (``NTS_BIAS_DIR``) makes the processor non-argmax-invariant, so
vLLM runs it for greedy rows too: a bias that lifts one token far above the others makes every
greedy token that token, while ``nts_bias: false`` gets the model's own greedy output.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from noisy_temp_server.correction.files import bias_sha256, save_bias_file
from noisy_temp_server.engine_contract.keys import BIAS_DIR_ENV
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.rules import Rule

pytestmark = pytest.mark.vllm

LIFTED = 7  # the token the bias lifts
PROMPT = "the cat sat on"


@pytest.fixture(scope="module")
def biased(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """(engine, policy JSON naming the bias, the engine's bias directory)."""
    from transformers import AutoConfig  # noqa: PLC0415
    from vllm import LLM  # noqa: PLC0415

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    bias = torch.zeros(vocab)
    bias[LIFTED] = 1e3
    folder = tmp_path_factory.mktemp("biases")
    save_bias_file(folder, bias)
    policy = dataclasses.replace(TemperaturePolicy(rule=Rule.OFF), bias=bias_sha256(bias))
    saved = os.environ.get(BIAS_DIR_ENV)
    os.environ[BIAS_DIR_ENV] = str(folder)
    engine = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        logprobs_mode="processed_logprobs",
        enforce_eager=True,
        seed=0,
    )
    yield engine, policy.to_json(), folder
    del engine
    if saved is None:
        os.environ.pop(BIAS_DIR_ENV, None)
    else:
        os.environ[BIAS_DIR_ENV] = saved


def _greedy(engine: Any, **keys: Any) -> Any:
    from vllm import SamplingParams  # noqa: PLC0415

    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, extra_args=keys or None)
    return engine.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]


def test_greedy_output_and_logprobs_follow_the_bias(biased: Any) -> None:
    engine, policy, _ = biased
    plain = _greedy(engine)
    assert set(plain.token_ids) != {LIFTED}
    lifted = _greedy(engine, nts_policy=policy)
    assert list(lifted.token_ids) == [LIFTED] * 6
    assert all(step[LIFTED].logprob > -1e-3 for step in lifted.logprobs)
    assert list(_greedy(engine, nts_policy=policy, nts_bias=False).token_ids) == list(
        plain.token_ids
    )


def test_a_bias_the_engine_does_not_have_is_refused(biased: Any) -> None:
    engine, _, _ = biased
    unknown = dataclasses.replace(TemperaturePolicy(), bias="ab" * 32).to_json()
    from vllm.exceptions import VLLMValidationError  # noqa: PLC0415

    with pytest.raises(VLLMValidationError, match="not available to this engine"):
        _greedy(engine, nts_policy=unknown)
    assert len(_greedy(engine).token_ids) == 6  # the engine keeps serving
