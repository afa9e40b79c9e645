"""A tensor-parallel group (TP 2 and 4) of cache messagers sharing FastDeploy's barriers: the
rules that decide by "is the task registered yet?" on each rank diverge and deadlock, and the
bridge must not. Each run feeds every rank the same GPU messages and cache_infos, each rank
with a seeded jitter of its own; a barrier that times out counts as a deadlock (harness:
redis_layer_signals/fastdeploy/demo/tp.py; figures: benchmarks/results/tp.md)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from redis_layer_signals.fastdeploy.demo.tp import GroupOutcome, Rule, run_group
from redis_layer_signals.fastdeploy.demo.tp_rules import (
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
from tests.tp_fixture import FixtureRule

RACY = ("mixed_message", "chunked_prefill", "slot_reuse")
"""Workloads whose tasks race their first signal (the others show it too, less often)."""
SEEDS = (0, 1)
QUICK_TIMEOUT_S = 0.5
"""Barrier timeout of the runs expected to deadlock: each deadlock costs this much."""
SAFE_TIMEOUT_S = 2.0
"""Barrier timeout of the runs that must not deadlock: far above any wait of a healthy group,
on a loaded machine too."""


def runs(rule: Rule, workloads: Sequence[str], seeds: Sequence[int], barrier_timeout_s: float) -> list[GroupOutcome]:
    return [
        run_group(rule, WORKLOADS[name](), nranks, seed, barrier_timeout_s=barrier_timeout_s)
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


@pytest.mark.parametrize("rule", [FixtureRule(), ready_split_rule()], ids=["fastdeploy-structure", "model"])
def test_the_pre_8034_rule_deadlocks_a_tp_group(rule: Rule) -> None:
    """Ready entries as one batch now, early ones one by one later: ranks split differently.
    Over these 12 runs (three racy workloads, TP 2 and 4, seeds 0-1), three passes on
    2026-12-02: FastDeploy's structure deadlocked in 4, 5 and 5 and diverged in 6, 8 and 7;
    the model in 4-6 and 6-8. Timing moves them; at least one deadlock every time."""
    outcomes = runs(rule, RACY, SEEDS, QUICK_TIMEOUT_S)
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
