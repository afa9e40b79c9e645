"""Redis Cluster: keys spread over every primary while each call stays on one slot; the race
test on three primaries; a primary killed and its replica promoted, and a slot migrated
(MOVED/ASK/TRYAGAIN), both while calls run, with every signal accounted for exactly once.

The behaviour suite itself runs here too: ``cluster`` is a backend of the ``buf`` fixture."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from redis.cluster import key_slot

from redis_layer_signals import AsyncSignalBuffer, CacheTask, InvalidConfig, SignalBuffer
from redis_layer_signals.protocol.keys import KeySpace
from redis_layer_signals.transport import routing
from tests.churn import churn_during
from tests.servers import RedisServer, wait_until
from tests.test_race import assert_every_signal_accounted_once, run_race
from tests.topology import ClusterTopology

MIGRATE_BATCH = 10
"""Keys per MIGRATE, redis-cli's default pipeline."""


@pytest.fixture
def replicated(cluster_with_replicas: ClusterTopology) -> Iterator[ClusterTopology]:
    """The 3+3 cluster, healthy before and after the test (a killed node is back as a replica)."""
    wait_until(cluster_with_replicas.healthy, timeout=30, what="cluster healthy")
    yield cluster_with_replicas
    for node in cluster_with_replicas.nodes:
        if node.process is None or node.process.poll() is not None:
            node.start()
    wait_until(cluster_with_replicas.healthy, timeout=30, what="cluster healthy again")


def test_keys_of_instances_and_ranks_spread_over_all_three_primaries(cluster: ClusterTopology, namespace: str) -> None:
    buf = SignalBuffer.from_url(cluster.url, namespace=namespace, env={})
    owners = [(f"p{i}", rank) for i in range(6) for rank in range(4)]
    for instance, rank in owners:
        buf.record(instance, rank, 0, [(1, 10)])
    holders: dict[int, set[str]] = {}
    for node in cluster.primary_nodes():
        client = node.client()
        holders[node.port] = {k.decode() for k in client.scan_iter(match=f"rls:{{{namespace}/*", count=1000)}
        client.close()
    assert all(holders.values()), f"a primary holds none of the keys: { {p: len(k) for p, k in holders.items()} }"
    keys = KeySpace(namespace)
    for instance, rank in owners:
        rank_keys = keys.rank(instance, rank)
        on = [port for port, held in holders.items() if rank_keys.pending in held]
        assert len(on) == 1 and rank_keys.stats in holders[on[0]]
    buf.close()


def test_every_function_call_touches_one_slot(
    cluster: ClusterTopology, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    buf = SignalBuffer.from_url(cluster.url, namespace=namespace, env={})
    seen: list[set[int]] = []
    real = routing.fcall

    def spy(node_client: Any, function: str, keys: Any, args: Any, asking: bool) -> object:
        seen.append({key_slot(k.encode()) for k in keys})
        return real(node_client, function, keys, args, asking)

    monkeypatch.setattr(routing, "fcall", spy)
    for rank in range(3):
        buf.record("p0", rank, 0, [(5, 10), (6, 20)])
        buf.register(CacheTask("p0", rank, 5, "r", 100, 4))
        buf.finish("p0", rank, 5, "r")
    buf.stats()  # sweeps every rank
    assert len(seen) >= 10 and all(len(slots) == 1 for slots in seen)
    assert len(set().union(*seen)) == 3  # three ranks, three tags, three slots
    buf.close()


def fcall_counts(buf: SignalBuffer) -> dict[str, dict[str, int]]:
    """Each primary's FCALL and COMMAND GETKEYS counts since its last CONFIG RESETSTAT."""
    counted = {}
    for node in buf.client.get_primaries():
        stats = node.redis_connection.info("commandstats")
        wanted = ("cmdstat_fcall", "cmdstat_command|getkeys")
        counted[node.name] = {name: stats[name]["calls"] for name in stats if name in wanted}
    return counted


def reset_counts(buf: SignalBuffer) -> None:
    for node in buf.client.get_primaries():
        node.redis_connection.config_resetstat()


def assert_on_the_owner_alone(buf: SignalBuffer, calls: int) -> None:
    counts = fcall_counts(buf)
    owner = buf.client.get_node_from_key(buf.protocol.keys.rank("p0", 0).pending).name
    assert counts[owner].get("cmdstat_fcall") == calls, counts
    assert all("cmdstat_command|getkeys" not in found for found in counts.values()), counts
    assert sum(found.get("cmdstat_fcall", 0) for found in counts.values()) == calls, counts


def test_function_calls_go_to_the_key_node_alone(cluster: ClusterTopology, namespace: str) -> None:
    """redis-py's own FCALL asks a node COMMAND GETKEYS first (sync: the default node, which
    may not serve the call and which a partition may have cut off). The buffers name the node."""
    buf = SignalBuffer.from_url(cluster.url, namespace=namespace, env={})
    buf.record("p0", 0, 0, [(5, 10)])  # connected, library loaded, permissions checked
    reset_counts(buf)
    for layer in range(20):
        buf.record("p0", 0, layer, [(5, 10)])
    assert_on_the_owner_alone(buf, 20)

    async def run_async() -> None:
        abuf = AsyncSignalBuffer.from_url(cluster.url, namespace=namespace, env={})
        try:
            await abuf.record("p0", 0, 0, [(5, 10)])
            reset_counts(buf)
            for layer in range(20):
                await abuf.record("p0", 0, layer, [(5, 10)])
        finally:
            await abuf.close()

    asyncio.run(run_async())
    assert_on_the_owner_alone(buf, 20)
    buf.close()


def test_a_refresh_redis_py_asks_for_runs_on_the_refresher_thread(cluster: ClusterTopology, namespace: str) -> None:
    """redis-py refreshes its slot table on the calling thread after a timeout; a client made
    by ``from_url`` hands that to its one refresher: the caller goes on at once, and a second
    request while a refresh runs starts none."""
    buf = SignalBuffer.from_url(cluster.url, namespace=namespace, env={})
    refresher = routing.refresher_of(buf.client)
    entered, release = threading.Event(), threading.Event()
    asked: list[tuple[str | None, str]] = []
    real = refresher._initialize

    def slow_refresh(**kwargs: Any) -> None:
        asked.append((kwargs.get("last_failed_node_name"), threading.current_thread().name))
        entered.set()
        release.wait(10)
        real(**kwargs)

    refresher._initialize = slow_refresh  # type: ignore[method-assign]
    failed = buf.client.get_primaries()[0].name
    buf.client.nodes_manager.initialize(last_failed_node_name=failed)  # returns: the refresh is elsewhere
    assert entered.wait(10)
    assert routing.refresh_slots(buf.client, None) is None  # one refresh at a time
    buf.record("p0", 0, 0, [(5, 10)])  # calls go on meanwhile
    release.set()
    assert asked == [(failed, "rls-slot-refresh")]
    wait_until(lambda: refresher.request(None) is not None, timeout=10, what="the refresh ended")
    buf.close()


def test_eight_processes_racing_on_the_cluster_account_for_every_signal_once(cluster: ClusterTopology) -> None:
    logs, buf = run_race(cluster.url, seed=5)
    assert sum(log.registered for log in logs) > 0 and sum(len(log.delivered) for log in logs) > 0
    assert_every_signal_accounted_once(logs, buf)
    buf.close()


def test_killed_primary_replaced_by_its_replica_while_calls_run_loses_and_repeats_nothing(
    replicated: ClusterTopology,
) -> None:
    namespace = f"failover-{uuid.uuid4().hex[:8]}"
    tag_key = KeySpace(namespace).rank("p0", 0).pending
    victim: RedisServer = replicated.node_for_key(tag_key)

    def fault() -> None:
        time.sleep(1)  # let the calls get going first
        victim.kill()
        wait_until(lambda: replicated.node_for_key(tag_key).port != victim.port, timeout=30, what="replica promoted")
        victim.start()  # back as a replica of the promoted node, so WAIT can be satisfied again
        wait_until(replicated.healthy, timeout=30, what="cluster healthy")

    # wait_replicas=1: a call is acknowledged only once the replica has it, so the promoted
    # replica holds every acknowledged signal (without it, the last writes could be lost).
    logs = churn_during(replicated.url, namespace, fault, retry_s=20, wait_replicas=1, wait_timeout_ms=500)
    assert replicated.node_for_key(tag_key).port != victim.port
    buf = SignalBuffer.from_url(replicated.url, namespace=namespace, env={})
    assert_every_signal_accounted_once(logs, buf)
    buf.close()


def _redirections(topology: ClusterTopology) -> dict[str, int]:
    """MOVED/ASK/TRYAGAIN replies the primaries have sent so far (INFO errorstats)."""
    totals: dict[str, int] = {}
    for node in topology.primary_nodes():
        client = node.client()
        for name, value in client.info("errorstats").items():
            kind = name.removeprefix("errorstat_")
            if kind in ("MOVED", "ASK", "TRYAGAIN"):
                totals[kind] = totals.get(kind, 0) + int(value["count"])
        client.close()
    return totals


def _migrate_slot(topology: ClusterTopology, key: str) -> None:
    """Move ``key``'s slot to another primary the way ``redis-cli --cluster reshard`` does:
    IMPORTING/MIGRATING, MIGRATE the keys in batches, then SETSLOT NODE everywhere. Calls that
    arrive meanwhile get TRYAGAIN (their fresh reply key is missing on the source while the
    rank's other keys are still there) and then ASK, until the slot is moved."""
    source = topology.node_for_key(key)
    target = next(n for n in topology.primary_nodes() if n.port != source.port)
    src, dst = source.client(), target.client()
    try:
        slot = key_slot(key.encode())
        src_id, dst_id = src.cluster("myid"), dst.cluster("myid")
        src_id = src_id.decode() if isinstance(src_id, bytes) else src_id
        dst_id = dst_id.decode() if isinstance(dst_id, bytes) else dst_id
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        while True:
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, MIGRATE_BATCH)
            if not keys:
                break
            src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
        for node in topology.primary_nodes():
            client = node.client()
            client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
            client.close()
    finally:
        src.close()
        dst.close()


def test_slot_migrated_while_calls_run_is_followed_and_nothing_is_delivered_twice(
    replicated: ClusterTopology,
) -> None:
    namespace = f"migrate-{uuid.uuid4().hex[:8]}"
    tag_key = KeySpace(namespace).rank("p0", 0).pending
    before = replicated.node_for_key(tag_key).port

    def fault() -> None:
        time.sleep(1)  # let the calls get going first
        _migrate_slot(replicated, tag_key)
        wait_until(lambda: replicated.node_for_key(tag_key).port != before, timeout=10, what="slot moved")
        _migrate_slot(replicated, tag_key)  # and on again
        time.sleep(0.5)  # calls after the move: their cached slot map is stale (MOVED)

    redirections_before = _redirections(replicated)
    logs = churn_during(replicated.url, namespace, fault, retry_s=10)
    redirected = {k: v - redirections_before.get(k, 0) for k, v in _redirections(replicated).items()}
    assert redirected.get("MOVED", 0) > 0 and redirected.get("ASK", 0) + redirected.get("TRYAGAIN", 0) > 0, redirected
    buf = SignalBuffer.from_url(replicated.url, namespace=namespace, env={})
    assert_every_signal_accounted_once(logs, buf)
    buf.close()


def test_async_cluster_with_wait_replicas_is_refused_before_anything_is_sent(
    cluster: ClusterTopology, namespace: str
) -> None:
    async def scenario() -> None:
        abuf = AsyncSignalBuffer.from_url(cluster.url, namespace=namespace, env={}, wait_replicas=1)
        try:
            with pytest.raises(InvalidConfig) as refused:
                await abuf.record("p0", 0, 0, [(5, 100)])
            assert refused.value.field == "wait_replicas"
            assert await abuf.pending("p0", 0, 5) == []
        finally:
            await abuf.close()

    asyncio.run(scenario())
