"""Headless Chromium driven over the DevTools protocol, for the dashboard's browser test.

Starts the system's `chromium` (its own process group and profile directory), opens one page
and speaks CDP to it over a websocket: navigate, evaluate JavaScript, take screenshots.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from services.common import process
from services.common.ports import free_ports

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    """The browser's path, from RIPTIDE_CHROMIUM or PATH (None: not installed)."""
    explicit = os.environ.get("RIPTIDE_CHROMIUM")
    if explicit:
        return explicit
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


class Chromium:
    """One headless browser with one page; use as a context manager."""

    def __init__(self, executable: str, width: int = 1400, height: int = 2400) -> None:
        self.executable, self.width, self.height = executable, width, height
        self.profile = Path(tempfile.mkdtemp(prefix="riptide-chromium-"))
        self.port = free_ports(1)[0]
        self._ids = itertools.count(1)
        self.proc: subprocess.Popen[bytes] | None = None
        self.ws: Any = None

    def __enter__(self) -> Chromium:
        import websocket

        self.proc = process.spawn([
            self.executable, "--headless=new", "--no-sandbox", "--disable-gpu",
            "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
            f"--user-data-dir={self.profile}", f"--remote-debugging-port={self.port}",
            f"--window-size={self.width},{self.height}", "about:blank",
        ], log_path=self.profile / "chromium.log")
        page = self._page_target(deadline=time.monotonic() + 60)
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60,
                                              suppress_origin=True)
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                  deviceScaleFactor=1, mobile=False)
        return self

    def _page_target(self, deadline: float) -> dict[str, Any]:
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited {self.proc.returncode}: "
                                   f"{(self.profile / 'chromium.log').read_text()[-2000:]}")
            try:
                targets = httpx.get(f"http://127.0.0.1:{self.port}/json/list", timeout=2).json()
                pages = [t for t in targets if t.get("type") == "page"]
                if pages:
                    return pages[0]
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError("chromium did not open its DevTools port within 60 s")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One CDP command; returns its result (events on the way are skipped)."""
        ident = next(self._ids)
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (a promise is awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True,
                           returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript error: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float) -> Any:
        """Poll a JavaScript expression until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.25)
        raise TimeoutError(f"{expression!r} still falsy after {timeout_s} s")

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        """A PNG of the page (its whole height when `full_page`)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.call("Page.getLayoutMetrics")["cssContentSize"]
            params.update(captureBeyondViewport=True, clip={
                "x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})
        data = self.call("Page.captureScreenshot", **params)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def __exit__(self, *exc_info: object) -> None:
        if self.ws is not None:
            self.ws.close()
        if self.proc is not None:
            process.stop(self.proc)
        shutil.rmtree(self.profile, ignore_errors=True)
