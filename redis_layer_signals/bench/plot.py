"""The two plots of a benchmark run. matplotlib is optional (the ``bench`` extra); only this
module imports it, and only when a plot is asked for.

Each implementation has one colour of the Okabe-Ito palette (told apart with colour-blindness
too) and the same colour on both plots; each plot has one legend, under its panels, that names
the implementations and what solid and dotted lines are, so it reads without the page's text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

IMPLS = (
    ("ours", "redis-layer-signals", "#0072B2"),
    ("dict", "FastDeploy's in-process dict (no Redis)", "#E69F00"),
    ("naive", "naive client (WATCH/MULTI)", "#222222"),
    ("floor", "floor: EVALSHA of a no-op via redis-py", "#009E73"),
    ("floor_direct", "floor sent like ours (packed, kept connection)", "#CC79A7"),
)
"""(implementation in results.json, legend label, colour)."""


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_log_axis(axis: Any) -> None:
    """A log y axis labelled 100, 1000 rather than 10^2, 10^3."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    axis.set_yscale("log")
    axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}" if value >= 1 else f"{value:g}"))
    axis.yaxis.set_minor_formatter(FuncFormatter(lambda *_: ""))
    axis.grid(True, which="major", alpha=0.3)


def _legend(figure: Any, axes: Any, *, styles: bool) -> None:
    """One legend for the figure, under its panels: the implementations shown, by colour, and
    (when p50 and p99 are both drawn) what a solid and a dotted line are."""
    from matplotlib.lines import Line2D

    shown = {line.get_label() for axis in axes for line in axis.get_lines()}
    handles = [Line2D([], [], color=color, marker="o", label=label) for _, label, color in IMPLS if label in shown]
    if styles:
        handles += [
            Line2D([], [], color="#888888", linestyle="-", label="solid line: p50 (median)"),
            Line2D([], [], color="#888888", linestyle=":", label="dotted line: p99"),
        ]
    figure.legend(handles=handles, loc="lower center", ncol=2, fontsize=8.5, frameon=False)


def latency_vs_batch(result: dict[str, Any], path: Path) -> Path:
    """Write a PNG of record's latency per call (p50 solid, p99 dotted) against entries per
    call, one panel per record path, for each implementation the run measured."""
    plt = _pyplot()
    cases = [case for case in result["latency"] if case["mode"] == "sync" and case["op"] == "record"]
    paths = sorted({case["path"] for case in cases})
    figure, axes = plt.subplots(1, len(paths), figsize=(4 * len(paths), 5.4), squeeze=False, sharey=True)
    for axis, record_path in zip(axes[0], paths, strict=True):
        for impl, label, color in IMPLS:
            points = sorted(
                (c["size"], c["p50_us"], c["p99_us"]) for c in cases if c["impl"] == impl and c["path"] == record_path
            )
            if not points:
                continue
            sizes = [p[0] for p in points]
            axis.plot(sizes, [p[1] for p in points], marker="o", color=color, label=label)
            axis.plot(sizes, [p[2] for p in points], linestyle=":", color=color, alpha=0.8, label="p99")
        axis.set_xscale("log", base=2)
        sizes = sorted({c["size"] for c in cases if c["path"] == record_path})
        axis.set_xticks(sizes, [str(size) for size in sizes])
        axis.minorticks_off()
        _plain_log_axis(axis)
        axis.set_xlabel("signals per record call")
        axis.set_title(f"record, {record_path}\n({_path_meaning(record_path)})", fontsize=10)
    axes[0][0].set_ylabel("latency per call, µs (log scale)")
    _legend(figure, axes[0], styles=True)
    figure.suptitle(_machine(result), fontsize=8)
    figure.tight_layout(rect=(0, 0.2, 1, 1))
    return _save(plt, figure, path)


def latency_vs_pending(result: dict[str, Any], path: Path) -> Path:
    """Write a PNG of p50 latency against the pending layers each slot holds: record of 32 and
    of 512 entries onto such slots, and register of such a slot, one panel each."""
    plt = _pyplot()
    layered = result.get("pending_layers", [])
    registers = [c for c in result["latency"] if c["mode"] == "sync" and c["op"] == "register"]
    panels: list[tuple[str, list[dict[str, Any]]]] = [
        (f"record of {size} entries", [c for c in layered if c["size"] == size])
        for size in sorted({case["size"] for case in layered})
    ]
    panels.append(("register of one task", registers))
    figure, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 4.8), squeeze=False)
    for axis, (title, cases) in zip(axes[0], panels, strict=True):
        ticks = sorted({int(c["path"]) for c in cases})
        for impl, label, color in IMPLS:
            points = sorted((int(c["path"]), c["p50_us"]) for c in cases if c["impl"] == impl)
            if points:
                xs = [ticks.index(layers) for layers, _ in points]
                axis.plot(xs, [p50 for _, p50 in points], marker="o", color=color, label=label)
        axis.set_xticks(range(len(ticks)), [str(tick) for tick in ticks])
        _plain_log_axis(axis)
        axis.set_xlabel("pending layers in the slot")
        axis.set_title(title, fontsize=10)
    axes[0][0].set_ylabel("p50 latency per call, µs (log scale)")
    _legend(figure, axes[0], styles=False)
    figure.suptitle(_machine(result), fontsize=8)
    figure.tight_layout(rect=(0, 0.2, 1, 1))
    return _save(plt, figure, path)


def _path_meaning(record_path: str) -> str:
    return {"buffered": "no task yet, kept in Redis", "delivered": "task live, handed back"}.get(record_path, "")


def _machine(result: dict[str, Any]) -> str:
    machine = result["machine"]
    return (
        f"Run of {result.get('started_at', '?')}\n{machine['cpu_model']}, {machine['cpu_count']} cores, "
        f"Redis {machine['redis_version']}, Python {machine['python']}"
    )


def _save(plt: Any, figure: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
