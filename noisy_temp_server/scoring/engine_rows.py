"""The served model's rows as vLLM's engine computes them: calibrating on what is served.

Where transformers' forward of a served checkpoint is not what vLLM's kernels compute (W8A8
int8 on a CPU, whose kernel quantizes the activations its own way: docs/quantized_checkpoints.md),
scoring the pair with transformers measures a model nobody serves. Then the served side comes
from the engine itself:

- `sample_with_engine` samples one completion per prompt with vLLM's offline engine at T = 1
  (no top-k, top-p or penalty), asking for every position's whole raw log-probability row
  (``logprobs=-1`` in vLLM's default ``raw_logprobs`` mode: before any processor or
  temperature, the row the engine samples from);
- `EngineRows` hands those rows to the `PairScorer` as its served side (the `CleanBackend`
  contract). A log-probability row is the logits less a constant, which no statistic of the
  scorer sees.

Memory: every completion's rows stay until scored, 4·V bytes a generated position (48 prompts
of 48 tokens at V = 49 152: 0.45 GB), beside the engine's weights and KV cache while it runs;
and vLLM's own Python objects of the rows of the requests it runs, which it keeps until each
ends: so only as many run at once as fit in 2 GiB of them (`_in_flight`: 9 at 48 tokens and
V = 49 152, 2 at 64 tokens and V = 128 256). The engine is shut down before the rows are
returned.
"""

from __future__ import annotations

import gc
import itertools
import os
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from noisy_temp_server.scoring.sequence import ScoringSequence

if TYPE_CHECKING:
    from vllm.outputs import CompletionOutput

__all__ = ["EngineCompletion", "EngineRows", "sample_with_engine"]

_LOGPROBS_BUDGET_BYTES = 2 * 2**30
"""What the running requests' log-probabilities may take as vLLM's Python objects."""
_LOGPROB_ENTRY_BYTES = 100
"""About what one vocabulary entry of one step takes there: a token id, a log-probability and a
rank as Python objects, and their three list slots."""
_KV_CACHE_BYTES = 2**30
"""The engine's KV cache on any device (calibration's completions are short and few; on a GPU it
leaves the memory to the clean model beside it), unless ``VLLM_CPU_KVCACHE_SPACE`` sets it."""
_ENGINE_ENV = {
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
"""vLLM's settings for the offline engine where the environment gives none: logs on standard
error, the engine in this process."""


@dataclass(frozen=True)
class EngineCompletion:
    """One prompt's completion as the engine sampled it, with the raw log-probability row
    (float32 ``[len(completion), V]``) it sampled each completion token from."""

    sequence: ScoringSequence
    rows: Tensor

    def __post_init__(self) -> None:
        generated = len(self.sequence.token_ids) - self.sequence.prompt_length
        if self.rows.ndim != 2 or self.rows.shape[0] != generated:
            raise ValueError(
                f"sequence {self.sequence.sequence_id}: {tuple(self.rows.shape)} rows for "
                f"{generated} generated tokens"
            )


def sample_with_engine(
    model: Path,
    prompt_ids: Sequence[list[int]],
    *,
    max_new_tokens: int,
    seed: int,
    stop_token_ids: Collection[int],
    progress: Callable[[int, int], None] | None = None,
) -> list[EngineCompletion]:
    """One completion per prompt (token ids) sampled by vLLM's offline engine serving the
    checkpoint folder `model` at T = 1, with its rows (the module docstring). Sequence ids are
    the prompts' indices; prompt i is sampled with seed ``seed * 1_000_003 + i``. A completion
    stops after a token of `stop_token_ids` (which it keeps) or at `max_new_tokens`.

    The engine runs in this process (no engine or worker process to outlive a killed command,
    unless ``VLLM_ENABLE_V1_MULTIPROCESSING`` says otherwise), eager, in the dtype `serve` gives
    it by default (vLLM's ``auto``), with a 1 GiB KV cache (`_KV_CACHE_BYTES`), logging to
    standard error unless ``VLLM_LOGGING_STREAM`` is set (a command's standard output is its
    answer), and is shut down before this returns. `progress(done, total)` is called as each
    completion ends. ValueError for no prompts, or when vLLM's engine does not start on `model`
    (the engine's log says why); what else vLLM raises for a folder it cannot serve passes
    through."""
    if not prompt_ids:
        raise ValueError("no prompts to sample")
    with _engine_environment():
        engine = _start_engine(model, max(len(ids) for ids in prompt_ids) + max_new_tokens, seed)
        try:
            tokens, rows = _run_requests(
                engine,
                prompt_ids,
                max_new_tokens=max_new_tokens,
                seed=seed,
                stop_token_ids=stop_token_ids,
                progress=progress,
            )
        finally:
            del engine
            gc.collect()
    return [
        EngineCompletion(
            ScoringSequence(list(ids) + tokens[index], len(ids), index), torch.cat(rows[index])
        )
        for index, ids in enumerate(prompt_ids)
    ]


@contextmanager
def _engine_environment() -> Iterator[None]:
    """`_ENGINE_ENV`'s variables that the environment does not set, set while inside: for this
    engine alone, not for the engines and servers started after it."""
    added = {name: value for name, value in _ENGINE_ENV.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _start_engine(model: Path, max_model_len: int, seed: int) -> Any:
    """vLLM's offline engine on `model` as `sample_with_engine` describes it; ValueError when it
    does not start."""
    from vllm import LLM  # noqa: PLC0415 (vLLM only where the engine is asked for)

    try:
        return LLM(
            str(model),
            dtype="auto",
            enforce_eager=True,
            max_model_len=max_model_len,
            max_logprobs=-1,
            kv_cache_memory_bytes=_KV_CACHE_BYTES,
            skip_tokenizer_init=True,
            seed=seed,
            distributed_executor_backend="uni",
        )
    except RuntimeError as error:  # vLLM's engine start failure; its log above says why
        raise ValueError(f"vLLM's engine did not start on {model}: {error}") from error


def _run_requests(
    engine: Any,
    prompt_ids: Sequence[list[int]],
    *,
    max_new_tokens: int,
    seed: int,
    stop_token_ids: Collection[int],
    progress: Callable[[int, int], None] | None,
) -> tuple[list[list[int]], list[list[Tensor]]]:
    """Every prompt's sampled tokens and the dense rows they were sampled from, by prompt index,
    read from the engine step by step (delta outputs), with at most `_in_flight` requests in
    the engine at a time: vLLM keeps each running request's whole-vocabulary log-probabilities
    of every step as Python objects until it ends."""
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415
    from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415

    core = engine.llm_engine
    vocab_size = core.model_config.get_vocab_size()

    def add(index: int) -> None:
        params = SamplingParams(
            temperature=1.0,
            max_tokens=max_new_tokens,
            stop_token_ids=sorted(stop_token_ids),
            logprobs=-1,
            flat_logprobs=True,
            seed=seed * 1_000_003 + index,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        core.add_request(str(index), TokensPrompt(prompt_token_ids=list(prompt_ids[index])), params)

    waiting = iter(range(len(prompt_ids)))
    for index in itertools.islice(waiting, _in_flight(max_new_tokens, vocab_size)):
        add(index)
    tokens: list[list[int]] = [[] for _ in prompt_ids]
    rows: list[list[Tensor]] = [[] for _ in prompt_ids]
    finished = 0
    while core.has_unfinished_requests():
        for output in core.step():
            index, completion = int(output.request_id), output.outputs[0]
            if completion.token_ids:
                tokens[index].extend(completion.token_ids)
                rows[index].append(_dense_rows(completion, vocab_size))
            if output.finished:
                finished += 1
                for following in itertools.islice(waiting, 1):
                    add(following)
                if progress is not None:
                    progress(finished, len(prompt_ids))
    return tokens, rows


def _in_flight(max_new_tokens: int, vocab_size: int) -> int:
    """Requests sampled at once: as many as `_LOGPROBS_BUDGET_BYTES` of vLLM's log-probability
    objects allow at `_LOGPROB_ENTRY_BYTES` an entry (at least 1)."""
    per_request = max_new_tokens * vocab_size * _LOGPROB_ENTRY_BYTES
    return max(1, _LOGPROBS_BUDGET_BYTES // per_request)


def _dense_rows(completion: CompletionOutput, vocab_size: int) -> Tensor:
    """The float32 ``[n, V]`` rows of a completion's flat whole-vocabulary log-probabilities."""
    flat: Any = completion.logprobs
    ids = torch.tensor(flat.token_ids, dtype=torch.int64)
    values = torch.tensor(flat.logprobs, dtype=torch.float32)
    rows = torch.full((len(completion.token_ids), vocab_size), float("nan"))
    for step, (start, end) in enumerate(zip(flat.start_indices, flat.end_indices, strict=True)):
        rows[step, ids[start:end]] = values[start:end]
    if torch.isnan(rows).any():
        raise ValueError("the engine answered a row without the whole vocabulary")
    return rows


class EngineRows:
    """The served side of a `PairScorer` read from the engine's rows (`sample_with_engine`),
    by sequence id. Refuses (ValueError) a sequence it has no rows of, or whose tokens are not
    the ones the engine sampled."""

    def __init__(self, completions: Sequence[EngineCompletion]) -> None:
        if not completions:
            raise ValueError("no engine completions")
        self._by_id = {c.sequence.sequence_id: c for c in completions}
        self._vocab_size = int(completions[0].rows.shape[1])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def completion_rows(self, sequence: ScoringSequence, chunk_positions: int) -> Iterator[Tensor]:
        recorded = self._by_id.get(sequence.sequence_id)
        if recorded is None or list(recorded.sequence.token_ids) != list(sequence.token_ids):
            raise ValueError(f"sequence {sequence.sequence_id} is not one the engine sampled")
        yield from recorded.rows.split(chunk_positions)

    def status(self) -> dict[str, Any]:
        return {"kind": "engine_rows", "sequences": len(self._by_id)}
