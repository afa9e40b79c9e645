"""What both layouts of a bridge share: its rank, its queue, its lock and its outage episodes.

A bridge serves one (instance, rank) in one of two layouts (``owned``, ``shared``); whichever
it is, the hooks put batches on the sender's queue under one lock, serve the process locally
while Redis does not answer (an *episode*, logged once with its cause), and count errors per
hook. ``RankContext`` holds that state, so that each layout keeps only its own.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..buffer.sync import SignalBuffer
from ..errors import InvalidSignal, InvalidTask
from ..models import CacheTask
from .local import LocalState
from .logs import BridgeLog, one_line

Batch = list[tuple[int, int]]
"""What ``cache_prefilled_engine_ids_queue`` carries: ``[(engine_idx, prefilled_token_num)]``."""

STATS_DEGRADED_MS, STATS_SERVED_LOCALLY, STATS_RECONCILED = "degraded_ms", "served_locally", "reconciled"
"""Fields the bridge adds to its rank's ``stats`` hash when an episode ends."""


class QueueLike(Protocol):
    """Either a ``queue.Queue`` or a ``multiprocessing`` queue."""

    def put(self, item: Any) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...


ReadySource = QueueLike | Callable[[], QueueLike]
"""The sender's queue, or a zero-argument callable returning the current one (looked up at
each put): ``ready=lambda: self.cache_prefilled_engine_ids_queue`` follows the messager's
attribute when code replaces the queue later."""


class RankContext:
    """One bridge's rank, queue, lock, local state and episode counters (see the module)."""

    def __init__(
        self,
        buffer: SignalBuffer,
        instance: str,
        rank: int,
        ready: ReadySource,
        probe_s: float,
        logger: Any,
    ) -> None:
        self.buffer = buffer
        self.instance = instance
        self.rank = rank
        self.logger = logger if isinstance(logger, BridgeLog) else BridgeLog(logger)
        """Every line of the bridge goes through it: one string per call (see ``logs``)."""
        self.probe_s = probe_s
        self._ready = ready
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        """Wakes the writer (a decision to write) and flush (Redis caught up)."""
        self.closed = threading.Event()
        self.local = LocalState()
        self.pending_ttl_ms = round(buffer.config.pending_ttl_s * 1000)
        self.offset_ms: int | None = None
        """The server's clock minus this host's monotonic clock, from a reply (None until one
        came): what turns the time of a decision into the server's time. Never this host's wall
        clock, which may be off by minutes and jump when it is corrected."""
        self.degraded_since: float | None = None
        self.degraded_total = 0.0
        self.episodes = 0
        self.episode_calls = 0
        self.episode_reconciled = 0
        self.reconciled = 0
        self.local_calls: collections.Counter[str] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.suppressed = 0
        self.logged: set[str] = set()
        """Kinds of error already logged (bad input per hook, a bug per hook and type): each is
        logged once, until its hook succeeds again."""

    @property
    def ready(self) -> QueueLike:
        """The sender's queue as of now (a callable ``ready`` is called each time)."""
        source = self._ready
        if hasattr(source, "put"):
            return source  # type: ignore[return-value]
        return source()

    def mono_ms(self) -> int:
        """Now, for a decision: this host's monotonic clock in ms (the buffer's injected clock,
        which stands for the server's, in tests). Ages and expiries decided in the process are
        measured on it, so a wrong or corrected wall clock changes none of them."""
        clock = self.buffer.protocol.clock
        if clock is not None:
            return int(clock())
        return int(time.monotonic() * 1000)

    def anchored(self) -> bool:
        """The offset to the server's clock is known (a reply came), or the clock is injected."""
        return self.offset_ms is not None or self.buffer.protocol.clock is not None

    def anchor(self, server_ms: int, sent_s: float, received_s: float) -> None:
        """Keep the offset a reply showed: the server read ``server_ms`` about halfway between
        ``sent_s`` and ``received_s`` (``time.monotonic``). Nothing with an injected clock."""
        if self.buffer.protocol.clock is None:
            self.offset_ms = server_ms - round((sent_s + received_s) / 2 * 1000)

    def to_server(self, mono_ms: int) -> int:
        """A ``mono_ms`` time on the server's clock (the offset of the last reply; the caller
        has one: see ``anchored``)."""
        return mono_ms + (self.offset_ms or 0)

    def to_mono(self, server_ms: int) -> int:
        """The inverse of ``to_server``: a time Redis stores, on this host's monotonic clock."""
        return server_ms - (self.offset_ms or 0)

    # -- episodes --------------------------------------------------------------------------

    def degrade(self, operation: str, exc: BaseException, log: bool = True) -> bool:
        """Under the lock: count the error; start an episode (logged once, with its cause,
        unless ``log`` is False: the caller then logs it with ``log_degraded`` once it released
        the lock, which the hooks wait for). True when the episode started here."""
        self.errors[operation] += 1
        if self.degraded_since is not None:
            return False
        self.degraded_since = time.monotonic()
        self.local.counting = True
        self.episodes += 1
        self.episode_calls = self.episode_reconciled = 0
        if log:
            self.log_degraded(operation, exc)
        return True

    def log_degraded(self, operation: str, exc: BaseException) -> None:
        """An outage is expected, not a bug: one line with its cause, no traceback."""
        self.logger.warning(
            "%s/%d: Redis failed in %s (%s); serving this process locally until it answers",
            self.instance,
            self.rank,
            operation,
            one_line(exc),
        )

    def end_episode(self) -> tuple[float, int, int]:
        """Under the lock, with what was decided written back: serve from Redis again. Returns
        the episode's seconds, calls served locally and entries written back."""
        assert self.degraded_since is not None
        seconds = time.monotonic() - self.degraded_since
        self.degraded_total += seconds
        self.degraded_since = None
        # Every local decision is in Redis now, counted there: the local signals are Redis's too.
        self.local.counting = False
        self.local.counts.clear()
        self.local.early = {slot: dataclasses.replace(s, shared=True) for slot, s in self.local.early.items()}
        calls, entries = self.episode_calls, self.episode_reconciled
        self.logger.warning(
            "%s/%d: Redis answers again after %.1fs degraded: %d calls served locally, %d entries written back",
            self.instance,
            self.rank,
            seconds,
            calls,
            entries,
        )
        return seconds, calls, entries

    def degraded_seconds(self) -> float:
        """Under the lock: time spent degraded, the current episode included."""
        since = self.degraded_since
        return self.degraded_total + (time.monotonic() - since if since is not None else 0.0)

    # -- logs --------------------------------------------------------------------------------

    def bug(self, operation: str, exc: Exception) -> None:
        """An error of the bridge itself, after the Redis call: count it, log it with its
        traceback once per kind, and let FastDeploy's loop go on."""
        with self.lock:
            self.errors[operation] += 1
            kind = f"bug:{operation}:{type(exc).__name__}"
            first = kind not in self.logged
            self.logged.add(kind)
        if first:
            self.logger.error("%s/%d: %s failed in the bridge itself", self.instance, self.rank, operation, trace=exc)

    def invalid(self, operation: str, exc: InvalidSignal | InvalidTask) -> None:
        """Count bad input; log it once until the same hook succeeds again."""
        with self.lock:
            self.errors[operation] += 1
            first = operation not in self.logged
            self.logged.add(operation)
        if first:
            self.logger.error("%s/%d: %s skipped invalid input: %s", self.instance, self.rank, operation, exc)
        else:
            self.logger.debug("%s/%d: %s skipped invalid input: %s", self.instance, self.rank, operation, exc)

    def log_takeover(self, task: CacheTask, holder: str) -> None:
        self.logger.warning(
            "slot %d of %s/%d still held by request %s: registering %s over it, as FastDeploy does",
            task.slot,
            self.instance,
            self.rank,
            holder,
            task.request_id,
        )

    def log_dropped(self, task: CacheTask, tokens: int, reason: Any) -> None:
        self.logger.warning(
            "dropped early layer-0 signal of slot %d (%d tokens) for request %s: %s",
            task.slot,
            tokens,
            task.request_id,
            reason.value,
        )
