"""A mixed workload for the reference messager, in one process or with the adder in another.

Many chunked requests share forward steps, as under continuous batching; each request's task
reaches the messager in one of three orders: ``early`` (some chunks run, and are read, before
the task is sent), ``late`` (the task is registered before any chunk runs) or ``racy`` (the
task and the chunks go out without waiting for each other). ``run`` drives it and returns
what happened, so a caller can check that nothing was lost or sent twice.
"""

from __future__ import annotations

import multiprocessing
import queue
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...buffer.sync import SignalBuffer
from ..bridge import DEFAULT_BLOCK_SIZE, Layer0Bridge, QueueLike
from ..health import BridgeHealth
from .reference import STOP, ReferenceMessager, run_adder_process
from .scripted import PrefillRequest, RecordingTransport, ScriptedGpu

ORDERS = ("early", "late", "racy")
INSTANCE = "p0"
RANK = 0
CHUNK_CHOICES = (64, 128, 256, 1024)
"""Chunk sizes a request is prefilled in (1024: usually one chunk)."""
MAX_STEP_MATES = 3
"""Other requests that may share one forward step."""


@dataclass
class Plan:
    """One request and the order in which its task and its chunks reach the messager."""

    request: PrefillRequest
    order: str
    early_chunks: int
    chunks: list[tuple[int, int]]
    task_sent: bool = False


def make_plans(seed: int, requests: int, max_tokens: int = 520) -> list[Plan]:
    """``requests`` requests on slots ``0..requests-1``, orders in rotation, sizes seeded."""
    rng = random.Random(seed)
    plans = []
    for slot in range(requests):
        need = rng.randint(40, max_tokens)
        request = PrefillRequest(f"req-{slot}", slot, need, decode_cached_blocks=rng.choice([0, 0, 1]))
        chunks = request.chunks(rng.choice(CHUNK_CHOICES))
        order = ORDERS[slot % len(ORDERS)]
        early = rng.randint(1, len(chunks)) if order == "early" else 0
        plans.append(Plan(request, order, early, chunks))
    return plans


def drive(
    plans: list[Plan],
    gpu: ScriptedGpu,
    seed: int,
    adder_inbox: QueueLike,
    await_registered: Callable[[str], None],
    await_consumed: Callable[[], None],
    on_step: Callable[[int], None] | None = None,
) -> None:
    """Run every chunk and send every task (both ``cache_info`` halves, on ``adder_inbox``) in a
    seeded interleaving that honours each order. ``on_step`` is called with a running count
    after each forward step and each task sent (a fault injector hooks in there)."""
    rng = random.Random(seed)
    steps = 0

    def stepped() -> None:
        nonlocal steps
        steps += 1
        if on_step is not None:
            on_step(steps)

    cursor = {p.request.slot: 0 for p in plans}
    active = list(plans)

    def send(plan: Plan) -> None:
        if plan.order == "early":
            await_consumed()  # its early chunks are buffered before the task can see them
        adder_inbox.put(plan.request.prefill_half())
        adder_inbox.put(plan.request.decode_half())
        plan.task_sent = True
        if plan.order == "late":
            await_registered(plan.request.request_id)

    while active:
        plan = rng.choice(active)
        if not plan.task_sent and cursor[plan.request.slot] >= plan.early_chunks:
            send(plan)
            stepped()
            continue
        runnable = [p for p in active if p is not plan and (p.task_sent or cursor[p.request.slot] < p.early_chunks)]
        step = [plan, *rng.sample(runnable, min(len(runnable), rng.randint(0, MAX_STEP_MATES)))]
        gpu.forward([(p.request, *p.chunks[cursor[p.request.slot]]) for p in step])
        for p in step:
            cursor[p.request.slot] += 1
        stepped()
        for p in list(active):
            if cursor[p.request.slot] == len(p.chunks):
                if not p.task_sent:
                    send(p)
                    stepped()
                active.remove(p)


PROBE_SLOT_OFFSET = 1
"""The request sent after the workload to show the threads still consume goes on the first
slot after the workload's."""


@dataclass(frozen=True)
class Outcome:
    """What a run did: finished and acknowledged requests, every block write, the buffer's
    counters and the bridge's, and whether the messager still served a request at the end."""

    plans: list[Plan]
    layers: int
    finished: set[str]
    acks: set[str]
    block_writes: dict[tuple[int, int, int], int]
    premature: int
    errors: int
    stats: dict[str, int] | None
    """The namespace's counters at the end; None when Redis could not be read."""
    local_counts: dict[str, int]
    """What the bridge decided locally and had not written back (see LocalState.counts)."""
    local_pending: int
    health: BridgeHealth
    alive_at_end: bool
    """The three threads were alive after the workload and served one more request."""
    seconds: float

    def expected(self) -> set[tuple[int, int, int]]:
        """``(slot, layer, block)`` of every block the decode nodes lack."""
        return {
            (p.request.slot, layer, block)
            for p in self.plans
            for layer in range(self.layers)
            for block in p.request.src_block_ids[p.request.decode_cached_blocks :]
        }

    def layer0_signals(self) -> int:
        """Layer-0 entries the GPU emitted: one per chunk of each request."""
        return sum(len(p.chunks) for p in self.plans)

    def problems(self) -> list[str]:
        """Everything that went wrong, in words; empty when nothing was lost or repeated."""
        expected = self.expected()
        out = []
        ids = {p.request.request_id for p in self.plans}
        if unfinished := ids - self.finished:
            out.append(f"{len(unfinished)} requests never finished")
        if unacked := ids - self.acks:
            out.append(f"{len(unacked)} 'task added' acknowledgements never sent")
        if missing := expected - set(self.block_writes):
            out.append(f"{len(missing)} block writes missing")
        if extra := set(self.block_writes) - expected:
            out.append(f"{len(extra)} unexpected block writes")
        if repeated := [key for key, count in self.block_writes.items() if count > 1]:
            out.append(f"{len(repeated)} blocks written more than once")
        if self.premature:
            out.append(f"{self.premature} blocks written before the GPU finished them")
        if self.errors:
            out.append(f"{self.errors} thread errors")
        if not self.alive_at_end:
            out.append("the messager's threads stopped serving")
        return out


def run(
    url: str,
    namespace: str,
    *,
    requests: int = 32,
    seed: int = 1,
    layers: int = 4,
    adder_process: bool = False,
    timeout_s: float = 30.0,
    retry_s: float | None = None,
    probe_s: float = 0.2,
    on_step: Callable[[int, ReferenceMessager], None] | None = None,
    before_end: Callable[[ReferenceMessager], None] | None = None,
) -> Outcome:
    """Drive the workload through a ``ReferenceMessager`` and collect the outcome.

    With ``adder_process`` the cache-task adder runs in a spawned process that shares only
    Redis (so ``url`` must be a real server) and the ready queue with this one. ``on_step``
    sees the driver's progress (see ``drive``); ``before_end`` runs once every request
    finished, before the closing probe request and the counters are read.
    """
    started = time.perf_counter()
    plans = make_plans(seed, requests)
    buffer = SignalBuffer.from_url(url, namespace=namespace, retry_s=retry_s)
    context = multiprocessing.get_context("spawn")
    ready: QueueLike | None = context.Queue() if adder_process else None
    bridge = Layer0Bridge(
        buffer, INSTANCE, RANK, num_layers=layers, ready=ready, registers_tasks=not adder_process, probe_s=probe_s
    )
    messager = ReferenceMessager(bridge, RecordingTransport(), with_adder=not adder_process)
    gpu = ScriptedGpu(messager.signals, layers)
    messager.transport.gpu = gpu
    acks: set[str] = set()

    def await_consumed() -> None:
        if not messager.wait_drained(timeout_s):
            raise TimeoutError(f"the messager did not drain its queues within {timeout_s}s")

    step_hook = None if on_step is None else (lambda step: on_step(step, messager))
    adder = None
    try:
        with messager:
            if adder_process:
                inbox, ack_queue = context.Queue(), context.Queue()
                args = (url, namespace, INSTANCE, RANK, layers, DEFAULT_BLOCK_SIZE, inbox, ready, ack_queue, retry_s)
                adder = context.Process(target=run_adder_process, args=args, daemon=True)
                adder.start()
                drive(plans, gpu, seed, inbox, _await_acked(ack_queue, acks, timeout_s), await_consumed, step_hook)
            else:  # the adder is a thread of the messager: drained means registered
                drive(plans, gpu, seed, messager.cache_infos, lambda _id: await_consumed(), await_consumed, step_hook)
            ids = {p.request.request_id for p in plans}
            finished = messager.wait_finished(ids, timeout_s)
            if adder is not None:
                acks |= _collect_acks(ack_queue, ids - acks, timeout_s)
            else:
                acks |= _drain(messager.acks)
            if before_end is not None:
                before_end(messager)
            if not bridge.health().degraded:
                bridge.flush(timeout_s)  # Redis then holds what the process decided
            stats = _stats_or_none(buffer)  # before the closing probe, which is not the workload's
            if bridge.owned is not None:
                local_counts, local_pending = bridge.owned.unwritten_counts(), bridge.owned.pending_here()
            else:
                local_counts, local_pending = dict(bridge.local.counts), bridge.local.pending_here()
            alive = all(t.is_alive() for t in messager.threads) and _serves_one_more(
                messager, gpu, requests, inbox if adder is not None else messager.cache_infos, timeout_s
            )
            if adder is not None:
                inbox.put(STOP)
                adder.join(timeout_s)
            if not bridge.health().degraded:
                bridge.flush(timeout_s)  # the probe's decisions too
        return Outcome(
            plans=plans,
            layers=layers,
            finished=finished,
            acks=acks,
            block_writes=_without_slot(messager.transport.block_writes(), requests),
            premature=len(messager.transport.premature),
            errors=len(messager.errors) + (0 if adder is None or adder.exitcode == 0 else 1),
            stats=stats,
            local_counts=local_counts,
            local_pending=local_pending,
            health=bridge.health(),
            alive_at_end=alive,
            seconds=time.perf_counter() - started,
        )
    finally:
        bridge.close()
        if adder is not None and adder.is_alive():
            adder.kill()
            adder.join(5)
        buffer.close()


def _serves_one_more(
    messager: ReferenceMessager, gpu: ScriptedGpu, requests: int, inbox: QueueLike, timeout_s: float
) -> bool:
    """One more request, its task first, on a slot the workload did not use: finishes?"""
    probe = PrefillRequest("req-probe", requests + PROBE_SLOT_OFFSET - 1, 100)
    inbox.put(probe.prefill_half())
    inbox.put(probe.decode_half())
    deadline = time.monotonic() + timeout_s
    # The task must be registered before the signal, or the probe tests recovery instead.
    while messager.bridge.registers_tasks and probe.slot not in messager.bridge.local.tasks:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    if not messager.bridge.registers_tasks:
        time.sleep(0.2)  # the adder process acknowledges on its own queue: give it a moment
    gpu.prefill(probe)
    return messager.wait_finished([probe.request_id], timeout_s) == {probe.request_id}


def _without_slot(writes: dict[tuple[int, int, int], int], slot: int) -> dict[tuple[int, int, int], int]:
    return {key: count for key, count in writes.items() if key[0] != slot}


def _stats_or_none(buffer: SignalBuffer) -> dict[str, int] | None:
    try:
        return buffer.stats()
    except Exception:
        return None


def _drain(source: queue.Queue[str]) -> set[str]:
    out = set()
    while True:
        try:
            out.add(source.get_nowait())
        except queue.Empty:
            return out


def _collect_acks(source: QueueLike, wanted: set[str], timeout_s: float) -> set[str]:
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while not wanted <= seen and time.monotonic() < deadline:
        try:
            seen.add(source.get(timeout=0.05))
        except queue.Empty:
            continue
    return seen


def _await_acked(acks: QueueLike, seen: set[str], timeout_s: float) -> Callable[[str], None]:
    """Wait until the adder process acknowledges ``request_id`` ("task added")."""

    def await_acked(request_id: str) -> None:
        while request_id not in seen:
            try:
                seen.add(acks.get(timeout=timeout_s))
            except queue.Empty:
                raise TimeoutError(f"the adder process did not acknowledge {request_id} within {timeout_s}s") from None

    return await_acked
