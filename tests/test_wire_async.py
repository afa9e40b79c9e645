"""AsyncSignalBuffer's direct calls (wire.AsyncDirectCalls) on real redis-servers: concurrent
tasks, cancelled tasks, kept connections, a missing library, Sentinel failover, and which clients use them;
also the kept-connection limit the sync transport shares."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fakeredis
import pytest
import redis
import redis.asyncio

from redis_layer_signals import AsyncSignalBuffer, CacheTask, SignalBuffer
from redis_layer_signals.server.library import LIBRARY_NAME
from redis_layer_signals.transport import wire
from tests.servers import RedisServer

CONCURRENT = 200


def task(slot: int, request_id: str = "req-1") -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=4096, num_layers=61)


def direct_of(buffer: AsyncSignalBuffer) -> wire.AsyncDirectCalls:
    direct = buffer.sender.direct
    assert isinstance(direct, wire.AsyncDirectCalls)
    return direct


@pytest.fixture
async def abuf(redis_server: RedisServer, namespace: str) -> AsyncIterator[AsyncSignalBuffer]:
    buffer = AsyncSignalBuffer.from_url(redis_server.url, namespace=namespace, env={})
    yield buffer
    await buffer.close()


@pytest.fixture
def admin(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A separate sync client, for what an operator sees (CLIENT LIST, FUNCTION FLUSH)."""
    client = redis_server.client()
    yield client
    client.close()


async def test_concurrent_tasks_on_one_buffer_each_get_their_own_reply(abuf: AsyncSignalBuffer) -> None:
    live = range(0, CONCURRENT, 2)
    registered = await asyncio.gather(*(abuf.register(task(slot, f"r{slot}")) for slot in live))
    assert all(r.recovered == [] and not r.repeated for r in registered)
    results = await asyncio.gather(*(abuf.record("p0", 0, 0, [(slot, 1000 + slot)]) for slot in range(CONCURRENT)))
    for slot, result in enumerate(results):
        expected = [(slot, 1000 + slot)]
        delivered = [(s.slot, s.tokens) for s in result.delivered]
        buffered = [(s.slot, s.tokens) for s in result.buffered]
        assert (delivered, buffered) == ((expected, []) if slot % 2 == 0 else ([], expected)), slot
    stats = await abuf.stats()
    assert (stats["delivered"], stats["buffered"], stats["registered"]) == (CONCURRENT // 2,) * 3
    # The calls overlapped, so they were spread over several kept connections.
    assert 1 < len(direct_of(abuf)._idle) <= abuf.client.connection_pool.max_connections // 2


async def test_kept_connections_never_take_the_whole_pool(redis_server: RedisServer, namespace: str) -> None:
    """A burst wider than the pool borrows every connection; afterwards half at most stay kept,
    so the client's own commands (reads, SCRIPT LOAD) still find a free one."""
    client = redis.asyncio.Redis.from_url(redis_server.url, max_connections=4)
    buffer = AsyncSignalBuffer(client, namespace=namespace, env={})
    try:
        results = await asyncio.gather(*(buffer.record("p0", 0, 0, [(slot, 7)]) for slot in range(20)))
        assert [[s.slot for s in r.buffered] for r in results] == [[slot] for slot in range(20)]
        assert len(direct_of(buffer)._idle) <= 2
        assert [s.tokens for s in await buffer.pending("p0", 0, 19)] == [7]
        assert (await buffer.stats())["buffered"] == 20
    finally:
        await buffer.close()


async def test_cancelled_call_leaves_no_reply_behind_for_the_next_call(abuf: AsyncSignalBuffer) -> None:
    await abuf.register(task(slot=1))
    direct = direct_of(abuf)
    connection = direct._idle[-1]
    reading = asyncio.Event()

    async def stalled(*args: Any, **kwargs: Any) -> Any:
        del connection.read_response  # once only: the class's own method reads from now on
        reading.set()
        await asyncio.Event().wait()  # the reply arrives on the socket and is never read

    connection.read_response = stalled
    cancelled = asyncio.create_task(abuf.record("p0", 0, 0, [(1, 111)]))
    await reading.wait()
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert not connection.is_connected and connection not in direct._idle

    second = await abuf.record("p0", 0, 0, [(2, 222)])
    assert second.delivered == [] and [(s.slot, s.tokens) for s in second.buffered] == [(2, 222)]
    third = await abuf.register(task(slot=2, request_id="req-2"))
    assert [(s.slot, s.tokens) for s in third.recovered] == [(2, 222)]
    fourth = await abuf.record("p0", 0, 1, [(1, 333)])
    assert [(s.slot, s.layer, s.tokens) for s in fourth.delivered] == [(1, 1, 333)]
    # The cancelled record was sent, so it ran once on the server; only its reply was dropped.
    stats = await abuf.stats()
    assert (stats["delivered"], stats["buffered"]) == (2, 1)


async def test_connections_stay_bounded_over_many_sequential_calls(
    redis_server: RedisServer, namespace: str, admin: redis.Redis
) -> None:
    name = f"wire-{uuid.uuid4().hex[:8]}"
    client = redis.asyncio.Redis.from_url(redis_server.url, client_name=name)
    buffer = AsyncSignalBuffer(client, namespace=namespace, env={})
    try:
        for round_ in range(100):
            await buffer.record("p0", 0, 0, [(3, round_ + 1)])
            await buffer.register(task(slot=3, request_id=f"req-{round_}"))
            await buffer.finish("p0", 0, 3, f"req-{round_}")
        named = [c for c in admin.client_list() if c["name"] == name]
        # One kept connection, plus at most the pool's own for SCRIPT LOAD.
        assert 1 <= len(named) <= 2, named
        assert (await buffer.stats())["recovered"] == 100
    finally:
        await buffer.close()


async def test_function_not_found_after_function_flush_is_loaded_and_sent_again(
    abuf: AsyncSignalBuffer, admin: redis.Redis
) -> None:
    await abuf.record("p0", 0, 0, [(4, 40)])
    connection = direct_of(abuf)._idle[-1]
    admin.function_flush()
    res = await abuf.record("p0", 0, 1, [(4, 41)])
    assert [(s.layer, s.tokens) for s in res.buffered] == [(1, 41)]
    names = [entry[entry.index(b"library_name") + 1] for entry in admin.function_list()]  # RESP2: flat pairs
    assert names == [LIBRARY_NAME.encode()]
    # "Function not found" is a whole error reply: the connection stayed clean and is kept.
    assert direct_of(abuf)._idle == [connection] and connection.is_connected


async def test_supports_async_only_plain_resp2_redis_asyncio_clients() -> None:
    plain = redis.asyncio.Redis()
    resp3 = redis.asyncio.Redis(protocol=3)
    single = redis.asyncio.Redis(single_connection_client=True)
    fake = fakeredis.FakeAsyncRedis()
    sync = redis.Redis()
    try:
        assert wire.supports_async(plain)
        assert not wire.supports_async(resp3)
        assert not wire.supports_async(single)
        assert not wire.supports_async(fake)
        assert not wire.supports_async(sync)
        assert not wire.supports(plain)
    finally:
        for client in (plain, resp3, single, fake):
            await client.aclose()
        sync.close()


async def test_fakeredis_async_buffer_keeps_the_client_path() -> None:
    buffer = AsyncSignalBuffer.from_url(f"memory://{uuid.uuid4().hex}", namespace="fake", env={})
    try:
        assert buffer.sender.direct is None
        assert [s.tokens for s in (await buffer.record("p0", 0, 0, [(1, 5)])).buffered] == [5]
    finally:
        await buffer.close()


def test_sync_kept_connections_never_take_the_whole_pool(
    redis_server: RedisServer, namespace: str, admin: redis.Redis
) -> None:
    """The same limit on the sync transport: threads on a bounded pool and a server without our
    library (FUNCTION LOAD needs a connection of its own while the others are kept)."""
    admin.function_flush()
    buffer = SignalBuffer(redis.Redis.from_url(redis_server.url, max_connections=4), namespace=namespace, env={})
    try:
        with ThreadPoolExecutor(8) as threads:
            results = list(threads.map(lambda slot: buffer.record("p0", 0, 0, [(slot, 7)]), range(40)))
        assert [[s.slot for s in r.buffered] for r in results] == [[slot] for slot in range(40)]
        assert isinstance(buffer.sender.direct, wire.DirectCalls) and len(buffer.sender.direct._idle) <= 2
        assert [s.tokens for s in buffer.pending("p0", 0, 39)] == [7]
    finally:
        buffer.close()


async def test_close_during_a_call_leaves_no_connection_checked_out(redis_server: RedisServer, namespace: str) -> None:
    """:func:`tests.test_wire.test_close_during_a_call_leaves_no_connection_checked_out`, with
    the close running in another task while a call waits for its reply."""
    pool = redis.asyncio.ConnectionPool(port=redis_server.port, max_connections=2)
    buffer = AsyncSignalBuffer(redis.asyncio.Redis(connection_pool=pool), namespace=namespace, env={})
    await buffer.record("p0", 0, 0, [(1, 1)])
    (connection,) = direct_of(buffer)._idle
    real_read = connection.read_response
    closed = asyncio.Event()

    async def read_after_close(*args: Any, **kwargs: Any) -> Any:
        connection.read_response = real_read
        await closed.wait()
        return await real_read(*args, **kwargs)

    connection.read_response = read_after_close
    call = asyncio.create_task(buffer.record("p0", 0, 0, [(1, 2)]))
    await asyncio.sleep(0.01)
    await buffer.close()
    closed.set()
    assert [(s.slot, s.tokens) for s in (await call).buffered] == [(1, 2)]
    both = [await pool.get_connection(), await pool.get_connection()]  # one leaked: too many
    for each in both:
        await pool.release(each)
    await pool.disconnect()


async def test_a_call_cancelled_again_while_it_cleans_up_still_returns_its_connection(
    redis_server: RedisServer, namespace: str
) -> None:
    """Cancel scopes that cancel every await after the first cancel (anyio's, so Starlette's)
    interrupt the clean-up of a cancelled call too; a clean-up that waits for the socket to
    close would never hand the connection back, and the bounded pool would run out."""
    pool = redis.asyncio.ConnectionPool(port=redis_server.port, max_connections=2)
    buffer = AsyncSignalBuffer(redis.asyncio.Redis(connection_pool=pool), namespace=namespace, env={})
    await buffer.record("p0", 0, 0, [(1, 1)])
    (connection,) = direct_of(buffer)._idle
    real_read = connection.read_response

    async def never_answered(*args: Any, **kwargs: Any) -> Any:
        connection.read_response = real_read
        await asyncio.Event().wait()

    connection.read_response = never_answered
    call = asyncio.create_task(buffer.record("p0", 0, 0, [(1, 2)]))
    await asyncio.sleep(0.01)
    while not call.done():
        call.cancel()
        await asyncio.sleep(0)
    with pytest.raises(asyncio.CancelledError):
        await call
    both = [await pool.get_connection(), await pool.get_connection()]  # one leaked: too many
    for each in both:
        await pool.release(each)
    await pool.disconnect()
