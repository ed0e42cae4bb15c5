"""The compensation adapter over HTTP, with the fake engine: which requests get it (folded and
LoRA paths), `nts.adapter`, the 400s, `/v1/models`, `/v1/nts/status`, `nts_adapter_info`, and
that requests served without it are never shadow-sampled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from server_fakes import MODEL, POLICY, Harness, assert_error, build, sse_events

from noisy_temp_server.adapter.serving import CalibratedKl, ServedAdapter
from noisy_temp_server.settings import Settings

SHA = "ab" * 32


CALIBRATED = CalibratedKl(without_adapter=0.48, with_adapter=0.18)


def _adapter(path: str) -> ServedAdapter:
    folder = Path("/adapters/adapter-abab")
    return ServedAdapter(SHA, path, folder, rank=16, model_name=MODEL, calibrated_kl=CALIBRATED)  # type: ignore[arg-type]


class _AdmittingShadow:
    """A shadow scorer that samples every request it is offered (and scores nothing)."""

    def __init__(self) -> None:
        self.admitted: list[str] = []

    def admit(self, trace_id: str, max_positions: int) -> bool:
        self.admitted.append(trace_id)
        return True

    def submit(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def cancel(self, trace_id: str) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {"enabled": True}


def _complete(server: Harness, **extra: Any) -> Any:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 2, **extra}
    return server.post("/v1/completions", body)


def test_folded_adapter_is_reported_and_attaches_no_lora() -> None:
    server = build(Settings(), POLICY, adapter=_adapter("folded"))
    response = _complete(server)
    assert response.status_code == 200, response.text
    assert response.json()["nts"]["adapter"] == SHA
    assert response.json()["choices"][0]["nts"]["adapter"] == SHA
    assert server.engine.lora_requests == [None]


def test_folded_adapter_cannot_be_turned_off() -> None:
    server = build(Settings(), POLICY, adapter=_adapter("folded"))
    error = assert_error(_complete(server, nts_adapter=False), 400)
    assert "folded into the served weights" in error["message"]
    assert error["param"] == "nts_adapter"
    error = assert_error(_complete(server, model=f"{MODEL}-base"), 400)
    assert "folded into the served weights" in error["message"]
    assert server.engine.calls == []


def test_lora_adapter_is_attached_to_every_request_by_default() -> None:
    server = build(Settings(), POLICY, adapter=_adapter("lora"))
    assert _complete(server).json()["nts"]["adapter"] == SHA
    assert _complete(server, nts_adapter=SHA[:16]).json()["nts"]["adapter"] == SHA
    requests = server.engine.lora_requests
    assert len(requests) == 2
    assert all(r is not None for r in requests)
    assert requests[0].lora_path == "/adapters/adapter-abab"  # type: ignore[union-attr]
    assert requests[0].lora_int_id == 1  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "extra", [{"nts_adapter": False}, {"vllm_xargs": {"nts_adapter": "false"}}, {"model": None}]
)
def test_lora_adapter_is_off_by_key_or_base_model(extra: dict[str, Any]) -> None:
    shadow = _AdmittingShadow()
    server = build(Settings(), POLICY, adapter=_adapter("lora"), shadow=shadow)
    if "model" in extra:
        extra = {"model": f"{MODEL}-base"}
    response = _complete(server, temperature=1.0, **extra)
    assert response.status_code == 200, response.text
    assert response.json()["nts"]["adapter"] is None
    assert response.json()["model"] == extra.get("model", MODEL)  # the id it asked for
    assert server.engine.lora_requests == [None]
    assert shadow.admitted == []  # never mixed into the online fit
    _complete(server, temperature=1.0)
    assert len(shadow.admitted) == 1


def test_streamed_chunks_carry_the_adapter() -> None:
    server = build(Settings(), POLICY, adapter=_adapter("lora"))
    response = _complete(server, stream=True)
    events = [event for event in sse_events(response) if event != "[DONE]"]
    assert events[-1]["nts"]["adapter"] == SHA


@pytest.mark.parametrize(
    ("adapter", "extra"),
    [
        ("lora", {"nts_adapter": "cd" * 32}),
        ("lora", {"nts_adapter": "ab"}),  # too short a prefix to name anything
        ("lora", {"nts_adapter": 3}),
        ("lora", {"model": f"{MODEL}-base", "nts_adapter": True}),
        (None, {"nts_adapter": True}),
        (None, {"nts_adapter": SHA}),
    ],
)
def test_requests_naming_an_adapter_the_server_does_not_hold_are_400(
    adapter: str | None, extra: dict[str, Any]
) -> None:
    server = build(Settings(), POLICY, adapter=None if adapter is None else _adapter(adapter))
    error = assert_error(_complete(server, **extra), 400)
    assert error["param"].startswith("nts_adapter")  # pydantic's own 400 adds the type tried
    assert server.engine.calls == []


def test_no_adapter_reports_null_and_takes_false() -> None:
    server = build(Settings(), POLICY)
    assert _complete(server).json()["nts"]["adapter"] is None
    assert _complete(server, nts_adapter=False).status_code == 200


def test_models_list_the_base_model_on_the_lora_path_only() -> None:
    lora = build(Settings(), POLICY, adapter=_adapter("lora"))
    ids = [card["id"] for card in lora.client.get("/v1/models").json()["data"]]
    assert ids == [MODEL, f"{MODEL}-base"]
    folded = build(Settings(), POLICY, adapter=_adapter("folded"))
    assert [card["id"] for card in folded.client.get("/v1/models").json()["data"]] == [MODEL]


@pytest.mark.parametrize("path", ["folded", "lora", None])
def test_status_and_metrics_say_which_path_is_in_force(path: str | None) -> None:
    server = build(Settings(), POLICY, adapter=None if path is None else _adapter(path))
    status = server.client.get("/v1/nts/status").json()["adapter"]
    assert status["path"] == (path or "none")
    assert status["sha256"] == (None if path is None else SHA)
    assert status["base_model_id"] == (f"{MODEL}-base" if path == "lora" else None)
    expected = None if path is None else {"without_adapter": 0.48, "with_adapter": 0.18}
    assert status["calibrated_kl"] == expected
    sha = "" if path is None else SHA[:16]
    assert server.metric("nts_adapter_info", path=path or "none", sha256=sha) == 1
