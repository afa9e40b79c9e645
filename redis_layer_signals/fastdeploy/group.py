"""What the tensor-parallel ranks of one instance queue: the same batches, in the same order.

FastDeploy's sender waits on barriers shared by every rank of the instance, once per batch and
once per finished task, so every rank must put the identical sequence of batches on its
sender's queue. What the ranks share is the GPU's stream of layer-0 messages (same entries,
same order) and the stream of registrations (the adders run in lockstep); how the two
interleave differs per rank. So nothing a rank queues may depend on that interleaving:

- every entry of every layer-0 message becomes its own batch ``[(slot, tokens)]``, numbered in
  message and entry order (``Entry.seq``), never coalesced, reordered or skipped;
- the entries are released in that order, the head first, once its slot's task is registered
  on the rank (dropped instead when the task's verdict says so: the same data on every rank);
- a head whose task never registers (a request aborted before it registered) is given up by
  the group, never by one rank: a rank whose head waited ``give_up_s`` stops releasing it on
  its own and votes (lua/group.lua); the group answers "released" (another rank released it:
  release it once registered here, which the lockstep adders guarantee) or "abandoned" (every
  rank voted: drop it, as ``expired``).

``GroupQueue`` holds one rank's side of that: the waiting entries, the tasks registered on the
rank, and the state of the head's vote. No I/O, no threads, no locking: the bridge calls it under
its own lock, and a thread of the bridge carries the votes to Redis (``voting``).
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..models import CacheTask, DropReason
from .local import verdict_of

NEVER_MS = 1 << 62
"""A deadline that never passes: the group gives up on an entry, never the clock."""


class HeadState(enum.Enum):
    WAITING = "waiting"
    """Released once its task is registered, or voted on after ``give_up_s``."""
    VOTED = "voted"
    """The rank voted to give it up: it waits for the group's outcome, never released alone."""
    RELEASED_BY_GROUP = "released_by_group"
    """Another rank released it: released here once its task is registered."""


class Outcome(str, enum.Enum):
    """What the group answered about an entry a rank voted to give up (lua/group.lua)."""

    RELEASED = "released"
    ABANDONED = "abandoned"
    OPEN = "open"


@dataclass(slots=True)
class Entry:
    """One entry of a layer-0 message, the batch ``[(slot, tokens)]`` it becomes."""

    seq: int
    """Its place in the GPU's stream: the layer-0 entries the bridge consumed before it."""
    slot: int
    tokens: int
    request_id: str | None
    arrived_s: float
    """When the rank read it (monotonic seconds): how long it has waited."""
    state: HeadState = HeadState.WAITING


@dataclass
class Progress:
    """What one call settled, in sequence order: entries to queue, entries dropped and why."""

    released: list[Entry] = field(default_factory=list)
    dropped: list[tuple[Entry, DropReason]] = field(default_factory=list)

    def counts(self, first_new: int, arrived: int = 0) -> dict[str, int]:
        """The counters these decisions advance, as the Lua functions name them. ``arrived``
        entries, from sequence number ``first_new`` on, came in this call: those released at
        once were ``delivered``, the others ``buffered``. A buffered entry ends as ``recovered``
        (released later), ``dropped_<reason>``, or ``expired`` (given up by the group)."""
        counts: collections.Counter[str] = collections.Counter()
        for entry in self.released:
            counts["delivered" if entry.seq >= first_new else "recovered"] += 1
        counts["buffered"] = arrived - counts["delivered"]
        for _entry, reason in self.dropped:
            counts["expired" if reason is DropReason.EXPIRED else f"dropped_{reason.value}"] += 1
        return {name: n for name, n in counts.items() if n}


class GroupQueue:
    """One rank's layer-0 entries not yet released, released in the group's order."""

    def __init__(self, give_up_s: float) -> None:
        self.give_up_s = give_up_s
        self.entries: collections.deque[Entry] = collections.deque()
        self.tasks: dict[int, CacheTask] = {}
        """The task registered on each slot of this rank (a finish removes it)."""
        self.next_seq = 0
        """The sequence number of the next entry: the layer-0 entries consumed so far."""
        self.handled = -1
        """The highest sequence number released, dropped or given up (-1: none): what this rank
        tells the group."""

    # -- the streams every rank shares ----------------------------------------------------

    def arrive(
        self, entries: Iterable[tuple[int, int]], request_ids: Mapping[int, str] | None, now_s: float
    ) -> Progress:
        """One layer-0 message: number its entries and release what can go."""
        for slot, tokens in entries:
            request_id = None if request_ids is None else request_ids.get(slot)
            self.entries.append(Entry(self.next_seq, slot, tokens, request_id, now_s))
            self.next_seq += 1
        return self._advance()

    def registered(self, task: CacheTask) -> Progress:
        """A task registered on this rank (over whatever held its slot, as FastDeploy does)."""
        self.tasks[task.slot] = task
        return self._advance()

    def finished(self, slot: int, request_id: str) -> None:
        """The slot's task finished: a later entry of the slot waits for the next registration.
        A finish of another request than the slot's holder changes nothing (fenced)."""
        task = self.tasks.get(slot)
        if task is not None and task.request_id == request_id:
            del self.tasks[slot]

    # -- giving up, decided by the group ---------------------------------------------------

    def give_up(self, now_s: float) -> int | None:
        """The head's sequence number when this rank gives up on it now (it waited unregistered
        ``give_up_s``): from now on it is released only if the group says so. None otherwise."""
        head = self.entries[0] if self.entries else None
        if head is None or head.state is not HeadState.WAITING or self._task_for(head) is not None:
            return None
        if now_s - head.arrived_s < self.give_up_s:
            return None
        head.state = HeadState.VOTED
        return head.seq

    def voting(self) -> list[int]:
        """The sequence numbers this rank voted on and waits to hear about (the head, or none)."""
        head = self.entries[0] if self.entries else None
        return [head.seq] if head is not None and head.state is HeadState.VOTED else []

    def decided(self, seq: int, outcome: Outcome) -> Progress:
        """The group's outcome for ``seq``, which this rank voted on."""
        head = self.entries[0] if self.entries else None
        if head is None or head.seq != seq or head.state is not HeadState.VOTED or outcome is Outcome.OPEN:
            return Progress()
        if outcome is Outcome.RELEASED:
            head.state = HeadState.RELEASED_BY_GROUP
            return self._advance()
        self.entries.popleft()
        self.handled = seq
        progress = self._advance()
        progress.dropped.insert(0, (head, DropReason.EXPIRED))
        return progress

    def waiting(self) -> int:
        """Entries not released yet."""
        return len(self.entries)

    # -- inside -----------------------------------------------------------------------------

    def _task_for(self, entry: Entry) -> CacheTask | None:
        """The task ``entry`` may go to now: its slot's, unless the entry names another request
        (it then waits for its own request's registration)."""
        task = self.tasks.get(entry.slot)
        if task is None or (entry.request_id is not None and entry.request_id != task.request_id):
            return None
        return task

    def _advance(self) -> Progress:
        progress = Progress()
        entries = self.entries
        while entries:
            head = entries[0]
            if head.state is HeadState.VOTED:
                break
            task = self._task_for(head)
            if task is None:
                break
            entries.popleft()
            self.handled = head.seq
            reason = verdict_of(head.tokens, head.request_id, NEVER_MS, task, 0)
            if reason is None:
                progress.released.append(head)
            else:
                progress.dropped.append((head, reason))
        return progress
