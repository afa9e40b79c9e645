"""Invariant 1 under real concurrency: 8 processes record, register and finish the same slots
of one real Redis in random order; afterwards every signal is accounted for exactly once."""

from __future__ import annotations

import multiprocessing
import uuid
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

from redis_layer_signals import SignalBuffer
from tests.race import SLOTS, Log, ended, work
from tests.servers import RedisServer

WORKERS = 8
OPERATIONS = 250


def run_race(url: str, seed: int) -> tuple[list[Log], SignalBuffer]:
    namespace = f"race-{uuid.uuid4().hex[:8]}"
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=WORKERS, mp_context=context) as pool:
        futures = [pool.submit(work, url, namespace, w, OPERATIONS, seed) for w in range(WORKERS)]
        logs = [f.result(timeout=240) for f in futures]
    return logs, SignalBuffer.from_url(url, namespace=namespace, env={})


def assert_every_signal_accounted_once(logs: list[Log], buf: SignalBuffer) -> None:
    recorded = [s for log in logs for s in log.recorded]
    assert len(recorded) == len(set(recorded)) > 0
    delivered = [s for log in logs for s in log.delivered]
    buffered = {s for log in logs for s in log.buffered}
    handed_out = delivered + [s for log in logs for s in log.recovered + log.dropped]
    still_pending = [(p.slot, p.layer, p.tokens) for slot in range(SLOTS) for p in buf.pending("p0", 0, slot)]

    # Never two places: no signal was handed out twice, nor handed out and still pending.
    duplicates = [s for s, n in Counter(handed_out + still_pending).items() if n > 1]
    assert duplicates == []
    # Every record reply split the batch: delivered or buffered, never both, never neither.
    assert set(delivered).isdisjoint(buffered) and set(delivered) | buffered == set(recorded)
    # Only buffered signals can be recovered, dropped or pending.
    assert {s for log in logs for s in log.recovered + log.dropped} | set(still_pending) <= buffered

    stats = buf.stats()
    assert stats["recorded"] == len(recorded)
    assert stats["delivered"] == len(delivered) and stats["buffered"] == len(buffered)
    assert stats["recovered"] == sum(len(log.recovered) for log in logs)
    assert sum(v for k, v in stats.items() if k.startswith("dropped_")) == sum(len(log.dropped) for log in logs)
    assert stats["finish_dropped"] == sum(log.finish_dropped for log in logs)
    assert stats["registered"] == sum(log.registered for log in logs)
    # Never none: each buffered signal ended somewhere, counted or visible.
    assert len(buffered) == ended(stats) + len(still_pending)


def test_eight_processes_racing_on_real_redis_account_for_every_signal_once(redis_server: RedisServer) -> None:
    logs, buf = run_race(redis_server.url, seed=7)
    assert sum(log.registered for log in logs) > 0 and sum(log.occupied for log in logs) > 0
    assert sum(len(log.recovered) for log in logs) > 0 and sum(len(log.delivered) for log in logs) > 0
    assert_every_signal_accounted_once(logs, buf)
    buf.close()


def test_sixteen_threads_racing_on_real_redis_account_for_every_signal_once(redis_server: RedisServer) -> None:
    namespace = f"race-threads-{uuid.uuid4().hex[:8]}"
    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = [pool.submit(work, redis_server.url, namespace, w, 120, 11) for w in range(16)]
        logs = [f.result(timeout=240) for f in futures]
    buf = SignalBuffer.from_url(redis_server.url, namespace=namespace, env={})
    assert_every_signal_accounted_once(logs, buf)
    buf.close()
