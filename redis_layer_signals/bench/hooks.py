"""The FastDeploy bridge's three hooks against FastDeploy's own fix, side by side in one run.

FastDeploy's fix is a lock, a dict lookup per entry and a queue put (``FastDeployDict``);
the bridge is ``redis_layer_signals.fastdeploy.Layer0Bridge`` in FastDeploy's layout
(the process registers every task of its rank). Both serve the same steps, a forward step of
``entries`` requests each prefilled in 2 chunks (first chunk's layer-0 signal before its task,
the task, the second chunk's signal, the finish), then ``step_s`` untimed for the GPU's part
of the step (``STEP_S``), under three conditions: a healthy Redis on loopback, the same behind a link
that delays every byte by ``delay_s`` (a proxy on loopback, in a process of its own), and
Redis killed. Every hook call is timed. On the healthy server the run also reads Redis's
CPU time (``INFO cpu``) and its calls (``INFO commandstats``) per request, with 8 requests in
flight per forward step.

Tensor parallelism (``--tp N``, 1 to 8): the N ranks of one instance, each in a process of its
own as FastDeploy runs them, each with its bridge (N bridges of one group, ``nranks=N``, sharing
one Redis) and its dict, all fed the same steps at once; the figures are over every rank's
calls. The ranks run every case, ``--tp 1`` included, in processes of their own.

Garbage collection: a full (generation 2) collection pauses every thread for as long as it takes
to traverse every tracked object of the process, and whatever a thread was doing takes that long
too, on either side. By default the run calls ``gc.freeze()`` once its imports are done and a
warm-up case ran, as a server process that freezes its startup heap does (see the FastDeploy
guide); ``--no-gc-freeze`` measures without it. Either way the run reports each side's largest
call and every case's longest collection and its full collections, and the sender's part
(taking the batches off each side's queue) is done between rounds, untimed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import queue
import statistics
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..buffer import SignalBuffer
from ..fastdeploy.bridge import Layer0Bridge
from ..fastdeploy.signals import KvSignal, encode_kv_signal
from .machine import describe
from .relay import DelayRelay
from .runner import default_out
from .server import REDIS_SERVER, LocalRedis

ENTRIES = (1, 8, 64)
DELAY_S = 0.3
STEPS = 300
"""Forward steps timed per case (each step is 2 + 2 x entries hook calls per side)."""
CPU_STEPS = 2000
"""Forward steps of 8 requests for the Redis CPU figure."""
REQUESTS_PER_S_PER_RANK = 40
LAYERS = 61
PROXY_START_S = 15.0
STEP_S = 0.02
"""Between forward steps, each side's driver sleeps this long: a forward step's GPU time, during
which FastDeploy's hook threads wait. Without it every rank's driver stays runnable all along,
and N ranks on fewer than N cores measure the scheduler, on either side."""
HOOKS = ("on_kv_signal", "on_cache_task", "on_task_finished")
MAX_TP = 8
"""Ranks ``--tp`` accepts: FastDeploy's tensor-parallel sizes run 1 to 8 GPUs per instance."""


class FastDeployDict:
    """The shape of FastDeploy's fix: a lock, a dict lookup per entry, a queue put."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tasks: dict[int, dict[str, Any]] = {}
        self.pending: dict[int, int] = {}
        self.ready: queue.Queue[Any] = queue.Queue()

    def on_kv_signal(self, entries: Sequence[tuple[int, int]]) -> None:
        ready = []
        with self.lock:
            for slot, tokens in entries:
                if slot in self.tasks:
                    ready.append((slot, tokens))
                else:
                    self.pending[slot] = tokens
        if ready:
            self.ready.put(ready)

    def on_cache_task(self, info: dict[str, Any]) -> None:
        with self.lock:
            slot = info["current_id"]
            self.tasks[slot] = info
            tokens = self.pending.pop(slot, None)
        if tokens is not None and tokens <= info["need_prefill_tokens"]:
            self.ready.put([(slot, tokens)])

    def on_task_finished(self, slot: int, request_id: str) -> None:
        with self.lock:
            self.tasks.pop(slot, None)
            self.pending.pop(slot, None)


class ProxyProcess:
    """A ``DelayRelay`` in a process of its own: its four threads never hold the benchmark's
    interpreter lock (a link's delay is in the network, not in the process it slows)."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        self.process = context.Process(target=_serve_proxy, args=(target_port, delay_s, theirs), daemon=True)
        self.process.start()
        if not ours.poll(PROXY_START_S):
            self.close()
            raise OSError(f"the delaying proxy did not start within {PROXY_START_S:.0f} s")
        self.port: int = ours.recv()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self.process.terminate()
        self.process.join(PROXY_START_S)


def _serve_proxy(target_port: int, delay_s: float, report: Any) -> None:
    proxy = DelayRelay.on_loopback(target_port, delay_s)
    report.send(proxy.port)
    threading.Event().wait()  # until terminated


def _kv(entries: Sequence[tuple[int, int, int]]) -> Any:
    return encode_kv_signal(0, entries)


def _steps(
    entries: int, steps: int, first: int = 0
) -> Iterator[tuple[Any, list[dict[str, Any]], Any, list[tuple[int, str]]]]:
    """Per forward step: the first chunks' message, the tasks, the second chunks' message, the
    finishes; slots cycle over 512. Steps are numbered from ``first`` and name their requests
    by it: a case's rounds go on numbering, so no request id comes back (a tensor-parallel
    group names an entry by its request, as FastDeploy's ids are unique)."""
    for step in range(first, first + steps):
        slots = [(step * entries + i) % 512 for i in range(entries)]
        ids = [f"req-{step}-{i}" for i in range(entries)]
        first = _kv([(slot, 0, 128) for slot in slots])
        second = _kv([(slot, 128, 128) for slot in slots])
        pairs = list(zip(slots, ids, strict=True))
        infos = [{"request_id": r, "current_id": s, "need_prefill_tokens": 256} for s, r in pairs]
        yield first, infos, second, pairs


def _drive(
    side: Any,
    entries: int,
    steps: int,
    wrap: Callable[[list[tuple[int, int]]], Any],
    step_s: float = 0.0,
    first: int = 0,
) -> dict[str, list[int]]:
    """Run the steps on one side; nanoseconds per hook call. Both sides get the message's
    entries already decoded (``wrap`` gives each its form), as FastDeploy's consumer decodes
    the message itself before its dict: what is timed is the hook."""
    times: dict[str, list[int]] = {hook: [] for hook in HOOKS}
    clock = time.perf_counter_ns
    for opening, infos, second, finishes in _steps(entries, steps, first):
        payload = wrap(_pairs(opening))
        t = clock()
        side.on_kv_signal(payload)
        times["on_kv_signal"].append(clock() - t)
        for info in infos:
            t = clock()
            side.on_cache_task(info)
            times["on_cache_task"].append(clock() - t)
        payload = wrap(_pairs(second))
        t = clock()
        side.on_kv_signal(payload)
        times["on_kv_signal"].append(clock() - t)
        for slot, request_id in finishes:
            t = clock()
            side.on_task_finished(slot, request_id)
            times["on_task_finished"].append(clock() - t)
        time.sleep(step_s)  # the rest of a forward step (the GPU's part), untimed
    return times


def _pairs(message: Any) -> list[tuple[int, int]]:
    """What FastDeploy's consumer builds from the message before its dict: (slot, tokens)."""
    count = int(message[0])
    rows = np.asarray(message[2 : 2 + 3 * count]).reshape(count, 3)
    return [(int(r[0]), int(r[1] + r[2])) for r in rows]


def _summary(ns: list[int]) -> dict[str, float]:
    ordered = sorted(ns)
    return {
        "calls": len(ordered),
        "p50_us": statistics.median(ordered) / 1000,
        "p99_us": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] / 1000,
        "max_us": ordered[-1] / 1000,
    }


def _drain(ready: Any) -> None:
    """What FastDeploy's sender does between forward steps: take the batches off the queue
    (else every batch of the run stays alive, which no process keeps)."""
    with ready.mutex:
        ready.queue.clear()


class GcPauses:
    """The interpreter's garbage collections during a case: a hook call that a collection
    interrupts takes that long, whatever the hook does."""

    def __init__(self) -> None:
        self.longest_s = 0.0
        self.full = 0
        """Generation-2 collections (those that traverse every object not frozen)."""
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            self.full += info["generation"] == 2
        else:
            self.longest_s = max(self.longest_s, time.perf_counter() - self._started)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def _as_signal(entries: list[tuple[int, int]]) -> KvSignal:
    return KvSignal(0, tuple(entries))


def _interleaved(bridge: Layer0Bridge, entries: int, steps: int, step_s: float) -> dict[str, Any]:
    """One rank: both sides on the same steps, interleaved (dict, bridge, dict, bridge...)."""
    fd = FastDeployDict()
    times: dict[str, dict[str, list[int]]] = {side: {hook: [] for hook in HOOKS} for side in ("dict", "bridge")}
    rounds = 10
    per_round = steps // rounds
    with GcPauses() as pauses:
        for round_ in range(rounds):
            for side, wrap in ((fd, list), (bridge, _as_signal)):
                for hook, ns in _drive(side, entries, per_round, wrap, step_s, round_ * per_round).items():
                    times["dict" if side is fd else "bridge"][hook] += ns
            _drain(fd.ready)
            _drain(bridge.ready)
    return {
        **times,
        "longest_gc_us": pauses.longest_s * 1e6,
        "full_collections": pauses.full,
        "entries_fed": 2 * entries * per_round * rounds,
    }


def _pooled(entries: int, tp: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's calls of a case, as one case."""
    times = {side: {hook: [ns for r in ranks for ns in r[side][hook]] for hook in HOOKS} for side in ("dict", "bridge")}
    out: dict[str, Any] = {"entries": entries, "tp": tp, "hooks": {}}
    for hook in HOOKS:
        d, b = _summary(times["dict"][hook]), _summary(times["bridge"][hook])
        out["hooks"][hook] = {"dict": d, "bridge": b, "p50_ratio": b["p50_us"] / d["p50_us"]}
    out["bridge_all"] = _summary([ns for hook in HOOKS for ns in times["bridge"][hook]])
    out["largest_us"] = out["bridge_all"]["max_us"]
    out["dict_largest_us"] = max(ns for hook in HOOKS for ns in times["dict"][hook]) / 1000
    out["longest_gc_us"] = max(r["longest_gc_us"] for r in ranks)
    out["full_collections"] = sum(r["full_collections"] for r in ranks)
    if tp > 1:  # how far the group's agreement kept up: entries queued by the case's end
        out["group_released"] = sum(r.get("group_released", 0) for r in ranks)
        out["group_fed"] = sum(r["entries_fed"] for r in ranks)
    return out


def _cpu(client: Any) -> tuple[float, int]:
    info = client.info("cpu")
    stats = client.info("commandstats")
    calls = sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_fcall", "cmdstat_evalsha"))
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"]), int(calls)


def _flushed(bridge: Layer0Bridge, timeout_s: float) -> None:
    """The writer caught up, or the figures would miss its calls (not an assert: ``-O`` drops those)."""
    if not bridge.flush(timeout_s):
        raise RuntimeError(f"the bridge's writer did not catch up within {timeout_s} s")


def _feed(bridge: Layer0Bridge, steps: int) -> int:
    """The steps of ``redis_cost`` on one rank, at a forward step's pace; the requests fed."""
    requests = 0
    for first, infos, second, finishes in _steps(8, steps):
        bridge.on_kv_signal(first)  # the raw message, as FastDeploy passes it
        for info in infos:
            bridge.on_cache_task(info)
        bridge.on_kv_signal(second)
        for slot, request_id in finishes:
            bridge.on_task_finished(slot, request_id)
        requests += len(infos)
        time.sleep(0.0005)  # a forward step takes time: the writer batches what comes meanwhile
    _flushed(bridge, 30)
    return requests


def redis_cost(server: LocalRedis, ranks: Ranks, steps: int) -> dict[str, Any]:
    """Redis's CPU and calls per request: 8 requests per forward step, 2 chunks each, on every
    rank (a request of each rank counts once)."""
    client = server.client()
    marks: list[tuple[float, int]] = []
    try:
        requests = sum(ranks.run(("cost", server.url, 8, steps, 0.0), before=lambda: marks.append(_cpu(client))))
        seconds = time.perf_counter() - ranks.went
        cpu1, calls1 = _cpu(client)
    finally:
        client.close()
    cpu0, calls0 = marks[0]
    cpu_us = (cpu1 - cpu0) * 1e6 / requests
    return {
        "requests": requests,
        "seconds": seconds,
        "calls_per_request": (calls1 - calls0) / requests,
        "redis_cpu_us_per_request": cpu_us,
        "ranks_per_core": 1e6 / (cpu_us * REQUESTS_PER_S_PER_RANK) if cpu_us > 0 else None,
    }


class Ranks:
    """The ``tp`` ranks of one instance, a process each, as FastDeploy runs them (their threads
    never share an interpreter lock). Each rank holds its own bridge (a rank of one group,
    ``nranks=tp``, on a namespace the ranks share) and its own dict, and runs the job it is
    given on the same steps as the others, all starting at once."""

    def __init__(self, tp: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipes: list[Any] = []
        self.processes: list[Any] = []
        self.went = 0.0
        """When the last job started (``perf_counter``)."""
        for rank in range(tp):
            ours, theirs = context.Pipe()
            process = context.Process(target=_serve_rank, args=(rank, tp, theirs), daemon=True)
            process.start()
            self.pipes.append(ours)
            self.processes.append(process)

    def run(self, job: tuple[Any, ...], before: Callable[[], None] | None = None) -> list[Any]:
        """Every rank's answer to ``job``, the ranks set up first (bridges made, writers
        flushed), then ``before``, then all of them at once."""
        job = (*job, f"bench-{uuid.uuid4().hex[:8]}")
        for pipe in self.pipes:
            pipe.send(job)
        for pipe in self.pipes:
            _answer(pipe)
        if before is not None:
            before()
        self.went = time.perf_counter()
        for pipe in self.pipes:
            pipe.send("go")
        return [_answer(pipe) for pipe in self.pipes]

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for process in self.processes:
            process.join(PROXY_START_S)
            if process.is_alive():
                process.terminate()


def _answer(pipe: Any) -> Any:
    kind, value = pipe.recv()
    if kind == "error":
        raise RuntimeError(f"a rank of the benchmark failed:\n{value}")
    return value


def _serve_rank(rank: int, tp: int, pipe: Any) -> None:
    """A rank's process: answers jobs until told to stop (``None``)."""
    while (job := pipe.recv()) is not None:
        try:
            pipe.send(("ok", _rank_job(rank, tp, job, pipe)))
        except Exception:  # carried to the parent, which raises it
            pipe.send(("error", traceback.format_exc()))


def _rank_job(rank: int, tp: int, job: tuple[Any, ...], pipe: Any) -> Any:
    kind, *args, namespace = job
    if kind == "gc":
        pipe.send(("ok", "ready"))
        pipe.recv()
        objects = len(gc.get_objects())
        if args[0]:  # freeze, as a server process does after its startup
            gc.collect()
            gc.freeze()
        return {"objects": objects, "frozen": gc.get_freeze_count()}
    url, entries, steps, step_s = args
    buffer = SignalBuffer.from_url(url, namespace=namespace, retry_s=3.0 if kind == "cost" else 0.5, env={})
    bridge = Layer0Bridge(buffer, "p0", rank, num_layers=LAYERS, ready=queue.Queue(), nranks=tp)
    try:
        if kind == "cost":
            _flushed(bridge, 10)  # the claim and adoption, out of the figures
        pipe.send(("ok", "ready"))
        pipe.recv()
        if kind == "cost":
            return _feed(bridge, steps)
        timed = _interleaved(bridge, entries, steps, step_s)
        timed["group_released"] = bridge.health().group_outcomes.get("released", 0)
        return timed
    finally:
        bridge.close()
        buffer.close()


def run(
    entries: Sequence[int] = ENTRIES,
    steps: int = STEPS,
    delay_s: float = DELAY_S,
    gc_freeze: bool = True,
    tp: int = 1,
    cpu_steps: int = CPU_STEPS,
    step_s: float = STEP_S,
) -> dict[str, Any]:
    if not 1 <= tp <= MAX_TP:
        raise ValueError(f"tp must be 1 to {MAX_TP}, got {tp}")
    result: dict[str, Any] = {"conditions": {}, "delay_s": delay_s, "steps": steps, "tp": tp}
    result["step_s"] = step_s
    result["load_average"] = {"start": os.getloadavg()[0]}
    server = LocalRedis(binary=REDIS_SERVER).start()
    ranks = Ranks(tp)
    try:
        client = server.client()
        result["machine"] = describe(client.info())
        client.close()

        def case(url: str, n: int, before: Callable[[], None] | None = None) -> dict[str, Any]:
            return _pooled(n, tp, ranks.run(("case", url, n, steps, step_s), before))

        ranks.run(("case", server.url, max(entries), 20, 0.0))  # warm-up: every path run once, untimed
        result["gc"] = ranks.run(("gc", gc_freeze))[0]
        result["conditions"]["healthy"] = [case(server.url, n) for n in entries]
        proxy = ProxyProcess(server.port, delay_s)
        try:
            result["conditions"][f"{delay_s * 1000:.0f} ms link"] = [case(proxy.url, n) for n in entries]
        finally:
            proxy.close()
        result["redis_cost"] = redis_cost(server, ranks, cpu_steps)
        outage = []
        for n in entries:
            if server.process is None or server.process.poll() is not None:
                server.start()
            outage.append(case(server.url, n, before=server.kill))
        result["conditions"]["outage"] = outage
    finally:
        ranks.close()
        server.cleanup()
    result["load_average"]["end"] = os.getloadavg()[0]
    return result


def markdown(result: dict[str, Any]) -> str:
    tp = result.get("tp", 1)
    ranks = (
        "one rank"
        if tp == 1
        else f"{tp} ranks of one tensor-parallel group (`nranks={tp}`) sharing one Redis, a process per rank "
        f"with its bridge and its dict, all fed the same steps at once; figures over every rank's calls"
    )
    load = result.get("load_average", {})
    lines = [
        f"# The FastDeploy bridge's hooks against FastDeploy's dict, TP {tp}",
        "",
        f"One run, both sides interleaved on the same steps, {ranks}; {result['steps']} forward steps per case, "
        "each of `entries` requests prefilled in 2 chunks (2 layer-0 messages, a task and a finish per "
        f"request), then {result.get('step_s', 0) * 1000:.0f} ms untimed for the GPU's part of the step. "
        f"Link: a proxy on loopback delaying each byte {result['delay_s'] * 1000:.0f} ms each way. "
        f"Machine: {result['machine']['cpu_model']}, {result['machine']['cpu_count']} cores, shared with other "
        f"work while it ran (load average {load.get('start', 0):.1f} at the start, {load.get('end', 0):.1f} at "
        f"the end); Python {result['machine']['python']}, Redis {result['machine']['redis_version']}.",
        "",
        "| condition | entries | hook | dict p50 µs | bridge p50 µs | ratio | dict p99 µs | bridge p99 µs "
        "| dict max µs | bridge max µs |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for condition, cases in result["conditions"].items():
        for case in cases:
            for hook, h in case["hooks"].items():
                lines.append(
                    f"| {condition} | {case['entries']} | `{hook}` | {h['dict']['p50_us']:.1f} | "
                    f"{h['bridge']['p50_us']:.1f} | {h['p50_ratio']:.2f} | {h['dict']['p99_us']:.1f} | "
                    f"{h['bridge']['p99_us']:.1f} | {h['dict']['max_us']:.0f} | {h['bridge']['max_us']:.0f} |"
                )
    if tp > 1:
        lines += [
            "",
            "The group's queue at each case's end (entries the agreement released on the ranks, of those fed; "
            "the last step's are still on their way): "
            + "; ".join(
                f"{condition} "
                + ", ".join(
                    f"{c['entries']}: {c.get('group_released', 0):,} of {c.get('group_fed', 0):,}" for c in cases
                )
                for condition, cases in result["conditions"].items()
            )
            + ".",
        ]
    cost = result["redis_cost"]
    gc_state = result["gc"]
    frozen = (
        f"`gc.freeze()` after the imports and a warm-up case ({gc_state['frozen']} objects frozen)"
        if gc_state["frozen"]
        else f"no `gc.freeze()` ({gc_state['objects']} objects tracked after the warm-up)"
    )

    def per_condition(pick: Callable[[dict[str, Any]], float], unit: float = 1000) -> str:
        return ", ".join(
            f"{condition} {max(pick(c) for c in cases) / unit:.1f} ms"
            for condition, cases in result["conditions"].items()
        )

    def worst(cases: list[dict[str, Any]], side: str) -> str:
        figures = [h[side] for c in cases for h in c["hooks"].values()]
        return (
            f"p99 {max(f['p99_us'] for f in figures):.0f} µs, largest {max(f['max_us'] for f in figures) / 1000:.1f} ms"
        )

    lines += [
        "",
        "Against the targets (every hook's p99 at most 1 ms, no call over 10 ms), the worst hook per condition: "
        + "; ".join(
            f"{condition} bridge {worst(cases, 'bridge')} (dict {worst(cases, 'dict')})"
            for condition, cases in result["conditions"].items()
        )
        + ".",
        "",
        f"Garbage collection: {frozen}. Largest single hook call, per condition: the bridge's "
        + per_condition(lambda c: c["largest_us"])
        + "; the dict's "
        + per_condition(lambda c: c["dict_largest_us"])
        + ". Longest garbage collection of the interpreter during a case (a hook call it interrupts "
        "takes that long, on either side): "
        + per_condition(lambda c: c["longest_gc_us"])
        + "; full collections per case: "
        + ", ".join(
            f"{condition} {'/'.join(str(c['full_collections']) for c in cases)}"
            for condition, cases in result["conditions"].items()
        )
        + ".",
        "",
        f"Redis's cost, 8 requests in flight per forward step per rank, each prefilled in 2 chunks "
        f"({cost['requests']} requests over {tp} rank{'s' if tp > 1 else ''}): "
        f"{cost['calls_per_request']:.3f} function calls and "
        f"{cost['redis_cpu_us_per_request']:.1f} µs of Redis CPU (`INFO cpu`, sys + user) per request; at "
        f"{REQUESTS_PER_S_PER_RANK} requests per second per rank one Redis core serves about "
        f"{cost['ranks_per_core']:.0f} ranks.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="rls bench --hooks", description=__doc__)
    cli.add_argument("--steps", type=int, default=STEPS)
    cli.add_argument(
        "--tp",
        type=int,
        default=1,
        choices=range(1, MAX_TP + 1),
        metavar=f"{{1..{MAX_TP}}}",
        help=f"tensor-parallel ranks, 1 to {MAX_TP}: that many bridges of one group (nranks=N) sharing "
        "one Redis, a process each (with its dict), fed the same steps at once",
    )
    cli.add_argument("--out", type=Path, default=None, help="default: a new rls-bench-<time> folder")
    cli.add_argument(
        "--step-ms",
        type=float,
        default=STEP_S * 1000,
        help="untimed milliseconds between forward steps, the GPU's part (0: the drivers never pause)",
    )
    cli.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="measure without gc.freeze() after the warm-up (full collections traverse every import's objects)",
    )
    args = cli.parse_args(argv)
    result = run(steps=args.steps, gc_freeze=not args.no_gc_freeze, tp=args.tp, step_s=args.step_ms / 1000)
    out: Path = args.out or default_out()  # the committed results only when named
    out.mkdir(parents=True, exist_ok=True)
    (out / "hooks.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    (out / "hooks.md").write_text(markdown(result))
    print(markdown(result))
    return 0
