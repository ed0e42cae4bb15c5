"""The engine asks Linux for AMX before vLLM's CPU kernels use it (else SIGILL)."""

from __future__ import annotations

import pytest

from noisy_temp_server.vllm_plugin import cpu_amx


def test_nothing_is_asked_on_a_cpu_without_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_amx, "_has_amx", lambda: False)
    assert cpu_amx.request_amx_permission() is False


@pytest.mark.skipif(not cpu_amx._has_amx(), reason="needs a CPU with AMX")
def test_a_cpu_with_amx_grants_it() -> None:
    assert cpu_amx.request_amx_permission() is True
    assert cpu_amx.request_amx_permission() is True  # asking again is harmless
