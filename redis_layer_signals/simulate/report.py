"""Figures of a run: per rank, merged into one summary, shown as a rich table or JSON."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.table import Table

from ..transport.connection import MEMORY, scheme_of

MAX_LISTED = 12
"""Violations printed before the rest are summarised as a count (--json has them all)."""
MODE_WORDS = {
    "redis": "this library's buffer",
    "drop": "before the fix: early signals dropped",
    "local": "FastDeploy's fix: a dict per process",
}
"""What each ``--mode`` runs, for the table's header."""
DROP_WORDS = {
    "finish": "the aborted requests' waiting signals, dropped by their finish, as designed",
    "no_task": "no task yet, so dropped at once: the bug the buffer fixes",
    "over_need": "more tokens than their task needs",
    "non_positive": "no tokens written",
    "layer_out_of_range": "a layer their task does not have",
    "request_mismatch": "signals naming another request",
    "expired": "older than the pending TTL when their task came",
}
"""Why ``dropped by reason`` dropped each signal, by reason (``DropReason``, ``finish_dropped``
as ``finish``, and ``--mode drop``'s ``no_task``)."""


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
    server: str = ""
    """The server the run used, as ``server_words`` names it (no password)."""

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
    server: str = "",
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
        server=server,
    )


def without_password(url: str) -> str:
    """``url`` as it may be printed: its password, if any, masked."""
    return re.sub(r"(://[^/@:]*:)[^@/]+@", r"\1***@", url)


def server_words(url: str) -> str:
    """Where a run's signals waited, as its header says it: ``memory://`` is the embedded
    server of this process (whatever ``--mode`` says), anything else the URL given."""
    if scheme_of(url) == MEMORY:
        return "the embedded server (memory://, in this process)"
    return without_password(url)


def table(summary: Summary) -> Table:
    """The figures, each with what it means in a line: a reader of the demo needs no docs to
    tell a designed drop from a lost signal."""
    processes = f"{summary.processes} process" + ("es" if summary.processes != 1 else "")
    mode = f"--mode {summary.mode} ({MODE_WORDS.get(summary.mode, summary.mode)}), seed {summary.seed}, {processes}"
    out = Table(title=f"run on {summary.server}\n{mode}" if summary.server else mode)
    out.add_column("figure")
    out.add_column("value", justify="right")
    out.add_column("what it means")
    dropped = ", ".join(f"{k} {v}" for k, v in summary.dropped.items()) or "0"
    why = "; ".join(f"{k}: {_drop_words(k, summary)}" for k in summary.dropped)
    rows: list[tuple[str, object, str]] = [
        ("requests", summary.requests, "--requests on every rank of the run"),
        (
            "  completed / aborted",
            f"{summary.completed} / {summary.aborted}",
            "aborted on purpose (--abort-share)",
        ),
        ("  task after 1st signal", summary.late_tasks, "the race the buffer is for"),
        ("signals (layer x chunk)", summary.signals, "one per layer of each chunk"),
        ("delivered at once", summary.delivered, "task there: straight to the sender"),
        ("buffered early", summary.buffered_early, "no task yet: waited for register"),
        ("recovered on register", summary.recovered, "buffered, handed back by register"),
        ("dropped by reason", dropped, why or "none"),
        (
            "superseded",
            summary.superseded,
            "buffered, replaced by a newer one",
        ),
        ("expired", summary.expired, "buffered past the pending TTL"),
        ("hung requests", summary.hung, "unsent --hang-timeout-s after prefill; must be 0"),
        ("lost layer-chunks", summary.lost, "never sent; must be 0"),
        ("sent twice", summary.duplicates, "layer-chunks sent again; must be 0"),
        (
            "record p50 / p99 ms",
            f"{_ms(summary.record_p50_ms)} / {_ms(summary.record_p99_ms)}",
            "one record call: a layer of a step",
        ),
        (
            "register p50 / p99 ms",
            f"{_ms(summary.register_p50_ms)} / {_ms(summary.register_p99_ms)}",
            "one register call, with recovery",
        ),
        ("elapsed s", summary.elapsed_s, "the whole run"),
    ]
    for name, value, meaning in rows:
        out.add_row(name, str(value), meaning)
    return out


def _drop_words(reason: str, summary: Summary) -> str:
    if reason == "finish" and summary.hung:  # a hung request's finish drops what it still waited for
        return "the aborted and hung requests' waiting signals, dropped by their finish"
    return DROP_WORDS.get(reason, "refused by register")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def clip(violations: list[str]) -> list[str]:
    if len(violations) <= MAX_LISTED:
        return violations
    return [*violations[:MAX_LISTED], f"... and {len(violations) - MAX_LISTED} more"]
