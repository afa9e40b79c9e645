"""State written by the previous layout (unpadded markers, "request_id|deadline" live entries)
and the string-compared stamps' boundaries: an old marker must read as one that is due, which
may make a script sweep sooner, never later (a far-future <next due> would leave expired
signals unswept and uncounted)."""

from __future__ import annotations

import pytest

from redis_layer_signals import CacheTask, SignalBuffer, SlotOccupied

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


def test_a_live_entry_of_the_previous_layout_is_read_by_register_finish_and_python(url: str, namespace: str) -> None:
    """Before 680b805 a live entry was "<request id>|<16-digit deadline>". Read as the new
    layout, its first 16 bytes compared above any stamp: a live task forever whose request id
    was garbage, so finish was fenced, register said occupied, and Python's int() raised."""
    from redis_layer_signals.admin import snapshot

    now = [1_000_000]
    buf = SignalBuffer.from_url(url, namespace=namespace, task_ttl_s=2, clock=lambda: now[0], env={})
    keys = buf.protocol.keys.rank("p0", 0)
    buf.register(task(5, "req-1"))
    buf.register(task(6, "req-2"))
    buf.client.hset(keys.live, "5", "req-1|0000000001002000")
    buf.client.hset(keys.live, "6", "req-2|0000000001002000")
    assert buf.task("p0", 0, 5) == task(5, "req-1")
    assert [t.request_id for t in snapshot(buf).tasks] == ["req-1", "req-2"]
    assert buf.register(task(5, "req-1")).repeated
    fin = buf.finish("p0", 0, 5, "req-1")
    assert fin.removed and not fin.fenced
    now[0] += 2000  # req-2's lease has lapsed: another request may take the slot
    assert buf.task("p0", 0, 6) is None
    assert not buf.register(task(6, "req-3")).replaced
    buf.close()


@pytest.mark.parametrize("request_id", ["r", "x" * 128, "0", "9" * 16])
@pytest.mark.parametrize("start", [1000, 1_796_090_394_406])
def test_a_lease_runs_while_its_deadline_is_after_now_whatever_the_request_id(
    url: str, namespace: str, request_id: str, start: int
) -> None:
    now = [start]
    buf = SignalBuffer.from_url(url, namespace=namespace, task_ttl_s=1, clock=lambda: now[0], env={})
    buf.register(task(5, request_id))
    now[0] = start + 999  # deadline = now + 1: still held
    assert buf.record("p0", 0, 0, [(5, 10)]).delivered
    assert buf.record("p0", 0, 0, [(5, 11, request_id)]).delivered
    assert buf.task("p0", 0, 5) is not None
    assert buf.finish("p0", 0, 5, "someone-else").fenced
    with pytest.raises(SlotOccupied):
        buf.register(task(5, "someone-else"))
    now[0] = start + 1000  # deadline = now: lapsed
    assert buf.record("p0", 0, 1, [(5, 12)]).buffered
    assert buf.record("p0", 0, 2, [(5, 13, request_id)]).buffered
    assert buf.task("p0", 0, 5) is None
    assert buf.finish("p0", 0, 5, "someone-else").dropped == 1  # not fenced: drops the unnamed 12
    rec = buf.register(task(5, "next"))
    assert not rec.replaced and [s.tokens for s, _ in rec.dropped] == [13]
    buf.close()
