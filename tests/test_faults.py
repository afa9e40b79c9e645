"""Faults of a single Redis: SIGKILL (and a frozen server) while calls are in flight, a restart
with AOF ``appendfsync always``, ``FUNCTION FLUSH`` mid-run, what a restart without persistence
loses (the library too), and ``rls simulate --chaos``. Each test starts its own server: they kill it."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from redis_layer_signals import AsyncSignalBuffer, BufferUnavailable, CacheTask, SignalBuffer
from redis_layer_signals.server.library import FUNCTIONS, LIBRARY_NAME
from redis_layer_signals.simulate import SimConfig, simulate
from redis_layer_signals.simulate.chaos import run_with_chaos
from tests.churn import churn_during
from tests.servers import RedisServer, library_functions, wait_until
from tests.test_race import assert_every_signal_accounted_once
from tests.topology import AOF_ALWAYS

RETRY_S = 1.0
SLACK_S = 5.0
"""Bound for joining a caller: retry_s, plus one socket timeout (= retry_s) for an attempt that
started just before the deadline, plus slack for a loaded 2-core machine. Not a latency check."""


def task(slot: int = 5, request_id: str = "req-1") -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=4096, num_layers=61)


@pytest.fixture
def aof_server() -> Iterator[RedisServer]:
    server = RedisServer(list(AOF_ALWAYS)).start()
    yield server
    server.cleanup()


@pytest.fixture
def plain_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.cleanup()


def callers_during(server: RedisServer, namespace: str, fault: object, threads: int = 8) -> list[object]:
    """Threads that call in a loop; each keeps the outcome of the call that was running (or
    started) after ``fault()``: a result or the exception it raised."""
    outcomes: list[object] = []
    faulted = threading.Event()
    lock = threading.Lock()

    def run(worker: int) -> None:
        buf = SignalBuffer.from_url(server.url, namespace=namespace, env={}, retry_s=RETRY_S)
        try:
            serial = 0
            while True:
                serial += 1
                after = faulted.is_set()
                try:
                    if serial % 2:
                        outcome: object = buf.record("p0", worker, 0, [(1, serial)])
                    else:
                        outcome = buf.register(CacheTask("p0", worker, 1, f"r{serial}", 2**40, 4), replace=True)
                except Exception as exc:
                    outcome = exc
                if after:
                    with lock:
                        outcomes.append(outcome)
                    return
        finally:
            buf.close()

    workers = [threading.Thread(target=run, args=(w,), daemon=True) for w in range(threads)]
    for worker in workers:
        worker.start()
    wait_until(lambda: server.client().dbsize() > 0, timeout=10, what="calls under way")
    fault()  # type: ignore[operator]
    faulted.set()
    for worker in workers:
        worker.join(2 * RETRY_S + SLACK_S)
    assert not any(w.is_alive() for w in workers), "a caller hung past retry_s"
    return outcomes


def test_sigkill_while_calls_in_flight_every_call_returns_or_raises_buffer_unavailable(
    plain_server: RedisServer, namespace: str
) -> None:
    outcomes = callers_during(plain_server, namespace, plain_server.kill)
    assert len(outcomes) == 8
    failures = [o for o in outcomes if isinstance(o, Exception)]
    assert failures, "the server is dead: the calls made after the kill must fail"
    for failure in failures:
        assert isinstance(failure, BufferUnavailable), repr(failure)
        assert isinstance(failure.__cause__, (RedisConnectionError, OSError))


def test_frozen_server_calls_raise_buffer_unavailable_within_the_bound(
    plain_server: RedisServer, namespace: str
) -> None:
    """A server that stops answering (SIGSTOP) without closing sockets: the socket timeout and
    the retry deadline still end every call."""
    assert plain_server.process is not None

    def freeze() -> None:
        plain_server.process.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]

    try:
        outcomes = callers_during(plain_server, namespace, freeze, threads=4)
    finally:
        plain_server.process.send_signal(signal.SIGCONT)
    failures = [o for o in outcomes if isinstance(o, Exception)]
    assert failures and all(isinstance(f, BufferUnavailable) for f in failures)
    assert any(isinstance(f.__cause__, (RedisTimeoutError, RedisConnectionError)) for f in failures)


def test_sigkill_async_calls_raise_buffer_unavailable(plain_server: RedisServer, namespace: str) -> None:
    async def scenario() -> list[BaseException | None]:
        abuf = AsyncSignalBuffer.from_url(plain_server.url, namespace=namespace, env={}, retry_s=RETRY_S)
        await abuf.record("p0", 0, 0, [(1, 10)])
        plain_server.kill()
        calls = [abuf.record("p0", 0, 1, [(1, 10)]), abuf.register(task(slot=1))]
        bounded = [asyncio.wait_for(call, 2 * RETRY_S + SLACK_S) for call in calls]
        results = await asyncio.gather(*bounded, return_exceptions=True)
        await abuf.close()
        return [r if isinstance(r, BaseException) else None for r in results]

    errors = asyncio.run(scenario())
    assert all(isinstance(e, BufferUnavailable) for e in errors), errors


def functions_on(server: RedisServer) -> set[str]:
    """The functions of our library the server holds (none when it has not got it)."""
    with server.client() as client:
        return library_functions(client, LIBRARY_NAME)


def test_restart_with_aof_always_keeps_signals_tasks_and_the_library(aof_server: RedisServer, namespace: str) -> None:
    buf = SignalBuffer.from_url(aof_server.url, namespace=namespace, env={}, retry_s=10)
    buf.record("p0", 0, 0, [(5, 100), (6, 200)])
    buf.register(task(slot=7, request_id="live"))

    aof_server.restart()  # SIGKILL, then start on the same port and data dir
    assert functions_on(aof_server) == set(FUNCTIONS.values())  # the AOF keeps the library

    # The same buffer, its pooled connections now dead: the calls reconnect.
    assert [(s.layer, s.tokens) for s in buf.register(task(slot=5)).recovered] == [(0, 100)]
    assert buf.record("p0", 0, 1, [(7, 300)]).delivered  # the task registered before the kill is live
    held = buf.task("p0", 0, 7)
    assert held is not None and held.request_id == "live"
    assert [s.tokens for s in buf.pending("p0", 0, 6)] == [200]
    buf.close()


def test_restarts_with_aof_always_while_calls_run_lose_and_repeat_nothing(aof_server: RedisServer) -> None:
    namespace = f"restart-{uuid.uuid4().hex[:8]}"

    def fault() -> None:
        for _ in range(2):
            time.sleep(0.5)  # let the calls get going first
            aof_server.restart()

    logs = churn_during(aof_server.url, namespace, fault, retry_s=15)
    buf = SignalBuffer.from_url(aof_server.url, namespace=namespace, env={})
    assert_every_signal_accounted_once(logs, buf)
    buf.close()


def test_function_flush_mid_run_is_transparent(aof_server: RedisServer) -> None:
    """Calls running while the library is flushed again and again load it and resend, with the
    same token: every signal is still accounted for once."""
    namespace = f"flush-{uuid.uuid4().hex[:8]}"
    admin = aof_server.client()

    def fault() -> None:
        for _ in range(5):
            time.sleep(0.2)  # let the calls get going first
            admin.function_flush()

    logs = churn_during(aof_server.url, namespace, fault, retry_s=5)
    buf = SignalBuffer.from_url(aof_server.url, namespace=namespace, env={})
    assert_every_signal_accounted_once(logs, buf)
    assert sum(len(log.recorded) for log in logs) > 0
    admin.close()
    buf.close()


def test_restart_without_persistence_loses_everything_buffered(plain_server: RedisServer, namespace: str) -> None:
    """What AOF is for: Redis without persistence forgets the buffer on restart, and the library
    with it. The early signal is gone and its task's registration recovers nothing (the request
    would hang); the register itself works: it loads the library again."""
    buf = SignalBuffer.from_url(plain_server.url, namespace=namespace, env={}, retry_s=10)
    buf.record("p0", 0, 0, [(5, 100)])
    plain_server.restart()
    assert functions_on(plain_server) == set()
    assert buf.pending("p0", 0, 5) == []
    assert buf.register(task()).recovered == []
    assert functions_on(plain_server) == set(FUNCTIONS.values())
    buf.close()


def test_simulate_chaos_restarts_with_aof_always_lose_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rls simulate --chaos``: the whole deployment in miniature (a process per rank) while
    its own AOF-always Redis is SIGKILLed and restarted; the simulation's checks find nothing
    lost, sent twice or left behind."""
    # The promise is "a call blocks while Redis restarts, then succeeds": it holds for a restart
    # within retry_s. A starved 2-core machine can take longer than the default 3 s to replay the
    # AOF and accept connections, so the ranks' processes get room for it.
    monkeypatch.setenv("RLS_RETRY_S", "15")
    config = SimConfig(namespace=f"chaos-{uuid.uuid4().hex[:6]}", requests=60, instances=1, ranks=2, seed=3)
    summary, report = run_with_chaos(config, 0.15, "always", lambda cfg, tick: simulate(cfg, tick))
    assert report.faults and set(report.faults) == {"SIGKILL + restart"} and report.failed == []
    assert summary.violations == [] and summary.lost == 0 and summary.duplicates == 0 and summary.hung == 0
    assert summary.completed + summary.aborted == summary.requests == 120
