"""Layer0Bridge with nranks > 1: the tensor-parallel ranks of one instance, each with its own
buffer and threads (consumer, adder, sender; the adders not in lockstep), fed the same GPU
stream, on fakeredis and on a real redis-server, queue the identical sequence of batches; nothing
is lost or queued twice, and an aborted request's entries expire on every rank while holding
nothing back. The ranks agree over a socket in ``RLS_GROUP_DIR`` (each test's own), not through
Redis; the faults are in ``test_fastdeploy_tp_faults.py``."""

from __future__ import annotations

import queue
from typing import Any

import pytest

from redis_layer_signals import InvalidConfig, SignalBuffer
from redis_layer_signals.fastdeploy import Layer0Bridge
from redis_layer_signals.fastdeploy.health import BridgeMetrics
from redis_layer_signals.fastdeploy.signals import encode_kv_signal
from tests.servers import running, wait_until
from tests.tp_group import Group, cache_info, check_agreement, signal, workload

Entry = tuple[int, int]


pytestmark = pytest.mark.usefixtures("group_base")


@pytest.mark.parametrize("nranks", [2, 4])
@pytest.mark.parametrize("seed", [1, 2])
def test_racing_ranks_queue_one_sequence_nothing_lost_nothing_twice(
    tp_url: str, namespace: str, nranks: int, seed: int, groups: list[Group]
) -> None:
    """Each rank's consumer, adder (each in an order and at a pace of its own) and sender race:
    every rank queues the same sequence of one-entry batches, each entry of the stream once,
    each slot's chunks in the GPU's order; each sender finishes its requests."""
    work = workload(seed)
    group = Group(tp_url, namespace, nranks)
    groups.append(group)
    group.run(work, seed=seed)
    group.wait_queued(len(work.stream))
    check_agreement(group.queued, work.stream)
    assert sorted(entry for [entry] in group.queued[0]) == sorted(work.stream)
    wait_until(lambda: all(b.health().group_reported == 0 for b in group.bridges), 30, what="the group to settle")
    for rank, health in enumerate(group.health()):
        assert len(group.queued[rank]) == len(work.stream), "nothing queued twice"
        assert (health.group_waiting, health.group_reported, dict(health.errors)) == (0, 0, {})
        assert health.group_outcomes == {"released": len(work.stream)}
        assert set(health.group_events) <= {"generation"}, health.group_events  # nothing went wrong
    for bridge in group.bridges:
        assert bridge.flush(10.0)
    stats = group.buffers[0].stats()
    total, tasks = nranks * len(work.stream), nranks * len(work.tasks)
    assert stats["recorded"] == stats["delivered"] + stats["buffered"] == total
    # Redis keeps a rank's newest early signal per slot, as for a rank of its own (an earlier
    # chunk counts as superseded there, though the group queued it): each entry ends once.
    assert stats["delivered"] + stats["recovered"] + stats["superseded"] == total
    assert (stats["registered"], stats["finished"], stats["expired"]) == (tasks, tasks, 0)
    for rank in range(nranks):  # every task finished: Redis holds no task of the rank
        assert all(group.buffers[0].task("p0", rank, slot) is None for slot, _r, _n in work.tasks)


@pytest.mark.parametrize("nranks", [2, 4])
def test_an_aborted_requests_entries_expire_on_every_rank_and_hold_nothing_back(
    tp_url: str, namespace: str, nranks: int, groups: list[Group]
) -> None:
    work = workload(7, requests=8, aborted=1)
    group = Group(tp_url, namespace, nranks, pending_ttl_s=1.0)
    groups.append(group)
    registered = [entry for entry in work.stream if entry[0] not in work.aborted]
    group.run(work)
    group.wait_queued(len(registered))
    check_agreement(group.queued, work.stream)
    assert sorted(entry for [entry] in group.queued[0]) == sorted(registered)
    aborted = len(work.stream) - len(registered)
    wait_until(
        lambda: all(h.group_waiting == 0 and h.group_outcomes.get("expired") == aborted for h in group.health()),
        30,
        what="the aborted entries to expire on every rank",
    )
    assert all(len(queued) == len(registered) for queued in group.queued)
    for bridge in group.bridges:
        assert bridge.flush(10.0)
    stats = group.buffers[0].stats()
    assert stats["expired"] == nranks * aborted
    assert stats["delivered"] + stats["recovered"] + stats["superseded"] == nranks * len(registered)


def test_the_tp2_example_one_message_for_two_slots_one_registered_late(
    tp_url: str, namespace: str, groups: list[Group]
) -> None:
    """Rank 1 had not registered slot 5 when the message came: before, rank 0 queued
    [[(5,128),(6,128)]] and rank 1 [[(6,128)],[(5,128)]], and the ranks deadlocked. Now the
    hooks queue nothing themselves; the group releases each entry once every rank has its
    task, as a batch of its own, in one order on both ranks: slot 6 does not wait for slot 5."""
    group = Group(tp_url, namespace, 2)
    groups.append(group)
    first, second = group.bridges
    for bridge in (first, second):
        assert bridge.on_cache_task(cache_info(6, "b", 300)) == []
    assert first.on_cache_task(cache_info(5, "a", 300)) == []
    message = encode_kv_signal(0, [(5, 0, 128), (6, 0, 128)])
    assert first.on_kv_signal(message) == []
    assert second.on_kv_signal(message) == []
    group.wait_queued(1)
    assert group.queued == [[[(6, 128)]], [[(6, 128)]]], "slot 6 is released while 5 waits on rank 1"
    assert [h.group_waiting for h in group.health()] == [0, 1]
    assert second.on_cache_task(cache_info(5, "a", 300)) == []
    group.wait_queued(2)
    assert group.queued == [[[(6, 128)], [(5, 128)]]] * 2


def test_releases_and_expiries_go_on_while_redis_is_down(namespace: str, groups: list[Group]) -> None:
    with running() as server:
        group = Group(server.url, namespace, 2, pending_ttl_s=1.0, retry_s=0.2)
        groups.append(group)
        group.wait_joined()
        for bridge in group.bridges:
            bridge.on_cache_task(cache_info(5, "a", 300))
        server.kill()
        for bridge in group.bridges:
            assert bridge.on_kv_signal(signal([(5, 128)])) == []
            assert bridge.on_kv_signal(signal([(9, 64), (5, 256)])) == []  # 9: aborted
        group.wait_queued(2)
        assert group.queued == [[[(5, 128)], [(5, 256)]]] * 2, "the entry behind the aborted one waits for nothing"
        wait_until(
            lambda: all(h.degraded and h.group_outcomes.get("expired") == 1 for h in group.health()),
            20,
            what="slot 9's entry to expire on both ranks with Redis down",
        )
        metrics = BridgeMetrics()
        metrics.track(group.bridges[1])
        labels = f'instance="p0",namespace="{namespace}"'
        text = metrics.render().decode()
        assert f'rls_bridge_group_waiting{{{labels},rank="1"}} 0.0' in text
        assert f'rls_bridge_group_entries_total{{{labels},outcome="released",rank="1"}} 2.0' in text
        assert f'rls_bridge_group_entries_total{{{labels},outcome="expired",rank="1"}} 1.0' in text
        server.start()
        for bridge in group.bridges:
            assert bridge.flush(30.0)
        assert group.queued == [[[(5, 128)], [(5, 256)]]] * 2


@pytest.mark.parametrize("bad", [0, 65, True, 2.0, "2"])
def test_nranks_must_be_an_int_in_1_to_64(bad: Any) -> None:
    buffer = SignalBuffer.from_url("memory://", env={})
    with pytest.raises(InvalidConfig, match="nranks"):
        Layer0Bridge(buffer, "p0", 0, num_layers=4, nranks=bad)


def test_nranks_above_1_needs_the_owned_layout() -> None:
    buffer = SignalBuffer.from_url("memory://", env={})
    with pytest.raises(InvalidConfig, match="registers_tasks"):
        Layer0Bridge(buffer, "p0", 0, num_layers=4, nranks=2, registers_tasks=False)


def test_early_signals_an_earlier_process_left_are_not_taken_over_by_a_tp_rank(tp_url: str, namespace: str) -> None:
    """A rank's entries come only from the GPU stream every rank reads: a signal left in Redis by
    an earlier process of one rank would be a batch the other ranks never queue. It ends as
    ``expired`` instead, and the task that registers gets nothing from it."""
    buffer = SignalBuffer.from_url(tp_url, namespace=namespace, env={})
    try:
        earlier = Layer0Bridge(buffer, "p0", 0, num_layers=4)
        earlier.on_kv_signal(encode_kv_signal(0, [(5, 0, 128)]))
        assert earlier.flush(10.0)
        earlier.close()
        assert [s.tokens for s in buffer.pending("p0", 0, 5)] == [128]
        ready: queue.Queue[list[Entry]] = queue.Queue()
        bridge = Layer0Bridge(buffer, "p0", 0, num_layers=4, ready=ready, nranks=2)
        try:
            assert bridge.on_cache_task(cache_info(5, "a", 300)) == []
            assert bridge.flush(10.0)
            assert buffer.pending("p0", 0, 5) == []
            stats = buffer.stats()
            assert (stats["buffered"], stats["expired"], stats["recovered"]) == (1, 1, 0)
            assert ready.empty()
        finally:
            bridge.close()
    finally:
        buffer.close()
