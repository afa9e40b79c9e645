"""What the bridge knows in its own process: FastDeploy's in-process fix, kept beside Redis.

FastDeploy's fix keeps, per slot, the task that holds it and the newest early layer-0 signal,
pops the signal when the task registers (dropping it when its tokens exceed
``need_prefill_tokens``) and forgets it when the task finishes. ``LocalState`` keeps the
same two maps for the slots of one (instance, rank) in this process, for two reasons:

- while Redis answers, it is the process's own view of where a signal may go (FastDeploy's
  sender only knows the tasks its process registered), and a copy of the early signals this
  process buffered in Redis, in case Redis loses them (a restart without persistence);
- while Redis does not answer, it *is* the buffer: the bridge serves FastDeploy from it with
  the semantics of FastDeploy's fix, and counts here what it decided (``counts``), until
  the decisions are written back to Redis.

No I/O and no locking: the bridge calls it under its own lock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..models import CacheTask, DropReason


@dataclass(slots=True)
class LocalTask:
    """A task this process registered, and the furthest layer-0 signal queued for it."""

    task: CacheTask
    queued_tokens: int = -1
    """Tokens of the newest layer-0 signal handed to the sender for this request (-1: none). A
    signal at or below it is already covered: queueing it again would resend its blocks, or
    reach the sender after the request finished."""
    registered_at_ms: int = 0
    """When the process registered it, on its monotonic clock (its lease runs from then)."""
    recovery: tuple[int, str | None, int, str] | None = None
    """What its registration popped (see ``owner``): tokens, request id, recorded at
    (monotonic ms) and the drop reason ('' recovered); None when it popped nothing."""


@dataclass(slots=True)
class EarlySignal:
    """The newest layer-0 signal of a slot that no task of this process has taken yet. Never
    changed once built (``dataclasses.replace`` makes another); not frozen, whose ``__init__``
    costs twice as much, and one is built per buffered entry."""

    tokens: int
    deadline_ms: int
    """When it expires, as in Redis: its recording time plus the pending TTL."""
    shared: bool
    """True when Redis counted its recording (it buffered it, or delivered it to a holder this
    process does not know): Redis counts its fate too. False when only this process has seen it
    (recorded while Redis was unreachable)."""
    request_id: str | None = None
    """The request the GPU computed it for, when the signal says (FastDeploy's does not)."""


@dataclass
class LocalState:
    """The tasks and early layer-0 signals of one (instance, rank), in this process."""

    tasks: dict[int, LocalTask] = field(default_factory=dict)
    early: dict[int, EarlySignal] = field(default_factory=dict)
    counting: bool = False
    """True while Redis is unreachable: only then are decisions made here counted in
    ``counts`` (otherwise Redis counts them)."""
    counts: Counter[str] = field(default_factory=Counter)
    """Fates decided here of signals Redis never saw (``recorded``, ``delivered``, ``buffered``,
    ``recovered``, ``dropped_<reason>``, ``superseded``, ``finish_dropped``), and
    ``shared_taken``: signals Redis still holds as pending that this process handed out or
    dropped. Every signal recorded here ends in exactly one of these, or is still in
    ``early``; the bridge clears them once Redis has replayed the same decisions."""

    def keep_early(self, slot: int, signal: EarlySignal, counted: bool) -> None:
        """Keep ``signal`` as the slot's early signal, newest wins. ``counted``: it was decided
        here (Redis never saw it), so its recording and what it supersedes are counted."""
        if counted and self.counting:
            self.counts["recorded"] += 1
            self.counts["buffered"] += 1
        older = self.early.get(slot)
        if older is not None:
            self._count_end(older, "superseded")
        self.early[slot] = signal

    def register(self, task: CacheTask, now_ms: int) -> tuple[EarlySignal | None, DropReason | None]:
        """Make ``task`` the slot's holder (overwriting, as FastDeploy does) and pop its early
        signal: returns the signal and, when it must not be sent, why (see ``verdict``).
        The same request registered again keeps what was queued for it."""
        holder = self.tasks.get(task.slot)
        if holder is not None and holder.task.request_id == task.request_id:
            return None, None  # a repeat, as register.lua answers it: the slot's signal stays
        self.tasks[task.slot] = LocalTask(task)
        early = self.early.pop(task.slot, None)
        if early is None:
            return None, None
        reason = verdict(early, task, now_ms)
        self._count_end(early, "recovered" if reason is None else f"dropped_{reason.value}")
        return early, reason

    def finish(self, slot: int, request_id: str) -> tuple[bool, int, bool]:
        """Release the slot if ``request_id`` holds it and drop its early signal (one of this
        request, or naming none); fenced (nothing changes) when another request holds it.
        Returns (removed, dropped, fenced), like ``redis_layer_signals.models.FinishResult``."""
        holder = self.tasks.get(slot)
        if holder is not None and holder.task.request_id != request_id:
            return False, 0, True
        removed = self.tasks.pop(slot, None) is not None
        early = self.early.get(slot)
        if early is None or early.request_id not in (None, request_id):
            return removed, 0, False  # a signal of another request stays for it, as in finish.lua
        del self.early[slot]
        self._count_end(early, "finish_dropped")
        return removed, 1, False

    def count_delivered(self) -> None:
        """A signal decided here went to the sender."""
        if self.counting:
            self.counts["recorded"] += 1
            self.counts["delivered"] += 1

    def pending_here(self) -> int:
        """Early signals only this process knows, still waiting."""
        return sum(1 for signal in self.early.values() if not signal.shared)

    def _count_end(self, signal: EarlySignal, fate: str) -> None:
        if self.counting:
            self.counts["shared_taken" if signal.shared else fate] += 1


def verdict(signal: EarlySignal, task: CacheTask, now_ms: int) -> DropReason | None:
    """Why an early layer-0 signal must not be sent to ``task``, or None when it may (Redis's
    checks, in Redis's order)."""
    return verdict_of(signal.tokens, signal.request_id, signal.deadline_ms, task, now_ms)


def verdict_of(
    tokens: int, request_id: str | None, deadline_ms: int, task: CacheTask, now_ms: int
) -> DropReason | None:
    """``verdict`` on a signal's fields."""
    if now_ms >= deadline_ms:
        return DropReason.EXPIRED
    if request_id is not None and request_id != task.request_id:
        return DropReason.REQUEST_MISMATCH
    if tokens <= 0:
        return DropReason.NON_POSITIVE
    if tokens > task.need_prefill_tokens:
        return DropReason.OVER_NEED
    return None
