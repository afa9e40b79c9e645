"""A small model checker for what a tensor-parallel group queues for layer 0, and the rules it
judges.

Every rank of a group reads the same GPU stream of layer-0 messages and registers the same
cache tasks in the same order; how a rank interleaves the two is its own, and so is the time
each of its messages to the others takes. FastDeploy's sender pairs batch ``i`` of every rank at
a barrier, so the ranks must queue the same batches in the same order. ``explore`` walks every
interleaving of a rule on a workload, breadth first (so a counterexample is a shortest one), and
checks in every reachable state:

- **same batches**: any two ranks' queues agree on the batches both hold (one is a prefix of
  the other);
- **once**: no rank queues an entry of the stream twice;
- **slot order**: a rank queues the entries of one slot in the GPU's order (a later chunk never
  overtakes an earlier one);
- **registered** (``Implemented`` only): a rank queues an entry only once its task is registered
  on the rank (FastDeploy's sender asserts it, or waits for it);

and in every state where nothing is left to happen (every message read, every task registered,
every message between ranks delivered):

- **served**: every rank has queued, for every request that registered, the entry that
  carries its last chunk, without any time-out: no request waits on another request's task
  (an aborted request's entry may never be queued, but it holds nothing back).

No rule is given a timer: a give-up after ``pending_ttl_s`` (60 s) is far past the 0.2 s a
request may wait on another, so a rule that needs one to move on fails **served**.
"""

from __future__ import annotations

import collections
import copy
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar

Entry = tuple[int, int]
"""(slot, tokens): one entry of a layer-0 message."""
Batch = tuple[int, ...]
"""The stream positions of the entries one queued batch holds."""


@dataclass(frozen=True)
class Request:
    slot: int
    request_id: str
    need: int


@dataclass(frozen=True)
class Workload:
    """The GPU's layer-0 messages and the registrations, in the orders every rank shares.
    A slot with entries but no registration is an aborted request."""

    messages: tuple[tuple[Entry, ...], ...]
    registrations: tuple[Request, ...]

    @property
    def stream(self) -> tuple[Entry, ...]:
        return tuple(entry for message in self.messages for entry in message)

    def positions(self, message: int) -> range:
        """The stream positions of ``message``'s entries."""
        start = sum(len(m) for m in self.messages[:message])
        return range(start, start + len(self.messages[message]))

    def owed(self) -> dict[int, int]:
        """Request slot -> the stream position of its last entry: what **served** asks every
        rank to have queued (when it fits the task's need)."""
        last: dict[int, int] = {}
        for position, (slot, _tokens) in enumerate(self.stream):
            last[slot] = position
        needs = {r.slot: r.need for r in self.registrations}
        stream = self.stream
        return {slot: pos for slot, pos in last.items() if slot in needs and 0 < stream[pos][1] <= needs[slot]}


@dataclass(frozen=True)
class Cursor:
    """How far one rank has read its two streams."""

    message: int = 0
    registration: int = 0


S = TypeVar("S")


class Rule(Protocol[S]):
    """A rule for what a rank queues, as a transition system over an immutable state."""

    name: str

    def initial(self, workload: Workload, nranks: int) -> S: ...

    def moves(self, workload: Workload, state: S) -> Iterator[tuple[str, S]]:
        """Every step that can happen next, each with a label for counterexamples."""
        ...

    def queues(self, state: S) -> tuple[tuple[Batch, ...], ...]:
        """What each rank has queued so far."""
        ...


@dataclass
class Verdict(Generic[S]):
    rule: str
    states: int
    violation: str | None = None
    trace: list[str] | None = None

    def explain(self) -> str:
        if self.violation is None:
            return f"{self.rule}: holds over {self.states} states"
        steps = "\n".join(f"  {n + 1}. {label}" for n, label in enumerate(self.trace or []))
        return f"{self.rule}: {self.violation}, after\n{steps}"


def check_state(workload: Workload, queues: Sequence[tuple[Batch, ...]]) -> str | None:
    """The safety properties of one state, or what breaks them."""
    stream = workload.stream
    contents = [[tuple(stream[p] for p in batch) for batch in queue] for queue in queues]
    for a in range(len(queues)):
        for b in range(a + 1, len(queues)):
            for i, (x, y) in enumerate(zip(contents[a], contents[b], strict=False)):
                if x != y:
                    return f"same batches: batch {i} is {list(x)} on rank {a} but {list(y)} on rank {b}"
    for rank, queue in enumerate(queues):
        seen: set[int] = set()
        last_of_slot: dict[int, int] = {}
        for batch in queue:
            for position in batch:
                if position in seen:
                    return f"once: rank {rank} queued stream entry {position} {stream[position]} twice"
                seen.add(position)
                slot = stream[position][0]
                if last_of_slot.get(slot, -1) > position:
                    return f"slot order: rank {rank} queued slot {slot}'s entry {position} after a later one"
                last_of_slot[slot] = position
    return None


def check_final(
    workload: Workload, queues: Sequence[tuple[Batch, ...]], exempt: frozenset[int] = frozenset()
) -> str | None:
    """**served**, in a state where nothing is left to happen: every rank queued as many
    batches, and every registered request's last entry (but the ``exempt`` slots': requests
    in flight when a rank restarted)."""
    lengths = {len(queue) for queue in queues}
    if len(lengths) > 1:
        return f"served: the ranks queued {[len(q) for q in queues]} batches: a barrier waits forever"
    owed = {slot: position for slot, position in workload.owed().items() if slot not in exempt}
    for rank, queue in enumerate(queues):
        queued = {position for batch in queue for position in batch}
        for slot, position in sorted(owed.items()):
            if position not in queued:
                return f"served: rank {rank} never queued slot {slot}'s last entry {workload.stream[position]}"
    return None


def explore(rule: Rule[S], workload: Workload, nranks: int, limit: int = 2_000_000) -> Verdict[S]:
    """Every interleaving of ``rule`` on ``workload`` at ``nranks``, breadth first."""
    start = rule.initial(workload, nranks)
    parent: dict[S, tuple[S, str] | None] = {start: None}
    frontier: collections.deque[S] = collections.deque([start])

    def trace(state: S) -> list[str]:
        labels = []
        link = parent[state]
        while link is not None:
            state, label = link
            labels.append(label)
            link = parent[state]
        return labels[::-1]

    while frontier:
        state = frontier.popleft()
        queues = rule.queues(state)
        broken = check_state(workload, queues) or getattr(state, "broken", None)
        if broken is None:
            steps = list(rule.moves(workload, state))
            if not steps:
                exempt = rule.exempt(workload, state) if isinstance(rule, Implemented) else frozenset()
                broken = check_final(workload, queues, exempt)
        if broken is not None:
            return Verdict(rule.name, len(parent), broken, trace(state))
        for label, following in steps:
            if following not in parent:
                if len(parent) >= limit:
                    raise RuntimeError(f"{rule.name}: more than {limit} states")
                parent[following] = (state, label)
                frontier.append(following)
    return Verdict(rule.name, len(parent))


# -- the rules -------------------------------------------------------------------------------------


def _verdict_ok(workload: Workload, position: int, request: Request) -> bool:
    """The task's verdict on an entry: sent when its tokens are in (0, need]."""
    tokens = workload.stream[position][1]
    return 0 < tokens <= request.need


@dataclass(frozen=True)
class Local:
    """One rank of a rule that decides alone: its cursor, tasks, waiting entries and queue."""

    cursor: Cursor = Cursor()
    tasks: frozenset[int] = frozenset()
    waiting: tuple[tuple[int, int], ...] = ()
    """(slot, stream position), in the order the rule keeps them."""
    queue: tuple[Batch, ...] = ()


class LocalRule:
    """A rule each rank runs on its own streams, with no message to the others."""

    name = "local"

    def initial(self, workload: Workload, nranks: int) -> tuple[Local, ...]:
        return tuple(Local() for _ in range(nranks))

    def queues(self, state: tuple[Local, ...]) -> tuple[tuple[Batch, ...], ...]:
        return tuple(rank.queue for rank in state)

    def moves(self, workload: Workload, state: tuple[Local, ...]) -> Iterator[tuple[str, tuple[Local, ...]]]:
        for r, rank in enumerate(state):
            for label, following in self.rank_moves(workload, rank):
                yield f"rank {r}: {label}", (*state[:r], following, *state[r + 1 :])

    def rank_moves(self, workload: Workload, rank: Local) -> Iterator[tuple[str, Local]]:
        cursor = rank.cursor
        if cursor.message < len(workload.messages):
            entries = [(workload.stream[p][0], p) for p in workload.positions(cursor.message)]
            moved = replace(rank, cursor=replace(cursor, message=cursor.message + 1))
            yield f"reads message {list(workload.messages[cursor.message])}", self.on_message(workload, moved, entries)
        if cursor.registration < len(workload.registrations):
            request = workload.registrations[cursor.registration]
            moved = replace(rank, cursor=replace(cursor, registration=cursor.registration + 1))
            moved = replace(moved, tasks=moved.tasks | {request.slot})
            yield f"registers slot {request.slot}", self.on_register(workload, moved, request)

    def on_message(self, workload: Workload, rank: Local, entries: list[tuple[int, int]]) -> Local:
        raise NotImplementedError

    def on_register(self, workload: Workload, rank: Local, request: Request) -> Local:
        raise NotImplementedError


def _request(workload: Workload, slot: int) -> Request:
    return next(r for r in workload.registrations if r.slot == slot)


def _newest_wins(waiting: tuple[tuple[int, int], ...], slot: int, position: int) -> tuple[tuple[int, int], ...]:
    """A dict keyed by slot, updated in place (an existing key keeps its place), as Python's."""
    if any(s == slot for s, _ in waiting):
        return tuple((s, position if s == slot else p) for s, p in waiting)
    return (*waiting, (slot, position))


class ReadySplit(LocalRule):
    """FastDeploy release/2.6 with PR 7872: a message's entries whose task is registered go out
    as one batch now; the others wait in a dict (newest per slot wins) and each is queued alone
    when its task registers, unless it claims more tokens than the task needs."""

    name = "7872 (ready now, the rest on registration)"

    def on_message(self, workload: Workload, rank: Local, entries: list[tuple[int, int]]) -> Local:
        ready = tuple(p for s, p in entries if s in rank.tasks)
        waiting = rank.waiting
        for s, p in entries:
            if s not in rank.tasks:
                waiting = _newest_wins(waiting, s, p)
        queue = (*rank.queue, ready) if ready else rank.queue
        return replace(rank, waiting=waiting, queue=queue)

    def on_register(self, workload: Workload, rank: Local, request: Request) -> Local:
        held = [p for s, p in rank.waiting if s == request.slot]
        waiting = tuple((s, p) for s, p in rank.waiting if s != request.slot)
        queue = rank.queue
        if held and _verdict_ok(workload, held[0], request):
            queue = (*queue, (held[0],))
        return replace(rank, waiting=waiting, queue=queue)


class AllPending(ReadySplit):
    """The rule after FastDeploy PR 8034/8035, as modelled: every entry goes to the dict
    (newest per slot wins), and only the adder takes entries out, one batch each, when it
    registers a task and on every turn of its polling loop (a move of its own here)."""

    name = "8035 (everything through the adder's dict)"

    def on_message(self, workload: Workload, rank: Local, entries: list[tuple[int, int]]) -> Local:
        waiting = rank.waiting
        for s, p in entries:
            waiting = _newest_wins(waiting, s, p)
        return replace(rank, waiting=waiting)

    def on_register(self, workload: Workload, rank: Local, request: Request) -> Local:
        return self.poll(workload, rank)

    def poll(self, workload: Workload, rank: Local) -> Local:
        taken = [(s, p) for s, p in rank.waiting if s in rank.tasks]
        waiting = tuple((s, p) for s, p in rank.waiting if s not in rank.tasks)
        queue = rank.queue
        for s, p in taken:
            if _verdict_ok(workload, p, _request(workload, s)):
                queue = (*queue, (p,))
        return replace(rank, waiting=waiting, queue=queue)

    def rank_moves(self, workload: Workload, rank: Local) -> Iterator[tuple[str, Local]]:
        yield from super().rank_moves(workload, rank)
        if any(s in rank.tasks for s, _ in rank.waiting):
            yield "adder polls the dict", self.poll(workload, rank)


class StrictOrder(LocalRule):
    """The bridge's group rule before this change: every entry its own batch, released in the
    GPU's order, the head first, once its task is registered on the rank. A head whose task
    never comes is given up only by a vote through Redis after ``pending_ttl_s``, which no
    request may wait for, so the model has no such move."""

    name = "strict GPU order (the head waits for its task)"

    def on_message(self, workload: Workload, rank: Local, entries: list[tuple[int, int]]) -> Local:
        return self.advance(workload, replace(rank, waiting=(*rank.waiting, *entries)))

    def on_register(self, workload: Workload, rank: Local, request: Request) -> Local:
        return self.advance(workload, rank)

    def advance(self, workload: Workload, rank: Local) -> Local:
        waiting, queue = list(rank.waiting), rank.queue
        while waiting and waiting[0][0] in rank.tasks:
            slot, position = waiting.pop(0)
            if _verdict_ok(workload, position, _request(workload, slot)):
                queue = (*queue, (position,))
        return replace(rank, waiting=tuple(waiting), queue=queue)


@dataclass(frozen=True)
class Member:
    """One rank under ``ReadyByAll``: what it read, and what it told the group."""

    cursor: Cursor = Cursor()
    tasks: frozenset[int] = frozenset()
    seen: frozenset[int] = frozenset()
    """Stream positions read and not yet found ready."""
    reported: frozenset[int] = frozenset()
    """Found ready (reported, or to report once connected) and not queued yet."""
    queue: tuple[Batch, ...] = ()
    generation: int = 0
    """The sequencer generation this rank has joined."""


Report = tuple[int, ...]
"""``(position,)``: a ready report; ``(-1, len(history), *history, *reported)`` packed as a
join: what the rank queued, in order, and what it reported and has not queued."""


@dataclass(frozen=True)
class Agreement:
    """``ReadyByAll``'s whole state: the members, the channels and the sequencer."""

    members: tuple[Member, ...]
    up: tuple[tuple[Report, ...], ...]
    """Per member, the reports on their way to the sequencer (FIFO, one connection)."""
    down: tuple[tuple[int, ...], ...]
    """Per member, the releases on their way from the sequencer (FIFO)."""
    ready: tuple[tuple[int, frozenset[int]], ...] = ()
    """Stream position -> the members that reported it ready (sorted by position)."""
    released: tuple[int, ...] = ()
    """The group's order: what every member queues, in this order."""
    generation: int = 0
    joins: tuple[tuple[int, tuple[int, ...]], ...] | None = None
    """While a new sequencer gathers the ranks (None once all joined): rank -> its history."""
    crashes_left: int = 0


class ReadyByAll:
    """The rule proposed for the group: each rank reports an entry ready once it has read it and
    its task is registered there (an entry the task refuses is never reported); one sequencer
    for the instance (a thread of one rank's process, over a socket only the instance's
    processes reach) releases an entry once every rank reported it, and tells every rank, in
    one order. An aborted request is never ready, so it holds nothing back; a task late on one
    rank holds back its own request only. Nothing here travels through Redis.

    The sequencer may die (``crashes`` times), losing its state and every message in flight. A
    new one (a new generation) waits until every rank has joined with what it queued, in order,
    and what it reported and has not queued; the longest history is the group's order so far
    (they are prefixes of one order), each rank is sent what its own lacks, and the reports are
    counted again."""

    def __init__(self, crashes: int = 0) -> None:
        self.crashes = crashes
        self.name = "ready on every rank, one sequencer's order" + (
            f" ({crashes} sequencer restart{'s' if crashes > 1 else ''})" if crashes else ""
        )

    def initial(self, workload: Workload, nranks: int) -> Agreement:
        return Agreement(
            tuple(Member() for _ in range(nranks)), ((),) * nranks, ((),) * nranks, crashes_left=self.crashes
        )

    def queues(self, state: Agreement) -> tuple[tuple[Batch, ...], ...]:
        return tuple(member.queue for member in state.members)

    def moves(self, workload: Workload, state: Agreement) -> Iterator[tuple[str, Agreement]]:
        for r, member in enumerate(state.members):
            cursor = member.cursor
            if cursor.message < len(workload.messages):
                read = frozenset(workload.positions(cursor.message))
                moved = replace(member, cursor=replace(cursor, message=cursor.message + 1), seen=member.seen | read)
                yield (
                    f"rank {r}: reads message {list(workload.messages[cursor.message])}",
                    self._report(workload, state, r, moved),
                )
            if cursor.registration < len(workload.registrations):
                request = workload.registrations[cursor.registration]
                moved = replace(
                    member,
                    cursor=replace(cursor, registration=cursor.registration + 1),
                    tasks=member.tasks | {request.slot},
                )
                yield f"rank {r}: registers slot {request.slot}", self._report(workload, state, r, moved)
            if member.generation < state.generation:
                history = tuple(p for batch in member.queue for p in batch)
                join = (-1, len(history), *history, *sorted(member.reported))
                yield (
                    f"rank {r}: joins generation {state.generation}",
                    replace(
                        state,
                        members=_put(state.members, r, replace(member, generation=state.generation)),
                        up=_put(state.up, r, (*state.up[r], join)),
                    ),
                )
            if state.up[r]:
                yield f"sequencer: hears rank {r} {_describe(state.up[r][0])}", self._hear(state, r)
            if state.down[r]:
                position, *rest = state.down[r]
                queued = replace(member, queue=(*member.queue, (position,)), reported=member.reported - {position})
                yield (
                    f"rank {r}: queues {position}",
                    replace(
                        state,
                        members=_put(state.members, r, queued),
                        down=_put(state.down, r, tuple(rest)),
                    ),
                )
        if state.crashes_left:
            nranks = len(state.members)
            yield (
                "sequencer dies: its state and every message in flight are lost",
                Agreement(
                    state.members,
                    ((),) * nranks,
                    ((),) * nranks,
                    generation=state.generation + 1,
                    joins=(),
                    crashes_left=state.crashes_left - 1,
                ),
            )

    def _report(self, workload: Workload, state: Agreement, r: int, member: Member) -> Agreement:
        """The rank reports, in stream order, what it has read whose task is now registered;
        an entry its task refuses is dropped here, as on every rank (the task is the same). A
        rank not joined to the current sequencer keeps them for its join."""
        stream = workload.stream
        ready = sorted(p for p in member.seen if stream[p][0] in member.tasks)
        sendable = tuple(p for p in ready if _verdict_ok(workload, p, _request(workload, stream[p][0])))
        member = replace(member, seen=member.seen - set(ready), reported=member.reported | set(sendable))
        up = state.up
        if member.generation == state.generation:
            up = _put(up, r, (*up[r], *((p,) for p in sendable)))
        return replace(state, members=_put(state.members, r, member), up=up)

    def _hear(self, state: Agreement, r: int) -> Agreement:
        report, *rest = state.up[r]
        state = replace(state, up=_put(state.up, r, tuple(rest)))
        ready = dict(state.ready)
        if report[0] >= 0:
            reported: tuple[int, ...] = report
        else:
            size = report[1]
            history, reported = report[2 : 2 + size], report[2 + size :]
            if state.joins is not None:
                state = replace(state, joins=(*state.joins, (r, history)))
        for position in reported:
            ready[position] = ready.get(position, frozenset()) | {r}
        state = replace(state, ready=tuple(sorted(ready.items())))
        if state.joins is not None and len(state.joins) == len(state.members):
            state = self._resume(state)
        return state if state.joins is not None else self._release(state)

    def _resume(self, state: Agreement) -> Agreement:
        """Every rank joined: the longest history is the order so far; each rank is sent what
        its own lacks."""
        assert state.joins is not None
        histories = dict(state.joins)
        order = max(histories.values(), key=len)
        down = tuple((*state.down[r], *order[len(histories[r]) :]) for r in range(len(state.members)))
        return replace(state, joins=None, released=order, down=down)

    def _release(self, state: Agreement) -> Agreement:
        """Every entry all ranks reported, in stream order, once."""
        nranks = len(state.members)
        complete = [p for p, reporters in state.ready if len(reporters) == nranks]
        ready = tuple((p, reporters) for p, reporters in state.ready if len(reporters) < nranks)
        fresh = tuple(p for p in complete if p not in state.released)
        down = tuple((*queue, *fresh) for queue in state.down)
        return replace(state, ready=ready, down=down, released=(*state.released, *fresh))


def _describe(report: Report) -> str:
    if report[0] >= 0:
        return f"ready {report[0]}"
    size = report[1]
    return f"join (queued {list(report[2 : 2 + size])}, reported {list(report[2 + size :])})"


T = TypeVar("T")


def _put(items: tuple[T, ...], index: int, item: T) -> tuple[T, ...]:
    return (*items[:index], item, *items[index + 1 :])


# -- the implementation, held to the model --------------------------------------------------------


class Implemented:
    """The group's real code (``redis_layer_signals.fastdeploy.agreement``: ``Member`` and
    ``Sequencer``) run as a rule: every move calls the classes the bridge runs, and the channels
    between them behave as ``group_link``'s (one FIFO line per rank; a join carries every report
    made before it, the reports made after it wait until the welcome and then go, once).

    ``crashes``: the sequencer may die that many times, anywhere (a new generation gathers every
    rank's join). ``restarts``: a rank's process may restart that many times, anywhere: the new
    process reads the streams on from where they are, and ``served`` then owes only the requests
    registered on every rank after every rank heard of the restart (the others were in flight:
    they may be dropped, but by every rank or by none)."""

    def __init__(self, crashes: int = 0, restarts: int = 0, forming: bool = False) -> None:
        self.crashes, self.restarts, self.forming = crashes, restarts, forming
        extra = [f"{crashes} sequencer restart(s)"] if crashes else []
        extra += ["the group forming: every join and welcome a move"] if forming else []
        extra += [f"{restarts} rank restart(s)"] if restarts else []
        self.name = "the implementation (agreement.Member, agreement.Sequencer)" + (
            f" ({', '.join(extra)})" if extra else ""
        )

    def initial(self, workload: Workload, nranks: int) -> ImplState:
        from redis_layer_signals.fastdeploy.agreement import Sequencer

        state = ImplState(
            cursors=tuple(Cursor() for _ in range(nranks)),
            members=tuple(_new_member() for _ in range(nranks)),
            tokens=tuple(f"t{r}" for r in range(nranks)),
            welcomed=(False,) * nranks,
            sequencer=Sequencer(nranks, 1, NO_TIMER_MS),
            up=((),) * nranks,
            down=((),) * nranks,
            queues=((),) * nranks,
            outbox=((),) * nranks,
            crashes_left=self.crashes,
            restarts_left=self.restarts,
        )
        for r in range(nranks):
            state = state.joining(r)
        if self.forming:  # the joins on their way, the sequencer gathering
            return state
        # Else the group starts joined: every rank's join heard, the sequencer resumed, every
        # welcome heard (a join is explored where it matters: after a sequencer's crash).
        for r in range(nranks):
            state = state.sequencer_hears(r)
        state = state.deliver(state.sequencer.resume())
        for r in range(nranks):
            while state.down[r]:
                state = state.member_hears(r, workload)
        return state

    def queues(self, state: ImplState) -> tuple[tuple[Batch, ...], ...]:
        return state.queues

    def exempt(self, workload: Workload, state: ImplState) -> frozenset[int]:
        """The slots of requests in flight at a restart: registered, or with an entry read, on
        some rank before it heard of the restart (the old process may have read the only copy
        of an entry). Every rank hears of it: a rank that never did fails ``served``."""
        if not state.heard_at:
            return frozenset()
        if None in state.heard_at:
            return frozenset()
        messages = max(h.message for h in state.heard_at if h is not None)
        registrations = max(h.registration for h in state.heard_at if h is not None)
        read = {slot for message in workload.messages[:messages] for slot, _tokens in message}
        return frozenset(read | {r.slot for r in workload.registrations[:registrations]})

    def moves(self, workload: Workload, state: ImplState) -> Iterator[tuple[str, ImplState]]:
        from redis_layer_signals.fastdeploy.agreement import Sequencer

        nranks = len(state.members)
        for r in range(nranks):
            cursor = state.cursors[r]
            if cursor.message < len(workload.messages):
                entries = list(workload.messages[cursor.message])
                following = state.copy()
                progress = following.members[r].arrive(entries, None, 0)
                following = following.advance(r, message=1).posted(r, progress)
                yield f"rank {r}: reads message {entries}", following
            if cursor.registration < len(workload.registrations):
                request = workload.registrations[cursor.registration]
                following = state.copy()
                progress = following.members[r].registered(_task(request), 0)
                following = following.advance(r, registration=1).posted(r, progress)
                yield f"rank {r}: registers slot {request.slot}", following
            if state.up[r]:
                yield f"sequencer: hears rank {r} {_brief(state.up[r][0])}", state.copy().sequencer_hears(r)
            if state.down[r]:
                yield f"rank {r}: hears {_brief(state.down[r][0])}", state.copy().member_hears(r, workload)
            if state.restarts_left and all(state.welcomed):
                yield f"rank {r}'s process restarts", state.copy().restart(r)
        if state.sequencer.gathering and all(state.joined_current):
            following = state.copy()
            yield "sequencer: every rank joined, resumes", following.deliver(following.sequencer.resume())
        if state.crashes_left:
            following = state.copy()
            following.sequencer = Sequencer(nranks, state.sequencer.generation + 1, NO_TIMER_MS)
            following.crashes_left -= 1
            following.up, following.down = ((),) * nranks, ((),) * nranks
            for m in range(nranks):
                following = following.joining(m)
            yield "sequencer dies: its state and every message in flight are lost", following


NO_TIMER_MS = 1 << 40
"""The model has no clock: nothing is given up on a timer (a rule that needs one fails
**served**)."""


def _new_member() -> Any:
    from redis_layer_signals.fastdeploy.agreement import Member

    return Member(give_up_ms=NO_TIMER_MS)


def _task(request: Request) -> Any:
    from redis_layer_signals.models import CacheTask

    return CacheTask("p0", 0, request.slot, request.request_id, request.need, 1)


def json_join(state: ImplState, r: int) -> str:
    return _line({"rank": r, **state.members[r].joining(state.tokens[r])})


def _line(message: dict[str, Any]) -> str:
    return json.dumps(message, sort_keys=True, separators=(",", ":"))


def _brief(line: str) -> str:
    message = json.loads(line)
    keys = message.get("keys")
    return f"{message['t']}" + (f" {[k[1:3] for k in keys]}" if keys else "")


@dataclass(eq=False)
class ImplState:
    """One state of ``Implemented``: the real objects, compared by what they hold."""

    cursors: tuple[Cursor, ...]
    members: tuple[Any, ...]
    tokens: tuple[str, ...]
    welcomed: tuple[bool, ...]
    sequencer: Any
    up: tuple[tuple[str, ...], ...]
    down: tuple[tuple[str, ...], ...]
    queues: tuple[tuple[Batch, ...], ...]
    outbox: tuple[tuple[str, ...], ...]
    """Per rank, what its hooks posted that waits for the sequencer's welcome."""
    crashes_left: int
    restarts_left: int
    broken: str | None = None
    """What a move broke that only the move can see (**registered**)."""
    heard_at: tuple[Cursor | None, ...] = ()
    """Per rank, its cursor when it heard of the last restart (None: not yet): a request any
    rank registered, or read an entry of, before it heard was in flight."""

    @property
    def joined_current(self) -> list[bool]:
        return [r in self.sequencer.joined for r in range(len(self.members))]

    def copy(self) -> ImplState:
        return copy.deepcopy(self)

    def fingerprint(self) -> tuple[Any, ...]:
        return (
            self.cursors,
            tuple(_member_print(m) for m in self.members),
            self.tokens,
            self.welcomed,
            _sequencer_print(self.sequencer),
            self.up,
            self.down,
            self.queues,
            self.outbox,
            self.crashes_left,
            self.restarts_left,
            self.heard_at,
            self.broken,
        )

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ImplState) and self.fingerprint() == other.fingerprint()

    # -- moves ------------------------------------------------------------------------------

    def advance(self, r: int, message: int = 0, registration: int = 0) -> ImplState:
        cursor = self.cursors[r]
        moved = Cursor(cursor.message + message, cursor.registration + registration)
        return replace(self, cursors=_put(self.cursors, r, moved))

    def send(self, r: int, line: str) -> ImplState:
        return replace(self, up=_put(self.up, r, (*self.up[r], line)))

    def posted(self, r: int, progress: Any) -> ImplState:
        """What ``GroupLink.post`` does with a hook's progress: sent once welcomed, else held
        in the outbox until the welcome."""
        posted = []
        if progress.report:
            posted.append(_line({"t": "ready", "keys": progress.report}))
        if progress.lost:
            posted.append(_line({"t": "lost", "keys": progress.lost}))
        state = replace(self, outbox=_put(self.outbox, r, (*self.outbox[r], *posted)))
        return state.flushed(r) if self.welcomed[r] else state

    def flushed(self, r: int) -> ImplState:
        """The outbox goes out, stamped with the generation joined (``_send_posted``)."""
        generation = self.members[r].generation
        lines = tuple(_line({**json.loads(line), "g": generation}) for line in self.outbox[r])
        return replace(self, up=_put(self.up, r, (*self.up[r], *lines)), outbox=_put(self.outbox, r, ()))

    def joining(self, r: int) -> ImplState:
        """A new line's join: it carries every report so far; the outbox keeps only lost keys."""
        kept = tuple(line for line in self.outbox[r] if json.loads(line)["t"] == "lost")
        state = replace(self, outbox=_put(self.outbox, r, kept), welcomed=_put(self.welcomed, r, False))
        return state.send(r, json_join(state, r))

    def deliver(self, out: list[tuple[int, dict[str, Any]]]) -> ImplState:
        down = list(self.down)
        for member, message in out:
            down[member] = (*down[member], _line(message))
        return replace(self, down=tuple(down))

    def sequencer_hears(self, r: int) -> ImplState:
        line, *rest = self.up[r]
        state = replace(self, up=_put(self.up, r, tuple(rest)))
        message = json.loads(line)
        out = state.sequencer.join(r, message, 0) if "rank" in message else state.sequencer.hear(r, message, 0)
        return state.deliver(out)

    def member_hears(self, r: int, workload: Workload) -> ImplState:
        line, *rest = self.down[r]
        state = replace(self, down=_put(self.down, r, tuple(rest)))
        message = json.loads(line)
        member = state.members[r]
        progress = member.hear(message)
        if message["t"] == "welcome" and member.generation == message["g"]:
            state = replace(state, welcomed=_put(state.welcomed, r, True))
            if message.get("skip"):
                # A restarted process starts at the group's order so far: its queue is checked
                # from there on against the others' (the model keeps the whole order: the tail
                # is never cut at these sizes).
                skipped = list(state.sequencer.tail)[: message["skip"]]
                positions = _positions(workload)
                state = replace(state, queues=_put(state.queues, r, tuple((positions[k],) for k in skipped)))
            state = state.flushed(r)
        if message["t"] == "restarted":
            state = state.heard(r)
        if message["t"] == "reset":
            state = state.joining(r)
        positions = _positions(workload)
        queued = tuple((positions[entry.key],) for entry in progress.released)
        for entry in progress.released:
            task = member.tasks.get(entry.slot)
            if task is None or task.request_id != entry.key[0]:
                state = replace(
                    state, broken=f"registered: rank {r} queued {positions[entry.key]} before its task registered there"
                )
        state = replace(state, queues=_put(state.queues, r, (*state.queues[r], *queued)))
        return state.posted(r, progress)

    def heard(self, r: int) -> ImplState:
        heard = list(self.heard_at)
        heard[r] = self.cursors[r]
        return replace(self, heard_at=tuple(heard))

    def restart(self, r: int) -> ImplState:
        """Rank ``r``'s process restarts: a fresh member under a new token, a new line (what
        the old one had on its way is lost with it), the sequencer sees the old line close."""
        self.sequencer.left(r)
        nranks = len(self.members)
        state = replace(
            self,
            members=_put(self.members, r, _new_member()),
            tokens=_put(self.tokens, r, self.tokens[r] + "'"),
            up=_put(self.up, r, ()),
            down=_put(self.down, r, ()),
            outbox=_put(self.outbox, r, ()),
            restarts_left=self.restarts_left - 1,
            heard_at=(None,) * nranks,
        )
        return state.joining(r)


def _member_print(member: Any) -> tuple[Any, ...]:
    return (
        tuple(sorted((slot, task.request_id) for slot, task in member.tasks.items())),
        tuple((e.slot, e.tokens, e.request_id) for e in member.waiting),
        tuple(member.reported),
        member.queued,
        tuple(member.history),
        member.generation,
        member.fresh,
        tuple(sorted(member.lost_requests)),
        tuple(sorted((rid, tuple(sorted(c.items()))) for rid, c in member._chunks.items())),
    )


def _sequencer_print(sequencer: Any) -> tuple[Any, ...]:
    return (
        sequencer.generation,
        sequencer.gathering,
        tuple(sorted((m, j.queued, tuple(j.tail), j.fresh) for m, j in sequencer.joined.items())),
        tuple(sorted(sequencer.tokens.items())),
        tuple((key, tuple(sorted(who))) for key, (who, _first) in sequencer.ready.items()),
        sequencer.order,
        tuple(sequencer.tail),
        tuple(sequencer.abandoned),
    )


_POSITIONS: dict[Workload, dict[tuple[str, int, int, int], int]] = {}


def _positions(workload: Workload) -> dict[tuple[str, int, int, int], int]:
    """Each entry's implementation key -> its stream position (requests named by slot)."""
    if workload not in _POSITIONS:
        names = {r.slot: r.request_id for r in workload.registrations}
        seen: collections.Counter[tuple[str, int, int]] = collections.Counter()
        table = {}
        for position, (slot, tokens) in enumerate(workload.stream):
            request_id = names.get(slot, f"aborted{slot}")
            table[(request_id, slot, tokens, seen[(request_id, slot, tokens)])] = position
            seen[(request_id, slot, tokens)] += 1
        _POSITIONS[workload] = table
    return _POSITIONS[workload]
