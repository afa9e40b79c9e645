"""A task's lease at its boundary: held while its deadline is after now, lapsed at the deadline,
whatever the request id looks like (short, long, all digits)."""

from __future__ import annotations

import pytest

from redis_layer_signals import CacheTask, SignalBuffer, SlotOccupied


def task(slot: int, request_id: str) -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=4096, num_layers=4)


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
