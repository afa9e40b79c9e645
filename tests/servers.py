"""Real Redis processes for the tests: started on free ports in temp dirs, never the machine's
own Redis on 6379, always torn down. Nothing here installs anything: `make test` made sure the
binaries exist, and a missing binary fails the test run instead of skipping."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import redis

REDIS_SERVER = "redis-server"


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed: run `make test`, which installs it")
    return path


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: object, timeout: float = 10.0, interval: float = 0.02, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if predicate():  # type: ignore[operator]
                return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


class RedisServer:
    """One redis-server process; ``kill``/``restart`` keep its port and data dir."""

    def __init__(self, args: Sequence[str] = (), port: int | None = None, directory: str | None = None) -> None:
        self.binary = require_binary(REDIS_SERVER)
        self.port = port or free_port()
        self.dir = directory or tempfile.mkdtemp(prefix="rls-redis-")
        self.args = list(args)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def logfile(self) -> Path:
        return Path(self.dir) / "redis.log"

    def command(self) -> list[str]:
        return [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.dir,
            "--save",
            "",
            "--appendonly",
            "no",
            "--logfile",
            str(self.logfile),
            "--daemonize",
            "no",
            *self.args,
        ]

    def start(self) -> RedisServer:
        self.process = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._answers, timeout=15, what=f"redis-server on port {self.port}")
        return self

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            log = self.logfile.read_text() if self.logfile.exists() else ""
            raise RuntimeError(f"redis-server exited with {self.process.returncode}: {log[-2000:]}")
        return bool(self.client().ping())

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **kwargs)  # type: ignore[arg-type]

    def kill(self) -> None:
        """SIGKILL: no shutdown save, clients see a reset."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running(args: Sequence[str] = ()) -> Iterator[RedisServer]:
    server = RedisServer(args).start()
    try:
        yield server
    finally:
        server.cleanup()


def is_machine_redis(port: int) -> bool:
    """The machine's own Redis listens on 6379: tests never use or flush it."""
    return port == 6379 or os.environ.get("RLS_TEST_ALLOW_6379") == "1"
