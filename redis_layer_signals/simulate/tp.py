"""``rls simulate --tp N``: each prefill instance is a tensor-parallel group of N ranks.

The ranks of an instance run FastDeploy's cache messager structure (``fastdeploy.tp_rules``)
and share its barriers (``fastdeploy.tp``): every rank reads the same GPU messages and the same
cache_infos, each with a seeded jitter of its own, and every sender waits for the others once
per batch and once per finished task. The group agreed when no barrier timed out, every rank
queued the same sequence of batches, and every request was sent once.

Each instance's workload is made from the simulation's settings (``tp_workloads.random_workload``):
``--requests`` requests in waves of ``--batch`` slots, chunked by ``--chunk-tokens``, a share of
the tasks after their first signal (``--early-share``) and a share of requests aborted
(``--abort-share``). ``--mode redis`` runs ``Layer0Bridge``; ``--mode local`` runs FastDeploy's
process-local fix, which a TP group cannot agree on.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from ..errors import InvalidConfig
from ..fastdeploy.demo.tp import DEFAULT_BARRIER_TIMEOUT_S, DEFAULT_TIMEOUT_S, GroupOutcome, Rule, run_group
from ..fastdeploy.demo.tp_rules import bridge_rule, ready_split_rule
from ..fastdeploy.demo.tp_workloads import random_workload
from .config import Mode, SimConfig

MAX_TP = 8
"""Tensor-parallel ranks per instance FastDeploy runs (2 to 8)."""
SEED_STRIDE = 1000
"""Instance i's workload and jitter use seed ``seed * SEED_STRIDE + i``."""


@dataclass(frozen=True)
class TpReport:
    """What ``rls simulate --tp`` found, per instance."""

    mode: str
    tp: int
    seed: int
    groups: list[GroupOutcome]
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return all(group.agreed for group in self.groups)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "tp": self.tp,
            "seed": self.seed,
            "elapsed_s": round(self.elapsed_s, 3),
            "ok": self.ok,
            "instances": [
                {
                    "instance": f"p{index}",
                    "agreed": group.agreed,
                    "deadlocked": group.deadlocked,
                    "stuck": [list(names) for names in group.stuck],
                    "stalled": group.stalled,
                    "identical_sequences": group.identical,
                    "batches_per_rank": [len(sequence) for sequence in group.sequences],
                    "requests": len(group.expected),
                    "sent": len(group.sent),
                    "lost": sorted(group.lost),
                    "sent_twice": sorted(group.sent_twice),
                    "errors": list(group.errors),
                }
                for index, group in enumerate(self.groups)
            ],
        }

    def problems(self) -> list[str]:
        return [f"p{index}: {group.describe()}" for index, group in enumerate(self.groups) if not group.agreed]


def check_tp(config: SimConfig, tp: int) -> None:
    """Refuse what ``--tp`` cannot run, naming the setting."""
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= MAX_TP:
        raise InvalidConfig("tp", tp, f"must be an int in [1, {MAX_TP}]")
    if config.mode is Mode.DROP:
        raise InvalidConfig("mode", config.mode.value, "--tp runs redis (the bridge) or local (FastDeploy's fix)")


def simulate_tp(config: SimConfig, tp: int, progress: Callable[[int], None] | None = None) -> TpReport:
    """Run every instance as a TP group of ``tp`` ranks, side by side, and report each group."""
    check_tp(config, tp)
    tick = progress or (lambda _n: None)
    started = time.monotonic()
    run_id = secrets.token_hex(3)
    rule = _rule(config)
    outcomes: dict[int, GroupOutcome] = {}
    failures: dict[int, BaseException] = {}

    def instance(index: int) -> None:
        seed = config.seed * SEED_STRIDE + index
        workload = random_workload(
            seed,
            config.requests,
            config.batch,
            config.chunk_tokens,
            config.max_prompt_tokens,
            config.early_share,
            config.abort_share,
            prefix=f"p{index}",
        )
        try:
            outcomes[index] = run_group(
                rule,
                workload,
                tp,
                seed,
                group=f"p{index}-{run_id}",
                layers=config.layers,
                barrier_timeout_s=max(DEFAULT_BARRIER_TIMEOUT_S, config.hang_timeout_s),
                timeout_s=min(config.timeout_s, DEFAULT_TIMEOUT_S + config.hang_timeout_s),
            )
        except BaseException as exc:  # reported below, with the instance it ended
            failures[index] = exc
        tick(1)

    threads = [threading.Thread(target=instance, args=(i,), daemon=True) for i in range(config.instances)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:  # a group that could not start (Redis unreachable, a bad setting): its error
        raise failures[min(failures)]
    return TpReport(
        mode=config.mode.value,
        tp=tp,
        seed=config.seed,
        groups=[outcomes[i] for i in range(config.instances)],
        elapsed_s=time.monotonic() - started,
    )


def _rule(config: SimConfig) -> Rule:
    if config.mode is Mode.LOCAL:
        return ready_split_rule()
    return bridge_rule(config.url, config.namespace, pending_ttl_s=max(1.0, config.hang_timeout_s))


def tp_table(report: TpReport) -> Table:
    out = Table(title=f"--tp {report.tp} --mode {report.mode}, seed {report.seed}")
    for column in ("instance", "requests", "sent", "lost", "sent twice", "batches per rank", "sequences", "barriers"):
        out.add_column(column, justify="left" if column in ("instance", "sequences", "barriers") else "right")
    for index, group in enumerate(report.groups):
        barriers = "timed out" if group.deadlocked else ("stalled" if group.stalled else "ok")
        out.add_row(
            f"p{index}",
            str(len(group.expected)),
            str(len(group.sent)),
            str(len(group.lost)),
            str(len(group.sent_twice)),
            "/".join(str(len(sequence)) for sequence in group.sequences),
            "identical" if group.identical else "divergent",
            barriers,
        )
    return out
