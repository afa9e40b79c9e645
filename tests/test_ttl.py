"""Invariant 4 and the expired path: per-request keys carry TTLs, only counters don't, and an
unclaimed signal expires after its pending TTL and is counted, on a real Redis clock."""

from __future__ import annotations

import time

import pytest

from redis_layer_signals import CacheTask, SignalBuffer
from redis_layer_signals.constants import PENDING_KEY_GRACE_S
from tests.servers import RedisServer


def task(slot: int, request_id: str) -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=4096, num_layers=4)


def namespace_keys(buf: SignalBuffer) -> list[str]:
    return sorted(k.decode() for k in buf.client.scan_iter(match=buf.protocol.keys.pattern(), count=1000))


def test_every_key_but_the_counters_has_a_ttl(buf: SignalBuffer) -> None:
    buf.record("p0", 0, 0, [(1, 10), (2, 10)])
    buf.register(task(1, "a"))
    buf.register(task(3, "c"))
    buf.record("p0", 1, 0, [(1, 10, "z")])
    buf.finish("p0", 0, 3, "c")
    keys = namespace_keys(buf)
    kinds = {key.rsplit(":", 1)[-1] if ":reply:" not in key else "reply" for key in keys}
    assert {"live", "pending", "expiry", "stats", "reply"} <= kinds
    for key in keys:
        ttl = buf.client.pttl(key)
        if key.endswith(":stats"):
            assert ttl == -1, key
        else:
            assert ttl > 0, key


def test_pending_key_ttl_covers_the_pending_ttl_plus_grace(url: str, namespace: str) -> None:
    buf = SignalBuffer.from_url(url, namespace=namespace, pending_ttl_s=10, env={})
    buf.record("p0", 0, 0, [(1, 10)])
    ttl_ms = buf.client.pttl(buf.protocol.keys.rank("p0", 0).pending)
    assert 10_000 < ttl_ms <= 40_000
    buf.close()


def test_released_slots_leave_only_counters_reply_tokens_and_finish_marks(buf: SignalBuffer) -> None:
    """Finish removes the slot's task and signals; what stays is the counters, the reply
    tokens, and the marks of the finishes (for a signal written back later), which expire
    with the pending TTL and its grace."""
    buf.record("p0", 0, 0, [(1, 10)])
    buf.register(task(1, "a"))
    buf.record("p0", 0, 1, [(1, 20)])
    buf.finish("p0", 0, 1, "a")
    buf.finish("p0", 0, 2, "never-registered")
    keys = buf.protocol.keys.rank("p0", 0)
    left = sorted(k for k in namespace_keys(buf) if ":reply:" not in k)
    assert left == sorted([keys.stats, keys.ended])
    assert sorted(buf.client.hkeys(keys.ended)) == [b"1", b"2"]
    assert 0 < buf.client.pttl(keys.ended) <= (buf.config.pending_ttl_s + PENDING_KEY_GRACE_S) * 1000


def test_unclaimed_signal_expires_on_real_redis_and_is_counted(redis_server: RedisServer, namespace: str) -> None:
    buf = SignalBuffer.from_url(redis_server.url, namespace=namespace, pending_ttl_s=1, env={})
    buf.record("p0", 0, 0, [(1, 10), (2, 10)])
    buf.record("p0", 0, 1, [(2, 10)])
    assert buf.stats()["expired"] == 0
    time.sleep(1.2)
    stats = buf.stats()  # sweeps the namespace first
    assert stats["expired"] == 3 and stats["buffered"] == 3
    assert buf.pending("p0", 0, 1) == [] and buf.pending("p0", 0, 2) == []
    assert buf.register(task(1, "late")).recovered == []
    buf.close()


def test_expired_signal_is_swept_by_the_next_call_on_the_rank(redis_server: RedisServer, namespace: str) -> None:
    buf = SignalBuffer.from_url(redis_server.url, namespace=namespace, pending_ttl_s=1, env={})
    buf.record("p0", 0, 0, [(1, 10)])
    time.sleep(1.2)
    buf.record("p0", 0, 0, [(2, 10)])
    assert buf.stats(sweep=False)["expired"] == 1
    assert [s.slot for s in buf.pending("p0", 0, 2)] == [2]
    buf.close()


@pytest.mark.parametrize("advance_ms", [999, 1000])
def test_signal_is_expired_once_server_time_reaches_recorded_at_plus_ttl(
    url: str, namespace: str, advance_ms: int
) -> None:
    """With an injected clock: the boundary is inclusive (recorded_at + ttl expires)."""
    now = [1_000_000]
    buf = SignalBuffer.from_url(url, namespace=namespace, pending_ttl_s=1, clock=lambda: now[0], env={})
    buf.record("p0", 0, 0, [(1, 10)])
    now[0] += advance_ms
    expired = buf.stats()["expired"]
    rec = buf.register(task(1, "a"))
    if advance_ms >= 1000:
        assert expired == 1 and rec.recovered == []
    else:
        assert expired == 0 and [s.tokens for s in rec.recovered] == [10]
    buf.close()


def test_lapsed_task_lease_no_longer_receives_signals(url: str, namespace: str) -> None:
    now = [5_000_000]
    buf = SignalBuffer.from_url(url, namespace=namespace, task_ttl_s=2, clock=lambda: now[0], env={})
    buf.register(task(1, "a"))
    assert buf.record("p0", 0, 0, [(1, 10)]).delivered
    now[0] += 2000
    assert buf.task("p0", 0, 1) is None
    assert buf.record("p0", 0, 0, [(1, 10)]).buffered
    rec = buf.register(task(1, "b"))  # the lapsed lease does not make the slot occupied
    assert [s.tokens for s in rec.recovered] == [10]
    buf.close()
