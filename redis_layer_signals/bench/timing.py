"""Latency samples and their summary: percentiles and throughput from measured times only."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Summary:
    """One measured case: ``calls`` timed calls carrying ``signals`` signals each."""

    calls: int
    signals_per_call: int
    p50_us: float
    p99_us: float
    mean_us: float
    wall_s: float
    throughput: float  # signals per second over the wall time of the timed loop

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(sorted_ns: list[int], q: float) -> float:
    """Nearest-rank percentile of sorted samples, in microseconds."""
    if not sorted_ns:
        raise ValueError("no samples")
    rank = min(len(sorted_ns) - 1, max(0, round(q * (len(sorted_ns) - 1))))
    return sorted_ns[rank] / 1000.0


def summarize(samples_ns: list[int], signals_per_call: int, wall_s: float) -> Summary:
    ordered = sorted(samples_ns)
    total_signals = signals_per_call * len(ordered)
    return Summary(
        calls=len(ordered),
        signals_per_call=signals_per_call,
        p50_us=percentile(ordered, 0.50),
        p99_us=percentile(ordered, 0.99),
        mean_us=sum(ordered) / len(ordered) / 1000.0,
        wall_s=wall_s,
        throughput=total_signals / wall_s if wall_s > 0 else 0.0,
    )


def measure_interleaved(
    calls: Mapping[str, Callable[[int], object]], iterations: int, warmup: int, signals_per_call: int
) -> dict[str, Summary]:
    """Time several implementations of one step, alternating them call by call (the order
    rotates each round), so a noisy neighbour slows them all alike and their ratios hold.
    Throughput is over each one's own summed call time."""
    names = list(calls)
    for i in range(warmup):
        for name in names:
            calls[name](i)
    samples: dict[str, list[int]] = {name: [] for name in names}
    clock = time.perf_counter_ns
    for i in range(warmup, warmup + iterations):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            before = clock()
            calls[name](i)
            samples[name].append(clock() - before)
    return {name: summarize(samples[name], signals_per_call, sum(samples[name]) / 1e9) for name in names}


async def measure_interleaved_async(
    calls: Mapping[str, Callable[[int], Any]], iterations: int, warmup: int, signals_per_call: int
) -> dict[str, Summary]:
    """``measure_interleaved`` for coroutine functions."""
    names = list(calls)
    for i in range(warmup):
        for name in names:
            await calls[name](i)
    samples: dict[str, list[int]] = {name: [] for name in names}
    clock = time.perf_counter_ns
    for i in range(warmup, warmup + iterations):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            before = clock()
            await calls[name](i)
            samples[name].append(clock() - before)
    return {name: summarize(samples[name], signals_per_call, sum(samples[name]) / 1e9) for name in names}
