"""Sentinel: the client follows a new primary (SENTINEL FAILOVER and a killed primary), what
asynchronous replication can still lose, and what ``wait_replicas`` (WAIT) changes about it.

One group for the whole test run (one primary, one replica, three sentinels, AOF always); every test
leaves it settled: one primary, one synced replica, sentinels agreeing."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from redis_layer_signals import AsyncSignalBuffer, BufferUnavailable, CacheTask, InvalidConfig, SignalBuffer
from redis_layer_signals.config import BufferConfig
from redis_layer_signals.ops import acl
from redis_layer_signals.transport import wire
from redis_layer_signals.transport.replication import NotReplicated
from tests.servers import RedisServer, wait_until
from tests.topology import SentinelTopology

CALL_BOUND_S = 30.0
"""Join bound for a call made across a failover: far above retry_s, only catches a hang."""


def task(slot: int = 5, request_id: str = "req-1") -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=4096, num_layers=61)


def layers_on(server: RedisServer, namespace: str, slot: int = 5) -> list[tuple[int, int]]:
    """What one server (primary or replica) holds for a slot, read directly from it."""
    direct = SignalBuffer(server.client(), namespace=namespace, env={})
    try:
        return [(s.layer, s.tokens) for s in direct.pending("p0", 0, slot)]
    finally:
        direct.close()


def set_config(server: RedisServer, name: str, value: int) -> None:
    client = server.client()
    try:
        client.config_set(name, value)
    finally:
        client.close()


@pytest.fixture
def group(sentinel_group: SentinelTopology) -> Iterator[SentinelTopology]:
    sentinel_group.settle()
    yield sentinel_group
    sentinel_group.settle()


def test_sentinel_url_reaches_the_primary_sync_and_async(group: SentinelTopology, namespace: str) -> None:
    buf = SignalBuffer.from_url(group.url, namespace=namespace, env={}, wait_replicas=1, wait_timeout_ms=2000)
    buf.record("p0", 0, 0, [(5, 100)])
    # wait_replicas=1 returned, so the replica already holds the signal.
    assert layers_on(group.current_replica(), namespace) == [(0, 100)]
    buf.close()

    async def async_roundtrip() -> list[int]:
        abuf = AsyncSignalBuffer.from_url(group.url, namespace=namespace, env={}, wait_replicas=1)
        try:
            return [s.layer for s in (await abuf.register(task())).recovered]
        finally:
            await abuf.close()

    assert asyncio.run(async_roundtrip()) == [0]


def test_sentinel_failover_client_follows_new_primary_when_old_one_refuses_writes(
    group: SentinelTopology, namespace: str
) -> None:
    """With ``min-replicas-to-write 1`` the demoted primary refuses writes (NOREPLICAS) and the
    client asks the sentinels again at once, so nothing lands on the old primary."""
    old = group.current_primary()
    before = SignalBuffer.from_url(group.url, namespace=namespace, env={}, wait_replicas=1, wait_timeout_ms=2000)
    before.record("p0", 0, 0, [(5, 100)])
    before.close()
    buf = SignalBuffer.from_url(group.url, namespace=namespace, env={}, retry_s=10)
    buf.pending("p0", 0, 5)  # the buffer now holds a pooled connection to the old primary
    set_config(old, "min-replicas-to-write", 1)

    new_port = group.failover()

    assert buf.record("p0", 0, 1, [(5, 200)]).buffered
    assert [(s.layer, s.tokens) for s in buf.register(task()).recovered] == [(0, 100), (1, 200)]
    assert new_port != old.port and layers_on(old, namespace) == [(0, 100)]
    buf.close()


def test_writes_after_sentinel_failover_reach_the_demoted_primary_and_are_lost_without_min_replicas(
    group: SentinelTopology, namespace: str
) -> None:
    """What the library cannot prevent alone: until the sentinels reconfigure the old primary
    (their 10 s INFO round), a client connected to it keeps writing there, acknowledged, and
    those writes vanish when it becomes a replica. ``min-replicas-to-write`` closes the window."""
    old = group.current_primary()
    buf = SignalBuffer.from_url(group.url, namespace=namespace, env={}, retry_s=10)
    buf.pending("p0", 0, 5)
    group.failover()

    assert buf.record("p0", 0, 0, [(5, 100)]).buffered  # acknowledged...
    assert layers_on(old, namespace) == [(0, 100)]  # ...by the demoted primary
    assert layers_on(group.current_primary(), namespace) == []

    group.settle()  # the old primary becomes a replica and resyncs: its copy is discarded
    assert layers_on(old, namespace) == []
    assert buf.register(task()).recovered == []
    buf.close()


def test_killed_primary_is_replaced_and_calls_in_flight_resume_on_the_promoted_replica(
    group: SentinelTopology, namespace: str
) -> None:
    durable = SignalBuffer.from_url(group.url, namespace=namespace, env={}, wait_replicas=1, wait_timeout_ms=2000)
    durable.record("p0", 0, 0, [(slot, 100) for slot in range(5, 10)])
    durable.close()
    buf = SignalBuffer.from_url(group.url, namespace=namespace, env={}, retry_s=15)
    old = group.current_primary()

    old.kill()
    with ThreadPoolExecutor(max_workers=5) as pool:
        futures = [pool.submit(buf.register, task(slot, f"req-{slot}")) for slot in range(5, 10)]
        results = [f.result(timeout=CALL_BOUND_S) for f in futures]

    assert group.current_primary_port() != old.port
    # Acknowledged after WAIT confirmed the replica: every early signal survived the failover.
    assert [[(s.layer, s.tokens) for s in r.recovered] for r in results] == [[(0, 100)]] * 5
    buf.close()


def test_acknowledged_write_the_replica_never_saw_is_lost_by_failover_and_wait_replicas_refuses_it(
    group: SentinelTopology, namespace: str
) -> None:
    """Asynchronous replication: the primary answers before the replica has the write. Here the
    replica is frozen and cut off, so a plain record is acknowledged but never replicated and a failover
    loses it. With ``wait_replicas=1`` the same call is not acknowledged: it raises
    ``BufferUnavailable`` (cause ``NotReplicated``) after ``retry_s``."""
    old, replica = group.current_primary(), group.current_replica()
    plain = SignalBuffer.from_url(group.url, namespace=namespace, env={}, retry_s=15)
    waiting = SignalBuffer.from_url(group.url, namespace=namespace, env={}, retry_s=0.5, wait_replicas=1)
    assert replica.process is not None
    replica.process.send_signal(signal.SIGSTOP)
    primary_client = old.client()
    # Cut the replication link while the replica is frozen: nothing written from now on is in
    # any socket towards it (a frozen process would still find earlier bytes in its buffer).
    primary_client.client_kill_filter(_type="replica")
    primary_client.close()
    try:
        assert plain.record("p0", 0, 0, [(5, 100)]).buffered
        with pytest.raises(BufferUnavailable) as refused:
            waiting.record("p0", 0, 1, [(6, 100)])
        assert isinstance(refused.value.__cause__, NotReplicated)
        assert layers_on(old, namespace) == [(0, 100)]
        old.kill()
    finally:
        replica.process.send_signal(signal.SIGCONT)
    group.wait_for_new_primary(old.port)

    assert plain.register(task()).recovered == []  # acknowledged, then lost with the old primary
    plain.close()
    waiting.close()


def test_wait_replicas_comes_from_the_environment_and_bad_values_are_refused() -> None:
    config = BufferConfig.resolve({"RLS_WAIT_REPLICAS": "2", "RLS_WAIT_TIMEOUT_MS": "250"})
    assert (config.wait_replicas, config.wait_timeout_ms) == (2, 250)
    assert BufferConfig.resolve({}, wait_replicas=1).wait_replicas == 1
    with pytest.raises(InvalidConfig) as bad_env:
        BufferConfig.resolve({"RLS_WAIT_REPLICAS": "one"})
    assert bad_env.value.field == "RLS_WAIT_REPLICAS"
    for field, value in (("wait_replicas", -1), ("wait_timeout_ms", 0), ("wait_replicas", True)):
        with pytest.raises(InvalidConfig) as bad:
            BufferConfig.resolve({}, **{field: value})
        assert bad.value.field == field and bad.value.value is value


def test_sentinel_url_carries_the_data_nodes_user_and_password(group: SentinelTopology, namespace: str) -> None:
    user = f"rls-{namespace}"
    for server in group.servers:  # ACL users are per server, not replicated
        client = server.client()
        client.execute_command("ACL", "SETUSER", user, "reset", "on", ">pw-1", *acl.rules(namespace))
        client.close()
    hosts = group.url.split("://", 1)[1]
    buf = SignalBuffer.from_url(f"redis+sentinel://{user}:pw-1@{hosts}", namespace=namespace, env={})
    buf.record("p0", 0, 0, [(5, 100)])
    assert [s.tokens for s in buf.register(task()).recovered] == [100]
    buf.close()
    wrong = SignalBuffer.from_url(f"redis+sentinel://{user}:nope@{hosts}", namespace=namespace, env={}, retry_s=0.3)
    with pytest.raises(BufferUnavailable):
        wrong.pending("p0", 0, 5)
    wrong.close()


async def test_sentinel_failover_kept_connection_asks_the_sentinels_again(
    group: SentinelTopology, namespace: str
) -> None:
    """A kept connection to a demoted primary that refuses writes (NOREPLICAS) is closed and
    handed back to the pool, whose next checkout asks the sentinels for the new primary."""
    old = group.current_primary()
    abuf = AsyncSignalBuffer.from_url(group.url, namespace=namespace, env={}, retry_s=10)
    try:
        await abuf.record("p0", 0, 0, [(5, 100)])
        # The replica holds the signal before the failover (read from it: a WAIT on another
        # connection than the write's would count nothing, and would ask the sentinels, which a
        # loaded machine can catch flagging the primary down for a moment).
        replica = group.current_replica()

        def held() -> bool:
            return layers_on(replica, namespace) == [(0, 100)]

        await asyncio.to_thread(wait_until, held, timeout=15, what="the replica holding the signal")
        direct = abuf.sender.direct
        assert isinstance(direct, wire.AsyncDirectCalls)
        assert direct._idle, "the buffer keeps a connection to the old primary"
        set_config(old, "min-replicas-to-write", 1)

        new_port = await asyncio.to_thread(group.failover)

        assert new_port != old.port
        assert (await abuf.record("p0", 0, 1, [(5, 200)])).buffered
        recovered = (await abuf.register(task(slot=5))).recovered
        assert [(s.layer, s.tokens) for s in recovered] == [(0, 100), (1, 200)]
    finally:
        await abuf.close()
