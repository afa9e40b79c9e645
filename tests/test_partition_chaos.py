"""``rls simulate --chaos --chaos-fault partition``: the run's own Redis on a host of its own,
cut off (packets vanish) for a second at a time while the ranks, on another host, keep going;
the simulation's checks find nothing lost, sent twice or left behind."""

from __future__ import annotations

import uuid

import pytest

from redis_layer_signals.errors import InvalidConfig
from redis_layer_signals.simulate import SimConfig, simulate
from redis_layer_signals.simulate.chaos import run_with_chaos
from redis_layer_signals.simulate.hosts import namespaces


@pytest.mark.netns
@pytest.mark.timeout(150)
def test_simulate_chaos_partitions_of_its_own_redis_host_lose_nothing() -> None:
    config = SimConfig(namespace=f"cut-{uuid.uuid4().hex[:6]}", requests=60, instances=1, ranks=2, seed=3)
    summary, report = run_with_chaos(config, 4.0, "always", lambda cfg, tick: simulate(cfg, tick), "partition")
    print(f"\nfigures chaos partition: {len(report.faults)} faults, {summary}")
    assert report.faults and all(f.startswith("partition") for f in report.faults) and report.failed == []
    assert "on a host of its own" in report.target
    assert summary.violations == [] and summary.lost == 0 and summary.duplicates == 0 and summary.hung == 0
    assert summary.completed + summary.aborted == summary.requests == 120
    assert not [n for n in namespaces() if n.startswith(f"rls-{__import__('os').getpid()}-")]


def test_simulate_chaos_partition_needs_the_runs_own_redis() -> None:
    config = SimConfig(url="redis://127.0.0.1:1/0", namespace="x", requests=4)
    with pytest.raises(InvalidConfig, match="chaos_fault"):
        run_with_chaos(config, 1.0, "always", lambda cfg, tick: simulate(cfg, tick), "partition")
