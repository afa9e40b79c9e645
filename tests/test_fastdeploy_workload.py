"""Many requests, chunked, in every order: early signals, late ones, and races with the task.

Once in one process (fakeredis and a real redis-server), and once with the cache-task adder in
a separate process that shares only a real Redis (and the ready queue) with the signal
consumer and the sender. Either way nothing is lost: every request finishes, every block of
every layer is written exactly once, and every recorded signal is accounted for."""

from __future__ import annotations

import multiprocessing
import queue
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from redis_layer_signals import SignalBuffer
from redis_layer_signals.fastdeploy import Layer0Bridge
from redis_layer_signals.fastdeploy.reference import STOP, ReferenceMessager, run_adder_process
from redis_layer_signals.fastdeploy.scripted import DEST_BLOCK_BASE, PrefillRequest, RecordingTransport, ScriptedGpu
from tests.servers import RedisServer

LAYERS = 4
REQUESTS = 32
WAIT_S = 30.0
"""Bound on the whole workload finishing; it takes about a second."""
ORDERS = ("early", "late", "racy")


@pytest.fixture(params=["fake", "real"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@dataclass
class Plan:
    """One request and the order its task and its chunks reach the messager."""

    request: PrefillRequest
    order: str
    early_chunks: int
    chunks: list[tuple[int, int]]
    task_sent: bool = False
    steps: list[str] = field(default_factory=list)


def make_plans(seed: int) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for slot in range(REQUESTS):
        need = rng.randint(40, 520)
        request = PrefillRequest(f"req-{slot}", slot, need, decode_cached_blocks=rng.choice([0, 0, 1]))
        chunks = request.chunks(rng.choice([64, 128, 256, 1024]))
        order = ORDERS[slot % len(ORDERS)]
        early = rng.randint(1, len(chunks)) if order == "early" else 0
        plans.append(Plan(request, order, early, chunks))
    return plans


def drive(
    plans: list[Plan],
    gpu: ScriptedGpu,
    seed: int,
    send_task: Callable[[PrefillRequest], None],
    await_registered: Callable[[str], None],
    await_consumed: Callable[[], None],
) -> None:
    """Interleave the requests: several share a forward step, as in continuous batching.

    ``early`` requests run their first chunks before the task is sent (and the consumer has
    read them); ``late`` ones wait for the task to be registered; ``racy`` ones send the task
    and run the chunks without waiting for either.
    """
    rng = random.Random(seed)
    cursor = {p.request.slot: 0 for p in plans}
    active = list(plans)
    while active:
        plan = rng.choice(active)
        if not plan.task_sent and cursor[plan.request.slot] >= plan.early_chunks:
            if plan.order == "early":
                await_consumed()
            send_task(plan.request)
            plan.task_sent = True
            if plan.order == "late":
                await_registered(plan.request.request_id)
            continue
        mates = [p for p in active if p is not plan and (p.task_sent or cursor[p.request.slot] < p.early_chunks)]
        step = [plan, *rng.sample(mates, min(len(mates), rng.randint(0, 3)))]
        gpu.forward([(p.request, *p.chunks[cursor[p.request.slot]]) for p in step])
        for p in step:
            cursor[p.request.slot] += 1
            if cursor[p.request.slot] == len(p.chunks) and p.task_sent:
                active.remove(p)
        for p in list(active):
            if cursor[p.request.slot] == len(p.chunks) and not p.task_sent:
                await_consumed()
                send_task(p.request)
                p.task_sent = True
                active.remove(p)


def assert_nothing_lost(plans: list[Plan], messager: ReferenceMessager, buffer: SignalBuffer) -> None:
    ids = {p.request.request_id for p in plans}
    assert messager.wait_finished(ids, WAIT_S) == ids
    expected = {
        (p.request.slot, layer, block): 1
        for p in plans
        for layer in range(LAYERS)
        for block in p.request.src_block_ids[p.request.decode_cached_blocks :]
    }
    transport = messager.transport
    assert transport.block_writes() == expected
    assert transport.premature == []
    assert messager.errors == []
    for write in transport.writes:
        assert [d - DEST_BLOCK_BASE for d in write.dest_blocks] == list(write.src_blocks)

    stats = buffer.stats()
    dropped = sum(v for k, v in stats.items() if k.startswith("dropped_"))
    assert stats["recorded"] == stats["delivered"] + stats["buffered"]
    assert stats["buffered"] == stats["recovered"] + stats["superseded"] + dropped + stats["finish_dropped"]
    assert (dropped, stats["expired"], stats["finish_dropped"]) == (0, 0, 0)
    assert stats["delivered"] > 0 and stats["recovered"] > 0, "both orders must have happened"
    assert stats["finished"] == REQUESTS
    for p in plans:
        assert buffer.pending("p0", 0, p.request.slot) == []
        assert buffer.task("p0", 0, p.request.slot) is None


@pytest.fixture
def single(url: str, namespace: str) -> Iterator[tuple[SignalBuffer, ReferenceMessager, ScriptedGpu]]:
    buffer = SignalBuffer.from_url(url, namespace=namespace, env={})
    messager = ReferenceMessager(Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS), RecordingTransport())
    gpu = ScriptedGpu(messager.signals, LAYERS)
    messager.transport.gpu = gpu
    with messager:
        yield buffer, messager, gpu
    buffer.close()


@pytest.mark.parametrize("seed", [1, 2])
def test_workload_in_one_process_loses_nothing(
    single: tuple[SignalBuffer, ReferenceMessager, ScriptedGpu], seed: int
) -> None:
    buffer, messager, gpu = single
    plans = make_plans(seed)

    def send_task(request: PrefillRequest) -> None:
        messager.cache_infos.put(request.prefill_half())
        messager.cache_infos.put(request.decode_half())

    def await_drained(_: str = "") -> None:
        assert messager.wait_drained(WAIT_S)

    drive(plans, gpu, seed, send_task, await_drained, await_drained)
    assert_nothing_lost(plans, messager, buffer)


@pytest.mark.timeout(120)
def test_adder_in_another_process_sharing_redis_loses_nothing(redis_server: RedisServer, namespace: str) -> None:
    """The signal consumer and sender here, the cache-task adder in a spawned process: they
    share the real Redis (and a ready queue); the hand-off of each early signal is decided
    in Redis alone."""
    context = multiprocessing.get_context("spawn")
    inbox, ready, registered = context.Queue(), context.Queue(), context.Queue()
    adder = context.Process(
        target=run_adder_process,
        args=(redis_server.url, namespace, "p0", 0, LAYERS, 64, inbox, ready, registered),
        daemon=True,
    )
    adder.start()
    buffer = SignalBuffer.from_url(redis_server.url, namespace=namespace, env={})
    messager = ReferenceMessager(
        Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS), RecordingTransport(), ready=ready, with_adder=False
    )
    gpu = ScriptedGpu(messager.signals, LAYERS)
    messager.transport.gpu = gpu
    seen: set[str] = set()

    def send_task(request: PrefillRequest) -> None:
        inbox.put(request.prefill_half())
        inbox.put(request.decode_half())

    def await_registered(request_id: str) -> None:
        while request_id not in seen:
            try:
                seen.add(registered.get(timeout=WAIT_S))
            except queue.Empty:
                pytest.fail(f"the adder process did not register {request_id} within {WAIT_S}s")

    def await_consumed() -> None:
        assert messager.wait_drained(WAIT_S)

    try:
        with messager:
            plans = make_plans(seed=3)
            drive(plans, gpu, 3, send_task, await_registered, await_consumed)
            assert_nothing_lost(plans, messager, buffer)
        inbox.put(STOP)
        adder.join(WAIT_S)
        assert adder.exitcode == 0
    finally:
        if adder.is_alive():
            adder.kill()
            adder.join(5)
        buffer.close()
