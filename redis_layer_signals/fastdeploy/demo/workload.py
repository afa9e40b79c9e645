"""A mixed workload for the reference messager, in one process or with the adder in another.

Many chunked requests share forward steps, as under continuous batching; each request's task
reaches the messager in one of three orders: ``early`` (some chunks run, and are read, before
the task is sent), ``late`` (the task is registered before any chunk runs) or ``racy`` (the
task and the chunks go out without waiting for each other). ``run`` drives it and returns
what happened, so a caller can check that nothing was lost or sent twice.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...buffer.sync import SignalBuffer
from ...errors import BufferUnavailable
from ..bridge import DEFAULT_BLOCK_SIZE, Layer0Bridge, QueueLike
from ..health import BridgeHealth
from ..logs import one_line
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


FLUSH_POLL_S = 0.1
"""How often the end of a run checks, while it waits for the writer, whether Redis answers."""
WAIT_SLICE_S = 0.1
"""How often a run waiting for its requests checks whether waiting is still worth it."""
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
    redis_error: str | None = None
    """Why the counters could not be read at the end (one line), when they could not."""
    timed_out: float | None = None
    """The run's ``timeout_s`` when the run ran out of it before every step was done."""
    tensors: str = "paddle"
    """What the scripted GPU's signal tensors were: ``paddle`` or ``numpy``."""
    redis_answered: bool = True
    """Redis answered at least one call of this process during the run."""

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
        if self.timed_out is not None:
            out.append(f"the run did not end within its timeout of {self.timed_out:g}s")
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

    def unanswered(self, url: str) -> str | None:
        """One line when Redis did not answer by the end of the run (the bridge then served its
        process locally, and Redis holds none of what it decided since); None when it did."""
        if self.stats is not None:
            return None
        cause = f" ({self.redis_error})" if self.redis_error else ""
        served = "served locally: " if self.health.degraded or self.health.episodes else ""
        if not self.redis_answered:
            return f"{served}Redis at {url} never answered{cause}"
        if served:
            return f"{served}Redis at {url} stopped answering{cause}"
        return f"Redis at {url} did not answer at the end{cause}: its counters could not be read"


class RunTimedOut(TimeoutError):
    """The run's ``timeout_s`` ran out while it waited for the messager."""


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
    log_format: str | None = None,
) -> Outcome:
    """Drive the workload through a ``ReferenceMessager`` and collect the outcome.

    With ``adder_process`` the cache-task adder runs in a spawned process that shares only
    Redis (so ``url`` must be a real server) and the ready queue with this one. ``on_step``
    sees the driver's progress (see ``drive``); ``before_end`` runs once every request
    finished, before the closing probe request and the counters are read.

    ``timeout_s`` bounds the whole run, not each wait: out of time, the run stops waiting,
    says so in ``Outcome.timed_out``, reads the counters (at most the buffer's ``retry_s``)
    and stops its threads and the adder process (killed if it does not end at once). Where
    Redis does not answer, the bridge serves the process locally and the run does not wait
    for a write-back. ``log_format``: the adder process logs warnings to stderr in it.
    """
    started = time.perf_counter()
    deadline = time.monotonic() + timeout_s

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    plans = make_plans(seed, requests)
    buffer = SignalBuffer.from_url(url, namespace=namespace, retry_s=retry_s)
    first_contact = _FirstContact(buffer)  # while paddle loads, if it does
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
        if not messager.wait_drained(left()):
            raise RunTimedOut(f"the messager did not drain its queues within {timeout_s}s")

    step_hook = None if on_step is None else (lambda step: on_step(step, messager))
    adder = None
    timed_out: float | None = None
    try:
        with messager:
            if adder_process:
                inbox, ack_queue = context.Queue(), context.Queue()
                args = (url, namespace, INSTANCE, RANK, layers, DEFAULT_BLOCK_SIZE, inbox, ready, ack_queue, retry_s)
                adder = context.Process(target=_adder_child, args=(log_format, *args), daemon=True)
                adder.start()
                adder_inbox: QueueLike = inbox
                await_registered = _await_acked(ack_queue, acks, left)
            else:  # the adder is a thread of the messager: drained means registered
                adder_inbox = messager.cache_infos
                await_registered = lambda _id: await_consumed()  # noqa: E731
            try:
                drive(plans, gpu, seed, adder_inbox, await_registered, await_consumed, step_hook)
            except RunTimedOut:
                timed_out = timeout_s
            ids = {p.request.request_id for p in plans}

            def hopeless() -> bool:
                # Across processes the handoff goes through Redis: one that never answered
                # finishes nothing, however long the run waits.
                return adder is not None and first_contact.failed and bridge.health().degraded

            finished = _wait_finished(messager, ids, left, hopeless)
            if timed_out is None and not ids <= finished and not hopeless():
                timed_out = timeout_s  # only running out of time ends the wait short otherwise
            if adder is not None:
                acks |= _collect_acks(ack_queue, ids - acks, left())
            else:
                acks |= _drain(messager.acks)
            if before_end is not None:
                before_end(messager)
            if not _flush_unless_degraded(bridge, left):  # Redis then holds what the process decided
                timed_out = timeout_s
            if first_contact.failed and bridge.health().degraded:  # Redis never answered: no read
                stats, redis_error = None, first_contact.error
            else:  # before the closing probe, which is not the workload's
                stats, redis_error = _stats_or_error(buffer)
            if bridge.owned is not None:
                local_counts, local_pending = bridge.owned.unwritten_counts(), bridge.owned.pending_here()
            else:
                local_counts, local_pending = dict(bridge.local.counts), bridge.local.pending_here()
            alive = all(t.is_alive() for t in messager.threads)
            if alive and left() > 0 and not hopeless():
                alive = _serves_one_more(messager, gpu, requests, adder_inbox, left)
            if adder is not None:
                inbox.put(STOP)  # it writes back what it decided, if Redis answers: not worth waiting for if never
                adder.join(0 if hopeless() else left())
                if adder.is_alive() and not hopeless():
                    timed_out = timeout_s
            if not _flush_unless_degraded(bridge, left):  # the probe's decisions too
                timed_out = timeout_s
        health = bridge.health()
        return Outcome(
            plans=plans,
            layers=layers,
            finished=finished,
            acks=acks,
            block_writes=_without_slot(messager.transport.block_writes(), requests),
            premature=len(messager.transport.premature),
            errors=len(messager.errors) + (0 if adder is None or adder.exitcode in (0, None) else 1),
            stats=stats,
            local_counts=local_counts,
            local_pending=local_pending,
            health=health,
            alive_at_end=alive,
            seconds=time.perf_counter() - started,
            redis_error=redis_error,
            timed_out=timed_out,
            tensors=gpu.tensors,
            redis_answered=stats is not None
            or first_contact.answered
            or health.identity in ("held", "refused")
            or health.reconciled_entries > 0,
        )
    finally:
        bridge.close()
        if adder is not None and adder.is_alive():
            adder.kill()
            adder.join(5)
            inbox.cancel_join_thread()  # what it never read must not hold this process's exit
        buffer.close()


def _adder_child(log_format: str | None, *args: Any) -> None:
    """The adder process's entry: its warnings in ``log_format`` on stderr, then the adder."""
    if log_format is not None:
        say_warnings(log_format)
    run_adder_process(*args)


def say_warnings(log_format: str) -> None:
    """The library's warnings and errors on stderr, one line each in ``log_format`` (a process
    of the demo's own: it replaces whatever handlers a dependency installed, paddle's too)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LowerCaseLevel(log_format))
    handler.setLevel(logging.WARNING)
    library = logging.getLogger("redis_layer_signals")
    library.handlers[:] = [handler]
    library.propagate = False


class _FirstContact:
    """One read of the server's clock as the run starts, in a thread of its own: did Redis
    answer this process at least once? (The bridge's calls say only whether it answers now.)"""

    def __init__(self, buffer: SignalBuffer) -> None:
        self.answered = False
        self.error: str | None = None
        """Why the read got no answer (within the buffer's ``retry_s``), in one line."""
        self._buffer = buffer
        threading.Thread(target=self._ask, name="rls-first-contact", daemon=True).start()

    @property
    def failed(self) -> bool:
        return self.error is not None

    def _ask(self) -> None:
        try:
            self._buffer.now_ms()
        except Exception as exc:
            self.error = redis_error_line(exc)
            return
        self.answered = True


class _LowerCaseLevel(logging.Formatter):
    """``warning:``, ``error:``, as a command line says them."""

    def format(self, record: logging.LogRecord) -> str:
        copy = logging.makeLogRecord(record.__dict__)
        copy.levelname = record.levelname.lower()
        return super().format(copy)


def _flush_unless_degraded(bridge: Layer0Bridge, left: Callable[[], float]) -> bool:
    """Wait until Redis holds what the process decided, unless Redis does not answer (the
    bridge then serves locally: nothing to wait for); False when the run's time ran out first."""
    while not bridge.health().degraded:
        if bridge.flush(min(FLUSH_POLL_S, left())):
            return True
        if left() <= 0:
            return False
    return True


def _serves_one_more(
    messager: ReferenceMessager, gpu: ScriptedGpu, requests: int, inbox: QueueLike, left: Callable[[], float]
) -> bool:
    """One more request, its task first, on a slot the workload did not use: finishes?"""
    probe = PrefillRequest("req-probe", requests + PROBE_SLOT_OFFSET - 1, 100)
    inbox.put(probe.prefill_half())
    inbox.put(probe.decode_half())
    # The task must be registered before the signal, or the probe tests recovery instead.
    while messager.bridge.registers_tasks and probe.slot not in messager.bridge.local.tasks:
        if left() <= 0:
            return False
        time.sleep(0.005)
    if not messager.bridge.registers_tasks:
        time.sleep(min(0.2, left()))  # the adder process acknowledges on its own queue: give it a moment
    gpu.prefill(probe)
    return messager.wait_finished([probe.request_id], left()) == {probe.request_id}


def _wait_finished(
    messager: ReferenceMessager, ids: set[str], left: Callable[[], float], hopeless: Callable[[], bool]
) -> set[str]:
    """The requests of ``ids`` that finish before the run's time is up, or waiting is hopeless."""
    finished: set[str] = set()
    while True:
        finished |= messager.wait_finished(ids - finished, min(WAIT_SLICE_S, left()))
        if ids <= finished or left() <= 0 or hopeless():
            return finished


def _without_slot(writes: dict[tuple[int, int, int], int], slot: int) -> dict[tuple[int, int, int], int]:
    return {key: count for key, count in writes.items() if key[0] != slot}


def _stats_or_error(buffer: SignalBuffer) -> tuple[dict[str, int] | None, str | None]:
    """The namespace's counters, or None and why not, in one line."""
    try:
        return buffer.stats(), None
    except Exception as exc:
        return None, redis_error_line(exc)


def redis_error_line(exc: BaseException) -> str:
    """Why Redis did not answer, in one line: the connection's error rather than the buffer's
    ("Error 111 connecting to ...: Connection refused"), which says only that it retried."""
    cause = exc.__cause__ if isinstance(exc, BufferUnavailable) and exc.__cause__ is not None else exc
    return " ".join(str(cause).split()) or one_line(cause)


def _drain(source: queue.Queue[str]) -> set[str]:
    out = set()
    while True:
        try:
            out.add(source.get_nowait())
        except queue.Empty:
            return out


def _collect_acks(source: QueueLike, wanted: set[str], timeout_s: float) -> set[str]:
    """The acknowledgements of ``wanted`` that come within ``timeout_s``, and any already
    there when it is 0."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while not wanted <= seen:
        remaining = deadline - time.monotonic()
        try:
            seen.add(source.get(timeout=min(remaining, 0.05)) if remaining > 0 else source.get(block=False))
        except queue.Empty:
            if remaining <= 0:
                break
    return seen


def _await_acked(acks: QueueLike, seen: set[str], left: Callable[[], float]) -> Callable[[str], None]:
    """Wait until the adder process acknowledges ``request_id`` ("task added"), at most until
    the run's time is up."""

    def await_acked(request_id: str) -> None:
        while request_id not in seen:
            try:
                seen.add(acks.get(timeout=left()))
            except queue.Empty:
                raise RunTimedOut(f"the adder process did not acknowledge {request_id} in time") from None

    return await_acked
