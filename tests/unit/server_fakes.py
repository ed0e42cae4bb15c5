"""Fakes and builders the server tests share: an engine with AsyncLLM's `generate()` interface
(one token per step, token id = position), a tokenizer, a trace channel, the app harness and its
builder, the OpenAI error-body check, and a shadow scorer and estimator.

The fake engine produces one token per step (ids counting up from the prompt length), so every
test built on it runs in milliseconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensInput
from vllm.logprobs import Logprob
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

from noisy_temp_server.adapter.serving import ServedAdapter
from noisy_temp_server.correction.paired_rows import PairedRows
from noisy_temp_server.engine_contract.trace_channel import CapturedRows, TraceReport
from noisy_temp_server.online.policy_source import StaticPolicySource
from noisy_temp_server.scoring.position_scores import scores_at_temperatures
from noisy_temp_server.scoring.records import PositionRecords
from noisy_temp_server.scoring.scorer import LiveScores, ServedRows
from noisy_temp_server.scoring.sequence import ScoringSequence
from noisy_temp_server.server.app import create_app
from noisy_temp_server.server.metrics import ApiMetrics
from noisy_temp_server.settings import Settings
from noisy_temp_server.temperature.policy import TemperaturePolicy
from noisy_temp_server.temperature.stats import PairTerms

VOCAB = 1000
MAX_MODEL_LEN = 64
MODEL = "fake-model"


class FakeInputProcessor:
    """AsyncLLM's `input_processor`, as far as vLLM's beam search reads it."""

    def resolve_watermarking(self, params: Any) -> bool:
        return False


class FakeEngine:
    """AsyncLLM's generate(): `max_tokens` tokens, one per step, token id = position."""

    def __init__(self) -> None:
        self.input_processor = FakeInputProcessor()
        self.calls: list[tuple[list[int], SamplingParams, str]] = []
        self.dead = False
        self.step_seconds = 0.0
        self.aborted: list[str] = []
        self.lora_requests: list[LoRARequest | None] = []
        self.prompts: list[TokensInput] = []
        self.priorities: list[int] = []
        self.cached_tokens: int | None = None  # what each output reports as num_cached_tokens
        self.script: list[int] | None = None  # the token ids each request generates instead
        self.texts: dict[int, str] = {}  # a token's text instead of " t<id>"
        self.reasoning: list[tuple[bool | None, dict[str, Any] | None]] = []

    async def generate(
        self,
        prompt: TokensInput,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        ids = list(prompt["prompt_token_ids"])
        if any(i >= VOCAB for i in ids):
            raise VLLMValidationError("Token id out of vocabulary", parameter="prompt")
        self.calls.append((ids, sampling_params, request_id))
        self.lora_requests.append(lora_request)
        self.prompts.append(prompt)
        self.priorities.append(priority)
        self.reasoning.append((reasoning_ended, reasoning_parser_kwargs))
        count = sampling_params.max_tokens or 1
        new = [(len(ids) + step) % VOCAB for step in range(count)]
        if self.script is not None:
            new = self.script[:count]
        delta = sampling_params.output_kind == RequestOutputKind.DELTA
        try:
            async for output in self._outputs(request_id, ids, new, delta, sampling_params):
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)  # where AsyncLLM aborts the engine request
            raise

    async def _outputs(
        self,
        request_id: str,
        ids: list[int],
        new: list[int],
        delta: bool,
        sampling_params: SamplingParams,
    ) -> AsyncGenerator[RequestOutput, None]:
        count = len(new)
        for step, token in enumerate(new):
            await asyncio.sleep(self.step_seconds)
            last = step == count - 1
            if not delta and not last:
                continue
            tokens = [token] if delta else new
            logprobs = None
            if sampling_params.logprob_token_ids:  # the sampled token, then the ids asked for
                asked = sampling_params.logprob_token_ids
                logprobs = [
                    {t: Logprob(-0.5, 1, f" t{t}")}
                    | {i: Logprob(-3.0, rank, f" t{i}") for rank, i in enumerate(asked, 1)}
                    for t in tokens
                ]
            elif sampling_params.logprobs is not None:
                logprobs = [
                    {t: Logprob(-0.5, 1, f" t{t}"), t + 1: Logprob(float("-inf"), 2, f" t{t + 1}")}
                    for t in tokens
                ]
            output = CompletionOutput(
                index=0,
                text="".join(self.texts.get(t, f" t{t}") for t in tokens),
                token_ids=tokens,
                cumulative_logprob=None,
                logprobs=logprobs,
                finish_reason="length" if last else None,
            )
            first = step == 0 or not delta
            prompt_logprobs = (
                _prompt_logprobs(ids)
                if first and sampling_params.prompt_logprobs is not None
                else None
            )
            yield RequestOutput(
                request_id,
                None,
                ids,
                prompt_logprobs,
                [output],
                finished=last,
                num_cached_tokens=self.cached_tokens,
            )

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("engine is dead")


def _prompt_logprobs(ids: list[int]) -> list[dict[int, Logprob] | None]:
    """As vLLM gives them: none for the first prompt token; -1 for each later one, and its
    successor id at -2 as the other candidate."""
    return [None] + [
        {t: Logprob(-1.0, 1, chr(t)), t + 1: Logprob(-2.0, 2, chr(t + 1))} for t in ids[1:]
    ]


class FakeTokenizer:
    eos_token_id = 0

    def __init__(
        self,
        chat_template: str | None = "{{ messages }}",
        special_tokens: dict[str, int] | None = None,
    ) -> None:
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}

    def get_vocab(self) -> dict[str, int]:
        """Only the `special_tokens` (what vLLM's reasoning parsers look up)."""
        return dict(self.special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(t) for t in token_ids)

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        *,
        tokenize: bool,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The messages marked by role (after the `tools`' names); a request's own
        `chat_template` puts itself first, each of the other `template_kwargs` `<key=value>`."""
        text = "" if chat_template is None else f"<template {chat_template}>"
        text += "".join(f"<{key}={value}>" for key, value in sorted(template_kwargs.items()))
        text += "".join(f"<tool>{t['function']['name']}" for t in tools or [])
        text += "".join(f"<{m['role']}>{m['content']}" for m in conversation)
        return text + ("<assistant>" if add_generation_prompt else "")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(t) for t in ids]


class FakeTraces:
    """The trace channel: every tuned step ran at `temperature`; every captured request has
    rows of `vocab` columns for all the steps asked for."""

    def __init__(self, temperature: float, vocab: int = 16) -> None:
        self.temperature = temperature
        self.vocab = vocab
        self.waited: list[tuple[str, int]] = []
        self.forgotten: list[str] = []
        self.taken: list[tuple[str, int]] = []
        self.dropped: list[str] = []

    def take_rows(self, trace_id: str, n_steps: int, timeout: float) -> CapturedRows:
        self.taken.append((trace_id, n_steps))
        rows = np.zeros((n_steps, self.vocab), dtype=np.float32)
        return CapturedRows(np.arange(n_steps, dtype=np.int64), rows)

    def drop_rows(self, trace_id: str) -> None:
        self.dropped.append(trace_id)

    def capture_drops(self) -> dict[str, int]:
        return {"rows_per_step": len(self.dropped)}

    async def wait_for(
        self, trace_id: str, n_steps: int, timeout: float, *, want_trace: bool = False
    ) -> TraceReport:
        self.waited.append((trace_id, n_steps))
        t = self.temperature
        trace = (t,) * n_steps if want_trace else ()
        return TraceReport(steps=n_steps, t_mean=t, t_min=t, t_max=t, trace=trace)

    def forget(self, trace_id: str) -> None:
        self.forgotten.append(trace_id)


class Harness:
    def __init__(self, client: TestClient, engine: FakeEngine, traces: FakeTraces) -> None:
        self.client = client
        self.engine = engine
        self.traces = traces
        self.registry: CollectorRegistry = client.app.state.registry  # type: ignore[attr-defined]

    def post(self, path: str, body: dict[str, Any], **kwargs: Any) -> Any:
        return self.client.post(path, json=body, **kwargs)

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)


def build(
    settings: Settings,
    policy: TemperaturePolicy,
    trace_t: float = 1.25,
    traces: FakeTraces | None = None,
    tokenizer: FakeTokenizer | None = None,
    *,
    adapter: ServedAdapter | None = None,
    shadow: Any = None,
    output_parser: Any = None,
    sampling_defaults: dict[str, Any] | None = None,
) -> Harness:
    engine, registry = FakeEngine(), CollectorRegistry()
    traces = traces or FakeTraces(trace_t)
    app = create_app(
        settings,
        engine,
        tokenizer=tokenizer or FakeTokenizer(),
        model_name=MODEL,
        max_model_len=MAX_MODEL_LEN,
        policy_source=StaticPolicySource(policy, "test"),
        metrics=ApiMetrics(registry),
        metrics_registry=registry,
        trace_source=traces,
        shadow=shadow,
        adapter=adapter,
        output_parser=output_parser,
        sampling_defaults=sampling_defaults,
    )
    app.state.registry = registry
    return Harness(TestClient(app), engine, traces)


POLICY = TemperaturePolicy(version=7, rule="sqrt", alpha_by_step=(0.5625,))


def sse_events(response: Any) -> Iterator[Any]:
    for line in response.text.splitlines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            yield payload if payload == "[DONE]" else json.loads(payload)


def assert_error(response: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    return dict(error)


def live_scores_of(sequence: ScoringSequence, served_temperatures: Sequence[float]) -> LiveScores:
    """Live scores of random logits, the completion's length, T* where the trace has one."""
    count = len(sequence.token_ids) - sequence.prompt_length
    generator = torch.Generator().manual_seed(sequence.sequence_id)
    clean = torch.randn(count, 16, generator=generator)
    served = clean + 0.5 * torch.randn(count, 16, generator=generator)
    steps = torch.arange(count)
    traced = min(count, len(served_temperatures))
    t_star = torch.ones(count)
    t_star[:traced] = torch.tensor(served_temperatures[:traced])
    one, starred = scores_at_temperatures(
        PairTerms.from_logits(clean, served),
        torch.tensor(list(sequence.token_ids[sequence.prompt_length :])) % 16,
        [1.0, t_star],
        sequence_id=sequence.sequence_id,
        step=steps,
    )
    records = PositionRecords.from_logits(
        clean, served, step=steps, sequence_id=sequence.sequence_id, with_oracle=False
    )
    return LiveScores(records, one, starred.select(slice(0, traced)))


class FakeScorer:
    def __init__(self, gate: threading.Event | None = None, fail: bool = False) -> None:
        self.gate = gate
        self.fail = fail
        self.sequences: list[ScoringSequence] = []
        self.kl_curves: list[bool] = []
        self.biases: list[torch.Tensor | None] = []
        self.request_temperatures: list[float] = []

    def score_live(
        self,
        sequence: ScoringSequence,
        served_temperatures: Sequence[float],
        served: ServedRows,
        max_rows: int = 0,
        *,
        request_temperature: float,
        kl_curve: bool = True,
        bias: torch.Tensor | None = None,
    ) -> LiveScores:
        self.request_temperatures.append(request_temperature)
        self.kl_curves.append(kl_curve)
        self.biases.append(bias)
        if self.gate is not None:
            self.gate.wait(5)
        if self.fail:
            raise RuntimeError("scoring failed")
        self.sequences.append(sequence)
        live = live_scores_of(sequence, served_temperatures)
        if not max_rows:
            return live
        clean = torch.randn(max_rows, 16)
        return dataclasses.replace(live, rows=PairedRows.from_logits(clean, clean, 0))

    def clean_status(self) -> dict[str, Any]:
        return {"kind": "fake"}


class FakeEstimator:
    """Publishes version + 1 every `every` positions."""

    def __init__(self, every: int, reads_kl_curves: bool = True) -> None:
        self.reads_kl_curves = reads_kl_curves
        self.every = every
        self.positions = 0
        self.version = 0
        self.rows: list[PairedRows | None] = []

    def add(self, records: PositionRecords, rows: PairedRows | None = None) -> None:
        self.rows.append(rows)
        self.positions += len(records)
        self.version = self.positions // self.every

    def current_policy(self) -> int:
        return self.version

    def status(self) -> dict[str, Any]:
        return {"version": self.version}
