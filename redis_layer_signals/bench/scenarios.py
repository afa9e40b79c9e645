"""Single-client latency cases: the same step on the buffer and on each baseline, interleaved.

Every case runs on fresh keys (its own namespace or prefix) so no case sees another's data,
and the implementations take turns call by call (``timing.measure_interleaved``), so the
ratios hold on a noisy machine. ``record`` is timed on two paths: ``buffered`` (no task yet:
the early signal is stored; the same layer again on each call, so the buffer holds one signal
per slot as FastDeploy's fix does) and ``delivered`` (the slots' tasks are live). ``register``
is timed with 0, 1 or 61 pending layers waiting in its slot, ``finish`` on a registered slot.
The floor of every case sends the case's entries (one for register and finish); in the sync
cases a second floor, ``floor_direct``, sends the same call the way the buffer sends its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis

from ..buffer.aio import AsyncSignalBuffer
from ..buffer.sync import SignalBuffer
from ..models import CacheTask
from ..transport import wire
from . import names
from .baselines import AsyncFloor, Floor, FloorDirect, LocalDictBuffer, NaiveRedisBuffer
from .commandstats import server_time
from .timing import Summary, measure_interleaved, measure_interleaved_async

INSTANCE = "bench"
RANK = 0
NUM_LAYERS = 61
NEED = 1 << 20
TOKENS = 2048
SERVER_PASS_CALLS = 200
"""Calls of a separate, non-interleaved pass that reads the server time of ours and the floor."""


@dataclass(frozen=True)
class Case:
    """One measured row: which operation, on which path and size, by which implementation."""

    mode: str  # "sync" or "async"
    op: str  # "record", "register", "finish"
    path: str  # record: "buffered"/"delivered"; register: pending layers; finish: "-"
    size: int  # entries per record call, or pending layers for register
    impl: str  # "ours", "floor", "floor_direct", "naive", "dict"
    summary: Summary
    server_us: float | None = None  # FCALL (ours) or EVALSHA (floor) time on the server per call

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "op": self.op,
            "path": self.path,
            "size": self.size,
            "impl": self.impl,
            "server_us": self.server_us,
            **self.summary.as_dict(),
        }


def task(slot: int, request_id: str) -> CacheTask:
    return CacheTask(INSTANCE, RANK, slot, request_id, need_prefill_tokens=NEED, num_layers=NUM_LAYERS)


def entries_of(size: int) -> list[tuple[int, int]]:
    return [(slot, TOKENS + slot) for slot in range(size)]


def runs_for(iterations: int, size: int) -> int:
    """Fewer rounds for big batches: about the same number of signals, at least 30 calls."""
    return max(30, min(iterations, iterations * 32 // max(size, 32)))


def slot_rounds(iterations: int, warmup: int, slots: int = 512) -> Iterator[tuple[list[int], int]]:
    """Rounds of up to ``slots`` fresh slots, one call per slot, ``iterations + warmup`` calls in
    all; yields each round's slots and how many of its first calls are warm-up (only in the first
    round, and never all of it)."""
    total = iterations + warmup
    done = 0
    while done < total:
        batch = list(range(min(slots, total - done)))
        yield batch, min(warmup if done == 0 else 0, len(batch) - 1)
        done += len(batch)


def merge(parts: list[Summary]) -> Summary:
    """One summary over several rounds: mean and throughput exact, p50/p99 the call-weighted
    mean of the rounds' (the rounds are equal-sized except the last)."""
    calls = sum(part.calls for part in parts)
    wall = sum(part.wall_s for part in parts)
    return Summary(
        calls=calls,
        signals_per_call=parts[0].signals_per_call,
        p50_us=sum(part.p50_us * part.calls for part in parts) / calls,
        p99_us=sum(part.p99_us * part.calls for part in parts) / calls,
        mean_us=sum(part.mean_us * part.calls for part in parts) / calls,
        wall_s=wall,
        throughput=calls * parts[0].signals_per_call / wall if wall > 0 else 0.0,
    )


class SyncCases:
    """Runs every sync case against one server URL."""

    def __init__(self, url: str, iterations: int, warmup: int) -> None:
        self.url = url
        self.iterations = iterations
        self.warmup = warmup
        self.client = redis.Redis.from_url(url)
        self.floor = Floor(self.client, names.floor_key())
        # Only where the buffer itself sends directly; elsewhere both go through redis-py.
        self.floor_direct = FloorDirect(self.client, names.floor_key()) if wire.supports(self.client) else None
        self._ids = iter(range(1 << 62))

    def close(self) -> None:
        if self.floor_direct is not None:
            self.floor_direct.close()
        self.client.close()

    def _floors(self, args: list[int]) -> dict[str, Callable[[int], object]]:
        """The timed floor steps of a case, each sending ``args``."""
        steps: dict[str, Callable[[int], object]] = {"floor": lambda _i: self.floor.call(args)}
        direct = self.floor_direct
        if direct is not None:
            steps["floor_direct"] = lambda _i: direct.call(args)
        return steps

    def _request(self) -> str:
        return f"r{next(self._ids)}"

    def _buffer(self) -> SignalBuffer:
        return SignalBuffer.from_url(self.url, namespace=names.namespace(), env={})

    def _naive(self) -> NaiveRedisBuffer:
        return NaiveRedisBuffer(self.client, names.naive_prefix())

    def _server_us(self, call: Callable[[], object], calls: int) -> float:
        def many() -> None:
            for _ in range(calls):
                call()

        return server_time(self.client, many)

    def _cases(
        self, op: str, path: str, size: int, results: dict[str, Summary], server: dict[str, float]
    ) -> list[Case]:
        return [Case("sync", op, path, size, impl, summary, server.get(impl)) for impl, summary in results.items()]

    def record(self, size: int, path: str) -> list[Case]:
        entries = entries_of(size)
        args = Floor.flat(entries)
        runs = runs_for(self.iterations, size)
        buf, naive, local = self._buffer(), self._naive(), LocalDictBuffer()
        try:
            if path == "delivered":
                for slot, _ in entries:
                    request = self._request()
                    buf.register(task(slot, request))
                    naive.register(slot, request, NEED)
                    local.register(slot, request, NEED)
            results = measure_interleaved(
                {
                    **self._floors(args),
                    "ours": lambda _i: buf.record(INSTANCE, RANK, 0, entries),
                    "naive": lambda _i: naive.record(0, entries),
                    "dict": lambda _i: local.record(0, entries),
                },
                runs,
                self.warmup,
                size,
            )
            calls = min(runs, SERVER_PASS_CALLS)
            server = {
                "ours": self._server_us(lambda: buf.record(INSTANCE, RANK, 0, entries), calls),
                "floor": self._server_us(lambda: self.floor.call(args), calls),
            }
        finally:
            buf.close()
        return self._cases("record", path, size, results, server)

    def record_onto_pending(self, size: int, layers: int) -> list[Case]:
        """``record`` of ``size`` entries (layer 0 again) onto slots that already hold ``layers``
        pending layers each (0 to layers - 1): each entry replaces its slot's layer-0 signal and
        the other layers stay, as when a task comes late and its first chunk's layers wait. Ours
        against both floors, interleaved; the case's path is the pending layers."""
        entries = entries_of(size)
        args = Floor.flat(entries)
        buf = self._buffer()
        try:
            for layer in range(layers):
                buf.record(INSTANCE, RANK, layer, entries)
            results = measure_interleaved(
                {**self._floors(args), "ours": lambda _i: buf.record(INSTANCE, RANK, 0, entries)},
                runs_for(self.iterations, size),
                self.warmup,
                size,
            )
            calls = min(runs_for(self.iterations, size), SERVER_PASS_CALLS)
            server = {"ours": self._server_us(lambda: buf.record(INSTANCE, RANK, 0, entries), calls)}
        finally:
            buf.close()
        return self._cases("record", str(layers), size, results, server)

    def _slot_rounds(
        self,
        slots: int,
        prefill: Callable[[list[int]], None],
        steps: dict[str, Callable[[int], object]],
        cleanup: Callable[[list[int]], None],
    ) -> dict[str, Summary]:
        """Interleave ``steps[impl](slot)`` over rounds of up to ``slots`` fresh slots, each round
        prepared by ``prefill`` and cleaned by ``cleanup`` outside the timed calls."""
        parts: dict[str, list[Summary]] = {name: [] for name in steps}
        for batch, warm in slot_rounds(self.iterations, self.warmup, slots):
            prefill(batch)
            timed: dict[str, Callable[[int], object]] = {
                name: (lambda i, step=step, batch=batch: step(batch[i]))  # type: ignore[misc]
                for name, step in steps.items()
            }
            for name, summary in measure_interleaved(timed, len(batch) - warm, warm, 1).items():
                parts[name].append(summary)
            cleanup(batch)
        return {name: merge(found) for name, found in parts.items()}

    def register(self, pending: int, slots: int = 512) -> list[Case]:
        buf, naive, local = self._buffer(), self._naive(), LocalDictBuffer()
        one = Floor.flat(entries_of(1))
        held: dict[str, dict[int, str]] = {"ours": {}, "naive": {}, "dict": {}}
        try:

            def fill(batch: list[int]) -> None:
                for layer in range(pending):
                    signals = [(slot, TOKENS) for slot in batch]
                    buf.record(INSTANCE, RANK, layer, signals)
                    naive.record(layer, signals)
                    local.record(layer, signals)

            def clean(batch: list[int]) -> None:
                for slot in batch:
                    buf.finish(INSTANCE, RANK, slot, held["ours"][slot])
                    naive.finish(slot, held["naive"][slot])
                    local.finish(slot, held["dict"][slot])

            def ours(slot: int) -> object:
                held["ours"][slot] = self._request()
                return buf.register(task(slot, held["ours"][slot]))

            def naive_step(slot: int) -> object:
                held["naive"][slot] = self._request()
                return naive.register(slot, held["naive"][slot], NEED)

            def dict_step(slot: int) -> object:
                held["dict"][slot] = self._request()
                return local.register(slot, held["dict"][slot], NEED)

            steps = {**self._floors(one), "ours": ours, "naive": naive_step, "dict": dict_step}
            results = self._slot_rounds(slots, fill, steps, clean)
        finally:
            buf.close()
        return self._cases("register", str(pending), pending, results, {})

    def finish(self, slots: int = 512) -> list[Case]:
        buf, naive, local = self._buffer(), self._naive(), LocalDictBuffer()
        one = Floor.flat(entries_of(1))
        ids: dict[int, str] = {}
        try:

            def fill(batch: list[int]) -> None:
                for slot in batch:
                    ids[slot] = self._request()
                    buf.register(task(slot, ids[slot]))
                    naive.register(slot, ids[slot], NEED)
                    local.register(slot, ids[slot], NEED)

            steps: dict[str, Callable[[int], object]] = {
                **self._floors(one),
                "ours": lambda slot: buf.finish(INSTANCE, RANK, slot, ids[slot]),
                "naive": lambda slot: naive.finish(slot, ids[slot]),
                "dict": lambda slot: local.finish(slot, ids[slot]),
            }
            results = self._slot_rounds(slots, fill, steps, lambda _batch: None)
        finally:
            buf.close()
        return self._cases("finish", "-", 0, results, {})


async def async_cases(url: str, sizes: tuple[int, ...], iterations: int, warmup: int) -> list[Case]:
    """The asyncio client: record on both paths, register and finish, against the async floor."""
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(url)
    floor = await AsyncFloor.create(client, names.floor_key())
    cases: list[Case] = []
    ids = iter(range(1 << 62))
    try:
        for path in ("buffered", "delivered"):
            for size in sizes:
                entries = entries_of(size)
                args = Floor.flat(entries)
                buf = AsyncSignalBuffer.from_url(url, namespace=names.namespace(), env={})
                try:
                    if path == "delivered":
                        for slot, _ in entries:
                            await buf.register(task(slot, f"r{next(ids)}"))
                    results = await measure_interleaved_async(
                        {
                            "floor": lambda _i, a=args: floor.call(a),  # type: ignore[misc]
                            "ours": lambda _i, b=buf, e=entries: b.record(INSTANCE, RANK, 0, e),  # type: ignore[misc]
                        },
                        runs_for(iterations, size),
                        warmup,
                        size,
                    )
                finally:
                    await buf.close()
                cases += [Case("async", "record", path, size, impl, summary) for impl, summary in results.items()]
        one = Floor.flat(entries_of(1))
        buf = AsyncSignalBuffer.from_url(url, namespace=names.namespace(), env={})
        try:
            registers: dict[str, list[Summary]] = {"floor": [], "ours": []}
            finishes: dict[str, list[Summary]] = {"floor": [], "ours": []}
            for batch, warm in slot_rounds(iterations, warmup):
                held = {slot: f"r{next(ids)}" for slot in batch}
                found = await measure_interleaved_async(
                    {
                        "floor": lambda _i: floor.call(one),
                        "ours": lambda i, b=batch, h=held: buf.register(task(b[i], h[b[i]])),  # type: ignore[misc]
                    },
                    len(batch) - warm,
                    warm,
                    1,
                )
                for name, summary in found.items():
                    registers[name].append(summary)
                found = await measure_interleaved_async(
                    {
                        "floor": lambda _i: floor.call(one),
                        "ours": lambda i, b=batch, h=held: buf.finish(INSTANCE, RANK, b[i], h[b[i]]),  # type: ignore[misc]
                    },
                    len(batch) - warm,
                    warm,
                    1,
                )
                for name, summary in found.items():
                    finishes[name].append(summary)
        finally:
            await buf.close()
        cases += [Case("async", "register", "0", 0, impl, merge(parts)) for impl, parts in registers.items()]
        cases += [Case("async", "finish", "-", 0, impl, merge(parts)) for impl, parts in finishes.items()]
    finally:
        await client.aclose()
    return cases
