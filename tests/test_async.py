"""AsyncSignalBuffer: the same scripts and protocol on redis.asyncio, fakeredis and real Redis."""

from __future__ import annotations

import asyncio

import pytest

from redis_layer_signals import AsyncSignalBuffer, CacheTask, DropReason, SignalBuffer, SlotOccupied


def task(slot: int = 5, request_id: str = "req-1", need: int = 4096) -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=need, num_layers=61)


async def test_async_buffer_round_trip(abuf: AsyncSignalBuffer) -> None:
    res = await abuf.record("p0", 0, 0, [(5, 2048), (7, 9000)])
    assert [s.slot for s in res.buffered] == [5, 7]
    rec = await abuf.register(task())
    assert [(s.layer, s.tokens) for s in rec.recovered] == [(0, 2048)]
    dropped = await abuf.register(task(slot=7, request_id="req-2"))
    assert [(s.tokens, r) for s, r in dropped.dropped] == [(9000, DropReason.OVER_NEED)]
    assert (await abuf.record("p0", 0, 1, [(5, 2048)])).delivered
    assert (await abuf.task("p0", 0, 5)) == task()
    with pytest.raises(SlotOccupied):
        await abuf.register(task(request_id="req-3"))
    fenced = await abuf.finish("p0", 0, 5, "req-3")
    assert fenced.fenced and not fenced.removed
    fin = await abuf.finish("p0", 0, 5, "req-1")
    assert fin.removed and not fin.fenced
    assert await abuf.pending("p0", 0, 5) == []
    stats = await abuf.stats()
    assert (stats["recorded"], stats["recovered"], stats["dropped_over_need"], stats["fenced"]) == (3, 1, 1, 1)


async def test_sync_and_async_buffers_share_one_store(url: str, namespace: str, abuf: AsyncSignalBuffer) -> None:
    sync = SignalBuffer.from_url(url, namespace=namespace, env={})
    sync.record("p0", 0, 0, [(5, 10)])
    assert [s.tokens for s in await abuf.pending("p0", 0, 5)] == [10]
    assert [s.tokens for s in (await abuf.register(task())).recovered] == [10]
    assert sync.record("p0", 0, 1, [(5, 20)]).delivered
    sync.close()


async def test_concurrent_async_registrations_hand_each_signal_out_once(abuf: AsyncSignalBuffer) -> None:
    await abuf.record("p0", 0, 0, [(slot, 100 + slot) for slot in range(32)])
    results = await asyncio.gather(*(abuf.register(task(slot=s, request_id=f"r{s}")) for s in range(32)))
    recovered = sorted(sig.tokens for r in results for sig in r.recovered)
    assert recovered == [100 + s for s in range(32)]


async def test_async_bad_input_is_rejected_before_sending(abuf: AsyncSignalBuffer) -> None:
    with pytest.raises(ValueError, match="entries"):
        await abuf.record("p0", 0, 0, [(1, 1)] * 513)
    assert await abuf.ranks() == []
