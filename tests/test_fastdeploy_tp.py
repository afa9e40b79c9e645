"""Layer0Bridge with nranks > 1: the tensor-parallel ranks of one instance, each with its own
buffer and threads (consumer, lockstep adder, sender), fed the same GPU stream, on fakeredis and
on a real redis-server, queue the identical sequence of batches; nothing is lost or queued
twice, and an aborted request's entries are given up by the whole group through Redis."""

from __future__ import annotations

import queue
import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from redis_layer_signals import InvalidConfig, SignalBuffer
from redis_layer_signals.fastdeploy import Layer0Bridge
from redis_layer_signals.fastdeploy.health import BridgeMetrics
from redis_layer_signals.fastdeploy.signals import encode_kv_signal
from tests.servers import RedisServer, running, wait_until

Entry = tuple[int, int]


@pytest.fixture(params=["fake", "real"])
def tp_url(request: pytest.FixtureRequest) -> str:
    if request.param == "fake":
        return f"memory://{uuid.uuid4().hex}"
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


@dataclass
class Workload:
    """The GPU's layer-0 messages (every rank reads them, in order) and the tasks the lockstep
    adders register, in an order of their own; ``aborted`` slots never register."""

    messages: list[list[Entry]]
    tasks: list[tuple[int, str, int]]  # (slot, request id, need_prefill_tokens)
    aborted: set[int]

    @property
    def stream(self) -> list[Entry]:
        return [entry for message in self.messages for entry in message]


def workload(seed: int, requests: int = 12, aborted: int = 0) -> Workload:
    rng = random.Random(seed)
    chunks = {slot: [rng.randint(1, 300) for _ in range(rng.randint(1, 3))] for slot in range(requests + aborted)}
    order = [slot for slot, sizes in chunks.items() for _ in sizes]
    rng.shuffle(order)
    emitted = dict.fromkeys(chunks, 0)
    prefilled = dict.fromkeys(chunks, 0)
    stream = []
    for slot in order:
        prefilled[slot] += chunks[slot][emitted[slot]]
        emitted[slot] += 1
        stream.append((slot, prefilled[slot]))
    messages = []
    while stream:
        size = rng.randint(1, 4)
        messages.append(stream[:size])
        stream = stream[size:]
    tasks = [(slot, f"req-{seed}-{slot}", prefilled[slot]) for slot in range(requests)]
    rng.shuffle(tasks)
    return Workload(messages, tasks, set(range(requests, requests + aborted)))


def cache_info(slot: int, request_id: str, need: int) -> dict[str, Any]:
    return {"request_id": request_id, "current_id": slot, "need_prefill_tokens": need}


class Group:
    """``nranks`` bridges of one instance, one buffer each, as one process per GPU has."""

    def __init__(self, url: str, namespace: str, nranks: int, **options: Any) -> None:
        self.buffers = [SignalBuffer.from_url(url, namespace=namespace, env={}, **options) for _ in range(nranks)]
        self.ready: list[queue.Queue[list[Entry]]] = [queue.Queue() for _ in range(nranks)]
        self.bridges = [
            Layer0Bridge(buffer, "p0", rank, num_layers=4, ready=ready, nranks=nranks, probe_s=0.05)
            for rank, (buffer, ready) in enumerate(zip(self.buffers, self.ready, strict=True))
        ]
        self.queued: list[list[list[Entry]]] = [[] for _ in range(nranks)]

    def run(self, work: Workload, expected: int, timeout_s: float = 60.0) -> None:
        """Each rank's consumer, adder (in lockstep: a barrier after each task) and sender race;
        returns once every sender took ``expected`` batches (or the timeout passes)."""
        nranks = len(self.bridges)
        adders_in_step = threading.Barrier(nranks)
        need = {slot: (request_id, tokens) for slot, request_id, tokens in work.tasks}
        failures: list[BaseException] = []

        def consumer(rank: int) -> None:
            rng = random.Random(rank)
            for message in work.messages:
                time.sleep(rng.random() * 0.003)
                self.bridges[rank].on_kv_signal(encode_kv_signal(0, [(slot, 0, tokens) for slot, tokens in message]))

        def adder(rank: int) -> None:
            rng = random.Random(100 + rank)
            for slot, request_id, tokens in work.tasks:
                time.sleep(rng.random() * 0.005)
                self.bridges[rank].on_cache_task(cache_info(slot, request_id, tokens))
                adders_in_step.wait(timeout_s)

        def sender(rank: int) -> None:
            deadline = time.monotonic() + timeout_s
            while len(self.queued[rank]) < expected and time.monotonic() < deadline:
                try:
                    batch = self.ready[rank].get(timeout=0.1)
                except queue.Empty:
                    continue
                self.queued[rank].append(batch)
                for slot, tokens in batch:
                    request_id, total = need[slot]
                    if tokens == total:
                        self.bridges[rank].on_task_finished(slot, request_id)

        def guarded(target: Any, rank: int) -> None:
            try:
                target(rank)
            except BaseException as exc:
                failures.append(exc)

        threads = [
            threading.Thread(target=guarded, args=(target, rank))
            for rank in range(nranks)
            for target in (consumer, adder, sender)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s + 10)
        assert not failures, failures

    def close(self) -> None:
        for bridge in self.bridges:
            bridge.close()
        for buffer in self.buffers:
            buffer.close()


@pytest.fixture
def groups() -> Iterator[list[Group]]:
    made: list[Group] = []
    yield made
    for group in made:
        group.close()


@pytest.mark.parametrize("nranks", [2, 4])
@pytest.mark.parametrize("seed", [1, 2])
def test_racing_ranks_queue_the_gpu_stream_identically_nothing_lost_nothing_twice(
    tp_url: str, namespace: str, nranks: int, seed: int, groups: list[Group]
) -> None:
    work = workload(seed)
    group = Group(tp_url, namespace, nranks)
    groups.append(group)
    group.run(work, expected=len(work.stream))
    for rank in range(nranks):
        assert group.queued[rank] == [[entry] for entry in work.stream], f"rank {rank}"
        assert group.ready[rank].empty(), "nothing queued twice"
        health = group.bridges[rank].health()
        assert (health.group_waiting, health.group_voting, dict(health.errors)) == (0, 0, {})
    for bridge in group.bridges:
        assert bridge.flush(10.0)
    stats = group.buffers[0].stats()
    total, tasks = nranks * len(work.stream), nranks * len(work.tasks)
    assert stats["recorded"] == stats["delivered"] + stats["buffered"] == total
    assert stats["delivered"] + stats["recovered"] == total
    assert (stats["registered"], stats["finished"], stats["expired"]) == (tasks, tasks, 0)
    for rank in range(nranks):  # every task finished: Redis holds no task of the rank
        assert all(group.buffers[0].task("p0", rank, slot) is None for slot, _r, _n in work.tasks)


@pytest.mark.parametrize("nranks", [2, 4])
def test_an_aborted_requests_entries_are_given_up_by_the_whole_group(
    tp_url: str, namespace: str, nranks: int, groups: list[Group]
) -> None:
    work = workload(7, requests=8, aborted=1)
    group = Group(tp_url, namespace, nranks, pending_ttl_s=1.0)  # give_up_s: the pending TTL
    groups.append(group)
    legit = [entry for entry in work.stream if entry[0] not in work.aborted]
    group.run(work, expected=len(legit))
    wait_until(lambda: all(b.health().group_waiting == 0 for b in group.bridges), 30, what="the group to settle")
    first = group.queued[0]
    for rank in range(nranks):
        assert group.queued[rank] == first, f"rank {rank}"
    assert all(slot not in work.aborted for [(slot, _tokens)] in first)
    stream = iter(work.stream)  # queued in the GPU's order (a subsequence of the stream)
    assert all(any(entry == batch[0] for entry in stream) for batch in first)
    for bridge in group.bridges:
        assert bridge.flush(10.0)
    stats = group.buffers[0].stats()
    given_up = len(work.stream) - len(first)  # the aborted entries (and any legit one all ranks gave up)
    assert given_up >= len(work.stream) - len(legit)
    assert stats["expired"] == nranks * given_up
    assert stats["delivered"] + stats["recovered"] == nranks * len(first)


def test_the_tp2_example_one_message_for_two_slots_one_registered_late(
    tp_url: str, namespace: str, groups: list[Group]
) -> None:
    """Rank 1 had not registered slot 5 when the message came: before, rank 0 queued
    [[(5,128),(6,128)]] and rank 1 [[(6,128)],[(5,128)]], and the ranks deadlocked."""
    group = Group(tp_url, namespace, 2)
    groups.append(group)
    first, second = group.bridges
    for bridge in (first, second):
        bridge.on_cache_task(cache_info(6, "b", 300))
    first.on_cache_task(cache_info(5, "a", 300))
    message = encode_kv_signal(0, [(5, 0, 128), (6, 0, 128)])
    assert first.on_kv_signal(message) == [(5, 128), (6, 128)]
    assert second.on_kv_signal(message) == []
    assert second.on_cache_task(cache_info(5, "a", 300)) == [(5, 128), (6, 128)]
    for ready in group.ready:
        assert [ready.get_nowait(), ready.get_nowait()] == [[(5, 128)], [(6, 128)]]
        assert ready.empty()


def test_releases_go_on_during_an_outage_and_give_ups_wait_for_redis(namespace: str, groups: list[Group]) -> None:
    with running() as server:
        group = Group(server.url, namespace, 2, pending_ttl_s=0.5, retry_s=0.2)
        groups.append(group)
        for bridge in group.bridges:
            bridge.on_cache_task(cache_info(5, "a", 300))
        server.kill()
        for bridge in group.bridges:
            assert bridge.on_kv_signal(encode_kv_signal(0, [(5, 0, 128)])) == [(5, 128)]
            assert bridge.on_kv_signal(encode_kv_signal(0, [(9, 0, 64), (5, 0, 256)])) == []  # 9: aborted
        wait_until(
            lambda: all(b.health().group_voting == 1 and b.health().group_unreachable for b in group.bridges),
            20,
            what="both ranks to vote with Redis down",
        )
        for ready in group.ready:
            assert ready.get_nowait() == [(5, 128)]
            assert ready.empty(), "the entry behind the given-up head waits for the group"
        metrics = BridgeMetrics()
        metrics.track(group.bridges[1])
        labels = f'instance="p0",namespace="{namespace}",rank="1"'
        text = metrics.render().decode()
        assert f"rls_bridge_group_waiting{{{labels}}} 2.0" in text
        assert f"rls_bridge_group_voting{{{labels}}} 1.0" in text
        server.start()
        for ready in group.ready:
            assert ready.get(timeout=30) == [(5, 256)]
        for bridge in group.bridges:
            health = bridge.health()
            assert (health.group_waiting, health.group_voting, health.group_unreachable) == (0, 0, False)


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
