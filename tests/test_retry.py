"""Invariant 2: a call whose reply is lost after the script ran is resent by the library with the
same idempotency token, and the resend neither delivers, buffers nor drops twice."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from redis_layer_signals import BufferUnavailable, CacheTask, SignalBuffer
from redis_layer_signals.protocol.calls import ScriptCall
from tests.servers import free_port


def task(slot: int = 5, request_id: str = "req-1", need: int = 4096) -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=need, num_layers=61)


def lose_first_reply(buf: SignalBuffer, between: Callable[[], object] | None = None) -> list[ScriptCall]:
    """Make the next script call run on the server and then 'lose' its reply once."""
    original = buf._run_script
    runs: list[ScriptCall] = []

    def flaky(call: ScriptCall) -> Any:
        reply = original(call)
        runs.append(call)
        if len(runs) == 1:
            if between is not None:
                between()
            raise RedisConnectionError("connection reset by peer (injected after the script ran)")
        return reply

    buf._run_script = flaky  # type: ignore[method-assign]
    return runs


def test_record_resent_after_lost_reply_does_not_buffer_twice(buf: SignalBuffer) -> None:
    runs = lose_first_reply(buf)
    res = buf.record("p0", 0, 0, [(5, 100), (6, 200)])
    assert len(runs) == 2 and runs[0].keys == runs[1].keys  # same token, resent
    assert [s.slot for s in res.buffered] == [5, 6]
    stats = buf.stats()
    assert (stats["recorded"], stats["buffered"], stats["superseded"], stats["replayed"]) == (2, 2, 0, 1)


def test_record_resent_after_another_client_registered_keeps_first_outcome(
    buf: SignalBuffer, url: str, namespace: str
) -> None:
    """The reply is lost, another process registers the slot (popping the signal), then the
    resend arrives: it must not deliver the signal a second time nor buffer it again."""
    other = SignalBuffer.from_url(url, namespace=namespace, env={})
    recovered: list[Any] = []
    lose_first_reply(buf, between=lambda: recovered.extend(other.register(task()).recovered))
    res = buf.record("p0", 0, 0, [(5, 100)])
    assert [s.tokens for s in recovered] == [100]
    assert [s.tokens for s in res.buffered] == [100] and res.delivered == []
    assert buf.pending("p0", 0, 5) == []
    stats = buf.stats()
    assert (stats["buffered"], stats["delivered"], stats["recovered"]) == (1, 0, 1)
    other.close()


def test_register_resent_after_lost_reply_returns_same_recovery(buf: SignalBuffer) -> None:
    buf.record("p0", 0, 0, [(5, 100)])
    buf.record("p0", 0, 1, [(5, 9999)])
    runs = lose_first_reply(buf)
    rec = buf.register(task())
    assert len(runs) == 2
    assert [s.tokens for s in rec.recovered] == [100]
    assert [s.tokens for s in (s for s, _ in rec.dropped)] == [9999]
    stats = buf.stats()
    assert (stats["registered"], stats["recovered"], stats["dropped_over_need"]) == (1, 1, 1)


def test_register_repeated_by_caller_after_reply_lost_everywhere_loses_nothing(buf: SignalBuffer) -> None:
    """The caller gave up (its own timeout) and registers again: a new token, the same request."""
    buf.record("p0", 0, 0, [(5, 100)])
    first = buf.register(task())
    again = buf.register(task())
    assert again.repeated and again.recovered == first.recovered


def test_finish_resent_after_new_signal_does_not_drop_it(buf: SignalBuffer, url: str, namespace: str) -> None:
    """finish(req-1) ran, its reply was lost, the GPU then buffered the next request's first
    signal on the free slot: the resent finish must not drop that signal."""
    other = SignalBuffer.from_url(url, namespace=namespace, env={})
    buf.register(task())
    lose_first_reply(buf, between=lambda: other.record("p0", 0, 0, [(5, 64)]))
    fin = buf.finish("p0", 0, 5, "req-1")
    assert (fin.removed, fin.dropped, fin.fenced) == (True, 0, False)
    assert [s.tokens for s in buf.pending("p0", 0, 5)] == [64]
    other.close()


def test_script_run_twice_for_one_call_equals_one_run(buf: SignalBuffer) -> None:
    """Inject a duplicate delivery of the same call (same token) to the server."""
    original = buf._run_script

    def twice(call: ScriptCall) -> Any:
        original(call)
        return original(call)

    buf._run_script = twice  # type: ignore[method-assign]
    buf.record("p0", 0, 0, [(5, 100)])
    rec = buf.register(task())
    buf.record("p0", 0, 1, [(5, 100)])
    fin = buf.finish("p0", 0, 5, "req-1")
    assert [s.tokens for s in rec.recovered] == [100] and fin.removed
    stats = buf.stats()
    assert (stats["recorded"], stats["buffered"], stats["delivered"], stats["recovered"]) == (2, 1, 1, 1)
    assert (stats["registered"], stats["finished"], stats["replayed"]) == (1, 1, 4)


def test_the_library_is_loaded_again_after_function_flush(buf: SignalBuffer) -> None:
    """On every backend: on the Cluster, FUNCTION FLUSH empties every primary."""
    buf.record("p0", 0, 0, [(5, 1)])
    buf.client.function_flush()
    assert buf.record("p0", 0, 0, [(6, 1)]).buffered
    assert [s.tokens for s in buf.register(task()).recovered] == [1]


def test_unreachable_redis_raises_buffer_unavailable_within_bound() -> None:
    port = free_port()  # nothing listens here
    buf = SignalBuffer.from_url(f"redis://127.0.0.1:{port}/0", namespace="down", retry_s=0.5, env={})
    started = time.monotonic()
    with pytest.raises(BufferUnavailable) as err:
        buf.record("p0", 0, 0, [(5, 1)])
    elapsed = time.monotonic() - started
    assert isinstance(err.value.__cause__, RedisConnectionError)
    assert err.value.operation == "record" and "0.5s" in str(err.value)
    assert elapsed >= 0.5  # it kept trying for the whole budget (an upper bound is the CI timeout)
    with pytest.raises(BufferUnavailable):
        buf.register(task())
    with pytest.raises(BufferUnavailable):
        buf.stats()
