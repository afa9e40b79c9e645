"""What an operator's bad day costs a tensor-parallel group of ``Layer0Bridge``s, against TP 1.

Each row is one event of a bad day, run at TP 1, 2 and 4 on a redis-server of its own (free
port, temp dir, started and stopped here; never the machine's 6379). A run builds one
``Layer0Bridge`` per rank (``registers_tasks=True``, ``nranks`` the group's size, each rank with
a client of its own, as separate processes would have) and drives it through its public face
only: the constructor, ``on_kv_signal``, ``on_cache_task``, ``on_task_finished``, ``health()``,
``close()`` and the ``ready`` queue it puts batches on. So the script measures any
implementation of the group's agreement unchanged.

The workload: a request arrives every ``--interval`` seconds for ``--seconds``, each on a slot
of its own (no slot is reused within a run, so an aborted request's entry is never taken by its
slot's next request). Each rank has a signal consumer, a task adder and a sender, as
FastDeploy's ``CacheMessagerV1`` does. The GPU's layer-0 message of a request is fed to every
rank in the same order, each rank 0-20 ms late at random; its task is registered on every rank,
in the same order, each rank's adder 0-20 ms late at random on its own (adders not in lockstep,
no barrier between them); within a request, the signal or the task comes first at random. A
rank's sender takes each batch from its ``ready`` queue and finishes the task
(``on_task_finished``). Rows:

1. ``aborted``: one request aborted before its task registered (its signal comes, its task
   never does), default ``pending_ttl_s``;
2. ``paused``: the same, plus the redis-server paused (SIGSTOP, then SIGCONT) for ``--outage``
   seconds mid-run;
3. ``black_hole``: only rank 1's link to Redis black-holed for ``--outage`` seconds (a TCP proxy
   in front of the server, for that rank alone, stops forwarding both ways; rank 0 at TP 1);
4. ``restart``: one rank's bridge closed and a new one started for that rank (rank 1; rank 0 at
   TP 1), as a restart of that rank's process alone, mid-request: right after the rank
   registered the task of the first request from ``--disrupt-at`` on whose task comes before its
   signal, so that its new bridge gets the signal;
5. ``nranks``: the last rank told half the group's size (4, 4, 4, 2 at TP 4; 2, 1 at TP 2; no
   TP 1 run).

``--abort-everywhere`` gives every row the aborted request, and ``--pending-ttl S`` the buffers a
``pending_ttl_s`` of their own (a short one puts the group's give-up inside the outage).

Per request, the added delay is the time its layer-0 batch is on the ``ready`` queue of the last
rank, minus the time both its signal and its task were given to every rank; "never" when it is
not queued on every rank by the end of the run (the later of the last request and the end of
the outage) plus ``--grace`` seconds. Where the group drops the requests in flight at a rank's
restart on every rank, by design, and each rank logs an ERROR line that a rank of its group
restarted, the ``restart`` row counts apart the requests not queued whose task some rank had
registered before it logged that line ("in flight, dropped by design"): only the others, each
registered on every rank after the rank knew of the restart, count as never queued. A run ends
early once every request is queued on every rank and the outage has been over for a second.
Per row: the requests (the aborted one not counted), how many were queued with more than 0.2 s
added, the largest added delay of those queued, how many were never queued (of which arrived
after the restart), whether every rank's queued batch sequence was identical, and the WARNING
and ERROR lines the bridges logged; below the table, what each run's ``health()`` said and
those lines.

Usage::

    .venv/bin/python benchmarks/tp_bad_day.py [--quick] [--json PATH] [--markdown PATH]
    .venv/bin/python benchmarks/tp_bad_day.py --report-from PATH   # the report of a saved --json

Prints the markdown report and writes it and the JSON of every run where asked. About 5 minutes
at the defaults, under 2 with ``--quick``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import platform
import queue
import random
import re
import select
import signal
import socket
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from redis_layer_signals import SignalBuffer
from redis_layer_signals.bench.server import LocalRedis
from redis_layer_signals.fastdeploy import KvSignal, Layer0Bridge

ROWS = ("aborted", "paused", "black_hole", "restart", "nranks")
LABELS = {
    "aborted": "one request aborted before its task registered",
    "paused": "the same, plus the redis-server paused (SIGSTOP) mid-run",
    "black_hole": "only rank 1's link to Redis black-holed mid-run (rank 0 at TP 1)",
    "restart": "one rank's bridge closed and a new one started mid-request (rank 1; rank 0 at TP 1)",
    "nranks": "the last rank told half the group's size (4, 4, 4, 2; 2, 1)",
}
ABORTS = {"aborted", "paused"}
"""The rows with an aborted request."""
DELAYED_S = 0.2
"""An added delay above this counts as delayed (issue 32's bound for an aborted request)."""
NUM_LAYERS = 61
MAX_SKEW_S = 0.05
"""Within a request, the signal and the task each come up to this late, so either may be first."""
POLL_S = 0.05
KEPT_LINES = 200
"""WARNING and ERROR lines kept per run (all are counted)."""
WIDTH = 100
"""The report's prose wraps here."""
SETTLE_S = 1.0
"""After an outage, a run goes on at least this long: the ranks' health then says how they came back."""
RESTART_HEARD = re.compile(r"rank \d+ of the tensor-parallel group restarted")
"""The ERROR line a rank logs when its group tells it a rank restarted (an agreement that drops
the requests in flight on every rank says so; one that does not, never logs it)."""
LOST_TO_RESTART = re.compile(r"request ([^)\s]+)\): a rank of the group restarted")
"""The line a rank logs for an entry it dropped because a rank restarted while it was in flight."""


@dataclass(frozen=True)
class Settings:
    seconds: float = 9.0
    """Requests arrive for this long."""
    interval: float = 0.3
    outage: float = 12.0
    """How long Redis stays paused, or the link black-holed."""
    disrupt_at: float = 3.0
    """When the pause or the black hole starts, and from when on the restart comes (seconds into
    the run, the warmup included)."""
    grace: float = 15.0
    """A request not queued on every rank this long after the run's end is "never"."""
    jitter: float = 0.02
    """Per rank, each message and each task is given up to this late."""
    warmup: float = 0.5
    """Before the first request: the bridges start (their writers claim their identities)."""
    seed: int = 0
    abort_everywhere: bool = False
    """Every row has the aborted request, not only ``aborted`` and ``paused``."""
    pending_ttl_s: float | None = None
    """The buffers' ``pending_ttl_s`` (None: the library's default)."""


QUICK = Settings(seconds=3.0, outage=3.0, disrupt_at=1.0, grace=4.0)


@dataclass(frozen=True)
class Request:
    index: int
    request_id: str
    slot: int
    tokens: int
    signal_at: float
    task_at: float | None
    """None for the aborted request: its task never comes."""


def request_count(settings: Settings) -> int:
    return max(2, round(settings.seconds / settings.interval))


def aborted_index(settings: Settings) -> int:
    """The aborted request: one sixth into the run (request 5 at the defaults)."""
    return max(1, request_count(settings) // 6)


def workload(settings: Settings, aborted: bool) -> list[Request]:
    """The requests of a run, the same on every rank and in every row of one seed: each arrives
    ``interval`` after the one before, its signal and its task each up to ``MAX_SKEW_S`` late."""
    rng = random.Random(f"{settings.seed}/workload")
    count = request_count(settings)
    abort_index = aborted_index(settings) if aborted else -1
    requests = []
    for i in range(count):
        start = settings.warmup + i * settings.interval
        task_at = None if i == abort_index else start + rng.uniform(0, MAX_SKEW_S)
        tokens = 1000 + i  # one request per (slot, tokens): a batch names its request
        requests.append(Request(i, f"req-{i}", i % 512, tokens, start + rng.uniform(0, MAX_SKEW_S), task_at))
    return requests


# -- what a rank is given and what it queues ---------------------------------------------------


class TimedQueue(queue.Queue[Any]):
    """The sender's queue (``cache_prefilled_engine_ids_queue``): notes when each batch is put."""

    def __init__(self) -> None:
        super().__init__()
        self.puts: list[tuple[float, tuple[tuple[int, int], ...]]] = []
        self._record = threading.Lock()

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        batch = tuple((int(slot), int(tokens)) for slot, tokens in item)
        with self._record:
            self.puts.append((time.monotonic(), batch))
        super().put(item, block, timeout)


class CountingLog:
    """The logger a bridge is given: counts its lines per level, keeps the first few."""

    def __init__(self, rank: int, sink: RunLog) -> None:
        self.rank, self.sink = rank, sink

    def _line(self, level: str, message: object, *args: object) -> None:
        text = str(message) % args if args else str(message)
        self.sink.add(level, self.rank, text, time.monotonic())

    def debug(self, message: object, *args: object) -> None:
        pass

    def info(self, message: object, *args: object) -> None:
        self._line("info", message, *args)

    def warning(self, message: object, *args: object) -> None:
        self._line("warning", message, *args)

    def error(self, message: object, *args: object) -> None:
        self._line("error", message, *args)


@dataclass
class RunLog:
    counts: dict[str, int] = field(default_factory=lambda: {"info": 0, "warning": 0, "error": 0})
    lines: list[dict[str, Any]] = field(default_factory=list)
    library: list[str] = field(default_factory=list)
    heard_restart: dict[int, float] = field(default_factory=dict)
    """Per rank, when it first said a rank of its group restarted (monotonic): from then on, a
    request registered on it is no longer one the restart drops."""
    named_lost: set[str] = field(default_factory=set)
    """Requests a rank said it dropped because a rank of the group restarted while in flight."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, level: str, rank: int, text: str, at: float) -> None:
        with self.lock:
            self.counts[level] += 1
            if level != "info" and len(self.lines) < KEPT_LINES:
                self.lines.append({"level": level.upper(), "rank": rank, "text": text.splitlines()[0][:400]})
            if RESTART_HEARD.search(text):
                self.heard_restart.setdefault(rank, at)
            named = LOST_TO_RESTART.search(text)
            if named:
                self.named_lost.add(named.group(1))


class Rank:
    """One rank's process: its buffer and bridge, replaced whole by ``restart``. A hook call
    waits while the rank restarts, as FastDeploy's messages wait for a restarted process."""

    def __init__(
        self, rank: int, nranks: int, url: str, namespace: str, instance: str, log: RunLog, pending_ttl_s: float | None
    ) -> None:
        self.rank, self.nranks, self.url, self.namespace, self.instance = rank, nranks, url, namespace, instance
        self.options: dict[str, Any] = {} if pending_ttl_s is None else {"pending_ttl_s": pending_ttl_s}
        self.log = log
        self.ready = TimedQueue()
        self._cond = threading.Condition()
        self._active = 0
        self._restarting = False
        self.buffer, self.bridge = self._build()

    def _build(self) -> tuple[SignalBuffer, Layer0Bridge]:
        buffer = SignalBuffer.from_url(self.url, namespace=self.namespace, env={}, **self.options)
        bridge = Layer0Bridge(
            buffer,
            self.instance,
            self.rank,
            num_layers=NUM_LAYERS,
            ready=self.ready,
            registers_tasks=True,
            nranks=self.nranks,
            logger=CountingLog(self.rank, self.log),
        )
        return buffer, bridge

    def call(self, hook: Callable[[Layer0Bridge], object]) -> float:
        """Run ``hook`` on the rank's bridge as of now; returns when it was given (monotonic)."""
        with self._cond:
            while self._restarting:
                self._cond.wait()
            self._active += 1
            bridge = self.bridge
        try:
            given = time.monotonic()
            hook(bridge)
            return given
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def restart(self) -> None:
        with self._cond:
            self._restarting = True
            while self._active:
                self._cond.wait()
        try:
            self.close()
            self.buffer, self.bridge = self._build()
        finally:
            with self._cond:
                self._restarting = False
                self._cond.notify_all()

    def health(self) -> dict[str, Any]:
        snapshot = _plain(self.bridge.health())
        return snapshot if isinstance(snapshot, dict) else {"health": snapshot}

    def close(self) -> None:
        try:
            self.bridge.close()
        finally:
            self.buffer.close()


def _plain(value: Any) -> Any:
    """A health snapshot as JSON-able values, whatever its class."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


def flagged(health: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a health snapshot that say something: true, positive, a non-empty count or
    a state other than the quiet ones."""
    said: dict[str, Any] = {}
    for name, value in health.items():
        if isinstance(value, bool):
            if value:
                said[name] = True
        elif isinstance(value, (int, float)):
            if value > 0:
                said[name] = round(value, 2) if isinstance(value, float) else value
        elif isinstance(value, Mapping):
            nonzero = {k: v for k, v in value.items() if v}
            if nonzero:
                said[name] = nonzero
        elif isinstance(value, str) and value not in ("", "none", "held"):
            said[name] = value
    return said


# -- the bad days ------------------------------------------------------------------------------


class BlackHoleProxy:
    """A TCP relay on loopback in front of one server: forwards both ways until ``cut``, then
    holds every byte (a black-holed link: connections stay open, nothing arrives) until
    ``heal`` sends what it held on."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.cut = threading.Event()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._listener], [], [], POLL_S)
            if not ready:
                continue
            with contextlib.suppress(OSError):
                client, _ = self._listener.accept()
                server = socket.create_connection(("127.0.0.1", self.upstream_port))
                self._sockets += [client, server]
                thread = threading.Thread(target=self._relay, args=(client, server), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        held = {client: b"", server: b""}  # bytes to send to each side
        other = {client: server, server: client}
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                ready, _, _ = select.select([client, server], [], [], POLL_S)
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        for end in (client, server):
                            end.close()
                        return
                    held[other[sock]] += data
                if not self.cut.is_set():
                    for sock, data in held.items():
                        if data:
                            sock.sendall(data)
                            held[sock] = b""

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2)
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()


@dataclass
class Disruption:
    """An outage: started ``disrupt_at`` seconds into the run, undone ``outage`` seconds later."""

    start: Callable[[], None]
    undo: Callable[[], None]


def rank_nranks(row: str, tp: int) -> list[int]:
    if row == "nranks":
        return [tp] * (tp - 1) + [tp // 2]
    return [tp] * tp


def disrupted_rank(tp: int) -> int:
    return min(1, tp - 1)


# -- one run -----------------------------------------------------------------------------------


class LibraryLog(logging.Handler):
    """The package's own log lines (the buffer's, not a bridge's) during a run, kept for the
    JSON instead of printed."""

    def __init__(self, log: RunLog) -> None:
        super().__init__(logging.WARNING)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        with self.log.lock:
            self.log.library.append(f"{record.levelname} {record.name}: {record.getMessage()[:300]}")


@contextlib.contextmanager
def library_log(log: RunLog) -> Iterator[None]:
    package = logging.getLogger("redis_layer_signals")
    handler = LibraryLog(log)
    propagate = package.propagate
    package.addHandler(handler)
    package.propagate = False
    try:
        yield
    finally:
        package.removeHandler(handler)
        package.propagate = propagate


def run_one(row: str, tp: int, settings: Settings) -> dict[str, Any]:
    log = RunLog()
    with library_log(log):
        return Run(row, tp, settings, log).run()


class Run:
    """One row at one TP size: its server, its ranks and their threads, and what they did."""

    def __init__(self, row: str, tp: int, settings: Settings, log: RunLog) -> None:
        self.row, self.tp, self.settings, self.log = row, tp, settings, log
        self.requests = workload(settings, aborted=row in ABORTS or settings.abort_everywhere)
        self.by_batch: dict[tuple[tuple[int, int], ...], Request] = {((q.slot, q.tokens),): q for q in self.requests}
        self.nranks = rank_nranks(row, tp)
        self.ranks: list[Rank] = []
        self.stop = threading.Event()
        self.given: dict[tuple[int, int, str], float] = {}
        """(rank, request, "signal" or "task") -> when the rank was given it (monotonic)."""
        self.lock = threading.Lock()
        self.started = 0.0
        self.restart_index = -1
        """The request whose task the restarting rank registers just before it restarts."""
        self.restarted_at: float | None = None
        """Seconds into the run when the restarted rank's new bridge took its first call."""
        if row == "restart":  # the first request from disrupt_at on whose task comes first
            later = [
                q for q in self.requests if q.task_at is not None and settings.disrupt_at <= q.task_at < q.signal_at
            ]
            self.restart_index = later[0].index if later else self.requests[-1].index

    def run(self) -> dict[str, Any]:
        settings, row = self.settings, self.row
        server = LocalRedis()
        server.start()
        proxy = BlackHoleProxy(server.port) if row == "black_hole" else None
        namespace = f"badday-{uuid.uuid4().hex[:8]}"
        try:
            for r in range(self.tp):
                url = proxy.url if proxy is not None and r == disrupted_rank(self.tp) else server.url
                self.ranks.append(Rank(r, self.nranks[r], url, namespace, "p0", self.log, settings.pending_ttl_s))
            self.started = time.monotonic()
            threads = [
                threading.Thread(target=target, args=args, daemon=True, name=f"rank{rank.rank}-{name}")
                for rank in self.ranks
                for name, target, args in (
                    ("consumer", self.feed, (rank, "signal")),
                    ("adder", self.feed, (rank, "task")),
                    ("sender", self.send, (rank,)),
                )
            ]
            for thread in threads:
                thread.start()
            ended, health = self.wait(_outage(row, server, proxy))
        finally:
            self.stop.set()
            with contextlib.suppress(Exception):
                if server.process is not None:
                    os.kill(server.process.pid, signal.SIGCONT)
            if proxy is not None:
                proxy.cut.clear()
            closers = [threading.Thread(target=_close_quietly, args=(rank,)) for rank in self.ranks]
            for closer in closers:
                closer.start()
            for closer in closers:
                closer.join(30)
            if proxy is not None:
                proxy.close()
            server.cleanup()
        return self.outcome(health, ended)

    def wait(self, outage: Disruption | None) -> tuple[float, list[dict[str, Any]]]:
        """Until every request is queued on every rank and the outage is over, or the deadline:
        start and end the outage on time. Returns the run's length and each rank's health."""
        settings = self.settings
        last_event = max(max(q.signal_at, q.task_at or 0.0) for q in self.requests) + settings.jitter
        outage_end = settings.disrupt_at + settings.outage
        run_end = max(last_event, outage_end) if outage is not None else last_event
        deadline = self.started + run_end + settings.grace
        expected = [q for q in self.requests if q.task_at is not None]
        began = ended = False
        try:
            while time.monotonic() < deadline:
                now = time.monotonic() - self.started
                if outage is not None and not began and now >= settings.disrupt_at:
                    outage.start()
                    began = True
                if outage is not None and began and not ended and now >= outage_end:
                    outage.undo()
                    ended = True
                over = now >= last_event and (outage is None or (ended and now >= outage_end + SETTLE_S))
                if over and all(self.queued_everywhere(q) for q in expected):
                    break
                time.sleep(POLL_S)
        finally:
            if outage is not None and began and not ended:
                outage.undo()
        return time.monotonic() - self.started, [rank.health() for rank in self.ranks]

    def feed(self, rank: Rank, kind: str) -> None:
        """A rank's signal consumer (``kind`` "signal") or task adder ("task"): each request's
        message or task, in the shared order, each up to ``jitter`` late at random."""
        settings = self.settings
        rng = random.Random(f"{settings.seed}/{rank.rank}/{kind}")
        events = [(q.signal_at if kind == "signal" else q.task_at, q) for q in self.requests]
        for at, q in sorted(((at, q) for at, q in events if at is not None), key=lambda pair: (pair[0], pair[1].index)):
            delay = self.started + at + rng.uniform(0, settings.jitter) - time.monotonic()
            if self.stop.wait(max(0.0, delay)):
                return
            if kind == "signal":
                message = KvSignal(0, ((q.slot, q.tokens),))
                when = rank.call(lambda bridge, m=message: bridge.on_kv_signal(m))  # type: ignore[misc]
            else:
                info = {"request_id": q.request_id, "current_id": q.slot, "need_prefill_tokens": q.tokens}
                when = rank.call(lambda bridge, i=info: bridge.on_cache_task(i))  # type: ignore[misc]
            with self.lock:
                self.given[(rank.rank, q.index, kind)] = when
            if kind == "task" and q.index == self.restart_index and rank.rank == disrupted_rank(self.tp):
                # The rank's process restarts with this request's task registered and its signal
                # still to come, which its new bridge gets (the calls wait meanwhile).
                rank.restart()
                self.restarted_at = time.monotonic() - self.started

    def send(self, rank: Rank) -> None:
        """A rank's sender: takes each batch off the ``ready`` queue and finishes its task."""
        while not self.stop.is_set():
            try:
                batch = rank.ready.get(timeout=POLL_S)
            except queue.Empty:
                continue
            q = self.by_batch.get(tuple((int(s), int(t)) for s, t in batch))
            if q is not None:
                rank.call(lambda bridge, q=q: bridge.on_task_finished(q.slot, q.request_id))  # type: ignore[misc]

    def queued_everywhere(self, q: Request) -> bool:
        return all(_first_put(rank, q) is not None for rank in self.ranks)

    def outcome(self, health: list[dict[str, Any]], ended: float) -> dict[str, Any]:
        per_request: list[dict[str, Any]] = []
        delays: list[float] = []
        for q in self.requests:
            if q.task_at is None:
                continue
            gives = [self.given.get((r.rank, q.index, kind)) for r in self.ranks for kind in ("signal", "task")]
            puts = [_first_put(r, q) for r in self.ranks]
            both_given = None if None in gives else max(g for g in gives if g is not None)
            last_queued = None if None in puts else max(p for p in puts if p is not None)
            delay = None
            if both_given is not None and last_queued is not None:
                delay = max(0.0, last_queued - both_given)
                delays.append(round(delay, 4))
            arrives = min(q.signal_at, q.task_at)
            # In flight at the restart: its task was registered on some rank before that rank
            # heard of the restart (an agreement that drops in-flight requests drops it there).
            in_flight = any(
                (when := self.given.get((rank, q.index, "task"))) is not None and when < heard
                for rank, heard in self.log.heard_restart.items()
            )
            per_request.append(
                {
                    "request": q.request_id,
                    "slot": q.slot,
                    "arrives_s": round(arrives, 3),
                    "after_restart": self.restarted_at is not None and arrives >= self.restarted_at,
                    "given_to_every_rank_s": None if both_given is None else round(both_given - self.started, 4),
                    "added_delay_s": None if delay is None else round(delay, 4),
                    "queued_on_ranks": sum(p is not None for p in puts),
                    "in_flight_at_restart": in_flight,
                }
            )
        sequences = [
            " ".join(",".join(f"{slot}:{tokens}" for slot, tokens in batch) for _, batch in rank.ready.puts)
            for rank in self.ranks
        ]
        """Per rank, the batches it queued in order, each ``slot:tokens`` (entries joined by commas)."""
        never = [p for p in per_request if p["added_delay_s"] is None]
        dropped = [p for p in never if p["in_flight_at_restart"]]
        heard = self.log.heard_restart
        return {
            "row": self.row,
            "tp": self.tp,
            "nranks": self.nranks,
            "requests": len(per_request),
            "aborted": [q.request_id for q in self.requests if q.task_at is None],
            "delayed": sum(d > DELAYED_S for d in delays),
            "max_added_delay_s": max(delays) if delays else None,
            "never": len(never),
            "never_after_restart": sum(p["after_restart"] for p in never) if self.row == "restart" else None,
            "restarted_at_s": None if self.restarted_at is None else round(self.restarted_at, 3),
            "rejoined_at_s": round(max(heard.values()) - self.started, 3) if heard else None,
            "dropped_in_flight": len(dropped) if heard else None,
            "never_owed": len(never) - len(dropped) if heard else None,
            "never_owed_after_restart": sum(p["after_restart"] for p in never if not p["in_flight_at_restart"])
            if heard
            else None,
            "named_lost": sorted(self.log.named_lost),
            "identical": all(s == sequences[0] for s in sequences),
            "batches_per_rank": [len(rank.ready.puts) for rank in self.ranks],
            "log_lines": dict(self.log.counts),
            "log": list(self.log.lines),
            "library_log": list(self.log.library),
            "health_flags": [flagged(h) for h in health],
            "health": health,
            "seconds": round(ended, 1),
            "per_request": per_request,
            "sequences": sequences,
        }


def _outage(row: str, server: LocalRedis, proxy: BlackHoleProxy | None) -> Disruption | None:
    if row == "paused":
        assert server.process is not None
        pid = server.process.pid
        return Disruption(lambda: os.kill(pid, signal.SIGSTOP), lambda: os.kill(pid, signal.SIGCONT))
    if row == "black_hole":
        assert proxy is not None
        return Disruption(proxy.cut.set, proxy.cut.clear)
    return None


def _close_quietly(rank: Rank) -> None:
    with contextlib.suppress(Exception):
        rank.close()


def _first_put(rank: Rank, q: Request) -> float | None:
    for when, batch in rank.ready.puts:
        if batch == ((q.slot, q.tokens),):
            return when
    return None


# -- the report --------------------------------------------------------------------------------


def table(results: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| bad day | TP | requests | delayed > 0.2 s | max added delay | never queued | identical sequences"
        " | WARNING / ERROR lines | run s |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for res in results:
        if res.get("skipped"):
            lines.append(f"| {res['row']} | {res['tp']} | - | - | - | - | - | - | - |")
            continue
        delay = "-" if res["max_added_delay_s"] is None else f"{res['max_added_delay_s']:.3f} s"
        never = str(res["never"])
        if res.get("dropped_in_flight") is not None:  # the restart dropped what was in flight, and said so
            never = str(res["never_owed"])
            if res["never_owed"]:
                never += f" ({res['never_owed_after_restart']} after the restart)"
            if res["dropped_in_flight"]:
                never += f"; {res['dropped_in_flight']} in flight dropped by design"
        elif res["never_after_restart"] is not None and res["never"]:
            never += f" ({res['never_after_restart']} after the restart)"
        told = "" if len(set(res["nranks"])) == 1 else f" (told {', '.join(map(str, res['nranks']))})"
        lines.append(
            f"| {res['row']} | {res['tp']}{told} | {res['requests']} | {res['delayed']} | {delay} | {never}"
            f" | {'yes' if res['identical'] else 'no'} | {res['log_lines']['warning']} / {res['log_lines']['error']}"
            f" | {res['seconds']:.0f} |"
        )
    return "\n".join(lines)


def details(results: Sequence[dict[str, Any]]) -> str:
    out = []
    for res in results:
        if res.get("skipped"):
            continue
        flags = [
            f"rank {r}: " + ", ".join(f"{k}={v}" for k, v in f.items()) for r, f in enumerate(res["health_flags"]) if f
        ]
        said = "; ".join(flags) + ("; the others quiet" if flags and len(flags) < res["tp"] else "")
        out.append(
            f"- **{res['row']}, TP {res['tp']}**: batches per rank {res['batches_per_rank']}; health: {said or 'quiet'}"
        )
        if res.get("rejoined_at_s") is not None:
            dropped = [
                p["request"] for p in res["per_request"] if p["added_delay_s"] is None and p["in_flight_at_restart"]
            ]
            out.append(
                f"  - restarted {res['restarted_at_s']:.2f} s into the run, every rank told by "
                f"{res['rejoined_at_s']:.2f} s; in flight and dropped: {', '.join(dropped) or 'none'} "
                f"(named in the ranks' drop lines: {', '.join(res['named_lost']) or 'none'})"
            )
        for text, ranks in distinct_lines(res["log"]):
            quoted = text.replace("`", "'")
            out.append(f"  - rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: `{quoted}`")
    return "\n".join(out)


def distinct_lines(lines: Sequence[Mapping[str, Any]]) -> list[tuple[str, list[int]]]:
    """Each distinct WARNING or ERROR line once, in order, with the ranks that logged it (the
    rank's own number and the server's port made alike)."""
    seen: dict[str, list[int]] = {}
    for line in lines:
        text = re.sub(r"/\d+: ", "/N: ", f"{line['level']} {line['text']}")
        text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", text)
        text = re.sub(
            r"\d+(\.\d+)?s degraded: \d+ calls served locally, \d+ entries",
            "Xs degraded: N calls served locally, M entries",
            text,
        )
        ranks = seen.setdefault(text, [])
        if line["rank"] not in ranks:
            ranks.append(line["rank"])
    return [(text, sorted(ranks)) for text, ranks in seen.items()]


def markdown(results: Sequence[dict[str, Any]], settings: Settings, meta: Mapping[str, str]) -> str:
    rows = "\n".join(f"- `{row}`: {LABELS[row]}" for row in ROWS if any(r["row"] == row for r in results))
    ttl = "the default" if settings.pending_ttl_s is None else f"{settings.pending_ttl_s:g} s"
    aborted = "every row" if settings.abort_everywhere else "`aborted` and `paused`"
    setup = (
        f"`benchmarks/tp_bad_day.py` ({meta['args']}), {meta['date']}, {meta['machine']}, {meta['server']}. "
        "Groups of `Layer0Bridge` (`registers_tasks=True`, `nranks` the group's size), one redis-server per run, "
        f"driven through the bridge's public face only. A request every {settings.interval:g} s for "
        f"{settings.seconds:g} s, each on a slot of its own; every rank gets each layer-0 message (same order) "
        f"and each task (its adder not in lockstep with the others), each 0-{settings.jitter * 1000:.0f} ms late "
        "at random, the signal or the task first at random; a rank's sender takes each batch off its `ready` "
        f"queue and finishes the task. The aborted request (in {aborted}) is request {aborted_index(settings)}: "
        f"its signal comes, its task never does; `pending_ttl_s` is {ttl}. Pause and black hole start "
        f"{settings.disrupt_at:g} s into the run and last {settings.outage:g} s; the restart comes right after "
        f"the restarting rank registered the task of the first request from {settings.disrupt_at:g} s on whose "
        "task comes before its signal: its new bridge gets that signal."
    )
    measure = (
        "Added delay: when the request's batch is on the `ready` queue of the last rank, minus when its signal "
        f'and its task had both been given to every rank. "Delayed" counts requests queued on every rank with '
        f'more than {DELAYED_S} s added; "never queued" those not queued on every rank {settings.grace:g} s '
        "after the run's end (the later of the last request and the end of the outage); the aborted request is "
        'not counted. "Identical sequences": every rank put the same batches in the same order on its queue '
        '(a restarted rank: both bridges\' batches, in order). "Run s": how long the run took (it ends once '
        f"every request is queued on every rank and the outage has been over for {SETTLE_S:g} s)."
    )
    if any(r.get("dropped_in_flight") is not None for r in results):
        measure += (
            " Where the group drops the requests in flight at a rank's restart on every rank and says so (an "
            'ERROR line on each rank), "in flight" counts the requests not queued whose task some rank had '
            'registered before it logged that line ("dropped by design"), and "never queued" only the '
            "others, those the group still owes."
        )
    return f"""# A tensor-parallel group's bad day: what it costs against TP 1

{textwrap.fill(setup, WIDTH, break_on_hyphens=False)}

{rows}

{textwrap.fill(measure, WIDTH, break_on_hyphens=False)}

{table(results)}

What each run's ranks said (`health()` fields that are true, positive or not quiet, at the run's
end, before `close()`; each distinct WARNING and ERROR line the bridges logged, with its ranks):

{details(results)}
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Short runs (3 s of requests, 3 s outage, 4 s grace).")
    parser.add_argument("--tp", default="1,2,4", help="TP sizes, comma-separated (default 1,2,4).")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"Rows to run (default {','.join(ROWS)}).")
    parser.add_argument("--seconds", type=float, default=None, help="Requests arrive for this long.")
    parser.add_argument("--interval", type=float, default=None, help="Seconds between requests (default 0.3).")
    parser.add_argument("--outage", type=float, default=None, help="Pause and black hole length, seconds.")
    parser.add_argument("--disrupt-at", type=float, default=None, help="When the disruption starts, seconds.")
    parser.add_argument("--grace", type=float, default=None, help="After the run, how long to wait for requests.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--abort-everywhere", action="store_true", help="Every row has the aborted request.")
    parser.add_argument("--pending-ttl", type=float, default=None, help="The buffers' pending_ttl_s (default: theirs).")
    parser.add_argument("--json", type=Path, default=None, help="Write every run's outcome here.")
    parser.add_argument("--markdown", type=Path, default=None, help="Write the report here too.")
    parser.add_argument(
        "--report-from", type=Path, default=None, help="Print the report of a --json file; run nothing."
    )
    args = parser.parse_args(argv)
    if args.report_from is not None:
        saved = json.loads(args.report_from.read_text())
        print(markdown(saved["runs"], Settings(**saved["settings"]), saved["meta"]), end="")
        return 0
    base = QUICK if args.quick else Settings()
    overrides = {
        name: getattr(args, name)
        for name in ("seconds", "interval", "outage", "disrupt_at", "grace")
        if getattr(args, name) is not None
    }
    settings = dataclasses.replace(
        base,
        seed=args.seed,
        abort_everywhere=args.abort_everywhere,
        pending_ttl_s=args.pending_ttl,
        **overrides,
    )
    sizes = [int(part) for part in args.tp.split(",") if part]
    rows = [row for row in args.rows.split(",") if row]
    unknown = [row for row in rows if row not in ROWS]
    if unknown or not sizes or any(not 1 <= n <= 8 for n in sizes):
        parser.error(f"rows must be among {', '.join(ROWS)} and TP sizes 1 to 8 (got {args.rows!r}, {args.tp!r})")
    results: list[dict[str, Any]] = []
    for row in rows:
        for tp in sizes:
            if row == "nranks" and tp == 1:
                results.append({"row": row, "tp": tp, "skipped": "nothing to disagree on at TP 1"})
                continue
            res = run_one(row, tp, settings)
            results.append(res)
            print(table([res]).splitlines()[-1], file=sys.stderr, flush=True)
    with LocalRedis() as url:
        import redis

        client = redis.Redis.from_url(url)
        version = str(client.info("server")["redis_version"])
        client.close()
    meta = {
        "args": " ".join(argv if argv is not None else sys.argv[1:]) or "defaults",
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, Python {platform.python_version()}",
        "server": f"redis-server {version}",
    }
    report = markdown(results, settings, meta)
    print(report)
    if args.markdown is not None:
        args.markdown.write_text(report)
    if args.json is not None:
        args.json.write_text(
            json.dumps({"settings": dataclasses.asdict(settings), "meta": meta, "runs": results}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
