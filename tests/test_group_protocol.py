"""Every interleaving of a tensor-parallel group's layer-0 rule, checked (tests/group_protocol.py):
FastDeploy's PR 7872 rule, the PR 8035 rule and the bridge's strict GPU order each fail with a
counterexample; the rule proposed for the group (ready on every rank, one sequencer's order)
holds on every workload, at 2 ranks and at 3; and so does the implementation (agreement.Member and
agreement.Sequencer), through sequencer crashes and rank restarts."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redis_layer_signals.fastdeploy.agreement import Out, Sequencer
from tests.group_protocol import (
    Agreement,
    AllPending,
    Implemented,
    ReadyByAll,
    ReadySplit,
    Request,
    StrictOrder,
    Workload,
    check_final,
    check_state,
    explore,
)

TWO_IN_ONE_MESSAGE = Workload(
    messages=(((1, 64), (2, 64)),),
    registrations=(Request(1, "a", 64), Request(2, "b", 64)),
)
"""Two live requests in one layer-0 message."""
TWO_CHUNKS = Workload(
    messages=(((1, 32),), ((1, 64),)),
    registrations=(Request(1, "a", 64),),
)
"""One request prefilled in two chunks."""
ABORTED_FIRST = Workload(
    messages=(((9, 100),), ((1, 64),)),
    registrations=(Request(1, "a", 64),),
)
"""A request aborted before its task registered (slot 9), then a live one."""
REGISTERED_IN_ANOTHER_ORDER = Workload(
    messages=(((1, 64),), ((2, 64),)),
    registrations=(Request(2, "b", 64), Request(1, "a", 64)),
)
"""Tasks register in another order than their signals came."""
MIXED = Workload(
    messages=(((9, 50), (1, 32)), ((2, 64),), ((1, 64), (3, 500))),
    registrations=(Request(2, "b", 64), Request(1, "a", 64), Request(3, "c", 100)),
)
"""An aborted request, a two-chunk request, a request whose signal claims more than it needs,
and registrations in an order of their own."""
WORKLOADS = {
    "two_in_one_message": TWO_IN_ONE_MESSAGE,
    "two_chunks": TWO_CHUNKS,
    "aborted_first": ABORTED_FIRST,
    "registered_in_another_order": REGISTERED_IN_ANOTHER_ORDER,
    "mixed": MIXED,
}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
@pytest.mark.parametrize("nranks", [2, 3])
def test_ready_on_every_rank_in_one_order_holds_over_every_interleaving(name: str, nranks: int) -> None:
    workload = WORKLOADS[name]
    if nranks == 3 and name == "mixed":
        workload = Workload(workload.messages[:2], workload.registrations[:2])
    verdict = explore(ReadyByAll(), workload, nranks)
    print(verdict.explain())
    assert verdict.violation is None, verdict.explain()
    assert verdict.states > 10


@pytest.mark.parametrize("name", ["two_in_one_message", "two_chunks", "aborted_first", "registered_in_another_order"])
def test_ready_by_all_holds_when_the_sequencer_dies_anywhere_and_a_new_one_gathers_the_ranks(name: str) -> None:
    verdict = explore(ReadyByAll(crashes=1), WORKLOADS[name], 2)
    print(verdict.explain())
    assert verdict.violation is None, verdict.explain()


def test_fastdeploy_7872_queues_one_message_as_one_batch_on_one_rank_and_two_on_another() -> None:
    verdict = explore(ReadySplit(), TWO_IN_ONE_MESSAGE, 2)
    print(verdict.explain())
    assert verdict.violation is not None and verdict.violation.startswith("same batches"), verdict.explain()


def test_fastdeploy_7872_sends_a_superseded_chunk_on_one_rank_only() -> None:
    verdict = explore(ReadySplit(), TWO_CHUNKS, 2)
    print(verdict.explain())
    assert verdict.violation is not None and verdict.violation.startswith("same batches"), verdict.explain()


def test_fastdeploy_8035_sends_a_chunk_one_adder_saw_and_another_found_superseded() -> None:
    verdict = explore(AllPending(), TWO_CHUNKS, 2)
    print(verdict.explain())
    assert verdict.violation is not None and verdict.violation.startswith("same batches"), verdict.explain()


def test_fastdeploy_8035_queues_in_each_adders_own_order() -> None:
    one_message = Workload(TWO_IN_ONE_MESSAGE.messages, REGISTERED_IN_ANOTHER_ORDER.registrations)
    verdict = explore(AllPending(), one_message, 2)
    print(verdict.explain())
    assert verdict.violation is not None and verdict.violation.startswith("same batches"), verdict.explain()


def test_strict_gpu_order_holds_a_live_request_behind_an_aborted_one() -> None:
    verdict = explore(StrictOrder(), ABORTED_FIRST, 2)
    print(verdict.explain())
    assert verdict.violation is not None and verdict.violation.startswith("served"), verdict.explain()
    assert "slot 1" in verdict.violation


def test_strict_gpu_order_agrees_when_no_request_is_aborted() -> None:
    """What the strict order was built for still holds: it only fails on an aborted request."""
    for workload in (TWO_IN_ONE_MESSAGE, TWO_CHUNKS, REGISTERED_IN_ANOTHER_ORDER):
        verdict = explore(StrictOrder(), workload, 2)
        assert verdict.violation is None, verdict.explain()


# -- the checker's own properties catch what they name ---------------------------------------


def test_check_state_names_the_first_batch_two_ranks_disagree_on() -> None:
    broken = check_state(TWO_IN_ONE_MESSAGE, [((0, 1),), ((0,), (1,))])
    assert broken is not None and "batch 0" in broken and "rank 0" in broken and "rank 1" in broken


def test_check_state_catches_an_entry_queued_twice_and_chunks_out_of_order() -> None:
    assert (check_state(TWO_CHUNKS, [((1,), (1,))]) or "").startswith("once")
    assert (check_state(TWO_CHUNKS, [((1,), (0,))]) or "").startswith("slot order")
    assert check_state(TWO_CHUNKS, [((0,), (1,)), ((0,),)]) is None


def test_check_final_owes_each_registered_request_its_last_chunk_and_nothing_of_an_aborted_one() -> None:
    assert check_final(ABORTED_FIRST, [((1,),), ((1,),)]) is None
    assert (check_final(ABORTED_FIRST, [((1,),), ()]) or "").startswith("served: the ranks queued [1, 0]")
    assert (check_final(ABORTED_FIRST, [((1,),), ()], exempt=frozenset({1})) or "").startswith("served: the ranks")
    assert (check_final(ABORTED_FIRST, [(), ()]) or "").startswith("served: rank 0 never queued slot 1")
    assert check_final(ABORTED_FIRST, [(), ()], exempt=frozenset({1})) is None
    assert check_final(MIXED, [((1,), (2,), (3,))]) is None  # slot 3's 500 tokens exceed its need


class _ResumesFromRankZero(ReadyByAll):
    """A broken recovery: the new sequencer trusts rank 0's history alone."""

    def _resume(self, state: Agreement) -> Agreement:
        assert state.joins is not None
        histories = dict(state.joins)
        order = histories[0]
        down = tuple((*state.down[r], *order[len(histories[r]) :]) for r in range(len(state.members)))
        return replace(state, joins=None, released=order, down=down)


class _ReleasesBeforeEveryRankJoined(ReadyByAll):
    """A broken recovery: the new sequencer goes on from the first rank that joins, before it
    knows what the others queued."""

    def _hear(self, state: Agreement, r: int) -> Agreement:
        state = super()._hear(state, r)
        if not state.joins:
            return state
        histories = dict(state.joins)
        order = max(histories.values(), key=len)
        down = tuple(
            (*queue, *order[len(histories[m]) :]) if m in histories else queue for m, queue in enumerate(state.down)
        )
        return self._release(replace(state, joins=None, released=order, down=down))


@pytest.mark.parametrize("broken", [_ResumesFromRankZero, _ReleasesBeforeEveryRankJoined])
def test_the_checker_catches_a_recovery_that_forgets_what_a_rank_queued(broken: type[ReadyByAll]) -> None:
    verdicts = [explore(broken(crashes=1), workload, 2) for workload in WORKLOADS.values()]
    failed = [verdict for verdict in verdicts if verdict.violation is not None]
    print("\n".join(verdict.explain() for verdict in failed[:1]))
    assert failed, "a broken recovery held on every workload"


# -- the implementation itself (agreement.Member and agreement.Sequencer) ------------------------


@pytest.mark.parametrize("name", sorted(WORKLOADS))
@pytest.mark.parametrize("nranks", [2, 3])
def test_the_implementation_holds_over_every_interleaving(name: str, nranks: int) -> None:
    workload = WORKLOADS[name]
    if nranks == 3 and name == "mixed":
        workload = Workload(workload.messages[:2], workload.registrations[:2])
    verdict = explore(Implemented(), workload, nranks)
    print(verdict.explain())
    assert verdict.violation is None, verdict.explain()
    assert verdict.states > 10


@pytest.mark.parametrize("name", ["two_in_one_message", "two_chunks", "aborted_first"])
def test_the_implementation_holds_when_its_sequencer_dies_anywhere(name: str) -> None:
    verdict = explore(Implemented(crashes=1), WORKLOADS[name], 2)
    print(verdict.explain())
    assert verdict.violation is None, verdict.explain()


@pytest.mark.parametrize("name", ["two_in_one_message", "aborted_first"])
def test_the_implementation_holds_while_the_group_forms(name: str) -> None:
    """Hooks called while the ranks' joins are on their way, the sequencer gathering them."""
    verdict = explore(Implemented(forming=True), WORKLOADS[name], 2)
    print(verdict.explain())
    assert verdict.violation is None, verdict.explain()


@pytest.mark.parametrize("name", ["two_chunks", "aborted_first"])
def test_the_implementation_holds_when_a_rank_restarts_anywhere(name: str) -> None:
    """A restart loses the requests in flight (on every rank alike) and nothing after them."""
    verdict = explore(Implemented(restarts=1), WORKLOADS[name], 2)
    print(verdict.explain())
    assert verdict.violation is None, verdict.explain()


class _ReleasesOnAnyReport(Sequencer):
    """A broken sequencer: an entry goes once one rank has it ready."""

    def __init__(self, nranks: int, generation: int, give_up_ms: int) -> None:
        super().__init__(1, generation, give_up_ms)


class _KeepsADeadProcesssReports(Sequencer):
    """A bug the check found: a restarted rank's old process's reports still count, so the new
    process is handed an entry before its task registered there."""

    def _forget(self, member: int) -> None:
        pass


class _ForgetsTheFormingGroupsReports(Sequencer):
    """A bug the check found: the reports a forming group's joins carried were forgotten as if
    their processes had restarted, so the first entries were never released."""

    def _fresh(self, member: int, restarted: bool) -> Out:
        self._forget(member)
        return super()._fresh(member, restarted)


@pytest.mark.parametrize(
    ("broken", "faults", "violation"),
    [
        (_ReleasesOnAnyReport, {}, "registered"),
        (_KeepsADeadProcesssReports, {"restarts": 1}, "registered"),
        (_ForgetsTheFormingGroupsReports, {"forming": True}, "served"),
    ],
)
def test_the_check_catches_a_broken_sequencer(
    broken: type[Sequencer], faults: dict[str, Any], violation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis_layer_signals.fastdeploy.agreement as agreement

    monkeypatch.setattr(agreement, "Sequencer", broken)
    verdicts = [explore(Implemented(**faults), workload, 2) for workload in (TWO_IN_ONE_MESSAGE, TWO_CHUNKS)]
    failed = [verdict for verdict in verdicts if verdict.violation is not None]
    print("\n".join(verdict.explain() for verdict in failed[:1]))
    assert failed and any(verdict.violation.startswith(violation) for verdict in failed if verdict.violation)


# -- larger groups and streams, sampled: random walks through the implementation's moves ----------


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    """Up to 5 requests over 4 slots in up to 6 messages (chunks of 32 tokens, some over their
    need, some aborted), registered in an order of their own."""
    requests = draw(st.integers(1, 5))
    slots = draw(st.permutations(range(1, 9)))[:requests]
    aborted = set(draw(st.sets(st.sampled_from(slots), max_size=1)))
    chunks = {slot: draw(st.integers(1, 3)) for slot in slots}
    entries = [(slot, 32 * (n + 1)) for slot in slots for n in range(chunks[slot])]
    order = draw(st.permutations(range(len(entries))))
    per_slot: dict[int, int] = {}
    stream = []
    for index in sorted(order, key=lambda i: order.index(i)):
        slot, _tokens = entries[index]
        per_slot[slot] = per_slot.get(slot, 0) + 1
        stream.append((slot, 32 * per_slot[slot]))  # each slot's chunks keep their order
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(stream) - 1)), max_size=5)))
    messages = tuple(tuple(stream[a:b]) for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True) if a < b)
    live = [slot for slot in slots if slot not in aborted]
    needs = {slot: 32 * chunks[slot] - draw(st.sampled_from([0, 0, 16])) for slot in live}
    registrations = tuple(Request(slot, f"r{slot}", needs[slot]) for slot in draw(st.permutations(live)))
    return Workload(messages, registrations)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads(), nranks=st.integers(2, 4), crashes=st.integers(0, 1), data=st.data())
def test_the_implementation_on_random_walks_of_larger_groups(
    workload: Workload, nranks: int, crashes: int, data: st.DataObject
) -> None:
    """Every step checked as ``explore`` checks it; at the end every rank queued every request."""
    rule = Implemented(crashes=crashes)
    state = rule.initial(workload, nranks)
    steps: list[str] = []
    for _ in range(2_000):
        broken = check_state(workload, rule.queues(state)) or state.broken
        assert broken is None, (broken, steps)
        moves = list(rule.moves(workload, state))
        if not moves:
            break
        label, state = moves[data.draw(st.integers(0, len(moves) - 1), label="move")]
        steps.append(label)
    else:
        raise AssertionError(f"no end after 2000 moves: {steps[-20:]}")
    assert check_final(workload, rule.queues(state)) is None, steps
