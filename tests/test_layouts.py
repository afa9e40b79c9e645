"""State written by the previous layout (unpadded markers) and the string-compared stamps'
boundaries: an old marker must read as "no marker", which may make a script sweep sooner,
never later (a far-future <next due> would leave expired signals unswept and uncounted)."""

from __future__ import annotations

from redis_layer_signals import CacheTask, SignalBuffer

KEPT = "kept longer than hash-max-listpack-value (64) so HMGET stays O(1) per field"


def task(slot: int, request_id: str) -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=4096, num_layers=4)


def test_register_over_a_previous_layout_pending_marker_keeps_sweeps_due(url: str, namespace: str) -> None:
    now = [1_000_000]
    buf = SignalBuffer.from_url(url, namespace=namespace, pending_ttl_s=1, clock=lambda: now[0], env={})
    keys = buf.protocol.keys.rank("p0", 0)
    buf.record("p0", 0, 0, [(3, 10)])  # buffered: deadline 1_001_000
    # the marker as the previous layout wrote it: "<longest>|<next due>|<expires>|..."
    buf.client.hset(keys.pending, "~", f"1000|1001000|0|{KEPT}")
    buf.register(task(5, "a"))  # a new live hash: its marker's next due comes from the pending one
    now[0] += 2000
    assert buf.record("p0", 0, 0, [(5, 20)]).delivered  # only delivers: sweeps when one is due
    assert buf.stats(sweep=False)["expired"] == 1
    assert buf.pending("p0", 0, 3) == []
    buf.close()


def test_register_over_a_previous_layout_pending_marker_on_the_server_clock(url: str, namespace: str) -> None:
    buf = SignalBuffer.from_url(url, namespace=namespace, pending_ttl_s=1, env={})
    keys = buf.protocol.keys.rank("p0", 0)
    buf.record("p0", 0, 0, [(3, 10)])
    old = buf.now_ms()
    buf.client.hset(keys.pending, "~", f"60000|{old - 60_000}|{old + 60_000}|{KEPT}")
    # the pending record's deadline has passed already (as if the upgrade came a while later)
    packed = buf.client.hget(keys.pending, "3").decode()
    recorded = packed.split(",")[3]
    buf.client.hset(keys.pending, "3", packed.rsplit(",", 1)[0] + f",{int(recorded) - 5}")
    buf.client.zadd(keys.expiry, {"0": int(recorded) - 5})
    buf.register(task(5, "a"))
    assert buf.record("p0", 0, 0, [(5, 20)]).delivered
    assert buf.stats(sweep=False)["expired"] == 1
    buf.close()
