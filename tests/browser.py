"""A headless Chromium the site's tests drive, over the DevTools protocol on a pipe.

Chromium started with ``--remote-debugging-pipe`` reads protocol commands on its file
descriptor 3 and answers on 4, each message JSON ended by a NUL byte: no port, no websocket
library, no browser download (Debian's ``chromium`` package, ``RLS_CHROMIUM`` else ``chromium``
on the PATH). One page, whose window size the tests set, opens the built site over ``file://``.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--disable-dev-shm-usage",  # a container's small /dev/shm would crash the renderer
    "--remote-debugging-pipe",
)
TIMEOUT_S = 60.0


class BrowserError(RuntimeError):
    """Chromium is missing, died, or answered a command with an error."""


def chromium() -> str:
    named = os.environ.get("RLS_CHROMIUM") or shutil.which("chromium")
    if not named or not Path(named).exists():
        raise BrowserError("chromium is missing: `make docs-browser` installs it as root (apt-get install chromium)")
    return named


def _high_pipe() -> tuple[int, int]:
    """A pipe whose two ends are above 4, so that moving them onto 3 and 4 overwrites neither."""
    ends = []
    for end in os.pipe():
        ends.append(fcntl.fcntl(end, fcntl.F_DUPFD_CLOEXEC, 10))
        os.close(end)
    return ends[0], ends[1]


class Browser:
    """One headless Chromium with one page; ``close()`` ends it (or use ``with``)."""

    def __init__(self, width: int, height: int) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="rls-chromium-", ignore_cleanup_errors=True)
        to_browser_r, self._to_browser = _high_pipe()
        self._from_browser, from_browser_w = _high_pipe()

        def on_fds_3_and_4() -> None:
            # The browser's ends of both pipes, at the numbers --remote-debugging-pipe reads
            # (inheritable; every other descriptor of this process is not, PEP 446).
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        self._process = subprocess.Popen(
            [chromium(), *FLAGS, f"--user-data-dir={self._profile.name}", f"--window-size={width},{height}"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=False,
            preexec_fn=on_fds_3_and_4,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        target = self._command("Target.createTarget", url="about:blank")["targetId"]
        self._session = self._command("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.command("Page.enable")
        self.resize(width, height)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Ask chromium to quit (its helper processes with it), then kill it if it lingers."""
        with contextlib.suppress(BrowserError):  # it may quit before it answers
            self._command("Browser.close")
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=TIMEOUT_S)
        os.close(self._to_browser)
        os.close(self._from_browser)
        self._profile.cleanup()

    def resize(self, width: int, height: int) -> None:
        """The page's viewport, as a phone's or a desktop's window (not a mobile emulation)."""
        self.command(
            "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
        )

    def open(self, url: str) -> None:
        """Load ``url`` and wait for its load event (Material's scripts have run by then)."""
        self._events.clear()
        self.command("Page.navigate", url=url)
        self._wait_for("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        reply = self.command("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in reply:
            raise BrowserError(f"{expression[:80]!r}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, within_s: float = 20.0) -> Any:
        """The value of ``expression`` once it is truthy (a script still drawing, a search worker
        still loading its index); its last value when ``within_s`` has passed."""
        deadline = time.monotonic() + within_s
        value = self.evaluate(expression)
        while not value and time.monotonic() < deadline:
            time.sleep(0.1)
            value = self.evaluate(expression)
        return value

    def screenshot(self, path: Path) -> None:
        """The whole page, as tall as it is, into a PNG."""
        height = int(self.evaluate("document.documentElement.scrollHeight"))
        width = int(self.evaluate("window.innerWidth"))
        shot = self.command(
            "Page.captureScreenshot",
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
        )
        path.write_bytes(base64.b64decode(shot["data"]))

    def command(self, method: str, **params: Any) -> dict[str, Any]:
        """A command to the page."""
        return self._command(method, session=self._session, **params)

    def _command(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._receive()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply["result"]
                return result
            if "method" in reply:
                self._events.append(reply)

    def _wait_for(self, event: str) -> None:
        while not any(e["method"] == event for e in self._events):
            self._events.append(self._receive())

    def _receive(self) -> dict[str, Any]:
        deadline = time.monotonic() + TIMEOUT_S
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._from_browser], [], [], max(left, 0))
            if not ready:
                raise BrowserError(f"chromium said nothing for {TIMEOUT_S:.0f} s")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise BrowserError(f"chromium ended (exit code {self._process.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        parsed: dict[str, Any] = json.loads(message)
        return parsed
