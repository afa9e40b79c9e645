"""A ``finish`` lost to a partition: the buffer owes it and sends it, same call and token,
before its next call on the rank, so the next request on the slot is not taken for the finished
one (its signals delivered to the finished task, its ``register`` refused ``SlotOccupied``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from redis_layer_signals import AsyncSignalBuffer, BufferUnavailable, CacheTask, OwedFinishesFull, SignalBuffer
from tests.netns import HostedRedis, Hosts

pytestmark = pytest.mark.netns  # make check deselects it: network namespaces need root

RETRY_S = 1.0


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    made = Hosts(["h1", "h2"])
    yield made
    made.cleanup()


@pytest.fixture
def server(hosts: Hosts) -> Iterator[HostedRedis]:
    started = HostedRedis(hosts, "h1").start()
    yield started
    started.cleanup()


def task(request_id: str, slot: int = 5) -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=4096, num_layers=4)


@pytest.mark.timeout(60)
def test_finish_lost_to_a_partition_no_longer_lets_the_next_request_reach_the_finished_task(
    hosts: Hosts, server: HostedRedis, namespace: str
) -> None:
    def scenario() -> None:
        buf = SignalBuffer.from_url(server.url, namespace=namespace, env={}, retry_s=RETRY_S)
        try:
            buf.register(task("req-a"))
            assert buf.record("p0", 0, 0, [(5, 100)]).delivered
            hosts.isolate("h1")
            with pytest.raises(BufferUnavailable):
                buf.finish("p0", 0, 5, "req-a")
            assert buf.owed.count() == 1
            with pytest.raises(BufferUnavailable):  # still cut: the owed finish goes first, and fails
                buf.record("p0", 0, 0, [(5, 200)])
            assert buf.owed.count() == 1
            hosts.heal()

            # The next request's early signal (no request id) is buffered, not delivered to req-a.
            early = buf.record("p0", 0, 0, [(5, 300)])
            assert buf.owed.count() == 0
            assert early.delivered == [] and [s.tokens for s in early.buffered] == [300]
            recovered = buf.register(task("req-b"))  # not SlotOccupied: req-a is gone
            assert [s.tokens for s in recovered.recovered] == [300]
            assert buf.stats()["finished"] == 1
        finally:
            buf.close()

    hosts.run("h2", scenario)


@pytest.mark.timeout(60)
def test_finishes_owed_past_max_slots_are_refused_loudly_and_the_owed_ones_all_arrive(
    hosts: Hosts, server: HostedRedis, namespace: str
) -> None:
    slots = 2

    def scenario() -> None:
        buf = SignalBuffer.from_url(server.url, namespace=namespace, env={}, retry_s=RETRY_S, max_slots=slots)
        try:
            for slot in range(slots):
                buf.register(task(f"req-{slot}", slot))
            hosts.isolate("h1")
            for slot in range(slots):
                with pytest.raises(BufferUnavailable):
                    buf.finish("p0", 0, slot, f"req-{slot}")
            with pytest.raises(BufferUnavailable) as again:
                buf.finish("p0", 0, 0, "req-0")  # the caller resends: still owed once
            assert not isinstance(again.value, OwedFinishesFull) and buf.owed.count() == slots
            with pytest.raises(OwedFinishesFull):  # one more: not kept, and said so
                buf.finish("p0", 0, 1, "req-late")
            assert buf.owed.count() == slots and buf.owed.refused == 1
            hosts.heal()

            buf.record("p0", 0, 0, [(0, 300)])  # the owed finishes go first
            assert buf.owed.count() == 0
            assert all(buf.task("p0", 0, slot) is None for slot in range(slots))
            assert buf.stats()["finished"] == slots
        finally:
            buf.close()

    hosts.run("h2", scenario)


@pytest.mark.timeout(60)
def test_async_finish_lost_to_a_partition_is_sent_before_the_next_call(
    hosts: Hosts, server: HostedRedis, namespace: str
) -> None:
    import asyncio

    async def scenario() -> None:
        abuf = AsyncSignalBuffer.from_url(server.url, namespace=namespace, env={}, retry_s=RETRY_S)
        try:
            await abuf.register(task("req-a"))
            hosts.isolate("h1")
            with pytest.raises(BufferUnavailable):
                await abuf.finish("p0", 0, 5, "req-a")
            hosts.heal()
            early = await abuf.record("p0", 0, 0, [(5, 300)])
            assert early.delivered == [] and abuf.owed.count() == 0
            assert [s.tokens for s in (await abuf.register(task("req-b"))).recovered] == [300]
        finally:
            await abuf.close()

    hosts.run("h2", lambda: asyncio.run(scenario()))
