"""A real headless browser for tests: Debian's `chromium`, driven over the DevTools protocol on a
pipe (`--remote-debugging-pipe`: JSON messages ended by NUL on file descriptors 3 and 4), so no
driver or websocket package is needed.

`chromium_executable()` finds the browser; without one the calling test is skipped, except in
CI (`CI` set), where it fails: there the dev setup (`scripts/setup.sh --dev`) must have
installed it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

__all__ = ["Browser", "chromium_executable"]

_CHROMIUM_NAMES = ("chromium", "chromium-browser")


def chromium_executable() -> str:
    """The chromium on PATH; skips the test when there is none (fails in CI)."""
    for name in _CHROMIUM_NAMES:
        path = shutil.which(name)
        if path is not None:
            return path
    message = (
        "chromium not found: install Debian's chromium (`scripts/setup.sh --dev`, or "
        "`apt-get install -y chromium`) to run the browser tests."
    )
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


class Browser:
    """One headless chromium with one page. Use as a context manager."""

    def __init__(self, executable: str, profile_dir: Path, *, width: int = 1360) -> None:
        self._width = width
        to_browser_read, self._to_browser = os.pipe()
        self._from_browser, from_browser_write = os.pipe()
        arguments = [
            executable,
            "--headless",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile_dir}",
            f"--window-size={width},900",
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            "--disable-extensions",
            "--disable-background-networking",
        ]
        if os.geteuid() == 0:
            arguments.append("--no-sandbox")  # chromium refuses to run as root with its sandbox
        self._log = (profile_dir / "chromium.log").open("wb")
        # The protocol's fixed descriptors 3 and 4, set up by bash (dash takes one-digit fds
        # only; no preexec_fn: tests run servers in threads).
        wire_pipes = f'exec "$@" 3<&{to_browser_read} 4>&{from_browser_write}'
        self._process = subprocess.Popen(
            ["bash", "-c", wire_pipes, "bash", *arguments, "about:blank"],
            pass_fds=(to_browser_read, from_browser_write),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        os.close(to_browser_read)
        os.close(from_browser_write)
        self._buffer = b""
        self._next_id = 0
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        attached = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})
        self._session = attached["sessionId"]

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self._process.poll() is None:
            with contextlib.suppress(OSError, TimeoutError, RuntimeError):
                self._call("Browser.close", {}, timeout=10)
            try:
                self._process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=20)
        for fd in (self._to_browser, self._from_browser):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._log.close()

    # ------------------------------------------------------------------ protocol

    def _send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._to_browser, data) :]

    def _receive(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no answer from chromium in time")
            ready, _, _ = select.select([self._from_browser], [], [], remaining)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium exited ({self._process.poll()})")
                self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)  # type: ignore[no-any-return]

    def _call(
        self, method: str, params: dict[str, Any], *, session: bool = False, timeout: float = 30
    ) -> dict[str, Any]:
        """Send one command and return its result (events arriving meanwhile are dropped)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self._session
        self._send(message)
        deadline = time.monotonic() + timeout
        while True:
            answer = self._receive(deadline)
            if answer.get("id") != self._next_id:
                continue
            if "error" in answer:
                raise RuntimeError(f"{method}: {answer['error']}")
            return answer["result"]  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ page

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page (promises are awaited)."""
        result = self._call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            session=True,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str, timeout: float = 30) -> None:
        """Navigate to `url` and wait for the document to have loaded."""
        self._call("Page.navigate", {"url": url}, session=True)
        self.wait_for("document.readyState === 'complete'", timeout)

    def wait_for(self, expression: str, timeout: float) -> Any:
        """Poll `expression` until it is truthy; return its value. Fails the test on timeout
        with the page's visible text."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                text = self.evaluate("document.body ? document.body.innerText : ''")
                pytest.fail(f"not true within {timeout} s: {expression}\npage text:\n{text}")
            time.sleep(0.2)

    def screenshot(self, path: Path) -> Path:
        """A PNG of the whole page (all of its height) at `path`."""
        height = int(self.evaluate("document.documentElement.scrollHeight"))
        self._call(
            "Emulation.setDeviceMetricsOverride",
            {"width": self._width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session=True,
        )
        time.sleep(0.3)  # let the charts re-lay out at the new size
        shot = self._call("Page.captureScreenshot", {"format": "png"}, session=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path
