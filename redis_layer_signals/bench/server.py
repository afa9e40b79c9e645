"""A throwaway redis-server for a benchmark run: free port, temp dir, no persistence.

The benchmark never touches a server it did not start unless given ``--redis URL``.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

START_TIMEOUT_S = 15.0


class BenchServerError(OSError):
    """A server binary the benchmark needs is missing or did not come up (an OSError, so the
    command line reports it in one line)."""


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalRedis:
    """``with LocalRedis() as url:`` a fresh redis-server for the duration of the block."""

    def __init__(self, binary: str = "redis-server") -> None:
        found = shutil.which(binary)
        if found is None:
            raise BenchServerError(f"{binary} is not installed (apt-get install redis-server)")
        self.binary = found
        self.port = _free_port()
        self.dir = tempfile.mkdtemp(prefix="rls-bench-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> str:
        log = str(Path(self.dir) / "redis.log")
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir]
        command += ["--save", "", "--appendonly", "no", "--logfile", log, "--daemonize", "no"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BenchServerError(f"redis-server exited with {self.process.returncode}; see {log}")
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    client.close()
                    return self.url
            time.sleep(0.02)
        self.stop()
        raise BenchServerError(f"redis-server did not answer on port {self.port} within {START_TIMEOUT_S}s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()
