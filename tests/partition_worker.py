"""A client process of the partition tests, run on a host of its own (``ip netns exec NS python
-m tests.partition_worker SPEC.json``): the race test's workers on threads sharing one client,
until a stop file appears, then their logs and call timings as JSON.

A call that raises :class:`BufferUnavailable` is sent again, the same call with the same token,
until it succeeds: the caller that resends on heal. The reply it replays is kept longer than the
library keeps it (``reply_ttl_s``), so a resend after a long partition still finds it; every
signal then has one known outcome, and the race test's accounting applies. Each attempt's wall
time is measured: that is what the ``retry_s`` bound is about.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from redis_layer_signals import BufferUnavailable, CacheTask, SignalBuffer
from redis_layer_signals.models import FinishResult, RecordResult, RegisterResult
from redis_layer_signals.protocol.calls import Prepared
from redis_layer_signals.transport.connection import sync_client
from tests.race import Log, Worker

MIN_OPERATIONS = 20


@dataclasses.dataclass
class Timing:
    """Attempts of one namespace's calls: the slowest, and how many raised BufferUnavailable;
    and each acknowledged call as ``[first attempt's start, acknowledged, signals recorded,
    registrations, signals handed out]`` (monotonic seconds, which every host shares), which
    places what a failover lost in time."""

    max_s: float = 0.0
    max_operation: str = ""
    attempts: int = 0
    unavailable: int = 0
    last_error: str = ""
    acks: list[list[float]] = dataclasses.field(default_factory=list)


class Resending:
    """``record``/``register``/``finish`` of a buffer, each resent on BufferUnavailable."""

    def __init__(self, buf: SignalBuffer, timing: Timing, lock: threading.Lock) -> None:
        self.buf = buf
        self.timing = timing
        self.lock = lock

    def _until_done(self, prepared: Prepared[Any], counts: Callable[[Any], tuple[int, int, int]]) -> Any:
        first = time.monotonic()
        while True:
            started = time.monotonic()
            try:
                result = self.buf._execute(prepared)
                acknowledged = time.monotonic()
                with self.lock:
                    self.timing.acks.append([first, acknowledged, *counts(result)])
                return result
            except BufferUnavailable as exc:
                with self.lock:
                    self.timing.unavailable += 1
                    self.timing.last_error = f"{exc!r} (cause {exc.__cause__!r})"
                time.sleep(0.05)
            finally:
                took = time.monotonic() - started
                with self.lock:
                    self.timing.attempts += 1
                    if took > self.timing.max_s:
                        self.timing.max_s, self.timing.max_operation = took, prepared.operation

    def record(self, instance: str, rank: int, layer: int, entries: Any) -> RecordResult:
        prepared = self.buf.protocol.record(instance, rank, layer, entries)
        return self._until_done(prepared, lambda r: (len(entries), 0, len(r.delivered)))  # type: ignore[no-any-return]

    def register(self, task: CacheTask, replace: bool = False) -> RegisterResult:
        prepared = self.buf.protocol.register(task, replace)
        return self._until_done(prepared, lambda r: (0, 1, len(r.recovered) + len(r.dropped)))  # type: ignore[no-any-return]

    def finish(self, instance: str, rank: int, slot: int, request_id: str) -> FinishResult:
        prepared = self.buf.protocol.finish(instance, rank, slot, request_id)
        return self._until_done(prepared, lambda r: (0, 0, 0))  # type: ignore[no-any-return]


class LagMeter:
    """How late this process's threads may run: a thread that sleeps ``TICK_S`` again and again
    and keeps the most it woke late (the CPU and the GIL it waited for, as any call's thread
    would). The tests widen the bound on an attempt by it: a deadline that fired on time
    still returns only when its thread runs."""

    TICK_S = 0.01

    def __init__(self, stop: Path) -> None:
        self.stop = stop
        self.max_s = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True, name="lag-meter")

    def _run(self) -> None:
        while not self.stop.exists():
            started = time.monotonic()
            time.sleep(self.TICK_S)
            self.max_s = max(self.max_s, time.monotonic() - started - self.TICK_S)


def main(spec_path: str) -> None:
    faulthandler.register(signal.SIGUSR1)  # a test that finds this process hung asks for its stacks
    spec = json.loads(Path(spec_path).read_text())
    stop = Path(spec["stop"])
    client = sync_client(spec["url"], spec["retry_s"])  # one client: its threads share the slot table
    Path(spec["out"] + ".ready").touch()  # connected: the test may break things from now on
    lock = threading.Lock()
    logs: dict[str, list[Log]] = {ns: [] for ns in spec["namespaces"]}
    timings = {ns: Timing() for ns in spec["namespaces"]}
    errors: list[str] = []
    lag = LagMeter(stop)
    lag.thread.start()

    def run(namespace: str, worker: int) -> None:
        buf = SignalBuffer(
            client,
            namespace=namespace,
            retry_s=spec["retry_s"],
            wait_replicas=spec["wait_replicas"],
            wait_timeout_ms=spec["wait_timeout_ms"],
            env={},
        )
        buf.protocol._reply_ttl = str(int(spec["reply_ttl_s"] * 1000))
        runner = Worker(buf, worker, seed=spec["seed"])
        runner.buf = Resending(buf, timings[namespace], lock)  # type: ignore[assignment]
        try:
            op = 0
            while op < MIN_OPERATIONS or not stop.exists():
                op += 1
                runner.step(op)
        except BaseException as exc:
            errors.append(f"{namespace} worker {worker}: {exc!r}")
        with lock:
            logs[namespace].append(runner.log)

    threads = []
    for index, namespace in enumerate(spec["namespaces"]):
        for thread in range(spec["threads"]):
            worker = spec["worker_base"] + index * 100 + thread
            threads.append(threading.Thread(target=run, args=(namespace, worker), daemon=True))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out = {
        "errors": errors,
        "logs": {ns: [dataclasses.asdict(log) for log in found] for ns, found in logs.items()},
        "timings": {ns: {**dataclasses.asdict(t), "max_lag_s": lag.max_s} for ns, t in timings.items()},
    }
    Path(spec["out"]).write_text(json.dumps(out))


def load_logs(raw: list[dict[str, Any]]) -> list[Log]:
    """The logs of one namespace as the race test's :class:`Log` (signals back to tuples)."""
    logs = []
    for item in raw:
        fields = {k: [tuple(s) for s in v] if isinstance(v, list) else v for k, v in item.items()}
        logs.append(Log(**fields))
    return logs


if __name__ == "__main__":
    main(sys.argv[1])
