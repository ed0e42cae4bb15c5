"""The clean side of scoring: where the clean model's rows over a sequence's completion come from.

One contract, `CleanBackend.completion_rows(sequence, chunk_positions)`: float32 `[c, V]` rows,
`chunk_positions` at a time, the row at step s predicting `token_ids[prompt_length + s]`. A
row may be the clean logits or the clean log-probabilities: every statistic the scorer computes
(tau2 and the sigma2 of served - clean, softmax, KL, argmax, the scoreboard) is invariant to a
constant added to a row, so the two give the same records.

- `InProcessModel`: a transformers model in this process, on a chosen device and dtype (the
  scorer reads the served model's rows through it too, until they come from the engine).
- `RemoteClean`: the clean model served by a stock vLLM OpenAI server (started as vLLM
  documents it, with `--max-logprobs -1`), asked for the prompt log-probabilities of the whole
  vocabulary (`prompt_logprobs=-1`, `max_tokens=1`) over prompt + completion. This is the path
  for a clean model that does not fit beside the served one, and for several served replicas
  sharing one clean scorer. The answer is exact (the full distribution), so its cost is about
  V x 40 bytes of JSON per scored position: fine for small vocabularies and sampled traffic,
  and the reason the served side's vocabulary must match (checked by the scorer).

Both report their health through `status()`. `RemoteClean` raises `CleanBackendError` for
anything but a well-formed answer (connection refused, timeout, HTTP error, rows missing), so
an unreachable or overloaded clean server costs the shadow scorer one dropped item per request
and never reaches serving; its counters show on `/v1/nts/status`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import torch
from torch import Tensor

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from noisy_temp_server.scoring.sequence import ScoringSequence

__all__ = ["CleanBackend", "CleanBackendError", "InProcessModel", "RemoteClean"]


class CleanBackendError(RuntimeError):
    """The clean backend gave no usable rows for a sequence (the message says why)."""


class CleanBackend(Protocol):
    """Where the clean rows of a sequence come from (see the module docstring)."""

    @property
    def vocab_size(self) -> int | None:
        """Columns of a row, when known before the first answer (None: not yet known)."""
        ...

    def completion_rows(
        self, sequence: ScoringSequence, chunk_positions: int
    ) -> Iterator[Tensor]: ...

    def status(self) -> dict[str, Any]: ...


class InProcessModel:
    """A transformers causal LM in this process: one forward pass per sequence, the output
    head applied `chunk_positions` rows at a time (peak memory `chunk_positions x V`). The
    model is used as given (its device and dtype; not modified); rows are float32 logits.
    `role` names the model in errors."""

    def __init__(self, model: PreTrainedModel, role: str = "clean") -> None:
        if getattr(model.config, "final_logit_softcapping", None):
            raise ValueError(f"the {role} model soft-caps its logits; the scorer cannot")
        self.model = model
        self.device = next(model.parameters()).device

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @torch.no_grad()
    def completion_rows(self, sequence: ScoringSequence, chunk_positions: int) -> Iterator[Tensor]:
        ids = torch.tensor(list(sequence.token_ids), dtype=torch.int64, device=self.device)
        start, stop = sequence.prompt_length - 1, len(ids) - 1
        hidden = self.model.base_model(input_ids=ids.unsqueeze(0)).last_hidden_state[0]
        hidden = hidden[start:stop]
        head = self.model.get_output_embeddings()
        for first in range(0, stop - start, chunk_positions):
            yield head(hidden[first : first + chunk_positions]).float()

    def status(self) -> dict[str, Any]:
        return {
            "kind": "in_process",
            "device": str(self.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
        }


class RemoteClean:
    """The clean model behind a vLLM OpenAI-compatible server (see the module docstring).

    base_url: e.g. `http://clean-scorer:8000`; model: the name it serves the clean model
    under; vocab_size: the clean model's vocabulary (each answer must have that many
    log-probabilities per position); timeout_s: per request, so an overloaded server fails
    fast. Thread-safe (one `httpx.Client`).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        vocab_size: int,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s, transport=transport
        )
        self.base_url = base_url
        self.model = model
        self._vocab_size = vocab_size
        self._lock = threading.Lock()
        self._counts = {"requests": 0, "failures": 0}
        self._last_error: str | None = None
        self._last_seconds: float | None = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def completion_rows(self, sequence: ScoringSequence, chunk_positions: int) -> Iterator[Tensor]:
        rows = self._fetch(sequence)
        yield from rows.split(chunk_positions)

    def _fetch(self, sequence: ScoringSequence) -> Tensor:
        started = time.perf_counter()
        with self._lock:
            self._counts["requests"] += 1
        try:
            rows = self._request(sequence)
        except CleanBackendError as error:
            self._fail(str(error))
            raise
        except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as error:
            message = f"clean server {self.base_url}: {type(error).__name__}: {error}"
            self._fail(message)
            raise CleanBackendError(message) from error
        with self._lock:
            self._last_seconds = time.perf_counter() - started
            self._last_error = None
        return rows

    def _fail(self, message: str) -> None:
        with self._lock:
            self._counts["failures"] += 1
            self._last_error = message

    def _request(self, sequence: ScoringSequence) -> Tensor:
        body = {
            "model": self.model,
            "prompt": list(sequence.token_ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": -1,
        }
        response = self._client.post("/v1/completions", json=body)
        if response.status_code != 200:
            raise CleanBackendError(
                f"clean server {self.base_url} answered HTTP {response.status_code}: "
                f"{response.text[:300]}"
            )
        positions = response.json()["choices"][0]["prompt_logprobs"]
        wanted = positions[sequence.prompt_length :]
        if len(wanted) != len(sequence.token_ids) - sequence.prompt_length:
            raise CleanBackendError(
                f"clean server {self.base_url}: {len(positions)} prompt positions for a "
                f"sequence of {len(sequence.token_ids)} tokens"
            )
        rows = torch.full((len(wanted), self._vocab_size), float("-inf"))
        for row, entries in enumerate(wanted):
            if entries is None or len(entries) < self._vocab_size:
                raise CleanBackendError(
                    f"clean server {self.base_url}: position {row} has "
                    f"{0 if entries is None else len(entries)} log-probabilities, not the "
                    f"whole vocabulary ({self._vocab_size}); start it with --max-logprobs -1"
                )
            ids = torch.tensor([int(token) for token in entries])
            values = torch.tensor([float(entry["logprob"]) for entry in entries.values()])
            rows[row, ids] = values
        return rows

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "kind": "remote",
                "url": self.base_url,
                "model": self.model,
                **self._counts,
                "healthy": self._last_error is None,
                "last_error": self._last_error,
                "last_request_seconds": self._last_seconds,
            }

    def close(self) -> None:
        self._client.close()
