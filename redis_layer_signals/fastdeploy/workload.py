"""A mixed workload for the reference messager, in one process or with the adder in another.

Many chunked requests share forward steps, as under continuous batching; each request's task
reaches the messager in one of three orders: ``early`` (some chunks run, and are read, before
the task is sent), ``late`` (the task is registered before any chunk runs) or ``racy`` (the
task and the chunks go out without waiting for each other). :func:`run` drives it and returns
what happened, so a caller can check that nothing was lost or sent twice.
"""

from __future__ import annotations

import multiprocessing
import queue
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..buffer import SignalBuffer
from .bridge import DEFAULT_BLOCK_SIZE, Layer0Bridge
from .reference import STOP, QueueLike, ReferenceMessager, run_adder_process
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
) -> None:
    """Run every chunk and send every task (both ``cache_info`` halves, on ``adder_inbox``) in a
    seeded interleaving that honours each order."""
    rng = random.Random(seed)
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
            continue
        runnable = [p for p in active if p is not plan and (p.task_sent or cursor[p.request.slot] < p.early_chunks)]
        step = [plan, *rng.sample(runnable, min(len(runnable), rng.randint(0, MAX_STEP_MATES)))]
        gpu.forward([(p.request, *p.chunks[cursor[p.request.slot]]) for p in step])
        for p in step:
            cursor[p.request.slot] += 1
        for p in list(active):
            if cursor[p.request.slot] == len(p.chunks):
                if not p.task_sent:
                    send(p)
                active.remove(p)


@dataclass(frozen=True)
class Outcome:
    """What a run did: finished requests, every block write, and the buffer's counters."""

    plans: list[Plan]
    layers: int
    finished: set[str]
    block_writes: dict[tuple[int, int, int], int]
    premature: int
    errors: int
    stats: dict[str, int]
    seconds: float

    def expected(self) -> set[tuple[int, int, int]]:
        """``(slot, layer, block)`` of every block the decode nodes lack."""
        return {
            (p.request.slot, layer, block)
            for p in self.plans
            for layer in range(self.layers)
            for block in p.request.src_block_ids[p.request.decode_cached_blocks :]
        }

    def problems(self) -> list[str]:
        """Everything that went wrong, in words; empty when nothing was lost or repeated."""
        expected = self.expected()
        out = []
        unfinished = {p.request.request_id for p in self.plans} - self.finished
        if unfinished:
            out.append(f"{len(unfinished)} requests never finished")
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
) -> Outcome:
    """Drive the workload through a :class:`ReferenceMessager` and collect the outcome.

    With ``adder_process`` the cache-task adder runs in a spawned process that shares only
    Redis (so ``url`` must be a real server) and the ready queue with this one.
    """
    started = time.perf_counter()
    plans = make_plans(seed, requests)
    buffer = SignalBuffer.from_url(url, namespace=namespace)
    bridge = Layer0Bridge(buffer, INSTANCE, RANK, num_layers=layers)
    context = multiprocessing.get_context("spawn")
    ready = context.Queue() if adder_process else None
    messager = ReferenceMessager(bridge, RecordingTransport(), ready=ready, with_adder=not adder_process)
    gpu = ScriptedGpu(messager.signals, layers)
    messager.transport.gpu = gpu

    def await_consumed() -> None:
        if not messager.wait_drained(timeout_s):
            raise TimeoutError(f"the messager did not drain its queues within {timeout_s}s")

    adder = None
    try:
        with messager:
            if adder_process:
                inbox, registered = context.Queue(), context.Queue()
                args = (url, namespace, INSTANCE, RANK, layers, DEFAULT_BLOCK_SIZE, inbox, ready, registered)
                adder = context.Process(target=run_adder_process, args=args, daemon=True)
                adder.start()
                drive(plans, gpu, seed, inbox, _await_registered(registered, timeout_s), await_consumed)
            else:  # the adder is a thread of the messager: drained means registered
                drive(plans, gpu, seed, messager.cache_infos, lambda _request_id: await_consumed(), await_consumed)
            finished = messager.wait_finished({p.request.request_id for p in plans}, timeout_s)
            if adder is not None:
                inbox.put(STOP)
                adder.join(timeout_s)
        return Outcome(
            plans=plans,
            layers=layers,
            finished=finished,
            block_writes=messager.transport.block_writes(),
            premature=len(messager.transport.premature),
            errors=len(messager.errors) + (0 if adder is None or adder.exitcode == 0 else 1),
            stats=buffer.stats(),
            seconds=time.perf_counter() - started,
        )
    finally:
        if adder is not None and adder.is_alive():
            adder.kill()
            adder.join(5)
        buffer.close()


def _await_registered(registered: multiprocessing.Queue[str], timeout_s: float) -> Callable[[str], None]:
    """Wait until the adder process reports ``request_id`` registered."""
    seen: set[str] = set()

    def await_registered(request_id: str) -> None:
        while request_id not in seen:
            try:
                seen.add(registered.get(timeout=timeout_s))
            except queue.Empty:
                raise TimeoutError(f"the adder process did not register {request_id} within {timeout_s}s") from None

    return await_registered
