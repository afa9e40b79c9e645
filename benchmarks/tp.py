"""Figures of the tensor-parallel harness: per rule, how many runs deadlocked or diverged.

``python benchmarks/tp.py [--seeds N] [--redis URL] [--json PATH]`` runs every rule on the seven
workloads at TP 2 and TP 4 for seeds ``0..N-1`` and prints a markdown table (the one in
benchmarks/results/tp.md). FastDeploy's pre-8034 structure, and the same file patched by
``rls fastdeploy patch``, are the test suite's fixture executed with stub imports
(tests/tp_fixture.py), so run it from a checkout.

``--adders free --sender pool`` runs FastDeploy develop's threads (tp.py's module doc): no
adders' barrier (PR 7724), a sender writing on a thread pool (PR 7931). The fixture's sender is
its own, so its rows keep one sender thread (their adders are free all the same).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from redis_layer_signals.fastdeploy.demo.tp import ADDERS, SENDERS, GroupOutcome, Rule, run_group
from redis_layer_signals.fastdeploy.demo.tp_rules import (
    all_pending_rule,
    bridge_rule,
    ready_split_rule,
)
from redis_layer_signals.fastdeploy.demo.tp_workloads import WORKLOADS
from tests.tp_fixture import FixtureRule, PatchedFixtureRule


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="Seeds 0..N-1 per workload and TP size.")
    parser.add_argument("--redis", default="", help="Also run the bridge on this Redis (redis://...).")
    parser.add_argument("--json", type=Path, default=None, help="Write every run's outcome here.")
    parser.add_argument("--only", default="", help="Run only the rules whose label contains this (e.g. bridge).")
    parser.add_argument("--adders", choices=ADDERS, default="lockstep", help="free: develop's (PR 7724).")
    parser.add_argument("--sender", choices=SENDERS, default="one", help="pool: develop's (PR 7931).")
    parser.add_argument("--adder-jitter-s", type=float, default=None, help="The adders' jitter per batch.")
    args = parser.parse_args()

    def memory() -> tuple[str, str]:
        return f"memory://{uuid.uuid4().hex}", f"tp-{uuid.uuid4().hex[:8]}"

    own = " (its own sender)" if args.sender == "pool" else ""
    rules: list[tuple[str, Rule, bool]] = [
        (f"pre-8034, FastDeploy's structure (fixture){own}", FixtureRule(), False),
        ("pre-8034, model", ready_split_rule(), True),
        ("8035, model", all_pending_rule(), True),
        ("bridge told nranks=1 (each rank alone), memory://", bridge_rule(*memory(), grouped=False), True),
        ("bridge, memory://", bridge_rule(*memory()), True),
        (f"bridge in FastDeploy's structure (patched fixture){own}, memory://", PatchedFixtureRule(*memory()), False),
    ]
    if args.redis:
        rules.append(("bridge, redis-server", bridge_rule(args.redis, f"tp-{uuid.uuid4().hex[:8]}"), True))
        rules.append(
            (
                f"bridge in FastDeploy's structure (patched fixture){own}, redis-server",
                PatchedFixtureRule(args.redis, f"tp-{uuid.uuid4().hex[:8]}"),
                False,
            )
        )
    rules = [entry for entry in rules if args.only in entry[0]]
    rows, everything = [], []
    for label, rule, poolable in rules:
        started = time.monotonic()
        outcomes: list[GroupOutcome] = []
        threads = {
            "adders": args.adders,
            "sender": args.sender if poolable else "one",
            "adder_jitter_s": args.adder_jitter_s,
        }
        for make in WORKLOADS.values():
            for nranks in (2, 4):
                for seed in range(args.seeds):
                    outcome = run_group(rule, make(), nranks, seed, **threads)
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
        "adders": outcome.adders,
        "sender": outcome.sender,
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
        "task_waits": list(outcome.task_waits),
    }


if __name__ == "__main__":
    raise SystemExit(main())
