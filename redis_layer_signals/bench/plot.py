"""The latency-vs-batch-size plot. matplotlib is optional (the ``bench`` extra); only this
module imports it, and only when a plot is asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

IMPLS = (
    ("ours", "redis-layer-signals", "tab:blue"),
    ("floor", "floor: EVALSHA of a no-op", "tab:green"),
    ("floor_direct", "floor sent directly (packed, kept connection)", "tab:olive"),
    ("naive", "naive WATCH/MULTI", "tab:purple"),
)


def latency_vs_batch(result: dict[str, Any], path: Path) -> Path:
    """Write a PNG of p50 latency per record call against entries per call, per record path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [case for case in result["latency"] if case["mode"] == "sync" and case["op"] == "record"]
    paths = sorted({case["path"] for case in cases})
    figure, axes = plt.subplots(1, len(paths), figsize=(6 * len(paths), 4.5), squeeze=False)
    for axis, record_path in zip(axes[0], paths, strict=True):
        for impl, label, color in IMPLS:
            points = sorted(
                (c["size"], c["p50_us"], c["p99_us"]) for c in cases if c["impl"] == impl and c["path"] == record_path
            )
            if not points:
                continue
            sizes = [p[0] for p in points]
            axis.plot(sizes, [p[1] for p in points], marker="o", color=color, label=f"{label} p50")
            axis.plot(sizes, [p[2] for p in points], linestyle=":", color=color, alpha=0.6, label=f"{label} p99")
        axis.set_xscale("log", base=2)
        sizes = sorted({c["size"] for c in cases if c["path"] == record_path})
        axis.set_xticks(sizes, [str(size) for size in sizes])
        axis.minorticks_off()
        axis.set_yscale("log")
        axis.set_xlabel("entries per record call")
        axis.set_ylabel("latency per call (µs)")
        axis.set_title(f"record, {record_path} path")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    machine = result["machine"]
    figure.suptitle(
        f"{machine['cpu_model']}, {machine['cpu_count']} cores, "
        f"Redis {machine['redis_version']}, Python {machine['python']}",
        fontsize=9,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def latency_vs_pending(result: dict[str, Any], path: Path) -> Path:
    """Write a PNG of p50 latency against the pending layers each slot holds: record onto such
    slots (one line per batch size, with its floors) and register of such a slot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(10, 4.5))
    layered = result.get("pending_layers", [])
    for size in sorted({case["size"] for case in layered}):
        for impl, label, color in IMPLS:
            points = sorted((int(c["path"]), c["p50_us"]) for c in layered if c["size"] == size and c["impl"] == impl)
            if points:
                style = "-" if impl == "ours" else ":"
                xs, ys = zip(*points, strict=True)
                axis.plot(xs, ys, marker="o", linestyle=style, color=color, label=f"record {size}: {label}")
    registers = sorted(
        (int(c["path"]), c["p50_us"])
        for c in result["latency"]
        if c["mode"] == "sync" and c["op"] == "register" and c["impl"] == "ours" and int(c["path"]) > 0
    )
    if registers:
        axis.plot(*zip(*registers, strict=True), marker="s", color="tab:red", label="register: redis-layer-signals")
    axis.set_xscale("log", base=2)
    ticks = sorted({int(c["path"]) for c in layered} | {layers for layers, _ in registers})
    if ticks:
        axis.set_xticks(ticks, [str(tick) for tick in ticks])
        axis.minorticks_off()
    axis.set_yscale("log")
    axis.set_xlabel("pending layers per slot")
    axis.set_ylabel("p50 latency per call (µs)")
    axis.set_title("record and register against the layers a slot already holds")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
