"""Figures of a run: per rank, merged into one summary, shown as a rich table or JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rich.table import Table

MAX_LISTED = 12
"""Violations printed before the rest are summarised as a count (--json has them all)."""


@dataclass
class RankReport:
    instance: str
    rank: int
    counts: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    duplicates: int = 0
    record_ms: list[float] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)


@dataclass
class Summary:
    mode: str
    seed: int
    processes: int
    elapsed_s: float
    requests: int
    completed: int
    aborted: int
    hung: int
    late_tasks: int
    signals: int
    delivered: int
    buffered_early: int
    recovered: int
    dropped: dict[str, int]
    superseded: int
    expired: int
    lost: int
    duplicates: int
    record_p50_ms: float | None
    record_p99_ms: float | None
    register_p50_ms: float | None
    register_p99_ms: float | None
    violations: list[str]

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data


def percentile(samples: list[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def summarize(
    mode: str,
    seed: int,
    processes: int,
    elapsed_s: float,
    ranks: list[RankReport],
    register_ms: list[float],
    extra_violations: list[str],
) -> Summary:
    counts: dict[str, int] = {}
    for report in ranks:
        for name, value in report.counts.items():
            counts[name] = counts.get(name, 0) + value
    record_ms = [x for report in ranks for x in report.record_ms]
    dropped = {
        name.removeprefix("dropped_"): n for name, n in sorted(counts.items()) if name.startswith("dropped_") and n
    }
    if counts.get("finish_dropped"):
        dropped["finish"] = counts["finish_dropped"]
    return Summary(
        mode=mode,
        seed=seed,
        processes=processes,
        elapsed_s=round(elapsed_s, 3),
        requests=counts.get("requests", 0),
        completed=counts.get("completed", 0),
        aborted=counts.get("aborted", 0),
        hung=counts.get("hung", 0),
        late_tasks=counts.get("late_tasks", 0),
        signals=counts.get("signals", 0),
        delivered=counts.get("delivered", 0),
        buffered_early=counts.get("buffered", 0),
        recovered=counts.get("recovered", 0),
        dropped=dropped,
        superseded=counts.get("superseded", 0),
        expired=counts.get("expired", 0),
        lost=sum(r.lost for r in ranks),
        duplicates=sum(r.duplicates for r in ranks),
        record_p50_ms=percentile(record_ms, 0.50),
        record_p99_ms=percentile(record_ms, 0.99),
        register_p50_ms=percentile(register_ms, 0.50),
        register_p99_ms=percentile(register_ms, 0.99),
        violations=[v for r in ranks for v in r.violations] + extra_violations,
    )


def table(summary: Summary) -> Table:
    out = Table(title=f"--mode {summary.mode}, seed {summary.seed}, {summary.processes} process(es)")
    out.add_column("figure")
    out.add_column("value", justify="right")
    dropped = ", ".join(f"{k} {v}" for k, v in summary.dropped.items()) or "0"
    rows: list[tuple[str, object]] = [
        ("requests", summary.requests),
        ("  completed / aborted", f"{summary.completed} / {summary.aborted}"),
        ("  task after 1st signal", summary.late_tasks),
        ("signals (layer x chunk)", summary.signals),
        ("delivered at once", summary.delivered),
        ("buffered early", summary.buffered_early),
        ("recovered on register", summary.recovered),
        ("dropped by reason", dropped),
        ("superseded", summary.superseded),
        ("expired", summary.expired),
        ("hung requests", summary.hung),
        ("lost layer-chunks", summary.lost),
        ("sent twice", summary.duplicates),
        ("record p50 / p99 ms", f"{_ms(summary.record_p50_ms)} / {_ms(summary.record_p99_ms)}"),
        ("register p50 / p99 ms", f"{_ms(summary.register_p50_ms)} / {_ms(summary.register_p99_ms)}"),
        ("elapsed s", summary.elapsed_s),
    ]
    for name, value in rows:
        out.add_row(name, str(value))
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def clip(violations: list[str]) -> list[str]:
    if len(violations) <= MAX_LISTED:
        return violations
    return [*violations[:MAX_LISTED], f"... and {len(violations) - MAX_LISTED} more"]
