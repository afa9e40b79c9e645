"""What the tensor-parallel ranks of one instance queue, and how they agree on it.

FastDeploy's sender waits on barriers shared by every rank of the instance, once per batch, so
every rank must queue the identical sequence of batches. Every rank reads the same GPU stream of
layer-0 messages and registers the same tasks; how and when a rank sees each is its own. The
rule (checked over every interleaving by ``tests/group_protocol.py``):

- **ready**: a rank reports an entry ready once it has read it and the entry's task is
  registered on the rank. An entry the task refuses (``verdict_of``) is dropped on every rank,
  never reported: the task is the same on every rank. An entry whose task never comes (an aborted
  request) is never ready, so it holds back nothing; it expires after ``pending_ttl_s``.
- **released by all**: one *sequencer* per group releases an entry once every rank reported it
  ready, and tells every rank, in one order. Each entry is its own batch ``[(slot, tokens)]``, so
  a late task delays its own request only.
- **named by content**: an entry is ``Key = (request_id, slot, tokens, n)``, ``n`` counting the
  request's earlier entries of the same tokens. Every rank names it alike without sharing a
  counter, so a rank's restart does not shift the names.
- **generations**: when the sequencer goes (its process died), another rank's takes over under a
  new generation. It gathers every live rank's *join*: how many entries the rank queued, its last
  ``HISTORY_KEPT`` keys, and what it reported and has not been given. The longest history is
  the group's order so far (all histories are prefixes of it), each rank is sent what its own
  lacks, and the reports are counted again.
- **a rank's restart**: a fresh process joins with nothing. It skips the order so far, and the
  requests registered before it came are *lost*: every rank drops their entries (an ERROR and a
  counter). Requests registered after it joined are sent as usual.

``Member`` is one rank's side, ``Sequencer`` the group's; both are pure (no I/O, no clock, no
threads): ``group_link`` carries their messages over a socket only the instance's processes
reach, and the bridge calls ``Member`` under its lock. Nothing of the agreement goes through
Redis.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..models import CacheTask, DropReason
from .local import verdict_of

Key = tuple[str, int, int, int]
"""An entry's name on every rank: (request_id, slot, tokens, n)."""
Message = dict[str, Any]
"""What travels between a member and the sequencer (one JSON line each, see ``group_link``)."""
Out = list[tuple[int, Message]]
"""What the sequencer sends: (member, message) pairs, in order."""

HISTORY_KEPT = 4096
"""Keys of its queued entries a member keeps for a join: a member that lags the group's order
by more after a sequencer's crash cannot be caught up and starts again (``diverged``)."""
ABANDONED_KEPT = 4096
"""Keys given up that the sequencer remembers, so a late report of one is answered at once."""
NEVER_MS = 1 << 62


@dataclass(slots=True)
class Entry:
    """One entry of a layer-0 message, the batch ``[(slot, tokens)]`` it becomes."""

    slot: int
    tokens: int
    request_id: str | None
    """The request the GPU named for it (FastDeploy names none: the slot's task decides)."""
    arrived_ms: int
    """When the rank read it, on its monotonic clock."""
    key: Key | None = None
    """Its name, once its task is known."""
    ready_ms: int = 0
    """When it was reported ready (its task known here): its wait for the other ranks starts."""


@dataclass
class Progress:
    """What one call of ``Member`` settled: keys to report, entries to queue, entries dropped."""

    report: list[Key] = field(default_factory=list)
    lost: list[Key] = field(default_factory=list)
    """Reported keys of requests lost to a rank's restart: the sequencer gives them up."""
    released: list[Entry] = field(default_factory=list)
    dropped: list[tuple[Entry, str]] = field(default_factory=list)
    """(entry, why): a ``DropReason`` value, ``lost`` (a rank restarted) or ``abandoned``."""


class Member:
    """One rank's side of the group: its tasks, the entries waiting for their task or for the
    group, and the order it has queued."""

    def __init__(self, give_up_ms: int) -> None:
        self.give_up_ms = give_up_ms
        self.tasks: dict[int, CacheTask] = {}
        """The task registered on each slot of this rank (a finish removes it)."""
        self.waiting: list[Entry] = []
        """Entries read whose task is not registered here yet, in stream order."""
        self.reported: dict[Key, Entry] = {}
        """Entries reported ready and not released yet."""
        self.queued = 0
        """Entries released to this rank since it started: its place in the group's order."""
        self.history: collections.deque[Key] = collections.deque(maxlen=HISTORY_KEPT)
        self.generation = 0
        """The generation joined (0: none yet)."""
        self.fresh = True
        """Never joined: a restarted process, whose history is not the group's."""
        self.lost_requests: set[str] = set()
        """Requests registered before a rank restarted: their entries are dropped."""
        self._chunks: dict[str, collections.Counter[int]] = {}
        """Per request, entries named so far per tokens: the ``n`` of the next key."""

    # -- the streams every rank shares ----------------------------------------------------

    def arrive(
        self, entries: Iterable[tuple[int, int]], request_ids: Mapping[int, str] | None, now_ms: int
    ) -> Progress:
        """One layer-0 message: report what has its task, keep the rest waiting."""
        progress = Progress()
        for slot, tokens in entries:
            request_id = None if request_ids is None else request_ids.get(slot)
            entry = Entry(slot, tokens, request_id, now_ms)
            task = self._task_for(entry)
            if task is None:
                self.waiting.append(entry)
            else:
                entry.ready_ms = now_ms
                self._ready(entry, task, progress)
        return progress

    def registered(self, task: CacheTask, now_ms: int) -> Progress:
        """A task registered on this rank (over whatever held its slot, as FastDeploy does):
        its waiting entries are ready, in stream order."""
        self.tasks[task.slot] = task
        progress = Progress()
        still: list[Entry] = []
        for entry in self.waiting:
            if entry.slot == task.slot and self._task_for(entry) is task:
                entry.ready_ms = now_ms
                self._ready(entry, task, progress)
            else:
                still.append(entry)
        self.waiting = still
        return progress

    def finished(self, slot: int, request_id: str) -> None:
        """The slot's task finished: a later entry of the slot waits for the next registration.
        A finish of another request than the slot's holder changes nothing (fenced)."""
        task = self.tasks.get(slot)
        if task is not None and task.request_id == request_id:
            del self.tasks[slot]
            self._chunks.pop(request_id, None)
            self.lost_requests.discard(request_id)

    def expire(self, now_ms: int) -> Progress:
        """Entries that waited ``give_up_ms`` for a task end as ``expired``: nothing was
        reported for them, so the group's queues do not change."""
        progress = Progress()
        if self.waiting and now_ms - self.waiting[0].arrived_ms >= self.give_up_ms:
            keep: list[Entry] = []
            for entry in self.waiting:
                if now_ms - entry.arrived_ms < self.give_up_ms:
                    keep.append(entry)
                else:
                    progress.dropped.append((entry, DropReason.EXPIRED.value))
            self.waiting = keep
        return progress

    # -- what the sequencer says ------------------------------------------------------------

    def joining(self, token: str) -> Message:
        """The join this member sends a sequencer (see the module); ``token`` names its process."""
        return {
            "t": "join",
            "token": token,
            "fresh": self.fresh,
            "queued": self.queued,
            "tail": [list(key) for key in self.history],
            "reported": [list(key) for key in self.reported],
        }

    def hear(self, message: Message) -> Progress:
        """A message of the sequencer (``welcome``, ``release``, ``abandon``, ``restarted``,
        ``reset``). One of another generation than the one joined changes nothing, except a
        ``reset``: the answer to this member's join, which a sequencer sends before it welcomed
        the member into its generation."""
        kind = message["t"]
        if kind == "welcome":
            self.generation, self.fresh = message["g"], False
            if message.get("skip") is not None:  # a restarted rank: the order so far is not its
                self.queued = message["skip"]
            return Progress()
        if kind == "reset":
            return self.reset()
        if message.get("g") != self.generation:
            return Progress()
        if kind == "release":
            return self._release([_key(k) for k in message["keys"]])
        if kind == "abandon":
            return self._drop([_key(k) for k in message["keys"]], "abandoned")
        if kind == "restarted":
            return self._restarted()
        return Progress()

    def reset(self) -> Progress:
        """This rank's history cannot be the group's (it lagged past what a join carries): drop
        what is in flight, as a restarted rank's, and join again as a fresh one."""
        progress = self._restarted()
        self.fresh, self.generation, self.history = True, 0, collections.deque(maxlen=HISTORY_KEPT)
        return progress

    def in_flight(self) -> int:
        """Entries read and not queued or dropped yet."""
        return len(self.waiting) + len(self.reported)

    # -- inside -----------------------------------------------------------------------------

    def _task_for(self, entry: Entry) -> CacheTask | None:
        """The task ``entry`` goes to: its slot's, unless the entry names another request."""
        task = self.tasks.get(entry.slot)
        if task is None or (entry.request_id is not None and entry.request_id != task.request_id):
            return None
        return task

    def _ready(self, entry: Entry, task: CacheTask, progress: Progress) -> None:
        """``entry`` has its task: name it and report it, or drop it (refused by the task, or
        of a request lost to a restart: then named as ``lost``, for the group to give it up on
        the ranks that did not see the restart first)."""
        reason = verdict_of(entry.tokens, entry.request_id, NEVER_MS, task, 0)
        if reason is not None:
            progress.dropped.append((entry, reason.value))
            return
        chunks = self._chunks.setdefault(task.request_id, collections.Counter())
        entry.key = (task.request_id, entry.slot, entry.tokens, chunks[entry.tokens])
        chunks[entry.tokens] += 1
        if task.request_id in self.lost_requests:
            progress.lost.append(entry.key)
            progress.dropped.append((entry, "lost"))
            return
        self.reported[entry.key] = entry
        progress.report.append(entry.key)

    def _release(self, keys: list[Key]) -> Progress:
        """Queue each released key, in the group's order. A key this rank does not hold (it
        dropped it, or a join caught it up) is queued all the same: the batches must match."""
        progress = Progress()
        for key in keys:
            entry = self.reported.pop(key, None)
            if entry is None:
                request_id, slot, tokens, _n = key
                entry = Entry(slot, tokens, request_id, 0, key)
            progress.released.append(entry)
            self.history.append(key)
        self.queued += len(keys)
        return progress

    def _drop(self, keys: list[Key], why: str) -> Progress:
        progress = Progress()
        for key in keys:
            entry = self.reported.pop(key, None)
            if entry is not None:
                progress.dropped.append((entry, why))
        return progress

    def _restarted(self) -> Progress:
        """A rank restarted: the requests registered so far are lost to it. Their entries are
        dropped here; the reported ones are sent back as ``lost`` for the sequencer to give up."""
        progress = Progress()
        self.lost_requests.update(task.request_id for task in self.tasks.values())
        for key, entry in list(self.reported.items()):
            if key[0] in self.lost_requests:
                del self.reported[key]
                progress.lost.append(key)
                progress.dropped.append((entry, "lost"))
        keep: list[Entry] = []
        for entry in self.waiting:
            task = self._task_for(entry)
            if task is not None and task.request_id in self.lost_requests:
                progress.dropped.append((entry, "lost"))
            else:
                keep.append(entry)
        self.waiting = keep
        return progress


def _key(raw: Any) -> Key:
    request_id, slot, tokens, n = raw
    return (str(request_id), int(slot), int(tokens), int(n))


@dataclass
class Joined:
    """A member the sequencer has heard from."""

    queued: int
    """Entries this member had queued when it joined, plus what it was sent since."""
    tail: list[Key]
    fresh: bool = False


class Sequencer:
    """The group's side: counts the ranks' ready reports and releases, in one order.

    While ``gathering`` (a new generation's first moments), it only collects joins; ``resume``
    ends that once every live rank joined (``group_link`` decides who is live)."""

    def __init__(self, nranks: int, generation: int, give_up_ms: int) -> None:
        self.nranks = nranks
        self.generation = generation
        self.give_up_ms = give_up_ms
        self.gathering = True
        self.joined: dict[int, Joined] = {}
        self.tokens: dict[int, str] = {}
        """The process each member spoke for last: a fresh join under another is a restart."""
        self.ready: dict[Key, tuple[set[int], int]] = {}
        """Reported keys not released yet -> (the members that reported it, first report ms)."""
        self.order = 0
        """Entries released in the group's order so far."""
        self.tail: collections.deque[Key] = collections.deque(maxlen=HISTORY_KEPT)
        """The last keys of the order: what a join may lack, and what its reports may name."""
        self.abandoned: collections.OrderedDict[Key, None] = collections.OrderedDict()
        self._complete: list[Key] = []
        """Keys whose last report came since the last release, in that order."""
        self.veterans = False
        """A member joined with its history of an earlier generation: the group ran before
        this one, so a process that joins fresh now came after it (a restart), even where no
        entry was released yet and this sequencer never saw the rank's last process."""

    def join(self, member: int, message: Message, now_ms: int) -> Out:
        """A member joins this generation (its first message on a connection)."""
        fresh, queued = bool(message["fresh"]), int(message["queued"])
        tail = [_key(k) for k in message["tail"]]
        reported = [_key(k) for k in message["reported"]]
        restarted = fresh and self.tokens.get(member, message["token"]) != message["token"]
        self.tokens[member] = message["token"]
        self.veterans = self.veterans or not fresh
        out: Out = []
        if self.gathering:
            self.joined[member] = Joined(queued, tail, fresh)
            out.append((member, self._welcome(None)))
        elif fresh:
            self._forget(member)  # what its last process reported died with it
            out += self._fresh(member, restarted)
        else:  # welcomed first: a member that has not joined this generation ignores its releases
            out.append((member, self._welcome(None)))
            if not self._catch_up(member, queued, tail, out):
                return [(member, {"t": "reset", "g": self.generation})]
        out += self._count(member, reported, now_ms, joining=True)
        return out if self.gathering else out + self._release()

    def resume(self) -> Out:
        """Every live rank joined: the longest history is the order so far (see the module)."""
        self.gathering = False
        out: Out = []
        histories = [j for j in self.joined.values() if not j.fresh]
        if histories:
            longest = max(histories, key=lambda j: j.queued)
            self.order, self.tail = longest.queued, collections.deque(longest.tail, maxlen=HISTORY_KEPT)
        released = set(self.tail)
        for key in [key for key in self.ready if key in released]:
            del self.ready[key]  # a report of a key the old sequencer released: not again
        for member, joined in sorted(self.joined.items()):
            if joined.fresh:
                out += self._fresh(member, False)
            elif not self._catch_up(member, joined.queued, joined.tail, out):
                out.append((member, {"t": "reset", "g": self.generation}))
        return out + self._release()

    def hear(self, member: int, message: Message, now_ms: int) -> Out:
        """A ``ready`` or ``lost`` report of a joined member."""
        if message.get("g") != self.generation or member not in self.joined:
            return []
        keys = [_key(k) for k in message["keys"]]
        if message["t"] == "lost":
            return self._abandon(keys)
        out = self._count(member, keys, now_ms)
        return out if self.gathering else out + self._release()

    def left(self, member: int) -> None:
        """A member's connection closed: it joins again (with its history and its reports) when
        it comes back; a restarted process, with neither."""
        self.joined.pop(member, None)
        self._forget(member)

    def expire(self, now_ms: int) -> Out:
        """Give up keys that some ranks reported ``give_up_ms`` ago and the others never did (a
        task that never came on one rank, a rank that expired the entry)."""
        stale = [key for key, (_who, first_ms) in self.ready.items() if now_ms - first_ms >= self.give_up_ms]
        return self._abandon(stale) if stale else []

    # -- inside -----------------------------------------------------------------------------

    def _welcome(self, skip: int | None) -> Message:
        return {"t": "welcome", "g": self.generation, "skip": skip}

    def _fresh(self, member: int, restarted: bool) -> Out:
        """A process that never joined: it starts at the order so far. Where the group released
        something already, ran under an earlier generation, or the rank spoke with another
        process before, the rank restarted: the requests in flight are lost to it, and every
        member is told."""
        self.joined[member] = Joined(self.order, [])
        out: Out = [(member, self._welcome(self.order))]
        if restarted or self.order or self.veterans:
            out += self._broadcast({"t": "restarted", "g": self.generation, "rank": member})
        return out

    def _forget(self, member: int) -> None:
        for reporters, _first_ms in self.ready.values():
            reporters.discard(member)

    def _count(self, member: int, keys: list[Key], now_ms: int, joining: bool = False) -> Out:
        """Count ``member``'s reports; a key given up already is given up on it at once. A
        join's reports may name keys released while the member was away (its catch-up sends
        them): those are not counted again."""
        given_up = []
        released = set(self.tail) if joining and keys else set()
        for key in keys:
            if key in self.abandoned:
                given_up.append(key)
                continue
            if key in released:
                continue  # said again: it went already
            reporters, first_ms = self.ready.get(key, (set(), now_ms))
            reporters.add(member)
            self.ready[key] = (reporters, first_ms)
            if len(reporters) == self.nranks:
                self._complete.append(key)
        return [(member, _abandoning(self.generation, given_up))] if given_up else []

    def _catch_up(self, member: int, queued: int, tail: list[Key], out: Out) -> bool:
        """Send ``member`` the part of the order its history lacks; False when its history is not
        a prefix of the order, or lags past what the sequencer keeps."""
        lag = self.order - queued
        if lag < 0 or lag > len(self.tail):
            return False
        if tail and lag < len(self.tail) and self.tail[len(self.tail) - lag - 1] != tail[-1]:
            return False
        self.joined[member] = Joined(self.order, [])
        if lag:
            missing = list(self.tail)[len(self.tail) - lag :]
            out.append((member, {"t": "release", "g": self.generation, "keys": [list(k) for k in missing]}))
        return True

    def _release(self) -> Out:
        """Every key all members reported, in the order they became complete (the keys a call
        completed, not a scan of every key waiting: a backlog costs a message nothing)."""
        done = []
        for key in self._complete:
            waiting = self.ready.get(key)
            if waiting is not None and len(waiting[0]) >= self.nranks:  # still: none left since
                del self.ready[key]
                done.append(key)
        self._complete.clear()
        if not done:
            return []
        for key in done:
            self.tail.append(key)
        self.order += len(done)
        return self._broadcast({"t": "release", "g": self.generation, "keys": [list(k) for k in done]})

    def _abandon(self, keys: list[Key]) -> Out:
        """Give ``keys`` up on every member that may hold them; remember them for late reports."""
        for key in keys:
            self.abandoned[key] = None
        while len(self.abandoned) > ABANDONED_KEPT:
            self.abandoned.popitem(last=False)
        held = [key for key in keys if self.ready.pop(key, None) is not None]
        return self._broadcast(_abandoning(self.generation, held)) if held else []

    def broadcast(self, message: Message) -> Out:
        """``message`` to every joined member (what the transport has to say to all)."""
        return self._broadcast(message)

    def _broadcast(self, message: Message) -> Out:
        return [(member, message) for member in sorted(self.joined)]


def _abandoning(generation: int, keys: list[Key]) -> Message:
    return {"t": "abandon", "g": generation, "keys": [list(k) for k in keys]}
