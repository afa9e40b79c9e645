"""Throughput of several processes recording onto the same slots of one rank at once.

Each worker process opens its own client, waits at a barrier, then calls ``record`` for layer
0 with the same batch of slots (the odd ones with live tasks, set up before the start) until
its time is up: the early layer-0 signal FastDeploy buffers, newest wins, so the buffer keeps
one signal per slot (what a slot holding many layers costs is in ``scaling``). Ours is
one atomic script per call; the naive version retries its WATCH transaction on every
conflict; the floor sends the same entries to a script that does nothing, through redis-py
(``floor``) or packed on a kept connection as the buffer sends its own (``floor_direct``).
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import redis

from ..buffer.sync import SignalBuffer
from ..models import CacheTask
from ..transport import wire
from . import names
from .baselines import Floor, FloorDirect, NaiveRedisBuffer
from .scenarios import entries_of

INSTANCE = "contend"
RANK = 0
NUM_LAYERS = 61
BARRIER_TIMEOUT_S = 60.0
RESULT_TIMEOUT_S = 120.0
KINDS = ("ours", "naive", "floor", "floor_direct")


def kinds(client: Any) -> tuple[str, ...]:
    """The contenders for a server reached like ``client``: the direct floor only where the
    buffer itself sends directly (elsewhere it would measure a path ours does not take)."""
    return KINDS if wire.supports(client) else tuple(kind for kind in KINDS if kind != "floor_direct")


def _worker(kind: str, url: str, name: str, batch: int, duration_s: float, barrier: Any, results: Any) -> None:
    """One contending process: count calls for ``duration_s`` after everyone is ready."""
    entries = entries_of(batch)
    client = redis.Redis.from_url(url)
    calls = 0
    conflicts = 0
    try:
        if kind == "ours":
            buf = SignalBuffer.from_url(url, namespace=name, env={})

            def step() -> None:
                buf.record(INSTANCE, RANK, 0, entries)

        elif kind == "naive":
            naive = NaiveRedisBuffer(client, name)

            def step() -> None:
                naive.record(0, entries)

        elif kind in ("floor", "floor_direct"):
            floor = Floor(client, name) if kind == "floor" else FloorDirect(client, name)
            args = Floor.flat(entries)

            def step() -> None:
                floor.call(args)

        else:
            raise ValueError(f"unknown contender kind {kind!r}")
        barrier.wait(timeout=BARRIER_TIMEOUT_S)
        started = time.perf_counter()
        deadline = started + duration_s
        while time.perf_counter() < deadline:
            step()
            calls += 1
        elapsed = time.perf_counter() - started
        if kind == "naive":
            conflicts = naive.conflicts
        results.put({"calls": calls, "elapsed_s": elapsed, "conflicts": conflicts, "error": None})
    except Exception as exc:  # reported to the parent, which raises it
        results.put({"calls": calls, "elapsed_s": 0.0, "conflicts": conflicts, "error": repr(exc)})
    finally:
        client.close()


def _prepare(kind: str, url: str, name: str, batch: int) -> None:
    """Give the odd slots of the batch a live task, so calls both deliver and buffer (a batch
    of one only buffers, which is where WATCH conflicts)."""
    live = list(range(batch))[1::2]
    if kind == "ours":
        buf = SignalBuffer.from_url(url, namespace=name, env={})
        for slot in live:
            buf.register(
                CacheTask(INSTANCE, RANK, slot, f"r{slot}", need_prefill_tokens=1 << 20, num_layers=NUM_LAYERS)
            )
        buf.close()
    elif kind == "naive":
        client = redis.Redis.from_url(url)
        naive = NaiveRedisBuffer(client, name)
        for slot in live:
            naive.register(slot, f"r{slot}", 1 << 20)
        client.close()


def contend(kind: str, url: str, processes: int, batch: int, duration_s: float) -> dict[str, Any]:
    """Run ``processes`` workers of ``kind``; total signals per second across them."""
    name = names.naive_prefix() if kind == "naive" else names.namespace(kind)
    _prepare(kind, url, name, batch)
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes)
    results = context.Queue()
    workers = [
        context.Process(target=_worker, args=(kind, url, name, batch, duration_s, barrier, results))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=RESULT_TIMEOUT_S) for _ in workers]
    for worker in workers:
        worker.join(timeout=RESULT_TIMEOUT_S)
    errors = [outcome["error"] for outcome in outcomes if outcome["error"]]
    if errors:
        raise RuntimeError(f"{kind} contender failed: {errors[0]}")
    calls = sum(int(outcome["calls"]) for outcome in outcomes)
    elapsed = max(float(outcome["elapsed_s"]) for outcome in outcomes)
    return {
        "impl": kind,
        "processes": processes,
        "batch": batch,
        "calls": calls,
        "elapsed_s": elapsed,
        "conflicts": sum(int(outcome["conflicts"]) for outcome in outcomes),
        "throughput": calls * batch / elapsed if elapsed > 0 else 0.0,
    }


def contend_interleaved(
    kinds: tuple[str, ...], url: str, processes: int, batch: int, duration_s: float, rounds: int
) -> list[dict[str, Any]]:
    """``contend`` for each kind in turn, ``rounds`` times, ``duration_s / rounds`` each,
    summed per kind: a neighbour's load during one run then weighs on every kind alike."""
    totals: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):
        for kind in kinds:
            row = contend(kind, url, processes, batch, duration_s / rounds)
            total = totals.setdefault(kind, {**row, "calls": 0, "elapsed_s": 0.0, "conflicts": 0})
            total["calls"] += row["calls"]
            total["elapsed_s"] += row["elapsed_s"]
            total["conflicts"] += row["conflicts"]
    for total in totals.values():
        elapsed = total["elapsed_s"]
        total["throughput"] = total["calls"] * batch / elapsed if elapsed > 0 else 0.0
        total["rounds"] = rounds
    return [totals[kind] for kind in kinds]
