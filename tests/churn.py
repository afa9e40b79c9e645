"""A workload that keeps calling while a test breaks something: the race test's worker (record,
register and finish on the shared slots of p0/0, every outcome logged) on threads that run
until the fault is over, so the race test's accounting can check the result."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

from redis_layer_signals import CacheTask, SignalBuffer, SlotOccupied
from tests.race import LAYERS, SLOTS, Log

JOIN_BOUND_S = 60.0
"""Bound on a worker thread across a fault: only catches a hang, never times a call."""


def churn(buf: SignalBuffer, worker: int, stop: threading.Event, seed: int, minimum: int = 40) -> Log:
    """Record, register and finish on the shared slots of p0/0 until told to stop (and at least
    ``minimum`` operations), logging every outcome: the race test's worker on a given buffer."""
    rng = random.Random(seed * 1000 + worker)
    log = Log()
    mine: dict[int, str] = {}
    op = 0
    while op < minimum or not stop.is_set():
        op += 1
        choice = rng.random()
        if choice < 0.55:
            layer = rng.randrange(LAYERS)
            entries = [(slot, worker * 1_000_000 + op * SLOTS + slot) for slot in range(SLOTS) if rng.random() < 0.6]
            if not entries:
                continue
            res = buf.record("p0", 0, layer, entries)
            log.recorded += [(s, layer, t) for s, t in entries]
            log.delivered += [(s.slot, s.layer, s.tokens) for s in res.delivered]
            log.buffered += [(s.slot, s.layer, s.tokens) for s in res.buffered]
        elif choice < 0.8:
            slot = rng.randrange(SLOTS)
            request_id = f"w{worker}-{op}"
            try:
                rec = buf.register(CacheTask("p0", 0, slot, request_id, need_prefill_tokens=2**40, num_layers=LAYERS))
            except SlotOccupied:
                log.occupied += 1
                continue
            mine[slot] = request_id
            log.registered += 1
            log.recovered += [(s.slot, s.layer, s.tokens) for s in rec.recovered]
            log.dropped += [(s.slot, s.layer, s.tokens) for s, _ in rec.dropped]
        else:
            slot = rng.randrange(SLOTS)
            log.finish_dropped += buf.finish("p0", 0, slot, mine.pop(slot, f"w{worker}-gone-{op}")).dropped
    return log


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
