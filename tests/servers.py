"""Real Redis processes for the tests: started on free ports in temp dirs, never the machine's
own Redis on 6379, always torn down. Nothing here installs anything: `make test` made sure the
binaries exist, and a missing binary fails the test run instead of skipping."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence

from redis_layer_signals.bench.server import REDIS_SERVER, LocalRedis, free_port

__all__ = ["REDIS_SERVER", "RedisServer", "free_port", "require_binary", "running", "wait_until"]


def require_binary(name: str) -> str:
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


class RedisServer(LocalRedis):
    """The package's one redis-server starter (:class:`redis_layer_signals.bench.server.LocalRedis`),
    with the test run's message for a missing binary and a restart that keeps port and data."""

    def __init__(
        self,
        args: Sequence[str] = (),
        port: int | None = None,
        directory: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(args, port, directory, binary=require_binary(REDIS_SERVER), env=env)

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
