"""Figures of the tensor-parallel harness: per rule, how many runs deadlocked or diverged.

``python benchmarks/tp.py [--seeds N] [--redis URL] [--json PATH]`` runs every rule on the seven
workloads at TP 2 and TP 4 for seeds ``0..N-1`` and prints a markdown table (the one in
benchmarks/results/tp.md). FastDeploy's pre-8034 structure is the test suite's fixture executed
with stub imports (tests/tp_fixture.py), so run it from a checkout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from redis_layer_signals.fastdeploy.demo.tp import GroupOutcome, Rule, run_group
from redis_layer_signals.fastdeploy.demo.tp_rules import (
    all_pending_rule,
    bridge_rule,
    ready_split_rule,
)
from redis_layer_signals.fastdeploy.demo.tp_workloads import WORKLOADS
from tests.tp_fixture import FixtureRule


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="Seeds 0..N-1 per workload and TP size.")
    parser.add_argument("--redis", default="", help="Also run the bridge on this Redis (redis://...).")
    parser.add_argument("--json", type=Path, default=None, help="Write every run's outcome here.")
    parser.add_argument("--only", default="", help="Run only the rules whose label contains this (e.g. bridge).")
    args = parser.parse_args()
    rules: list[tuple[str, Rule]] = [
        ("pre-8034, FastDeploy's structure (fixture)", FixtureRule()),
        ("pre-8034, model", ready_split_rule()),
        ("8035, model", all_pending_rule()),
        (
            "bridge told nranks=1 (each rank alone), memory://",
            bridge_rule(f"memory://{uuid.uuid4().hex}", f"tp-{uuid.uuid4().hex[:8]}", grouped=False),
        ),
        ("bridge, memory://", bridge_rule(f"memory://{uuid.uuid4().hex}", f"tp-{uuid.uuid4().hex[:8]}")),
    ]
    if args.redis:
        rules.append(("bridge, redis-server", bridge_rule(args.redis, f"tp-{uuid.uuid4().hex[:8]}")))
    rules = [(label, rule) for label, rule in rules if args.only in label]
    rows, everything = [], []
    for label, rule in rules:
        started = time.monotonic()
        outcomes: list[GroupOutcome] = []
        for make in WORKLOADS.values():
            for nranks in (2, 4):
                for seed in range(args.seeds):
                    outcome = run_group(rule, make(), nranks, seed)
                    outcomes.append(outcome)
                    everything.append({"rule": label, **_as_json(outcome)})
                    print(outcome.describe(), file=sys.stderr, flush=True)
        rows.append(_row(label, outcomes, time.monotonic() - started))
    print("| rule | runs | deadlocked | divergent sequences | agreed | requests lost | sent twice | seconds |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(row)
    if args.json is not None:
        args.json.write_text(json.dumps(everything, indent=2) + "\n")
    return 0


def _row(label: str, outcomes: list[GroupOutcome], seconds: float) -> str:
    deadlocked = sum(o.deadlocked for o in outcomes)
    divergent = sum(not o.identical for o in outcomes)
    agreed = sum(o.agreed for o in outcomes)
    lost = sum(len(o.lost) for o in outcomes)
    twice = sum(len(o.sent_twice) for o in outcomes)
    return f"| {label} | {len(outcomes)} | {deadlocked} | {divergent} | {agreed} | {lost} | {twice} | {seconds:.0f} |"


def _as_json(outcome: GroupOutcome) -> dict[str, object]:
    return {
        "workload": outcome.workload,
        "nranks": outcome.nranks,
        "seed": outcome.seed,
        "deadlocked": outcome.deadlocked,
        "stuck": [list(names) for names in outcome.stuck],
        "identical": outcome.identical,
        "batches_per_rank": [len(s) for s in outcome.sequences],
        "sent": sorted(outcome.sent),
        "lost": sorted(outcome.lost),
        "sent_twice": sorted(outcome.sent_twice),
        "errors": list(outcome.errors),
    }


if __name__ == "__main__":
    raise SystemExit(main())
