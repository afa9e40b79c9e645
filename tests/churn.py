"""A workload that keeps calling while a test breaks something: the race test's worker (record,
register and finish on the shared slots of p0/0, every outcome logged) on threads that run
until the fault is over, so the race test's accounting can check the result."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from redis_layer_signals import SignalBuffer
from tests.race import Log, Worker

JOIN_BOUND_S = 60.0
"""Bound on a worker thread across a fault: only catches a hang, never times a call."""


def churn(buf: SignalBuffer, worker: int, stop: threading.Event, seed: int, minimum: int = 40) -> Log:
    """The race test's worker on a given buffer, until told to stop (and at least ``minimum``
    operations)."""
    runner = Worker(buf, worker, seed)
    op = 0
    while op < minimum or not stop.is_set():
        op += 1
        runner.step(op)
    return runner.log


def churn_during(url: str, namespace: str, fault: Callable[[], None], workers: int = 3, **options: Any) -> list[Log]:
    """Run ``churn`` threads, apply ``fault()`` while they run, stop them and return their logs."""
    stop = threading.Event()
    logs: dict[int, Log] = {}
    errors: list[BaseException] = []

    def run(worker: int) -> None:
        buf = SignalBuffer.from_url(url, namespace=namespace, env={}, **options)
        try:
            logs[worker] = churn(buf, worker, stop, seed=3)
        except BaseException as exc:
            errors.append(exc)
        finally:
            buf.close()

    threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in range(workers)]
    for thread in threads:
        thread.start()
    try:
        fault()
    finally:
        stop.set()
        for thread in threads:
            thread.join(JOIN_BOUND_S)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    assert errors == [], [repr(e) for e in errors]
    return [logs[w] for w in sorted(logs)]
