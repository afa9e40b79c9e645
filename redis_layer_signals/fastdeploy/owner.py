"""The rank a process owns: it decides in memory, and keeps what Redis has not been told yet.

In FastDeploy's layout one process registers, feeds and finishes every task of its (instance,
rank). ``OwnedRank`` holds that rank's tasks and early layer-0 signals, decides each hook
call with FastDeploy's semantics, and counts every decision as the Lua functions would count the
same call (``delivered``, ``buffered``, ``superseded``, ``registered``, ``recovered``,
``dropped_<reason>``, ``occupied`` and ``replaced`` for a takeover, ``reregistered``,
``finished``, ``finish_dropped``, ``fenced``, ``expired``).

Time: every decision is dated on this host's monotonic clock, and every age and expiry is
measured on it, so a host wall clock off by minutes, or corrected while the process runs,
expires nothing early and keeps nothing late. What Redis stores is on the server's clock:
``take`` turns each time into it with the offset the last reply showed (``to_server``), and
``adopt`` turns Redis's times back (``to_mono``). The writer sends nothing before its first
reply (the claim), so a signal recorded while Redis was unreachable keeps the age it had.

A hook call does on the caller's thread only what its decision needs (per buffered entry, a
tuple of ints in a dict and a mark that its slot changed); what Redis stores (a signal's text, a
task's lease and document) is built by ``take``, on the writer's thread.

What Redis has not been told is kept compacted, so it stays bounded whatever an outage lasts:
the counters' increments (a Counter: exact, whatever their number), and per slot a mark that its
state changed, plus the fate of the one signal Redis holds for it, if the process ended that
signal (counted by Redis only while Redis still holds it: a reader's sweep that expired it
first counted it already). ``take`` turns that into one ``apply`` call (lua/apply.lua),
carrying each changed slot's state as it is *now*: its task, its pending signal. The bound is
the rank's slots, one signal each (the bridge keeps layer 0 only).

No I/O and no locking: the bridge calls it under its own lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ..models import CacheTask, DropReason
from ..protocol.calls import SlotState, encode_task
from .health import WaitHistogram
from .local import LocalTask, verdict_of

UNKNOWN = "?"
"""The holder Redis has for a slot, when the process does not know it (apply then counts no
override)."""


Early = tuple[int, str | None, int, int]
"""An early signal: (tokens, request_id or None, recorded_at_ms, deadline_ms), both times on the
monotonic clock. A tuple, the cheapest object to build: one is built per buffered entry."""
ToClock = Callable[[int], int]
"""Turns a time from one clock to the other (monotonic to the server's, or back)."""

NEVER = 1 << 62
"""The local sweep's next deadline when the rank holds no early signal."""
NO_FATE: tuple[str, str] = ("", "")
"""A changed slot's entry in ``OwnedRank._changed`` when no signal Redis holds ended."""


def stored(early: Early, to_server: ToClock) -> str:
    """An early signal as Redis stores it, "tokens,request_id,recorded_at,deadline", its times
    on the server's clock."""
    tokens, request_id, recorded_at_ms, deadline_ms = early
    return f"{tokens},{request_id or ''},{to_server(recorded_at_ms)},{to_server(deadline_ms)}"


def parse_stored(text: str, to_mono: ToClock) -> Early:
    """The inverse of ``stored``."""
    tokens, request_id, recorded_at_ms, deadline_ms = text.split(",")
    return int(tokens), request_id or None, to_mono(int(recorded_at_ms)), to_mono(int(deadline_ms))


@dataclass
class Batch:
    """What one ``apply`` call carries."""

    counts: dict[str, int]
    slots: list[SlotState]
    decisions: int
    """Hook decisions it writes (the lag it removes)."""
    everything: bool = False
    """It lists every slot of the rank."""


class OwnedRank:
    """The tasks and early layer-0 signals of one (instance, rank) that this process owns."""

    def __init__(self, pending_ttl_ms: int, task_ttl_ms: int) -> None:
        self.pending_ttl_ms = pending_ttl_ms
        self.task_ttl_ms = task_ttl_ms
        self.tasks: dict[int, LocalTask] = {}
        self._early: dict[int, Early] = {}
        self._next_deadline = NEVER
        """No early signal expires before this. It may be the deadline of a signal that ended
        since: the sweep then finds nothing to expire and moves it to the earliest live one."""
        self.counts: Counter[str] = Counter()
        """Counter increments not yet sent."""
        self._changed: dict[int, tuple[str, str]] = {}
        """Slots whose state changed since the last take -> (fate, text as Redis holds it) of
        the signal Redis holds that the process ended meanwhile (``NO_FATE`` when none)."""
        self._redis_holder: dict[int, str] = {}
        """The holder the process last sent per slot ('' none)."""
        self._redis_pending: dict[int, Early] = {}
        """The pending signal the process last sent per slot."""
        self._redis_text: dict[int, str] = {}
        """... and its text, as Redis holds it (times on the server's clock)."""
        self.held_back: set[int] = set()
        """Slots whose task registered while the process could not be sure it still owned the
        rank (``shared_usable`` False) and whose early signal Redis holds: handed out by
        ``settle_held_back`` once the claim is renewed, given up by ``disown`` if it is lost."""
        self.decisions = 0
        """Hook decisions since the last take."""
        self.in_flight: Batch | None = None
        """The batch taken and not yet confirmed written."""
        self.early_wait = WaitHistogram()
        """How long each early signal handed to its task had waited for it."""

    # -- what the hooks decide ----------------------------------------------------------

    def record(
        self, entries: Iterable[tuple[int, int]], request_ids: Mapping[int, str] | None, now_ms: int
    ) -> tuple[list[tuple[int, int]], int]:
        """Deliver each entry whose slot holds a task of this process (of its request, when
        ``request_ids`` names one for the slot), keep the others (newest wins). Returns the
        delivered entries to queue, and how many delivered entries it leaves out because one as
        far along was queued for the same request already (the sender has their blocks)."""
        self.expire(now_ms)
        self.decisions += 1
        tasks, early, changed = self.tasks, self._early, self._changed
        deadline = now_ms + self.pending_ttl_ms
        to_queue: list[tuple[int, int]] = []
        delivered = buffered = suppressed = 0
        for slot, tokens in entries:
            request_id = None if request_ids is None else request_ids.get(slot)
            holder = tasks.get(slot)
            if holder is not None and (request_id is None or request_id == holder.task.request_id):
                delivered += 1
                if tokens <= holder.queued_tokens:
                    suppressed += 1
                else:
                    holder.queued_tokens = tokens
                    to_queue.append((slot, tokens))
                continue
            buffered += 1
            if slot in early:
                self._end(slot, "superseded")
            early[slot] = (tokens, request_id, now_ms, deadline)
            changed.setdefault(slot, NO_FATE)
        if delivered:
            self.counts["delivered"] += delivered
        if buffered:
            self.counts["buffered"] += buffered
            self._next_deadline = min(self._next_deadline, deadline)
        return to_queue, suppressed

    def register(
        self, task: CacheTask, now_ms: int, shared_usable: Callable[[], bool] = lambda: True
    ) -> tuple[str | None, int | None, DropReason | None]:
        """Make ``task`` the slot's holder and pop its early signal, as register.lua does.
        Returns (the request it took the slot from or None, the early signal's tokens or None,
        why it must not be sent or None: else the caller queues it, counted as queued for the
        task). The same request again changes nothing (``reregistered``). When ``shared_usable()``
        says no (the process's lease on the rank may have ended), an early signal that Redis
        holds stays where it is (``held_back``): another owner may have adopted it."""
        self.expire(now_ms)
        self.decisions += 1
        slot = task.slot
        holder = self.tasks.get(slot)
        if holder is not None and holder.task.request_id == task.request_id:
            self.counts["reregistered"] += 1
            return None, None, None
        taken_from = None
        if holder is not None:
            taken_from = holder.task.request_id
            self.counts["occupied"] += 1  # the bridge's first, refused, attempt
            self.counts["replaced"] += 1
        self.counts["registered"] += 1
        local = LocalTask(task, registered_at_ms=now_ms)
        self.tasks[slot] = local
        self._changed.setdefault(slot, NO_FATE)
        early = self._early.get(slot)
        if early is None:
            return taken_from, None, None
        if self._redis_pending.get(slot) == early and not shared_usable():
            self.held_back.add(slot)
            return taken_from, None, None
        reason = self._pop_for(local, early, now_ms)
        return taken_from, early[0], reason

    def _pop_for(self, local: LocalTask, early: Early, now_ms: int) -> DropReason | None:
        """Hand the slot's early signal to its task (or drop it, with the reason)."""
        tokens, request_id, recorded_at_ms, deadline_ms = early
        reason = verdict_of(tokens, request_id, deadline_ms, local.task, now_ms)
        self._end(local.task.slot, "recovered" if reason is None else f"dropped_{reason.value}")
        local.recovery = (tokens, request_id, recorded_at_ms, reason.value if reason else "")
        if reason is None:
            local.queued_tokens = max(local.queued_tokens, tokens)
            self.early_wait.observe((now_ms - recorded_at_ms) / 1000)
        return reason

    def settle_held_back(self, now_ms: int) -> tuple[list[tuple[int, int]], list[tuple[CacheTask, int, DropReason]]]:
        """The claim was renewed: the early signals held back are handed to their tasks now (or
        dropped). Returns the entries to queue and the drops to log."""
        queued: list[tuple[int, int]] = []
        dropped: list[tuple[CacheTask, int, DropReason]] = []
        for slot in sorted(self.held_back):
            early, local = self._early.get(slot), self.tasks.get(slot)
            if early is None or local is None:
                continue  # expired or finished meanwhile, counted then
            before = local.queued_tokens
            reason = self._pop_for(local, early, now_ms)
            if reason is not None:
                dropped.append((local.task, early[0], reason))
            elif early[0] > before:
                queued.append((slot, early[0]))
        self.held_back.clear()
        return queued, dropped

    def disown(self) -> int:
        """The rank has another owner now (the server refused this process's write or
        renewal): the early signals Redis holds as this process wrote them are the new owner's
        (it adopted them), so this process gives them up, uncounted here; what Redis holds is
        unknown from now on. Returns how many it gave up. The process's own tasks and the
        signals only it has seen stay: it serves its process locally."""
        given_up = 0
        for slot, early in list(self._early.items()):
            if self._redis_pending.get(slot) == early:
                del self._early[slot]
                given_up += 1
        self._redis_pending.clear()
        self._redis_text.clear()
        self._redis_holder.clear()
        self.held_back.clear()
        for slot, (fate, _text) in list(self._changed.items()):
            if fate:
                self._changed[slot] = NO_FATE
        return given_up

    def finish(self, slot: int, request_id: str, now_ms: int) -> tuple[bool, int, bool]:
        """As finish.lua: (removed, dropped, fenced)."""
        self.expire(now_ms)
        self.decisions += 1
        holder = self.tasks.get(slot)
        if holder is not None and holder.task.request_id != request_id:
            self.counts["fenced"] += 1
            return False, 0, True
        removed = holder is not None
        if removed:
            del self.tasks[slot]
            self.counts["finished"] += 1
            self._changed.setdefault(slot, NO_FATE)
        early = self._early.get(slot)
        dropped = early is not None and early[1] in (None, request_id)
        if dropped:
            self._end(slot, "finish_dropped")
        return removed, int(dropped), False

    def expire(self, now_ms: int) -> None:
        """The local sweep: early signals whose deadline has passed end as ``expired``. Costs a
        comparison until the earliest deadline passes, then one pass over the rank's signals."""
        if now_ms < self._next_deadline:
            return
        following = NEVER
        for slot, early in list(self._early.items()):
            if early[3] <= now_ms:
                self._end(slot, "expired")
            else:
                following = min(following, early[3])
        self._next_deadline = following

    def pending_here(self) -> int:
        """Early signals Redis has not been told about yet."""
        return sum(1 for slot, early in self._early.items() if self._redis_pending.get(slot) != early)

    # -- what Redis has not been told ---------------------------------------------------

    def unwritten(self) -> bool:
        """Something to send: a changed slot, a counter, or a decision that changed neither (a
        finish of an empty slot: its call confirms it, so the lag it counts ends)."""
        return bool(self.decisions) or bool(self._changed) or any(self.counts.values())

    def unwritten_counts(self) -> dict[str, int]:
        """The counters' increments Redis does not hold yet (the batch in flight included),
        ``recorded`` summed as Redis's readers sum it, and ``shared_taken``: signals Redis holds
        that the process ended (their fate is counted once Redis hears of it)."""
        counts = Counter({name: n for name, n in self.counts.items() if n})
        taken = sum(1 for fate, _value in self._changed.values() if fate)
        if self.in_flight is not None:
            counts.update(self.in_flight.counts)
            taken += sum(1 for state in self.in_flight.slots if state[6])
        if counts["delivered"] or counts["buffered"]:
            counts["recorded"] = counts["delivered"] + counts["buffered"]
        if taken:
            counts["shared_taken"] = taken
        return {name: n for name, n in counts.items() if n}

    def written(self) -> None:
        """Redis confirmed the batch in flight."""
        self.in_flight = None

    def give_back(self) -> None:
        """The batch in flight will never be confirmed (the writer met a bug of its own before
        Redis had it): its counters and its slots' fates go with the next batch. The caller
        has the next batch list every slot, since what the process believes Redis holds was
        updated when the batch was taken."""
        batch, self.in_flight = self.in_flight, None
        if batch is None:
            return
        self.counts.update(batch.counts)
        self.decisions += batch.decisions
        for state in batch.slots:
            fate, value = state[6], state[7]
            self._changed.setdefault(int(state[0]), (fate, value) if fate else NO_FATE)

    def believed(self) -> tuple[int, int]:
        """The tasks and pending signals Redis holds for the rank, as far as the process knows
        (what ``apply`` reports after the last batch, unless Redis lost or kept others)."""
        return sum(1 for holder in self._redis_holder.values() if holder), len(self._redis_pending)

    def take(self, to_server: ToClock, every_slot: bool = False, also: range = range(0)) -> Batch:
        """Everything not yet sent, as one ``apply`` call's content, its times on the server's
        clock (``to_server``); from now on the process counts on Redis holding it (the writer
        sends it until Redis has it). ``every_slot``: also the slots that did not change (after
        Redis may have lost them: a restart); ``also``: these slots too (every slot of the rank,
        when Redis holds what the process does not know of)."""
        slots = set(self._changed) | set(also)
        if every_slot:
            slots |= set(self.tasks) | set(self._early) | {s for s, h in self._redis_holder.items() if h}
        states: list[SlotState] = []
        for slot in sorted(slots):
            fate, value = self._changed.get(slot, NO_FATE)
            holder = self.tasks.get(slot)
            prior = self._redis_holder.get(slot, UNKNOWN)
            if holder is None:
                lease = doc = recovery = ""
                self._redis_holder[slot] = ""
            else:
                task = holder.task
                lease = f"{to_server(holder.registered_at_ms + self.task_ttl_ms):016d}|{task.request_id}"
                doc, recovery = encode_task(task), _recovery_text(holder.recovery, to_server)
                self._redis_holder[slot] = task.request_id
            early = self._early.get(slot)
            if early is None:
                pending = ""
                self._redis_pending.pop(slot, None)
                self._redis_text.pop(slot, None)
            else:
                # Sent before: the same text (the fate check compares it).
                sent = self._redis_pending.get(slot) == early
                pending = self._redis_text[slot] if sent else stored(early, to_server)
                self._redis_pending[slot] = early
                self._redis_text[slot] = pending
            states.append((str(slot), prior, lease, doc, recovery, pending, fate, value))
        batch = Batch({name: n for name, n in self.counts.items() if n}, states, self.decisions, len(also) > 0)
        self.in_flight = batch
        self.counts.clear()
        self._changed.clear()
        self.decisions = 0
        return batch

    def adopt(
        self, pending: dict[int, str], holders: dict[int, str], now_ms: int, to_mono: ToClock, keep_early: bool = True
    ) -> list[tuple[int, int]]:
        """Once the process owns the rank, what an earlier process of it left in Redis: its early
        signals become this process's (a signal survives a restart of the messager); its tasks
        are no task of this process, so their slots are marked changed (the process's state
        wins: apply removes them and counts each as overridden).

        The hooks decided in the process before this (the writer adopts without holding up a
        start): a slot that has an early signal of the process since ends Redis's one as
        superseded; one whose task registered here since hands it to that task as register
        would have, or drops it with the reason. Returns those late recoveries, to queue.

        Without ``keep_early`` (a tensor-parallel rank, whose entries come only from the GPU's
        stream every rank reads, so that no rank's adoption races its own hooks) the early
        signals end as ``expired``. Redis's times come back on the monotonic clock
        (``to_mono``), so that their age keeps counting in the process."""
        late: list[tuple[int, int]] = []
        for slot, text in pending.items():
            if self._redis_text.get(slot) == text and self._early.get(slot) == self._redis_pending.get(slot):
                continue  # this process's own (it held the rank before, and claims it again)
            early = parse_stored(text, to_mono)
            self._redis_pending[slot] = early
            self._redis_text[slot] = text
            if not keep_early:
                self._changed[slot] = ("expired", text)
                continue
            if slot in self._early:
                self._changed[slot] = ("superseded", text)
                continue
            holder = self.tasks.get(slot)
            if holder is not None:
                tokens, request_id, recorded_at_ms, deadline_ms = early
                reason = verdict_of(tokens, request_id, deadline_ms, holder.task, now_ms)
                self._changed[slot] = ("recovered" if reason is None else f"dropped_{reason.value}", text)
                holder.recovery = (tokens, request_id, recorded_at_ms, reason.value if reason else "")
                if reason is None and tokens > holder.queued_tokens:
                    holder.queued_tokens = tokens
                    late.append((slot, tokens))
                continue
            self._early[slot] = early
            self._next_deadline = min(self._next_deadline, early[3])
        for slot, request_id in holders.items():
            holder = self.tasks.get(slot)
            if holder is not None and holder.task.request_id == request_id:
                self._redis_holder[slot] = request_id  # this process's own
                continue
            self._redis_holder[slot] = ""  # none of this process's: found there, counted overridden
            self._changed.setdefault(slot, NO_FATE)
        self.expire(now_ms)
        return late

    # -- inside -------------------------------------------------------------------------

    def held(self) -> int:
        """Entries the rank's state holds (tasks, early signals, what is not written yet):
        bounded by the slots, whatever an outage lasts."""
        return len(self.tasks) + len(self._early) + len(self._changed) + len(self.counts)

    def _end(self, slot: int, fate: str) -> None:
        """The slot's early signal ends as ``fate``: counted now if Redis never heard of it,
        else by apply, once, if Redis still holds it."""
        early = self._early.pop(slot, None)
        if early is None:
            return
        if self._redis_pending.get(slot) == early:
            self._changed[slot] = (fate, self._redis_text[slot])
        else:
            self.counts[fate] += 1
            self._changed.setdefault(slot, NO_FATE)


def _recovery_text(recovery: tuple[int, str | None, int, str] | None, to_server: ToClock) -> str:
    """What register.lua keeps as a task's first recovery, from ``LocalTask.recovery``."""
    if recovery is None:
        return ""
    tokens, request_id, recorded_at_ms, reason = recovery
    return f"0,{tokens},{request_id or ''},{to_server(recorded_at_ms)},{reason};"
