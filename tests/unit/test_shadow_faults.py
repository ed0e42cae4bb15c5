"""Faults in shadow scoring never reach serving: a scorer that raises, a hung clean model and a
full queue leave every response correct, and show on /v1/nts/status and in
`nts_shadow_requests_dropped_total` by reason."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from server_fakes import (
    MAX_MODEL_LEN,
    MODEL,
    POLICY,
    VOCAB,
    FakeEngine,
    FakeEstimator,
    FakeScorer,
    FakeTokenizer,
    FakeTraces,
)
from server_helpers import free_port
from starlette.types import Message
from tiny_model import TINY_VOCAB_SIZE

from noisy_temp_server.correction.files import bias_sha256, save_bias_file
from noisy_temp_server.engine_contract.keys import BIAS_DIR_ENV
from noisy_temp_server.online.policy_source import StaticPolicySource
from noisy_temp_server.online.shadow import ShadowScorer
from noisy_temp_server.scoring.clean_backend import RemoteClean
from noisy_temp_server.scoring.records import PositionRecords
from noisy_temp_server.scoring.scorer import LiveScores, PairScorer, ServedRows
from noisy_temp_server.scoring.sequence import ScoringSequence
from noisy_temp_server.server.app import create_app
from noisy_temp_server.server.metrics import ApiMetrics
from noisy_temp_server.settings import Settings
from noisy_temp_server.temperature.policy import TemperaturePolicy

REQUESTS = 12
BODY = {"prompt": "abc", "max_tokens": 2}
EXPECTED_TEXT = " t3 t4"  # the fake engine's tokens after a 3-token prompt


class HungScorer(FakeScorer):
    """A clean model that never returns until released."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def score_live(
        self,
        sequence: ScoringSequence,
        served_temperatures: Sequence[float],
        served: ServedRows,
        max_rows: int = 0,
        *,
        request_temperature: float,
        kl_curve: bool = True,
        bias: object = None,
    ) -> LiveScores:
        self.entered.set()
        self.release.wait(60)
        return super().score_live(
            sequence, served_temperatures, served, request_temperature=request_temperature
        )


class FailingEstimator(FakeEstimator):
    def add(self, records: PositionRecords, rows: object = None) -> None:
        raise ValueError("estimator broke")


class Served:
    def __init__(
        self,
        scorer: FakeScorer,
        estimator: FakeEstimator,
        queue_size: int,
        fraction: float = 1.0,
        policy: TemperaturePolicy = POLICY,
    ) -> None:
        self.registry = CollectorRegistry()
        self.engine = FakeEngine()
        self.traces = FakeTraces(1.25)
        metrics = ApiMetrics(self.registry)
        self.shadow = ShadowScorer(
            scorer,
            estimator,
            metrics.online,
            fraction=fraction,
            queue_size=queue_size,
            rows=self.traces,
            positions=128,
            version_of=int,
            on_policy=lambda _: None,
            rng=random.Random(0),
        ).start()
        app = create_app(
            Settings(),
            self.engine,
            tokenizer=FakeTokenizer(),
            model_name=MODEL,
            max_model_len=MAX_MODEL_LEN,
            policy_source=StaticPolicySource(policy, "test"),
            metrics=metrics,
            metrics_registry=self.registry,
            trace_source=self.traces,
            shadow=self.shadow,
        )
        self.client = TestClient(app)

    def serve_all(self) -> None:
        """REQUESTS requests, plain and streamed: every one served, and correctly."""
        for i in range(REQUESTS):
            if i % 2:
                response = self.client.post("/v1/completions", json={**BODY, "stream": True})
                assert response.status_code == 200
                assert "[DONE]" in response.text
                assert '"error"' not in response.text
            else:
                response = self.client.post("/v1/completions", json=BODY)
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["text"] == EXPECTED_TEXT

    def status(self) -> dict[str, Any]:
        return dict(self.client.get("/v1/nts/status").json()["shadow"])

    def engine_keys(self) -> list[dict[str, Any]]:
        """The `nts_*` keys of every engine request so far."""
        return [dict(params.extra_args or {}) for _, params, _ in self.engine.calls]

    def value(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def dropped(self, reason: str) -> float:
        value = self.registry.get_sample_value(
            "nts_shadow_requests_dropped_total", {"reason": reason}
        )
        return value or 0.0


@pytest.fixture
def hung() -> Iterator[tuple[Served, HungScorer]]:
    scorer = HungScorer()
    served = Served(scorer, FakeEstimator(every=4), queue_size=2)
    yield served, scorer
    scorer.release.set()
    served.shadow.close()


@pytest.mark.parametrize(
    ("scorer", "estimator"),
    [(FakeScorer(fail=True), FakeEstimator(every=4)), (FakeScorer(), FailingEstimator(4))],
    ids=["scorer raises", "estimator raises"],
)
def test_a_failing_scorer_drops_its_items_and_serving_is_untouched(
    scorer: FakeScorer, estimator: FakeEstimator
) -> None:
    served = Served(scorer, estimator, queue_size=64)
    try:
        served.serve_all()
        assert served.shadow.wait_idle(10)
        status = served.status()
        assert status["running"] is True  # the thread survived every failure
        assert status["dropped_error"] == REQUESTS
        assert status["scored"] == 0
        assert served.dropped("error") == REQUESTS
    finally:
        served.shadow.close()


def test_a_hung_clean_model_fills_the_queue_and_serving_is_untouched(
    hung: tuple[Served, HungScorer],
) -> None:
    served, scorer = hung
    served.client.post("/v1/completions", json=BODY)
    assert scorer.entered.wait(10)
    served.serve_all()  # would hang here if offering waited for the scorer
    status = served.status()
    assert status["busy_for_s"] is not None
    assert status["busy_for_s"] > 0
    assert status["queue_depth"] == status["queue_size"] == 2
    assert status["dropped_queue_full"] == REQUESTS - 2
    assert served.dropped("queue_full") == REQUESTS - 2
    scorer.release.set()
    assert served.shadow.wait_idle(10)
    after = served.status()
    assert after["busy_for_s"] is None
    assert after["scored"] == 3


def test_close_says_whether_the_scoring_thread_ended(
    hung: tuple[Served, HungScorer], caplog: pytest.LogCaptureFixture
) -> None:
    served, scorer = hung
    served.client.post("/v1/completions", json=BODY)
    assert scorer.entered.wait(10)
    assert served.shadow.close(timeout=0.1) is False  # still scoring
    assert "still scoring" in caplog.text
    scorer.release.set()
    assert served.shadow.close() is True  # closed already: nothing runs


def test_a_full_queue_drops_without_blocking_the_submit() -> None:
    scorer = HungScorer()
    served = Served(scorer, FakeEstimator(every=4), queue_size=1)
    try:

        def submit() -> bool:
            return served.shadow.submit(
                [1, 2], [3], [1.0], "t", request_id="r", request_temperature=1.0
            )

        assert submit()  # taken by the (hung) scorer
        assert scorer.entered.wait(10)
        assert submit()  # fills the queue
        assert [submit() for _ in range(5)] == [False] * 5
        assert served.dropped("queue_full") == 5
        assert served.status()["dropped_queue_full"] == 5
    finally:
        scorer.release.set()
        served.shadow.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_sampled_request_the_engine_refuses_is_cancelled(stream: bool) -> None:
    """Its reservation goes back and its rows are let go, streamed or not (a streamed request
    refused before its first output never reaches the stream's own cleanup)."""
    served = Served(FakeScorer(), FakeEstimator(every=4), queue_size=4)
    try:
        body = {"prompt": [5, VOCAB + 1], "max_tokens": 2, "stream": stream}
        assert served.client.post("/v1/completions", json=body).status_code == 400
        assert served.status()["sampled"] == 1
        assert len(served.traces.dropped) == 1  # `cancel`: the reservation comes back
        assert served.traces.forgotten == served.traces.dropped
    finally:
        served.shadow.close()


def _completions_call(spec_version: str, body: dict[str, Any]) -> tuple[dict[str, Any], Message]:
    """The ASGI scope of a POST to /v1/completions and the message carrying `body`."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    return scope, {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}


async def _post_and_vanish(
    served: Served, spec_version: str, body: dict[str, Any]
) -> tuple[list[Message], list[str], list[str]]:
    """POST `body` to /v1/completions straight through ASGI with a client that is gone as soon
    as the request is read: it answers every later `receive` with a disconnect (ASGI spec
    2.3, as uvicorn speaks it) or, from spec 2.4 on, fails every `send` with OSError. Returns
    the messages sent, the trace ids whose captured rows were dropped and the engine requests
    aborted by the time the ASGI call returned (not later, when the event loop finalizes a
    forgotten generator)."""
    scope, request = _completions_call(spec_version, body)
    requests: list[Message] = [request]
    sent: list[Message] = []

    async def receive() -> Message:
        return requests.pop() if requests else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if spec_version >= "2.4":
            raise OSError("the client is gone")
        sent.append(message)

    await served.client.app(scope, receive, send)  # a client gone is no error of the app's
    return sent, list(served.traces.dropped), list(served.engine.aborted)


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"], ids=["disconnect", "send fails"])
def test_a_sampled_stream_whose_client_is_gone_is_cancelled_when_its_call_ends(
    spec_version: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The client is gone before the stream ends (before its first event when sending
    fails): by the time the response's ASGI call returns, its engine request is aborted and
    the sampled choice's reservation is back and its rows and trace are let go, exactly
    once; a client gone is no server fault, so nothing is logged as one."""
    served = Served(FakeScorer(), FakeEstimator(every=4), queue_size=4)
    try:
        body = {**BODY, "max_tokens": 20, "stream": True}
        sent, dropped, aborted = asyncio.run(_post_and_vanish(served, spec_version, body))
        assert b"[DONE]" not in b"".join(m.get("body", b"") for m in sent)
        assert served.status()["sampled"] == 1
        assert len(dropped) == 1  # `cancel`: the reservation came back
        assert aborted == dropped  # the engine request id is the choice's trace id
        assert served.traces.dropped == dropped
        assert served.traces.forgotten == dropped
        assert served.shadow.status()["scored"] == 0
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        status = "499" if spec_version >= "2.4" else "200"  # 2.3: it went out, then the client
        labels = {"method": "POST", "route": "/v1/completions", "status": status}
        assert served.registry.get_sample_value("nts_http_requests_total", labels) == 1
    finally:
        served.shadow.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_sampled_request_cancelled_before_its_first_output_lets_everything_go(
    stream: bool,
) -> None:
    """The handler is cancelled (the server shutting down, a timeout) while the engine has not
    yet produced a token and the client still waits: by the time the cancelled call returns,
    the engine request is aborted and the sampled choice's reservation, rows and trace are let
    go."""
    served = Served(FakeScorer(), FakeEstimator(every=4), queue_size=4)
    served.engine.step_seconds = 60.0

    async def cancel_while_waiting() -> tuple[list[str], list[str], list[str]]:
        scope, request = _completions_call("2.3", {**BODY, "stream": stream})
        requests: list[Message] = [request]

        async def receive() -> Message:
            if requests:
                return requests.pop()
            await asyncio.Event().wait()  # the client stays
            raise AssertionError("unreachable")

        async def send(message: Message) -> None:
            raise AssertionError(f"nothing is sent before the first output: {message}")

        async def post() -> None:
            await served.client.app(scope, receive, send)

        call = asyncio.create_task(post())
        while not served.engine.calls:
            await asyncio.sleep(0.01)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        traces = served.traces
        return list(served.engine.aborted), list(traces.dropped), list(traces.forgotten)

    try:
        aborted, dropped, forgotten = asyncio.run(cancel_while_waiting())
        trace_id = served.engine.calls[0][2]
        assert aborted == [trace_id]
        assert dropped == [trace_id]  # `cancel`: the reservation came back
        assert forgotten == [trace_id]
        assert served.status()["sampled"] == 1
        assert served.shadow.status()["scored"] == 0
        # no response, no fault of the app's: counted as the client-closed 499, not as 500
        labels = {"method": "POST", "route": "/v1/completions"}
        assert (
            served.registry.get_sample_value("nts_http_requests_total", {**labels, "status": "499"})
            == 1
        )
        assert (
            served.registry.get_sample_value("nts_http_requests_total", {**labels, "status": "500"})
            is None
        )
    finally:
        served.shadow.close()


def test_a_sampled_tuned_request_runs_traced_and_its_full_trace_is_scored() -> None:
    served = Served(FakeScorer(), FakeEstimator(every=100), queue_size=8, fraction=1.0)
    try:
        response = served.client.post("/v1/completions", json={**BODY, "max_tokens": 5})
        assert response.status_code == 200, response.text
        assert served.shadow.wait_idle(10)
    finally:
        served.shadow.close()
    assert response.json()["nts"]["trace"] is None  # the client did not ask for it
    assert [keys.get("nts_trace") for keys in served.engine_keys()] == [True]
    assert [keys.get("nts_capture") for keys in served.engine_keys()] == [True]
    assert served.traces.taken == [(served.engine_keys()[0]["nts_trace_id"], 5)]
    assert served.value("nts_shadow_kl_nats_count", temperature="one") == 5
    assert served.value("nts_shadow_kl_nats_count", temperature="served") == 5
    status = served.status()
    assert (status["offered"], status["sampled"], status["scored"]) == (1, 1, 1)


@pytest.mark.parametrize(
    ("extra", "scored_at"),
    [({}, 1.0), ({"temperature": 0.5}, 0.5), ({"temperature": 1.3, "n": 2}, 1.3)],
    ids=["default", "0.5", "two choices at 1.3"],
)
def test_a_sampled_choice_is_scored_at_its_own_request_temperature(
    extra: dict[str, Any], scored_at: float
) -> None:
    scorer = FakeScorer()
    served = Served(scorer, FakeEstimator(every=100), queue_size=8, fraction=1.0)
    try:
        response = served.client.post("/v1/completions", json={**BODY, **extra})
        assert response.status_code == 200, response.text
        assert served.shadow.wait_idle(10)
    finally:
        served.shadow.close()
    choices = extra.get("n", 1)
    assert scorer.request_temperatures == pytest.approx([scored_at] * choices)
    assert len({sequence.sequence_id for sequence in scorer.sequences}) == 1  # one request


def test_the_choices_of_two_requests_are_two_sequences() -> None:
    scorer = FakeScorer()
    served = Served(scorer, FakeEstimator(every=100), queue_size=8, fraction=1.0)
    try:
        for _ in range(2):
            response = served.client.post("/v1/completions", json={**BODY, "n": 2})
            assert response.status_code == 200, response.text
        assert served.shadow.wait_idle(10)
    finally:
        served.shadow.close()
    ids = [sequence.sequence_id for sequence in scorer.sequences]
    assert len(ids) == 4
    assert len(set(ids)) == 2


def test_an_unsampled_request_is_not_traced_in_the_engine_keys() -> None:
    served = Served(FakeScorer(), FakeEstimator(every=100), queue_size=8, fraction=0.0)
    try:
        for body in (BODY, {**BODY, "stream": True}):
            assert served.client.post("/v1/completions", json=body).status_code == 200
        assert served.shadow.wait_idle(10)
    finally:
        served.shadow.close()
    keys = served.engine_keys()
    assert len(keys) == 2
    assert all("nts_trace" not in k and k.get("nts_trace_id") for k in keys)
    status = served.status()
    assert (status["offered"], status["sampled"], status["scored"]) == (2, 0, 0)


def test_a_sampled_request_is_scored_with_the_bias_it_was_served_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(BIAS_DIR_ENV, str(tmp_path))
    vector = torch.randn(16)
    save_bias_file(tmp_path, vector)
    policy = TemperaturePolicy(version=2, rule="fixed", bias=bias_sha256(vector))
    scorer = FakeScorer()
    served = Served(scorer, FakeEstimator(every=100), queue_size=8, policy=policy)
    try:
        for body in (BODY, {**BODY, "nts_bias": False}):
            assert served.client.post("/v1/completions", json=body).status_code == 200
            assert served.shadow.wait_idle(10)
    finally:
        served.shadow.close()
    bias, none = scorer.biases
    assert bias is not None
    assert torch.equal(bias, vector)
    assert none is None


def test_an_untuned_sampled_request_is_captured_under_its_trace_id() -> None:
    served = Served(FakeScorer(), FakeEstimator(every=100), queue_size=8, fraction=1.0)
    try:
        body = {**BODY, "nts_rule": "off"}
        assert served.client.post("/v1/completions", json=body).status_code == 200
        assert served.shadow.wait_idle(10)
    finally:
        served.shadow.close()
    (keys,) = served.engine_keys()
    assert keys["nts_capture"] is True
    assert keys["nts_trace_id"]
    assert served.status()["scored"] == 1


@pytest.mark.parametrize(
    "extra",
    [{"temperature": 0.0}, {"presence_penalty": 0.5}, {"logit_bias": {"3": 2.0}}],
    ids=["greedy", "penalty", "logit bias"],
)
def test_requests_whose_rows_are_not_the_models_are_never_sampled(extra: dict[str, Any]) -> None:
    served = Served(FakeScorer(), FakeEstimator(every=100), queue_size=8, fraction=1.0)
    try:
        assert served.client.post("/v1/completions", json={**BODY, **extra}).status_code == 200
    finally:
        served.shadow.close()
    assert "nts_capture" not in served.engine_keys()[0]
    assert served.status()["offered"] == 0


class NoRows(FakeTraces):
    def take_rows(self, trace_id: str, n_steps: int, timeout: float) -> None:  # type: ignore[override]
        return None


def test_an_item_whose_rows_never_came_is_dropped_and_serving_is_untouched() -> None:
    served = Served(FakeScorer(), FakeEstimator(every=4), queue_size=64)
    served.shadow._rows = NoRows(1.25)
    try:
        served.serve_all()
        assert served.shadow.wait_idle(10)
    finally:
        served.shadow.close()
    assert served.status()["dropped_not_captured"] == REQUESTS
    assert served.dropped("not_captured") == REQUESTS


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A listening socket that accepts connections and never answers (an overloaded server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize("fault", ["refused", "overloaded"])
def test_a_failing_remote_clean_server_drops_items_and_says_so(
    fault: str, tiny_model_dir: Path, silent_port: int
) -> None:
    port = free_port() if fault == "refused" else silent_port
    remote = RemoteClean(f"http://127.0.0.1:{port}", "clean", TINY_VOCAB_SIZE, timeout_s=0.3)
    scorer = PairScorer(remote)
    served = Served(scorer, FakeEstimator(every=4), queue_size=64)  # type: ignore[arg-type]
    try:
        served.serve_all()
        assert served.shadow.wait_idle(30)
        status = served.status()
        assert status["running"] is True
        assert status["dropped_error"] == REQUESTS
        assert served.dropped("error") == REQUESTS
        clean = status["clean_backend"]
        assert clean["kind"] == "remote"
        assert (clean["requests"], clean["failures"]) == (REQUESTS, REQUESTS)
        assert clean["healthy"] is False
        expected = "ConnectError" if fault == "refused" else "ReadTimeout"
        assert expected in clean["last_error"]
    finally:
        served.shadow.close()
        remote.close()
