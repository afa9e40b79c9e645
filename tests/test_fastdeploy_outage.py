"""The reference pipeline through a Redis outage: 32 mixed requests, Redis SIGKILLed mid-run and
kept down for several times ``retry_s`` while GPU signals, cache infos and finishes keep
arriving, then restarted empty, restarted from its AOF, or never restarted. In each, every
request finishes, every block of every layer is written exactly once and never before its GPU
signal, every "task added" acknowledgement is sent, the three threads still serve a request at
the end, and every signal is accounted for exactly once (OutageReport.problems)."""

from __future__ import annotations

import dataclasses

import pytest

from redis_layer_signals.simulate.outage import RESTARTS, run_outage

RETRY_S = 0.5
DOWN_S = 2.0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("restart", RESTARTS)
@pytest.mark.parametrize("seed", [1, 5])
def test_outage_loses_nothing_and_sends_nothing_twice(restart: str, seed: int) -> None:
    report = run_outage(restart, requests=32, seed=seed, retry_s=RETRY_S, down_s=DOWN_S)
    assert report.problems() == []
    outcome, health = report.outcome, report.outcome.health
    assert report.down_s >= DOWN_S and DOWN_S >= 4 * RETRY_S
    assert outcome.finished == {p.request.request_id for p in outcome.plans}
    assert health.episodes == 1 and sum(health.local_calls.values()) > 0
    if restart == "never":
        assert health.degraded and health.unwritten > 0, "still behind at the end"
    else:
        assert not health.degraded and health.unwritten == 0 and health.reconciled_entries > 0
        assert outcome.stats is not None and outcome.stats["served_locally"] == sum(health.local_calls.values())


def test_outage_report_names_a_signal_counted_twice() -> None:
    """The accounting check is not vacuous: a recovery counted once more than the signals
    recorded, or a layer-0 signal missing from the counters, is reported."""
    report = run_outage("aof", requests=8, seed=2, retry_s=0.3, down_s=1.0)
    assert report.problems() == []
    assert report.outcome.stats is not None
    stats = dict(report.outcome.stats)
    double = dataclasses.replace(report.outcome, stats={**stats, "recovered": stats["recovered"] + 1})
    assert any("buffered" in p for p in dataclasses.replace(report, outcome=double).problems())
    missing = {**stats, "recorded": stats["recorded"] - 1, "delivered": stats["delivered"] - 1}
    lost = dataclasses.replace(report, outcome=dataclasses.replace(report.outcome, stats=missing))
    assert any("layer-0 signals emitted" in p for p in lost.problems())
    unnoticed = dataclasses.replace(
        report,
        outcome=dataclasses.replace(report.outcome, health=dataclasses.replace(report.outcome.health, episodes=0)),
    )
    assert "the bridge never noticed the outage: it proved nothing" in unnoticed.problems()


def test_outage_run_checks_its_options() -> None:
    with pytest.raises(ValueError, match="restart"):
        run_outage("sometimes")
    with pytest.raises(ValueError, match="down_s"):
        run_outage("aof", retry_s=1.0, down_s=0.5)
