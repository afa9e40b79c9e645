"""Many requests, chunked, in every order: early signals, late ones, and races with the task.

Once in one process (fakeredis and a real redis-server), and once with the cache-task adder in
a spawned process that shares only a real Redis (and the ready queue) with the signal consumer
and the sender. Either way nothing is lost: every request finishes, every block of every layer
is written exactly once, and every recorded signal is accounted for in the counters."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from redis_layer_signals.fastdeploy.demo.workload import ORDERS, Outcome, Plan, make_plans, run
from redis_layer_signals.fastdeploy.health import BridgeHealth
from tests.servers import RedisServer
from tests.topology import ClusterTopology

REQUESTS = 32
LAYERS = 4
WAIT_S = 30.0
"""Bound on a whole run; it takes about a second."""


@pytest.fixture(params=["fake", "real"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def assert_nothing_lost(outcome: Outcome) -> None:
    plans = outcome.plans
    assert {p.order for p in plans} == set(ORDERS)
    assert outcome.finished == {p.request.request_id for p in plans}
    expected = {
        (p.request.slot, layer, block): 1
        for p in plans
        for layer in range(LAYERS)
        for block in p.request.src_block_ids[p.request.decode_cached_blocks :]
    }
    assert outcome.block_writes == expected
    assert (outcome.premature, outcome.errors) == (0, 0)
    assert outcome.problems() == []

    stats = outcome.stats
    assert stats is not None
    dropped = sum(v for k, v in stats.items() if k.startswith("dropped_"))
    assert stats["recorded"] == outcome.layer0_signals(), "every layer-0 entry the GPU emitted, recorded once"
    assert stats["recorded"] == stats["delivered"] + stats["buffered"]
    assert stats["buffered"] == stats["recovered"] + stats["superseded"] + dropped + stats["finish_dropped"]
    assert (dropped, stats["expired"], stats["finish_dropped"]) == (0, 0, 0)
    if not stats.get("served_locally") and not stats.get("degraded_ms"):
        # Redis decided every hand-off (no hook went past its budget and decided locally, as a
        # starved machine can make one do): each order then shows in its own counter.
        assert stats["delivered"] > 0 and stats["recovered"] > 0, "both orders must have happened"
    assert stats["registered"] == stats["finished"] == REQUESTS


@pytest.mark.parametrize("seed", [1, 2])
def test_workload_in_one_process_loses_nothing(url: str, namespace: str, seed: int) -> None:
    assert_nothing_lost(run(url, namespace, requests=REQUESTS, seed=seed, layers=LAYERS, timeout_s=WAIT_S))


@pytest.mark.timeout(120)
def test_adder_in_another_process_sharing_redis_loses_nothing(redis_server: RedisServer, namespace: str) -> None:
    """The signal consumer and sender here, the cache-task adder in a spawned process: the
    hand-off of each early signal is decided in Redis alone."""
    outcome = run(redis_server.url, namespace, requests=REQUESTS, seed=3, layers=LAYERS, adder_process=True)
    assert_nothing_lost(outcome)


def test_workload_on_a_three_primary_cluster_loses_nothing(cluster: ClusterTopology, namespace: str) -> None:
    """The bridge's calls (record, register, task reads, finish, stats) through a Cluster client."""
    assert_nothing_lost(run(cluster.url, namespace, requests=REQUESTS, seed=4, layers=LAYERS, timeout_s=WAIT_S))


def test_plans_are_seeded_and_cover_every_order() -> None:
    first, again = make_plans(7, 12), make_plans(7, 12)
    assert [(p.request, p.order, p.early_chunks) for p in first] == [
        (p.request, p.order, p.early_chunks) for p in again
    ]
    assert all(1 <= p.early_chunks <= len(p.chunks) for p in first if p.order == "early")
    assert all(p.early_chunks == 0 for p in first if p.order != "early")


def test_command_line_run_with_adder_process_reports_nothing_lost(redis_server: RedisServer) -> None:
    command = [sys.executable, "-m", "redis_layer_signals.fastdeploy", "--url", redis_server.url, "--adder-process"]
    done = subprocess.run([*command, "--requests", "12"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "requests finished: 12/12" in done.stdout and "lost nothing" in done.stdout


def outcome(plans: list[Plan], finished: set[str], writes: dict[tuple[int, int, int], int], **changes: Any) -> Outcome:
    ids = {p.request.request_id for p in plans}
    health = BridgeHealth(False, 0, 0.0, {}, 0, 0, {}, 0)
    fields: dict[str, Any] = {
        "plans": plans,
        "layers": 1,
        "finished": finished,
        "acks": ids,
        "block_writes": writes,
        "premature": 0,
        "errors": 0,
        "stats": {},
        "local_counts": {},
        "local_pending": 0,
        "health": health,
        "alive_at_end": True,
        "seconds": 0.0,
    }
    return Outcome(**{**fields, **changes})


def test_outcome_reports_a_lost_request() -> None:
    """The report the command line prints is not vacuous: a missing write, an unfinished
    request, a missing acknowledgement and a stopped thread are named."""
    plans = make_plans(1, 2)
    both = {"req-0", "req-1"}
    writes = dict.fromkeys(outcome(plans, both, {}).expected(), 1)
    assert outcome(plans, both, writes).problems() == []
    first = next(iter(writes))
    broken = outcome(plans, {"req-0"}, {**writes, first: 2})
    assert broken.problems() == ["1 requests never finished", "1 blocks written more than once"]
    unacked = outcome(plans, both, writes, acks={"req-1"}, alive_at_end=False)
    assert unacked.problems() == [
        "1 'task added' acknowledgements never sent",
        "the messager's threads stopped serving",
    ]
    del writes[first]
    assert outcome(plans, both, writes).problems() == ["1 block writes missing"]


@pytest.mark.timeout(240)
def test_racing_mix_a_hundred_times_never_lets_a_batch_overtake_its_slot(
    redis_server: RedisServer, namespace: str
) -> None:
    """With every bridge call outside FastDeploy's lock, a recovered batch must still reach the
    sender before any later batch of its slot: if it came after a later chunk's batch that
    finished the request, the sender's assertion (FastDeploy's own) would fail on the missing
    task, and the run would report a thread error. A hundred seeded mixes on a real Redis."""
    for seed in range(100):
        outcome = run(redis_server.url, f"{namespace}-{seed}", requests=8, seed=seed, layers=2, timeout_s=WAIT_S)
        assert outcome.problems() == [], (seed, outcome.problems())
