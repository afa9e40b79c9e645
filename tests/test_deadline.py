"""A bound on the whole call: every call returns or raises within ``retry_s`` plus
``deadline.MARGIN_S``, whatever the network does. Replies trickling one byte every 0.3 s, a
reply cut halfway, a black hole (a proxy on loopback between the buffer and a real server), and
a server that stops answering (``CLIENT PAUSE``) on the Cluster and under Sentinel; the sync and
the async buffers. Before the bound, a trickle kept ``record`` 7.5 s with ``retry_s=0.5``."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis.asyncio

from redis_layer_signals import AsyncSignalBuffer, BufferUnavailable, CacheTask, SignalBuffer
from redis_layer_signals.transport.deadline import MARGIN_S
from tests.proxy import BLACK_HOLE, HALF, PASS, TRICKLE, Proxy
from tests.servers import RedisServer
from tests.topology import ClusterTopology, SentinelTopology

RETRY_S = 0.5
BOUND_S = RETRY_S + MARGIN_S


def task(slot: int = 5, request_id: str = "req-1") -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=4096, num_layers=61)


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[Proxy]:
    started = Proxy(redis_server.port)
    yield started
    started.close()


def timed(call: Callable[[], Any]) -> tuple[float, BaseException | None]:
    started = time.monotonic()
    try:
        call()
    except BufferUnavailable as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


def calls(buf: SignalBuffer) -> dict[str, Callable[[], Any]]:
    return {
        "record": lambda: buf.record("p0", 0, 0, [(5, 100), (6, 200)]),
        "register": lambda: buf.register(task()),
        "finish": lambda: buf.finish("p0", 0, 5, "req-1"),
        "pending": lambda: buf.pending("p0", 0, 6),
        "stats": buf.stats,
    }


@pytest.mark.parametrize("mode", [TRICKLE, HALF, BLACK_HOLE])
def test_every_sync_call_returns_or_raises_within_retry_s_plus_the_margin(
    proxy: Proxy, namespace: str, mode: str
) -> None:
    buf = SignalBuffer.from_url(proxy.url, namespace=namespace, env={}, retry_s=RETRY_S)
    buf.record("p0", 0, 0, [(6, 1)])  # library and permissions checked while the network is fine
    try:
        for name, call in calls(buf).items():
            proxy.mode = mode
            elapsed, error = timed(call)
            proxy.mode = PASS
            assert error is not None, name  # a trickled reply takes seconds: it cannot have come
            assert elapsed < BOUND_S, (name, mode, elapsed)
    finally:
        buf.close()


@pytest.mark.parametrize("mode", [TRICKLE, HALF, BLACK_HOLE])
def test_every_async_call_returns_or_raises_within_retry_s_plus_the_margin(
    proxy: Proxy, namespace: str, mode: str
) -> None:
    async def run() -> list[tuple[str, float, bool]]:
        buf = AsyncSignalBuffer.from_url(proxy.url, namespace=namespace, env={}, retry_s=RETRY_S)
        await buf.record("p0", 0, 0, [(6, 1)])
        outcomes = []
        try:
            steps: dict[str, Callable[[], Awaitable[Any]]] = {
                "record": lambda: buf.record("p0", 0, 0, [(5, 100)]),
                "register": lambda: buf.register(task()),
                "finish": lambda: buf.finish("p0", 0, 5, "req-1"),
                "pending": lambda: buf.pending("p0", 0, 6),
                "stats": buf.stats,
            }
            for name, step in steps.items():
                proxy.mode = mode
                started = time.monotonic()
                raised = False
                try:
                    await step()
                except BufferUnavailable:
                    raised = True
                proxy.mode = PASS
                outcomes.append((name, time.monotonic() - started, raised))
        finally:
            await buf.close()
        return outcomes

    for name, elapsed, raised in asyncio.run(run()):
        assert raised, name
        assert elapsed < BOUND_S, (name, mode, elapsed)


def test_a_trickle_that_ends_in_time_is_still_answered(proxy: Proxy, namespace: str) -> None:
    """The bound cuts a call short only when its time is up: a slow reply inside it is read."""
    proxy.trickle_s = 0.005
    buf = SignalBuffer.from_url(proxy.url, namespace=namespace, env={}, retry_s=3.0)
    buf.record("p0", 0, 0, [(6, 1)])
    proxy.mode = TRICKLE
    try:
        assert [s.slot for s in buf.record("p0", 0, 0, [(7, 5)]).buffered] == [7]
    finally:
        proxy.mode = PASS
        buf.close()


@contextlib.contextmanager
def paused(server: RedisServer, seconds: float) -> Iterator[None]:
    """``server`` answers nothing (``CLIENT PAUSE``) for at most ``seconds``, or until the block ends."""
    client = server.client()
    client.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
    try:
        yield
    finally:
        client.execute_command("CLIENT", "UNPAUSE")
        client.close()


def test_the_cluster_client_is_bounded_when_the_rank_s_node_stops_answering(
    cluster: ClusterTopology, namespace: str
) -> None:
    buf = SignalBuffer.from_url(cluster.url, namespace=namespace, env={}, retry_s=RETRY_S)
    buf.record("p0", 0, 0, [(6, 1)])
    owner = cluster.node_for_key(buf.protocol.keys.rank("p0", 0).pending)
    try:
        with paused(owner, 3):
            elapsed, error = timed(lambda: buf.record("p0", 0, 0, [(5, 100)]))
        assert error is not None and elapsed < BOUND_S, elapsed
    finally:
        buf.close()


def test_the_sentinel_client_is_bounded_when_the_primary_stops_answering(
    sentinel_group: SentinelTopology, namespace: str
) -> None:
    buf = SignalBuffer.from_url(sentinel_group.url, namespace=namespace, env={}, retry_s=RETRY_S)
    buf.record("p0", 0, 0, [(6, 1)])
    try:
        with paused(sentinel_group.current_primary(), 3):
            elapsed, error = timed(lambda: buf.record("p0", 0, 0, [(5, 100)]))
        assert error is not None and elapsed < BOUND_S, elapsed
    finally:
        buf.close()


def closed_port() -> int:
    """A loopback port nothing listens on: connecting to it is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_sentinel_client_is_bounded_when_no_sentinel_answers(namespace: str) -> None:
    """The sentinels' own clients retried a refused connection 10 times, with up to 10 s of
    backoff between tries: a call asking sentinels a split had cut off took 56 s."""
    seeds = ",".join(f"127.0.0.1:{closed_port()}" for _ in range(2))
    buf = SignalBuffer.from_url(f"redis+sentinel://{seeds}/mymaster", namespace=namespace, env={}, retry_s=RETRY_S)
    try:
        elapsed, error = timed(lambda: buf.record("p0", 0, 0, [(5, 100)]))
        assert error is not None and elapsed < BOUND_S, elapsed
    finally:
        buf.close()


@pytest.mark.parametrize("first_call", [True, False])
def test_the_async_buffer_on_a_client_of_your_own_is_bounded_when_the_server_stops_answering(
    proxy: Proxy, namespace: str, first_call: bool
) -> None:
    """A plain ``redis.asyncio.Redis`` with no timeouts of its own: the call's first steps (the
    server check, the permission check) and a resend go through that client, not the direct
    path that times its reads, and are bounded by the call's deadline too (before, a first
    ``record`` through a black hole took 59.5 s with ``retry_s`` 0.5)."""

    async def run() -> tuple[float, bool]:
        client = redis.asyncio.Redis(port=proxy.port)
        buf = AsyncSignalBuffer(client, namespace=namespace, retry_s=RETRY_S)
        if not first_call:
            await buf.record("p0", 0, 0, [(6, 1)])  # checks done while the network is fine
        proxy.mode = BLACK_HOLE
        started = time.monotonic()
        try:
            await buf.record("p0", 0, 0, [(5, 100)])
        except BufferUnavailable:
            return time.monotonic() - started, True
        finally:
            proxy.mode = PASS
            await buf.close()
            await client.aclose()
        return time.monotonic() - started, False

    elapsed, raised = asyncio.run(run())
    assert raised
    assert elapsed < BOUND_S, elapsed
