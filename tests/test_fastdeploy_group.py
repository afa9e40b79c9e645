"""group.GroupQueue, one rank's side of a tensor-parallel group, without threads: ranks
fed the same GPU stream and the same registration stream, interleaved differently, queue the
same batches; giving up is decided by the group (``FakeGroup`` decides as lua/group.lua does,
``LuaGroup`` runs the function itself on fakeredis)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from redis_layer_signals import CacheTask, DropReason, SignalBuffer
from redis_layer_signals.fastdeploy.group import GroupQueue, Outcome, Progress
from redis_layer_signals.protocol.calls import Claim

GIVE_UP_S = 10.0
Workload = tuple[list[list[tuple[int, int]]], list[CacheTask]]
"""The GPU's layer-0 messages and the registrations, in the orders every rank shares."""


def task(slot: int, request_id: str, need: int = 4096) -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=need, num_layers=4)


class FakeGroup:
    """lua/group.lua's decision, in memory: released when a member handled the entry without
    voting on it, abandoned when every member voted, final once decided."""

    def __init__(self, nranks: int) -> None:
        self.nranks = nranks
        self.handled = dict.fromkeys(range(nranks), -1)
        self.votes: dict[int, set[int]] = {}
        self.outcomes: dict[int, Outcome] = {}

    def call(self, member: int, handled: int, votes: list[int]) -> list[Outcome]:
        self.handled[member] = handled
        answers = []
        for seq in votes:
            if seq not in self.outcomes:
                voters = self.votes.setdefault(seq, set())
                voters.add(member)
                if any(m not in voters and self.handled[m] >= seq for m in range(self.nranks)):
                    self.outcomes[seq] = Outcome.RELEASED
                elif len(voters) == self.nranks:
                    self.outcomes[seq] = Outcome.ABANDONED
            answers.append(self.outcomes.get(seq, Outcome.OPEN))
        return answers


class LuaGroup:
    """The same calls, answered by lua/group.lua itself (on fakeredis)."""

    def __init__(self, nranks: int) -> None:
        self.nranks = nranks
        self.buffer = SignalBuffer.from_url(f"memory://{uuid.uuid4().hex}", namespace="g", env={})
        self.keys = self.buffer.protocol.keys.group("p0", 0)
        self.claims = [Claim(f"rank{member}", 1, "host|1|") for member in range(nranks)]

    def call(self, member: int, handled: int, votes: list[int]) -> list[Outcome]:
        prepared = self.buffer.protocol.group(self.keys, self.nranks, member, self.claims[member], handled, votes)
        return [Outcome(outcome) for outcome in self.buffer.execute(prepared).outcomes]


@dataclass
class Rank:
    """One rank: its queue, its clock, and what it put on its sender's queue."""

    member: int
    queue: GroupQueue = field(default_factory=lambda: GroupQueue(GIVE_UP_S))
    now_s: float = 0.0
    queued: list[tuple[int, int, int]] = field(default_factory=list)
    dropped: list[tuple[int, DropReason]] = field(default_factory=list)

    def settle(self, progress: Progress) -> None:
        self.queued.extend((e.seq, e.slot, e.tokens) for e in progress.released)
        self.dropped.extend((e.seq, reason) for e, reason in progress.dropped)

    def sync(self, group: FakeGroup | LuaGroup) -> None:
        """What the rank's group thread does: give up on a head that is due, report, settle."""
        self.queue.give_up(self.now_s)
        votes = self.queue.voting()
        for seq, outcome in zip(votes, group.call(self.member, self.queue.handled, votes), strict=True):
            self.settle(self.queue.decided(seq, outcome))


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    """A GPU stream (messages of layer-0 entries, each request's chunks in order) and the
    registrations, in an order of their own; the last request may be aborted (never registered)."""
    requests = draw(st.integers(1, 6))
    chunks = {slot: draw(st.lists(st.integers(1, 400), min_size=1, max_size=3)) for slot in range(requests)}
    needs = {slot: draw(st.sampled_from([sum(c), max(c), 4096])) for slot, c in chunks.items()}
    order = draw(st.permutations([slot for slot in chunks for _ in chunks[slot]]))
    emitted = dict.fromkeys(chunks, 0)
    prefilled = dict.fromkeys(chunks, 0)
    stream: list[tuple[int, int]] = []
    for slot in order:  # each chunk's entry carries the tokens prefilled so far
        prefilled[slot] += chunks[slot][emitted[slot]]
        emitted[slot] += 1
        stream.append((slot, prefilled[slot]))
    messages: list[list[tuple[int, int]]] = []
    while stream:
        size = draw(st.integers(1, len(stream)))
        messages.append(stream[:size])
        stream = stream[size:]
    aborted = draw(st.booleans())
    registered = [task(slot, f"req-{slot}", needs[slot]) for slot in chunks if not (aborted and slot == requests - 1)]
    return messages, draw(st.permutations(registered))


def run_ranks(
    data: st.DataObject,
    nranks: int,
    messages: list[list[tuple[int, int]]],
    tasks: list[CacheTask],
    group: FakeGroup | LuaGroup,
) -> list[Rank]:
    """Every rank reads the same two streams, each in its own interleaving with its clock and its
    group thread; then the group runs until every rank's queue is empty."""
    ranks = [Rank(member) for member in range(nranks)]
    cursors = [[0, 0] for _ in ranks]
    while True:
        active = [i for i, c in enumerate(cursors) if c[0] < len(messages) or c[1] < len(tasks)]
        if not active:
            break
        index = data.draw(st.sampled_from(active))
        rank, cursor = ranks[index], cursors[index]
        rank.now_s += data.draw(st.sampled_from([0.0, 1.0, GIVE_UP_S]))
        steps = ["message"] if cursor[0] < len(messages) else []
        steps += ["task"] if cursor[1] < len(tasks) else []
        step = data.draw(st.sampled_from([*steps, "sync"]))
        if step == "message":
            rank.settle(rank.queue.arrive(messages[cursor[0]], None, rank.now_s))
            cursor[0] += 1
        elif step == "task":
            rank.settle(rank.queue.registered(tasks[cursor[1]]))
            cursor[1] += 1
        else:
            rank.sync(group)
    for _round in range(4 * len(messages) * sum(len(m) for m in messages) + 4):
        if not any(rank.queue.waiting() for rank in ranks):
            break
        for rank in ranks:
            rank.now_s += GIVE_UP_S
            rank.sync(group)
    return ranks


def check_identical(workload: Workload, ranks: list[Rank]) -> None:
    messages, tasks = workload
    first = ranks[0]
    total = sum(len(message) for message in messages)
    registered = {t.slot for t in tasks}
    for rank in ranks:
        assert rank.queue.waiting() == 0, "an entry blocked the group forever"
        assert rank.queued == first.queued
        assert rank.dropped == first.dropped
        handled = sorted([seq for seq, _slot, _tokens in rank.queued] + [seq for seq, _reason in rank.dropped])
        assert handled == list(range(total)), "every entry released or dropped exactly once"
        assert [seq for seq, *_ in rank.queued] == sorted(seq for seq, *_ in rank.queued), "in the GPU's order"
    flat = [entry for message in messages for entry in message]
    assert [(slot, tokens) for _seq, slot, tokens in first.queued] == [
        flat[seq] for seq, _slot, _tokens in first.queued
    ]
    for seq, reason in first.dropped:
        if flat[seq][0] not in registered:
            assert reason is DropReason.EXPIRED  # the aborted request's entries: given up by all


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
@given(workload=workloads(), nranks=st.sampled_from([2, 4]), data=st.data())
def test_ranks_fed_the_same_streams_in_any_interleaving_queue_the_same_batches(
    workload: Workload, nranks: int, data: st.DataObject
) -> None:
    check_identical(workload, run_ranks(data, nranks, *workload, FakeGroup(nranks)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
@given(workload=workloads(), nranks=st.sampled_from([2, 4]), data=st.data())
def test_the_same_with_lua_group_deciding(workload: Workload, nranks: int, data: st.DataObject) -> None:
    group = LuaGroup(nranks)
    try:
        check_identical(workload, run_ranks(data, nranks, *workload, group))
    finally:
        group.buffer.close()


def test_the_example_of_two_ranks_with_one_message_for_two_slots() -> None:
    """Rank 1 had not registered slot 5 when the message came: it waits, and queues the same two
    batches as rank 0, in the same order, once the lockstep adder registers slot 5."""
    first, second = GroupQueue(GIVE_UP_S), GroupQueue(GIVE_UP_S)
    for slot, request in ((5, "a"), (6, "b")):
        first.registered(task(slot, request))
    second.registered(task(6, "b"))
    message = [(5, 128), (6, 128)]
    batches = [[(e.slot, e.tokens)] for e in first.arrive(message, None, 0.0).released]
    assert batches == [[(5, 128)], [(6, 128)]]
    assert second.arrive(message, None, 0.0).released == []  # slot 6 waits behind slot 5
    assert [[(e.slot, e.tokens)] for e in second.registered(task(5, "a")).released] == batches


def test_an_aborted_requests_entry_is_dropped_by_every_rank_once_all_voted() -> None:
    group = FakeGroup(2)
    ranks = [Rank(0), Rank(1)]
    for rank in ranks:
        rank.settle(rank.queue.registered(task(6, "b")))
        rank.settle(rank.queue.arrive([(9, 64), (6, 128)], None, 0.0))  # slot 9 never registers
    ranks[0].now_s = GIVE_UP_S
    ranks[0].sync(group)
    assert ranks[0].queue.voting() == [0]  # open: rank 1 may still release it
    assert ranks[0].queued == [] and ranks[1].queued == []
    ranks[1].now_s = GIVE_UP_S
    ranks[1].sync(group)
    assert group.outcomes == {0: Outcome.ABANDONED}
    ranks[0].sync(group)
    for rank in ranks:
        assert rank.dropped == [(0, DropReason.EXPIRED)]
        assert rank.queued == [(1, 6, 128)]
        assert rank.queue.waiting() == 0


def test_a_rank_that_released_makes_the_voters_release_once_registered() -> None:
    group = FakeGroup(2)
    ranks = [Rank(0), Rank(1)]
    for rank in ranks:
        rank.settle(rank.queue.arrive([(5, 128)], None, 0.0))
    ranks[1].now_s = GIVE_UP_S
    ranks[1].sync(group)  # rank 1 gives up: it will never release entry 0 on its own
    assert ranks[1].queue.voting() == [0]
    ranks[0].settle(ranks[0].queue.registered(task(5, "a")))  # rank 0 did not vote: it releases
    ranks[1].settle(ranks[1].queue.registered(task(5, "a")))
    assert ranks[0].queued == [(0, 5, 128)]
    assert ranks[1].queued == [], "a voter waits for the group even once its task registered"
    ranks[1].sync(group)
    assert ranks[1].queued == [], "the group has not heard of rank 0's release yet"
    ranks[0].sync(group)  # rank 0's report: handled up to 0, no vote
    ranks[1].sync(group)
    assert group.outcomes == {0: Outcome.RELEASED}
    assert ranks[1].queued == [(0, 5, 128)]


def test_a_voter_told_released_waits_for_its_own_registration() -> None:
    group = FakeGroup(2)
    ranks = [Rank(0), Rank(1)]
    for rank in ranks:
        rank.settle(rank.queue.arrive([(5, 128), (7, 64)], None, 0.0))
    ranks[0].settle(ranks[0].queue.registered(task(5, "a")))
    ranks[0].sync(group)
    ranks[1].now_s = GIVE_UP_S
    ranks[1].sync(group)
    assert ranks[1].queue.voting() == [] and ranks[1].queued == []  # released by the group, not yet here
    assert ranks[1].queue.give_up(3 * GIVE_UP_S) is None, "never voted on twice"
    ranks[1].settle(ranks[1].queue.registered(task(7, "c")))
    assert ranks[1].queued == []  # entry 1 waits behind entry 0
    ranks[1].settle(ranks[1].queue.registered(task(5, "a")))
    assert ranks[1].queued == [(0, 5, 128), (1, 7, 64)]


def test_entries_naming_another_request_wait_for_their_own_and_verdicts_are_the_tasks() -> None:
    queue = GroupQueue(GIVE_UP_S)
    queue.registered(task(5, "old"))
    progress = queue.arrive([(5, 128), (6, 5000)], {5: "new"}, 0.0)
    assert progress.released == [] and progress.dropped == []
    queue.finished(5, "someone-else")  # fenced: the slot stays old's
    assert queue.tasks[5].request_id == "old"
    queue.finished(5, "old")
    assert [e.seq for e in queue.registered(task(5, "new")).released] == [0]
    dropped = queue.registered(task(6, "x", need=4096)).dropped
    assert [(e.seq, reason) for e, reason in dropped] == [(1, DropReason.OVER_NEED)]


def test_counts_follow_the_lua_functions_names() -> None:
    queue = GroupQueue(GIVE_UP_S)
    queue.registered(task(5, "a", need=100))
    first = queue.next_seq
    progress = queue.arrive([(5, 50), (5, 500), (7, 10)], None, 0.0)
    assert progress.counts(first, 3) == {"delivered": 1, "buffered": 2, "dropped_over_need": 1}
    later = queue.registered(task(7, "b"))
    assert later.counts(queue.next_seq) == {"recovered": 1}
