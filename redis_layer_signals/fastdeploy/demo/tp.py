"""A tensor-parallel group of cache messagers in one process: do its ranks agree?

FastDeploy runs one ``CacheMessagerV1`` per GPU. The ``nranks`` ranks of an instance each run a
signal consumer, a cache-task adder and a sender, and barriers that span every rank pace them:
the adders wait on ``finish_add_cache_task_barrier`` after each batch of cache_infos, and each
sender waits on ``begin_send_cache_barrier`` once per batch it takes from its queue, then on
``finish_send_cache_barrier`` once per task of the batch that finished. So every rank must queue
the same sequence of batches: a rank that queues one batch more, or another split, waits on a
barrier the others never reach, and the instance hangs.

``run_group`` runs ``nranks`` messagers as threads, feeds each the same GPU messages and the same
cache_infos (``tp_workloads``), each rank with a seeded jitter of its own (0 to ``max_jitter_s``
before each message its consumer or adder takes), and shares real ``threading.Barrier`` objects
between them. The barriers time out: a group whose ranks wait on different barriers is reported
deadlocked instead of hanging. A ``Rule`` builds a rank's messager around its ``RankIO``, what
FastDeploy's engine gives a messager (signals, cache_infos, barriers, the transport), which
records what the rank queued and sent.

Two options model FastDeploy's develop branch, where the prefill messager changed twice after
release/2.6 (their pull-request threads describe the changes; no copy of the files is public):

- ``adders="free"`` (PR 7724, which prepares requests on several engine threads): the adders'
  ``finish_add_cache_task_barrier`` is gone, with the acknowledgement the engine waited for
  (``put_finished_add_cache_task_req``). Each rank's adder reads cache_infos with its own
  jitter (``adder_jitter_s``) and nothing brings the adders back together, so one rank can
  register a task well before another (the jitters add up over the batches waiting in a rank's
  inbox). Instead, the sender polls until an entry's task is registered on its rank
  (``_maybe_wait_for_cache_task``; with no time limit, as a review of the PR notes; here the
  poll ends with the run), after ``begin_send_cache_barrier``, where release/2.6 asserts the
  task is there (our reading of where the PR calls it). ``adders="lockstep"`` (the default) is
  release/2.6.
- ``sender="pool"`` (PR 7931, which sends the cache "layer x request" at once on a
  ``ThreadPoolExecutor``): the sender still takes one batch at a time from its queue, but each
  layer of each entry of the batch is a job on a small pool (``pool_workers``; FastDeploy
  starts 32), and a batch of a single job is written on the sender's thread (our reading of the
  PR's single-task path). The PR's description names no change to the barriers, so they stay
  on the sender's thread: ``begin_send_cache_barrier`` once per batch taken; then the wait for
  each entry's task and the jobs (``RankIO.write_layer``); once every job is done, the entries
  count as sent (``RankIO.write_cache``) in the batch's order, and ``finish_send_cache_barrier``
  is met once per task the batch finished, in the batch's order, under the lock. A batch of
  the bridge holds one entry, so it is ``layers`` jobs. ``sender="one"`` (the default) writes
  on the sender's thread.

What the GPU computes is not paced in either mode: a job does not wait for its layer's
progress, as the harness's later-layer messages only advance progress.
"""

from __future__ import annotations

import queue
import random
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..signals import KV_SIGNAL_LENGTH, NO_SIGNAL, SIGNAL_LAYER, encode_kv_signal
from .tp_workloads import AwaitFinished, Pause, Step, Tasks, Workload

Batch = tuple[tuple[int, int], ...]
"""A batch as recorded: ``((slot, tokens), ...)``."""

POLL_S = 0.005
"""How long an idle loop blocks before it checks whether the run is over."""
DEFAULT_BARRIER_TIMEOUT_S = 1.0
"""A rank waits this long on a barrier before the group counts as deadlocked. The ranks' jitter
is at most tens of milliseconds per message, so a healthy group never comes close."""
DEFAULT_MAX_JITTER_S = 0.02
DEFAULT_LAYERS = 2
"""GPU messages per forward step: layer 0 starts a send, the others only advance progress."""
DEFAULT_TIMEOUT_S = 10.0
"""A run whose requests are not all sent this long after the last event ends as stalled."""
BARRIERS = ("finish_add_cache_task_barrier", "begin_send_cache_barrier", "finish_send_cache_barrier")
ADDERS = ("lockstep", "free")
"""``lockstep``: the adders meet at ``finish_add_cache_task_barrier`` after each batch of
cache_infos (release/2.6); ``free``: no such barrier (develop, PR 7724)."""
SENDERS = ("one", "pool")
"""``one``: the sender writes on its own thread (release/2.6); ``pool``: it writes a batch's
layers as concurrent jobs on a thread pool (develop, PR 7931)."""
DEFAULT_POOL_WORKERS = 4
"""Threads of a pooled sender: few, on a 2-core machine; FastDeploy starts 32."""


class Stopped(BaseException):
    """Ends a messager's loop: the run is over, or the group broke a barrier. A BaseException,
    because FastDeploy's loops catch ``Exception`` and go on."""


class GroupState:
    """What the ranks of one group share: the barriers, and whether the run is over."""

    def __init__(self, nranks: int, barrier_timeout_s: float) -> None:
        self.nranks = nranks
        self.over = threading.Event()
        self.broken: str | None = None
        """The barrier whose wait timed out first: the group deadlocked there."""
        self.barriers = {name: threading.Barrier(nranks, timeout=barrier_timeout_s) for name in BARRIERS}
        self.waiting: list[set[str]] = [set() for _ in range(nranks)]
        """Per rank, the barriers its threads wait on now."""
        self.stuck: tuple[tuple[str, ...], ...] = ()
        """Per rank, the barriers its threads waited on when the group deadlocked."""
        self._lock = threading.Lock()

    def wait(self, name: str, rank: int) -> None:
        """Wait on a group barrier; a timeout marks the group deadlocked and ends every loop."""
        if self.over.is_set():
            raise Stopped
        with self._lock:
            self.waiting[rank].add(name)
        try:
            self.barriers[name].wait()
        except threading.BrokenBarrierError:
            with self._lock:
                if not self.over.is_set() and self.broken is None:
                    self.broken = name
                    self.stuck = tuple(tuple(sorted(names)) for names in self.waiting)
            self.end()
            raise Stopped from None
        finally:
            with self._lock:
                self.waiting[rank].discard(name)

    def end(self) -> None:
        self.over.set()
        for barrier in self.barriers.values():
            barrier.abort()


class GroupBarrier:
    """One of FastDeploy's barriers as a messager sees it (``.wait()``)."""

    def __init__(self, state: GroupState, name: str, rank: int) -> None:
        self._state, self.name, self._rank = state, name, rank

    def wait(self) -> None:
        self._state.wait(self.name, self._rank)


class NoBarrier:
    """Where FastDeploy's develop branch has no barrier any more: ``.wait()`` returns at once."""

    def __init__(self, name: str) -> None:
        self.name = name

    def wait(self) -> None:
        return None


class RecordingQueue:
    """``cache_prefilled_engine_ids_queue``: records every batch put on it, in order. One
    sender takes from it; a batch counts as in hand until the sender asks for the next one."""

    def __init__(self, state: GroupState) -> None:
        self._state = state
        self._queue: queue.Queue[list[tuple[int, int]]] = queue.Queue()
        self._lock = threading.Lock()
        self.sequence: list[Batch] = []
        self._in_hand = False

    def put(self, batch: Iterable[tuple[int, int]], block: bool = True, timeout: float | None = None) -> None:
        items = [(int(slot), int(tokens)) for slot, tokens in batch]
        with self._lock:
            self.sequence.append(tuple(items))
            self._queue.put(items)

    def get(self, block: bool = True, timeout: float | None = None) -> list[tuple[int, int]]:
        """The next batch; blocks until one comes (``Stopped`` once the run is over)."""
        self._in_hand = False
        while True:
            if self._state.over.is_set():
                raise Stopped
            try:
                batch = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if not block:
                    raise
                continue
            self._in_hand = True
            return batch

    def idle(self) -> bool:
        with self._lock:
            return self._queue.empty() and not self._in_hand


class RankIO:
    """What FastDeploy's engine gives one rank's messager, recording what the rank did."""

    def __init__(
        self,
        state: GroupState,
        rank: int,
        seed: int,
        max_jitter_s: float,
        layers: int,
        *,
        adders: str = "lockstep",
        sender: str = "one",
        pool_workers: int = DEFAULT_POOL_WORKERS,
        adder_jitter_s: float | None = None,
    ) -> None:
        self.state = state
        self.rank = rank
        self.nranks = state.nranks
        self.layers = layers
        """GPU messages per forward step (the model's layers)."""
        self.adders = adders
        """``ADDERS``: whether the adders meet at a barrier after each batch of cache_infos."""
        self.sender = sender
        """``SENDERS``: how the rank's sender writes a batch."""
        self.pool_workers = pool_workers
        self.signals: queue.Queue[np.ndarray[Any, Any]] = queue.Queue()
        self.cache_infos: queue.Queue[list[dict[str, Any]]] = queue.Queue()
        self.ready = RecordingQueue(state)
        self.finish_add_cache_task_barrier: GroupBarrier | NoBarrier = (
            GroupBarrier(state, "finish_add_cache_task_barrier", rank)
            if adders == "lockstep"
            else NoBarrier("finish_add_cache_task_barrier")
        )
        self.begin_send_cache_barrier = GroupBarrier(state, "begin_send_cache_barrier", rank)
        self.finish_send_cache_barrier = GroupBarrier(state, "finish_send_cache_barrier", rank)
        self._consumer_jitter = random.Random(f"{seed}/{rank}/consumer")
        self._adder_jitter = random.Random(f"{seed}/{rank}/adder")
        self._max_jitter_s = max_jitter_s
        self._adder_max_jitter_s = max_jitter_s if adder_jitter_s is None else adder_jitter_s
        self._lock = threading.Lock()
        self.writes: list[tuple[str, int]] = []
        """``(request_id, tokens)`` of every send, in order."""
        self.layer_writes: list[tuple[str, int, int]] = []
        """``(request_id, tokens, layer)`` of every layer a pooled sender's job wrote, in the
        order the jobs ran."""
        self.task_waits = 0
        """Entries the sender took before its own adder had registered their task (it waited)."""
        self.finished: list[str] = []
        """Requests reported finished (``put_finished_req``), in order."""
        self.added: list[str] = []
        """Tasks acknowledged as added (``put_finished_add_cache_task_req``)."""
        self.errors: list[str] = []
        self._signal_in_hand = self._info_in_hand = False
        """The consumer (adder) handles what it took until it asks for the next one."""

    def _check(self) -> None:
        if self.state.over.is_set():
            raise Stopped

    def get_output_kv_signal(self, buffer: np.ndarray[Any, Any]) -> None:
        """Fill ``buffer`` as FastDeploy's op does: the next GPU message (a layer-0 one after
        this rank's jitter), or ``tasks_count`` -1 when none came within the poll."""
        self._check()
        self._signal_in_hand = False
        try:
            message = self.signals.get(timeout=POLL_S)
        except queue.Empty:
            buffer[0] = NO_SIGNAL
            return
        self._signal_in_hand = True
        if message[1] == SIGNAL_LAYER:  # later layers only advance progress: no race there
            time.sleep(self._consumer_jitter.uniform(0, self._max_jitter_s))
        buffer[:] = message

    def get_cache_info(self) -> list[dict[str, Any]]:
        """The next batch of cache_infos after this rank's jitter, ``[]`` when none came."""
        self._check()
        self._info_in_hand = False
        try:
            batch = self.cache_infos.get(timeout=POLL_S)
        except queue.Empty:
            return []
        self._info_in_hand = True
        time.sleep(self._adder_jitter.uniform(0, self._adder_max_jitter_s))
        return [dict(info) for info in batch]

    def write_cache(self, request_id: str, slot: int, tokens: int) -> None:
        with self._lock:
            self.writes.append((request_id, int(tokens)))

    def write_layer(self, request_id: str, slot: int, tokens: int, layer: int) -> None:
        """One job of a pooled sender: one layer of one entry."""
        with self._lock:
            self.layer_writes.append((request_id, int(tokens), int(layer)))

    def waited_for_task(self) -> None:
        with self._lock:
            self.task_waits += 1

    def put_finished_req(self, request_id: str, status: str) -> None:
        with self._lock:
            self.finished.append(request_id)

    def put_finished_add_cache_task_req(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            self.added.extend(request_ids)

    def error(self, where: str, exc: BaseException) -> None:
        with self._lock:
            self.errors.append(f"rank {self.rank} {where}: {type(exc).__name__}: {exc}")

    def idle(self) -> bool:
        """Nothing waits in this rank's inboxes or its sender's queue."""
        in_hand = self._signal_in_hand or self._info_in_hand
        return self.signals.empty() and self.cache_infos.empty() and self.ready.idle() and not in_hand

    def finished_ids(self) -> set[str]:
        with self._lock:
            return set(self.finished)


class RankMessager(Protocol):
    """One rank's messager: its loops run on threads of their own until ``Stopped``."""

    def loops(self) -> list[Callable[[], None]]: ...

    def close(self) -> None: ...


class Rule(Protocol):
    """How a rank decides what to queue for layer 0: builds a rank's messager."""

    name: str

    def messager(self, io: RankIO, group: str) -> RankMessager: ...


@dataclass(frozen=True)
class GroupOutcome:
    """What one run of a group did, per rank."""

    rule: str
    workload: str
    nranks: int
    seed: int
    sequences: tuple[tuple[Batch, ...], ...]
    """Per rank, every batch it queued for its sender, in order."""
    broken: str | None
    """The barrier whose wait timed out first (the group deadlocked), None if none did."""
    stuck: tuple[tuple[str, ...], ...]
    """Per rank, the barriers its threads waited on when the group deadlocked (none: it
    waited for work); empty when the group did not deadlock."""
    stalled: bool
    """The run ended at its timeout with requests unsent, no barrier broken."""
    expected: frozenset[str]
    finished: tuple[tuple[str, ...], ...]
    writes: tuple[tuple[tuple[str, int], ...], ...]
    errors: tuple[str, ...]
    seconds: float
    adders: str = "lockstep"
    sender: str = "one"
    task_waits: tuple[int, ...] = ()
    """Per rank, the entries its sender took before its own adder had registered their task."""

    @property
    def deadlocked(self) -> bool:
        return self.broken is not None

    @property
    def identical(self) -> bool:
        """Every rank queued the same sequence of batches."""
        return all(sequence == self.sequences[0] for sequence in self.sequences)

    @property
    def sent(self) -> frozenset[str]:
        """Requests every rank reported finished."""
        done = [set(f) for f in self.finished]
        return frozenset(set.intersection(*done)) if done else frozenset()

    @property
    def lost(self) -> frozenset[str]:
        return self.expected - self.sent

    @property
    def sent_twice(self) -> frozenset[str]:
        """Requests some rank finished twice, or sent a chunk of twice."""
        twice: set[str] = set()
        for finished, writes in zip(self.finished, self.writes, strict=True):
            twice |= {rid for rid, times in Counter(finished).items() if times > 1}
            twice |= {rid for (rid, _tokens), times in Counter(writes).items() if times > 1}
        return frozenset(twice)

    @property
    def agreed(self) -> bool:
        """No barrier timed out, every rank queued the same batches, nothing was lost or sent
        twice, and no rank's loop failed."""
        return (
            not self.deadlocked
            and not self.stalled
            and self.identical
            and not self.lost
            and not self.sent_twice
            and not self.errors
        )

    def describe(self) -> str:
        """One line for logs and assertion messages."""
        where = "; ".join(f"rank {r} at {', '.join(names)}" for r, names in enumerate(self.stuck) if names)
        state = f"deadlocked ({where})" if self.broken else ("stalled" if self.stalled else "ran through")
        batches = "/".join(str(len(s)) for s in self.sequences)
        mode = (
            ""
            if (self.adders, self.sender) == ("lockstep", "one")
            else f" ({self.adders} adders, {self.sender} sender)"
        )
        waits = f", sender waited for its task {sum(self.task_waits)} times" if any(self.task_waits) else ""
        return (
            f"{self.rule}{mode} {self.workload} TP{self.nranks} seed {self.seed}: {state}, "
            f"{'identical' if self.identical else 'divergent'} sequences ({batches} batches), "
            f"sent {len(self.sent)}/{len(self.expected)}, lost {_few(self.lost)}, "
            f"sent twice {_few(self.sent_twice)}, errors {len(self.errors)}{waits}"
        )


def _few(names: frozenset[str], shown: int = 4) -> str:
    ordered = sorted(names)
    more = f" and {len(ordered) - shown} more" if len(ordered) > shown else ""
    return f"{ordered[:shown]}{more}"


def run_group(
    rule: Rule,
    workload: Workload,
    nranks: int,
    seed: int,
    *,
    group: str | None = None,
    layers: int = DEFAULT_LAYERS,
    barrier_timeout_s: float = DEFAULT_BARRIER_TIMEOUT_S,
    max_jitter_s: float = DEFAULT_MAX_JITTER_S,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    adders: str = "lockstep",
    sender: str = "one",
    pool_workers: int = DEFAULT_POOL_WORKERS,
    adder_jitter_s: float | None = None,
) -> GroupOutcome:
    """Run ``workload`` on a group of ``nranks`` messagers built by ``rule`` and collect what
    each rank queued and sent. ``group`` names the instance (the bridge's ``instance``); a new
    name by default, so runs on one namespace never meet. ``adders`` and ``sender`` choose
    release/2.6's threads or develop's (see the module doc); ``adder_jitter_s`` bounds the
    adders' jitter per batch of cache_infos (``max_jitter_s`` unless given)."""
    if adders not in ADDERS:
        raise ValueError(f"adders={adders!r}: expected one of {ADDERS}")
    if sender not in SENDERS:
        raise ValueError(f"sender={sender!r}: expected one of {SENDERS}")
    if not isinstance(pool_workers, int) or pool_workers < 1:
        raise ValueError(f"pool_workers={pool_workers!r}: expected an int of at least 1")
    started = time.monotonic()
    group = group or f"tp-{secrets.token_hex(4)}"
    state = GroupState(nranks, barrier_timeout_s)
    ios = [
        RankIO(
            state,
            rank,
            seed,
            max_jitter_s,
            layers,
            adders=adders,
            sender=sender,
            pool_workers=pool_workers,
            adder_jitter_s=adder_jitter_s,
        )
        for rank in range(nranks)
    ]
    messagers: list[RankMessager] = []
    threads: list[threading.Thread] = []
    try:
        for io in ios:
            messager = rule.messager(io, group)
            messagers.append(messager)
            for loop in messager.loops():
                threads.append(threading.Thread(target=_serve, args=(loop, io), name=f"tp-{group}-{io.rank}"))
        for thread in threads:
            thread.daemon = True
            thread.start()
        _drive(workload, ios, state, layers, timeout_s)
        stalled = not _await(lambda: _complete(ios, workload.expected), state, timeout_s)
        if not stalled:
            # Let a late batch show up before the sequences are compared.
            time.sleep(2 * max_jitter_s + 5 * POLL_S)
            stalled = not _await(lambda: _complete(ios, workload.expected), state, timeout_s)
        broken, stuck = state.broken, state.stuck
    finally:
        state.end()
        for thread in threads:
            thread.join(timeout_s)
        for messager in messagers:
            messager.close()
    return GroupOutcome(
        rule=rule.name,
        workload=workload.name,
        nranks=nranks,
        seed=seed,
        sequences=tuple(tuple(io.ready.sequence) for io in ios),
        broken=broken,
        stuck=stuck,
        stalled=stalled and broken is None,
        expected=workload.expected,
        finished=tuple(tuple(io.finished) for io in ios),
        writes=tuple(tuple(io.writes) for io in ios),
        errors=tuple(e for io in ios for e in io.errors),
        seconds=time.monotonic() - started,
        adders=adders,
        sender=sender,
        task_waits=tuple(io.task_waits for io in ios),
    )


def _serve(loop: Callable[[], None], io: RankIO) -> None:
    try:
        loop()
    except Stopped:
        return
    except BaseException as exc:  # a loop that ends on its own is a failure of the rank
        io.error(getattr(loop, "__name__", "loop"), exc)


def _drive(workload: Workload, ios: list[RankIO], state: GroupState, layers: int, timeout_s: float) -> None:
    """Play the workload's events, each to every rank in the same order."""
    for event in workload.events:
        if state.over.is_set():
            return
        if isinstance(event, Tasks):
            for half in ([r.prefill_half() for r in event.requests], [r.decode_half() for r in event.requests]):
                for io in ios:
                    io.cache_infos.put(half)
        elif isinstance(event, Step):
            entries = [(r.slot, offset, length) for r, offset, length in event.entries]
            for layer in range(layers):
                message = encode_kv_signal(layer, entries)
                for io in ios:
                    io.signals.put(message)
        elif isinstance(event, Pause):
            state.over.wait(event.seconds)
        elif isinstance(event, AwaitFinished):
            _await(_finished_everywhere(ios, {r.request_id for r in event.requests}), state, timeout_s)


def _finished_everywhere(ios: list[RankIO], ids: set[str]) -> Callable[[], bool]:
    return lambda: all(ids <= io.finished_ids() for io in ios)


def _complete(ios: list[RankIO], expected: frozenset[str]) -> bool:
    return all(expected <= io.finished_ids() and io.idle() for io in ios)


def _await(condition: Callable[[], bool], state: GroupState, timeout_s: float) -> bool:
    """True once ``condition`` holds; False when the group broke or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while not state.over.is_set():
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return False


def new_signal_buffer() -> np.ndarray[Any, Any]:
    """A ``kv_signal_data`` buffer as FastDeploy's consumer allocates it."""
    return np.full(KV_SIGNAL_LENGTH, NO_SIGNAL, dtype=np.int32)
