"""Ratios, target checks and the markdown rendering of one benchmark result (a plain dict)."""

from __future__ import annotations

from typing import Any

TARGETS: tuple[tuple[str, str, float], ...] = (
    # (ratio name, comparison, limit)
    ("record.buffered.1.ours/floor", "<=", 1.3),
    ("record.delivered.1.ours/floor", "<=", 1.3),
    ("record.buffered.32.ours/floor", "<=", 1.5),
    ("record.delivered.32.ours/floor", "<=", 1.5),
    ("record.buffered.512.ours/floor", "<=", 1.5),
    ("record.delivered.512.ours/floor", "<=", 1.5),
    ("register.1.ours/floor", "<=", 1.3),
    ("finish.ours/floor", "<=", 1.3),
    ("contention.ours/naive", ">=", 5.0),
    ("contention.ours/floor", ">=", 0.6),
    ("memory.bytes_per_pending_signal", "<=", 120.0),
    ("pending.record.32.61/1", "<=", 1.2),
    ("pending.record.512.61/1", "<=", 1.2),
)
"""The performance targets, each checked against a ratio computed from this run's numbers."""

FLOORS = ("floor", "floor_direct")
"""The issue's floor (EVALSHA through redis-py) and the same call sent as the buffer sends its own."""
DIRECT_SUFFIX = "_direct"


def _find(cases: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for case in cases:
        if all(case.get(key) == value for key, value in match.items()):
            return case
    return None


def ratios(result: dict[str, Any]) -> dict[str, float]:
    """Every ratio the report heads with, computed from the measured medians and throughputs."""
    out: dict[str, float] = {}
    cases = result["latency"]
    for case in cases:
        if case["impl"] != "ours":
            continue
        mode, op, path, size = case["mode"], case["op"], case["path"], case["size"]
        if op == "record":
            name = f"record.{path}.{size}"
        elif op == "register":
            name = f"register.{path}"
        else:
            name = "finish"
        if mode == "async":
            name = f"async.{name}"
        for other in (*FLOORS, "naive", "dict"):
            base = _find(cases, mode=mode, op=op, path=path, size=size, impl=other)
            if base is not None and base["p50_us"] > 0:
                out[f"{name}.ours/{other}"] = case["p50_us"] / base["p50_us"]
                if other in FLOORS:
                    out[f"{name}.ours/{other}.p99"] = case["p99_us"] / base["p99_us"]
    contention = result.get("contention", [])
    by = {(row["impl"], row["batch"]): row for row in contention}
    batches = sorted({row["batch"] for row in contention})
    for batch in batches:
        ours = by.get(("ours", batch))
        if ours is None:
            continue
        for other in ("naive", *FLOORS):
            base = by.get((other, batch))
            if base is not None and base["throughput"] > 0:
                out[f"contention.{batch}.ours/{other}"] = ours["throughput"] / base["throughput"]
    if batches:
        # The headline contention ratios: the worst over the measured batch sizes.
        for other in ("naive", *FLOORS):
            values = [out[f"contention.{b}.ours/{other}"] for b in batches if f"contention.{b}.ours/{other}" in out]
            if values:
                out[f"contention.ours/{other}"] = min(values)
    memory = result.get("memory", {}).get("pending", [])
    if memory:
        out["memory.bytes_per_pending_signal"] = max(row["per_signal"] for row in memory)
    out.update(pending_ratios(result.get("pending_layers", [])))
    return out


def pending_ratios(cases: list[dict[str, Any]]) -> dict[str, float]:
    """record onto slots holding N pending layers: ours against both floors at each N, and
    ours at each N against ours at the fewest layers measured (``pending.record.<entries>.<N>/<fewest>``)."""
    out: dict[str, float] = {}
    for case in cases:
        if case["impl"] != "ours":
            continue
        size, layers = case["size"], case["path"]
        name = f"pending.record.{size}.{layers}"
        for other in FLOORS:
            base = _find(cases, path=layers, size=size, impl=other)
            if base is not None and base["p50_us"] > 0:
                out[f"{name}.ours/{other}"] = case["p50_us"] / base["p50_us"]
        measured = [c for c in cases if c["impl"] == "ours" and c["size"] == size]
        fewest = min(measured, key=lambda c: int(c["path"]))
        if fewest is not case and fewest["p50_us"] > 0:
            out[f"{name}/{fewest['path']}"] = case["p50_us"] / fewest["p50_us"]
    return out


def check(values: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    for name, comparison, limit in TARGETS:
        value = values.get(name)
        met = None if value is None else (value <= limit if comparison == "<=" else value >= limit)
        rows.append({"name": name, "comparison": comparison, "limit": limit, "value": value, "met": met})
    return rows


def reference(values: dict[str, float]) -> list[dict[str, Any]]:
    """For each target against the floor, the same ratio against ``floor_direct``: what our
    functions cost over the least possible call sent the way ours is sent. Not a target."""
    rows = []
    for name, _, _ in TARGETS:
        if name.endswith("ours/floor"):
            direct = name + DIRECT_SUFFIX
            rows.append({"name": direct, "target": name, "value": values.get(direct), "floor": values.get(name)})
    return rows


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def target_value(value: float | None, limit: float) -> str:
    """A measured ratio with two decimals, or three when two would print the limit itself
    (1.505 against 1.5 is missed, and "1.50" would not show why)."""
    if value is not None and value != limit and f"{value:.2f}" == f"{limit:.2f}":
        return _fmt(value, 3)
    return _fmt(value, 2)


def _reference_table(values: dict[str, float]) -> list[str]:
    lines = [
        "",
        "## Against the floor sent the same way (reference, not a target)",
        "",
        "The floor above is the project's reference call: EVALSHA of a no-op sent through redis-py's "
        "command path. "
        "The sync buffer sends its FCALLs packed on kept connections and skips that path; "
        "`floor_direct` sends the same no-op the same way, so these ratios show what our scripts "
        "cost over the least possible call (p50 latency; contention: throughput).",
        "",
        "| case | ours/floor_direct | ours/floor |",
        "|---|---:|---:|",
    ]
    for row in reference(values):
        lines.append(
            f"| {row['target'].removesuffix('.ours/floor')} | {_fmt(row['value'], 2)} | {_fmt(row['floor'], 2)} |"
        )
    return lines


def markdown(result: dict[str, Any]) -> str:
    machine = result["machine"]
    lines = [
        "# redis-layer-signals benchmark",
        "",
        f"Machine: {machine['cpu_model']}, {machine['cpu_count']} cores, {machine['platform']}; "
        f"Redis {machine['redis_version']} ({machine['redis_allocator']}); Python {machine['python']}, "
        f"redis-py {machine['redis_py']}, hiredis {machine['hiredis']}. Run at {result['started_at']}.",
        "",
        "## Targets",
        "",
        "| target | measured | limit | met |",
        "|---|---:|---:|---|",
    ]
    for row in result["targets"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[row["met"]]
        measured = target_value(row["value"], row["limit"])
        lines.append(f"| {row['name']} | {measured} | {row['comparison']} {row['limit']:g} | {met} |")
    lines += _reference_table(result["ratios"])
    lines += [
        "",
        "## Latency, one client (p50 / p99 in µs; throughput in signals/s)",
        "",
        "| mode | op | path | size | impl | p50 | p99 | throughput | server µs/call | ours/impl p50 |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    cases = result["latency"]
    for case in cases:
        ours = _find(cases, mode=case["mode"], op=case["op"], path=case["path"], size=case["size"], impl="ours")
        ratio = ours["p50_us"] / case["p50_us"] if ours is not None and case["p50_us"] > 0 else None
        lines.append(
            f"| {case['mode']} | {case['op']} | {case['path']} | {case['size']} | {case['impl']} | "
            f"{_fmt(case['p50_us'])} | {_fmt(case['p99_us'])} | {_fmt(case['throughput'], 0)} | "
            f"{_fmt(case['server_us'])} | {_fmt(ratio, 2)} |"
        )
    if result.get("pending_layers"):
        lines += [
            "",
            "## record onto slots holding pending layers (p50 / p99 in µs)",
            "",
            "Each entry replaces its slot's layer-0 signal; the slot's other layers stay pending. "
            "register against pending layers is in the latency table above (path = pending layers).",
            "",
            "| entries | pending layers | impl | p50 | p99 | server µs/call | ours/impl p50 |",
            "|---:|---:|---|---:|---:|---:|---:|",
        ]
        layered = result["pending_layers"]
        for case in layered:
            ours = _find(layered, path=case["path"], size=case["size"], impl="ours")
            ratio = ours["p50_us"] / case["p50_us"] if ours is not None and case["p50_us"] > 0 else None
            lines.append(
                f"| {case['size']} | {case['path']} | {case['impl']} | {_fmt(case['p50_us'])} | "
                f"{_fmt(case['p99_us'])} | {_fmt(case['server_us'])} | {_fmt(ratio, 2)} |"
            )
    if result.get("contention"):
        lines += [
            "",
            f"## {result['contention'][0]['processes']} processes recording onto the same slots",
            "",
            "| batch | impl | calls | WATCH conflicts | throughput (signals/s) |",
            "|---:|---|---:|---:|---:|",
        ]
        for row in result["contention"]:
            lines.append(
                f"| {row['batch']} | {row['impl']} | {row['calls']} | {row['conflicts']} "
                f"| {_fmt(row['throughput'], 0)} |"
            )
    server = result.get("scaling", {})
    if server:
        lines += ["", "## Server cost (FCALL and EVALSHA time from INFO commandstats)", ""]
        lines += ["| record entries | µs/call | µs/entry |", "|---:|---:|---:|"]
        for row in server.get("record_per_entry", []):
            lines.append(
                f"| {row['entries']} | {_fmt(row['server_us_per_call'])} | {_fmt(row['server_us_per_entry'], 2)} |"
            )
        lines += ["", "| signals buffered elsewhere on the rank | 1-entry record µs/call |", "|---:|---:|"]
        for row in server.get("record_vs_elsewhere", []):
            lines.append(f"| {row['buffered_elsewhere']} | {_fmt(row['server_us_per_call'])} |")
        full = server.get("record_into_full_slot")
        if full:
            lines.append(f"| (same slot holds {full['slot_layers']} layers) | {_fmt(full['server_us_per_call'])} |")
        lines += ["", "| pending layers in the slot | register µs/call |", "|---:|---:|"]
        for row in server.get("register_vs_pending", []):
            lines.append(f"| {row['pending_layers']} | {_fmt(row['server_us_per_call'])} |")
    memory = result.get("memory", {})
    if memory:
        lines += ["", "## Memory (MEMORY USAGE, SAMPLES 0)", "", "| what | bytes | per item |", "|---|---:|---:|"]
        for row in memory.get("pending", []):
            lines.append(
                f"| {row['slots']} slots x {row['layers']} layers pending | {row['bytes']} "
                f"| {_fmt(row['per_signal'])} / signal |"
            )
        for row in memory.get("tasks", []):
            lines.append(f"| {row['tasks']} tasks | {row['bytes']} | {_fmt(row['per_task'])} / task |")
        if "reply" in memory:
            lines.append(
                f"| idempotency reply of one call | {memory['reply']['per_call']} | per call, for retry_s + 5 s |"
            )
    if result.get("redis_benchmark"):
        lines += ["", "## redis-benchmark on the same server", "", "| command | clients | rps | p50 µs | p99 µs |"]
        lines.append("|---|---:|---:|---:|---:|")
        for row in result["redis_benchmark"]:
            lines.append(
                f"| {row['command']} | {row['clients']} | {_fmt(row['rps'], 0)} "
                f"| {_fmt(row['p50_us'])} | {_fmt(row['p99_us'])} |"
            )
    lines += ["", "## Ratios", "", "| ratio | value |", "|---|---:|"]
    for name, value in sorted(result["ratios"].items()):
        lines.append(f"| {name} | {value:.2f} |")
    return "\n".join(lines) + "\n"
