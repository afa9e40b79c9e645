"""A tensor-parallel group (TP 2 and 4) of cache messagers sharing FastDeploy's barriers: the
rules that decide by "is the task registered yet?" on each rank diverge and deadlock, and the
bridge must not. Each run feeds every rank the same GPU messages and cache_infos, each rank
with a seeded jitter of its own; a barrier that times out counts as a deadlock (harness:
redis_layer_signals/fastdeploy/demo/tp.py; figures: benchmarks/results/tp.md). The bridge is
run with release/2.6's threads and with develop's (adders out of lockstep, PR 7724; a sender
that writes on a thread pool, PR 7931), in the harness's model and in FastDeploy's structure
(the fixture patched by ``rls fastdeploy patch``)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from redis_layer_signals.fastdeploy.demo.tp import GroupOutcome, RankIO, RankMessager, Rule, run_group
from redis_layer_signals.fastdeploy.demo.tp_rules import (
    Layer0Policy,
    ModelMessager,
    ModelRule,
    ReadySplit,
    all_pending_rule,
    bridge_rule,
    ready_split_rule,
)
from redis_layer_signals.fastdeploy.demo.tp_workloads import WORKLOADS, Pause, Request, Step, Tasks, Workload
from redis_layer_signals.fastdeploy.signals import KvSignal
from tests.servers import Done, RedisServer
from tests.tp_fixture import FixtureRule, PatchedFixtureRule

RACY = ("mixed_message", "chunked_prefill", "slot_reuse")
"""Workloads whose tasks race their first signal (the others show it too, less often)."""
SEEDS = (0, 1)
DEVELOP: dict[str, Any] = {"adders": "free", "sender": "pool"}
"""FastDeploy develop's threads: no adders' barrier (PR 7724), a pooled sender (PR 7931)."""
ADDER_DRIFT_S = 0.1
"""An adder jitter per batch of cache_infos five times the default: with no barrier to bring
them together, one rank's adder registers a task up to tenths of a second before another's."""
QUICK_TIMEOUT_S = 0.5
"""Barrier timeout of the runs expected to deadlock: each deadlock costs this much."""
SAFE_TIMEOUT_S = 2.0
"""Barrier timeout of the runs that must not deadlock: far above any wait of a healthy group,
on a loaded machine too."""


def runs(
    rule: Rule, workloads: Sequence[str], seeds: Sequence[int], barrier_timeout_s: float, **threads: Any
) -> list[GroupOutcome]:
    return [
        run_group(rule, WORKLOADS[name](), nranks, seed, barrier_timeout_s=barrier_timeout_s, **threads)
        for name in workloads
        for nranks in (2, 4)
        for seed in seeds
    ]


def report(outcomes: list[GroupOutcome]) -> str:
    return "\n".join(o.describe() for o in outcomes)


# -- the harness ---------------------------------------------------------------------------------


class OneBatchPerEntry(ReadySplit):
    """Queues each registered layer-0 entry as a batch of its own."""

    def on_signal(self, m: ModelMessager, data: Any, signal: KvSignal) -> None:
        if signal.layer == 0:
            with m.lock:
                ready = [(s, t) for s, t in signal.entries if s in m.idx_cache_task_dict]
            for entry in ready:
                m.io.ready.put([entry])


def test_a_group_whose_ranks_queue_different_batches_is_reported_deadlocked_not_hung() -> None:
    """The brief's example by hand: rank 1 splits what rank 0 queues as one batch."""
    rule = ModelRule("split on rank 1", lambda io, _group: OneBatchPerEntry() if io.rank == 1 else ReadySplit())
    r5, r6 = Request("r5", 5, 128), Request("r6", 6, 128)
    workload = Workload("by hand", (Tasks((r5, r6)), Pause(0.3), Step(((r5, 0, 128), (r6, 0, 128)))), (r5, r6))
    outcome = run_group(rule, workload, 2, 0, barrier_timeout_s=QUICK_TIMEOUT_S)
    assert outcome.sequences == ((((5, 128), (6, 128)),), (((5, 128),), ((6, 128),)))
    assert outcome.deadlocked and not outcome.identical and not outcome.agreed
    # Rank 0 waits to report its second task while rank 1 waits to begin its second batch.
    assert outcome.stuck == (("finish_send_cache_barrier",), ("begin_send_cache_barrier",))
    assert outcome.sent == {"r5"} and outcome.lost == {"r6"}


def test_the_pre_8034_rule_agrees_when_every_task_is_registered_long_before_its_signals() -> None:
    """The control: without a race, it queues the same batches on every rank. (Not so the 8035
    model: two chunks of one request can meet in its pending dict before the adder looks, and
    the newer replaces the older on one rank only.)"""
    for rule in (FixtureRule(), ready_split_rule()):
        outcome = run_group(rule, WORKLOADS["early_registration"](), 2, 0, barrier_timeout_s=SAFE_TIMEOUT_S)
        assert outcome.agreed, outcome.describe()
        assert outcome.sent == outcome.expected == {"a", "b", "c"}


# -- the rules FastDeploy has had ----------------------------------------------------------------


@pytest.mark.parametrize("adders", ["lockstep", "free"])
@pytest.mark.parametrize("rule", [FixtureRule(), ready_split_rule()], ids=["fastdeploy-structure", "model"])
def test_the_pre_8034_rule_deadlocks_a_tp_group(rule: Rule, adders: str) -> None:
    """Ready entries as one batch now, early ones one by one later: ranks split differently.
    Over these 12 runs (three racy workloads, TP 2 and 4, seeds 0-1), three passes on
    2026-12-02: FastDeploy's structure deadlocked in 4, 5 and 5 and diverged in 6, 8 and 7;
    the model in 4-6 and 6-8. Timing moves them; at least one deadlock every time. Adders out
    of lockstep (develop's, PR 7724) change nothing to that; the fixture's sender is its own,
    so both run with one sender thread here."""
    outcomes = runs(rule, RACY, SEEDS, QUICK_TIMEOUT_S, adders=adders)
    deadlocked = [o for o in outcomes if o.deadlocked]
    assert deadlocked, report(outcomes)
    # A deadlock here is the ranks' disagreement, never a slow rank: their sequences differ.
    assert all(not o.identical for o in deadlocked), report(deadlocked)
    assert all(o.lost for o in deadlocked), report(deadlocked)


def test_the_8035_rule_still_diverges() -> None:
    """Every entry through the pending dict, taken out by the adder one by one: per-request
    batches, but in an order (and with a supersession) each rank's timing decides. Three
    passes on 2026-12-02: 6 of these 12 runs diverged each time, 5-6 of them deadlocked."""
    outcomes = runs(all_pending_rule(), ("chunked_prefill", "aborted_request", "slot_reuse"), SEEDS, QUICK_TIMEOUT_S)
    divergent = [o for o in outcomes if not o.identical]
    assert divergent, report(outcomes)
    assert any(not o.agreed for o in outcomes), report(outcomes)


# -- the bridge ----------------------------------------------------------------------------------


def url_of(backend: str, request: pytest.FixtureRequest) -> str:
    if backend == "memory":
        return f"memory://{uuid.uuid4().hex}"
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


@pytest.fixture(params=["memory", "real"])
def bridge_url(request: pytest.FixtureRequest) -> str:
    return url_of(str(request.param), request)


@pytest.mark.parametrize("nranks", [2, 4])
def test_the_bridge_never_deadlocks_and_every_rank_queues_the_same_batches(bridge_url: str, nranks: int) -> None:
    rule = bridge_rule(bridge_url, f"tp-{uuid.uuid4().hex[:8]}")
    for make in WORKLOADS.values():
        outcome = run_group(rule, make(), nranks, 0, barrier_timeout_s=SAFE_TIMEOUT_S)
        assert outcome.agreed, outcome.describe()
        assert outcome.sent == outcome.expected, outcome.describe()


# -- FastDeploy's develop: adders out of lockstep (PR 7724), a pooled sender (PR 7931) ----------


@pytest.mark.parametrize("nranks", [2, 4])
def test_the_bridge_agrees_with_develop_s_free_adders_and_pooled_sender(bridge_url: str, nranks: int) -> None:
    """No adders' barrier, so each rank registers a task when its own adder gets to it; the
    sender writes on a pool between the per-batch barriers. Seed 0 at the default jitter, seed
    1 with the adders drifting further apart (``ADDER_DRIFT_S``)."""
    rule = bridge_rule(bridge_url, f"tp-{uuid.uuid4().hex[:8]}")
    outcomes = [
        run_group(rule, make(), nranks, seed, barrier_timeout_s=SAFE_TIMEOUT_S, adder_jitter_s=jitter, **DEVELOP)
        for make in WORKLOADS.values()
        for seed, jitter in ((0, None), (1, ADDER_DRIFT_S))
    ]
    assert [o for o in outcomes if o.deadlocked] == [], report(outcomes)
    assert all(o.identical for o in outcomes), report(outcomes)
    assert all(o.agreed and o.sent == o.expected for o in outcomes), report(outcomes)


@pytest.mark.parametrize("adders", ["lockstep", "free"])
@pytest.mark.parametrize("nranks", [2, 4])
def test_fastdeploy_s_structure_with_the_bridge_agrees_with_adders_in_lockstep_or_not(
    bridge_url: str, nranks: int, adders: str
) -> None:
    """The fixture patched by ``rls fastdeploy patch``, its bridge on the test's Redis: FastDeploy's
    own threads (its sender asserts each entry's task is there), adders in lockstep or not."""
    rule = PatchedFixtureRule(bridge_url, f"tp-{uuid.uuid4().hex[:8]}")
    outcomes = [
        run_group(rule, make(), nranks, 0, barrier_timeout_s=SAFE_TIMEOUT_S, adders=adders)
        for make in WORKLOADS.values()
    ]
    assert [o for o in outcomes if o.deadlocked] == [], report(outcomes)
    assert all(o.agreed and o.sent == o.expected for o in outcomes), report(outcomes)


class Capture:
    """A rule that keeps each rank's ``RankIO``, to look at what the rank's threads did."""

    def __init__(self, rule: ModelRule) -> None:
        self.rule, self.name, self.ios = rule, rule.name, list[RankIO]()

    def messager(self, io: RankIO, group: str) -> RankMessager:
        self.ios.append(io)
        return self.rule.messager(io, group)


class QueueEveryEntry(Layer0Policy):
    """Queues each layer-0 message as one batch at once, its tasks registered or not (the same on
    every rank: no rank's registration decides it)."""

    def on_signal(self, m: ModelMessager, data: Any, signal: KvSignal) -> None:
        if signal.layer == 0:
            m.io.ready.put(signal.entries)


def test_develop_s_sender_waits_for_its_own_adder_where_release_2_6_s_asserts() -> None:
    """Entries queued before their tasks: develop's sender polls for each task after
    ``begin_send_cache_barrier`` (PR 7724) and the group sends them; release/2.6's asserts."""
    rule = ModelRule("queue every entry", lambda _io, _group: QueueEveryEntry())
    develop = Capture(rule)
    outcome = run_group(develop, WORKLOADS["late_registration"](), 2, 0, barrier_timeout_s=SAFE_TIMEOUT_S, **DEVELOP)
    assert outcome.agreed and outcome.sent == {"a", "b"}, outcome.describe()
    assert all(waits >= 1 for waits in outcome.task_waits), outcome.describe()
    # develop's adders acknowledge nothing: PR 7724 removed what the engine waited for
    assert all(io.added == [] for io in develop.ios)

    release = run_group(rule, WORKLOADS["late_registration"](), 2, 0, barrier_timeout_s=SAFE_TIMEOUT_S, timeout_s=1)
    assert not release.agreed and release.errors, release.describe()
    assert all("AssertionError" in error for error in release.errors), release.errors


def test_develop_s_pooled_sender_writes_every_layer_of_a_batch_once_then_meets_the_barriers() -> None:
    """Three slots in one batch, two layers: six jobs on the pool, each layer of each entry
    written once, the entries counted sent in the batch's order, the group agreed."""
    rule = Capture(ready_split_rule())
    outcome = run_group(rule, WORKLOADS["early_registration"](), 2, 0, barrier_timeout_s=SAFE_TIMEOUT_S, **DEVELOP)
    assert outcome.agreed and outcome.sequences[0][0] == ((0, 128), (1, 128), (2, 128)), outcome.describe()
    for io in rule.ios:
        assert sorted(io.layer_writes) == sorted(
            (rid, tokens, layer) for rid, tokens in [("a", 128), ("b", 128), ("c", 128), ("c", 256)] for layer in (0, 1)
        )
        assert io.writes == [("a", 128), ("b", 128), ("c", 128), ("c", 256)]


def test_the_fixture_s_own_sender_cannot_be_pooled() -> None:
    with pytest.raises(ValueError, match="sender='one'"):
        run_group(FixtureRule(), WORKLOADS["early_registration"](), 2, 0, **DEVELOP)


@pytest.mark.parametrize(
    ("option", "value"), [("adders", "barrier"), ("sender", "threads"), ("pool_workers", 0)], ids=str
)
def test_run_group_refuses_threads_it_does_not_model_naming_the_option(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=option):
        run_group(ready_split_rule(), WORKLOADS["early_registration"](), 2, 0, **{option: value})


# -- rls simulate --tp ---------------------------------------------------------------------------


def simulate_tp(rls: Callable[..., Done], tmp_path: Path, *args: str) -> tuple[Done, dict[str, Any]]:
    out = tmp_path / "tp.json"
    common = ("--requests", "16", "--layers", "2", "--hang-timeout-s", "1", "--json", str(out))
    done = rls("simulate", "--tp", *args, *common)
    return done, json.loads(out.read_text()) if out.exists() else {}


def test_simulate_tp_with_fastdeploy_s_in_process_fix_reports_groups_that_disagree(
    rls: Callable[..., Done], tmp_path: Path
) -> None:
    done, figures = simulate_tp(rls, tmp_path, "2", "--mode", "local", "--early-share", "0.5", "--instances", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "did not agree" in done.stderr
    groups = figures["instances"]
    assert len(groups) == 2 and not figures["ok"]
    assert any(g["deadlocked"] or not g["identical_sequences"] for g in groups), groups
    assert all(len(g["batches_per_rank"]) == 2 for g in groups)


@pytest.mark.parametrize(("backend", "nranks"), [("memory", "2"), ("real", "4")])
def test_simulate_tp_with_the_bridge_reports_every_group_agreed(
    rls: Callable[..., Done], tmp_path: Path, request: pytest.FixtureRequest, backend: str, nranks: str
) -> None:
    url = url_of(backend, request)
    namespace = f"tp{uuid.uuid4().hex[:8]}"
    done, figures = simulate_tp(rls, tmp_path, nranks, "--redis", url, "--namespace", namespace)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"every group of {nranks} ranks agreed" in " ".join(done.stdout.split())
    assert figures["ok"] and all(g["agreed"] and not g["deadlocked"] for g in figures["instances"])
    assert all(len(set(g["batches_per_rank"])) == 1 for g in figures["instances"])


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (("--tp", "9"), 2, "--tp"),
        (("--tp", "2", "--mode", "drop"), 1, "mode"),
        (("--tp", "2", "--chaos"), 2, "--tp runs without --chaos"),
    ],
    ids=["too-many-ranks", "drop-mode", "with-chaos"],
)
def test_simulate_tp_refuses_what_it_cannot_run_naming_the_option(
    rls: Callable[..., Done], args: tuple[str, ...], code: int, says: str
) -> None:
    done = rls("simulate", *args, "--requests", "1")
    assert done.returncode == code, done.stdout + done.stderr
    assert says in done.stderr
    assert "OK" not in done.stdout


def test_simulate_help_describes_tp_and_names_the_page_that_says_more(rls: Callable[..., Done]) -> None:
    done = rls("simulate", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.replace("│", " ").split())  # the help's box, unwrapped
    assert "--tp <n> Instead: N-rank tensor-parallel groups" in text
    assert "--tp in simulation.md" in text
    page = (Path(__file__).resolve().parents[1] / "docs" / "simulation.md").read_text()
    assert "--tp" in page and "barrier" in page
