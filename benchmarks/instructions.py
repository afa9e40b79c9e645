"""Server instructions per call, ours and the floor, counted by callgrind: the same numbers on a
busy machine as on a quiet one.

Latency ratios on a shared VM move by 10 % from run to run; instruction counts do not (the same
binary, workload and arguments give the same total), so a change to a Lua script can be judged
here before the timed benchmark confirms it. It starts its own redis-server under
``valgrind --tool=callgrind`` (free port, temp dir), and for each case runs the set-up calls,
zeroes the counters, makes the measured calls through the public buffer (or the floor's
EVALSHA of ``return 1`` with the entries as ARGV), dumps the counters and divides. The counts
cover everything the server does for a call: reading and parsing the request, the script,
the reply, and the share of background work (expiring reply keys) the calls cause.
Usage::

    .venv/bin/python benchmarks/instructions.py [--calls 200] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from redis_layer_signals import CacheTask, SignalBuffer
from redis_layer_signals.bench.baselines import Floor
from redis_layer_signals.bench.server import BenchServerError, LocalRedis

INSTANCE, RANK, NUM_LAYERS, NEED, TOKENS = "ir", 0, 61, 1 << 20, 2048
TOTALS = re.compile(r"^(?:summary|totals):\s+(\d+)", re.MULTILINE)


class CallgrindRedis(LocalRedis):
    """redis-server under callgrind; counting is zeroed and dumped around each measured step."""

    def command(self) -> list[str]:
        valgrind = shutil.which("valgrind")
        if valgrind is None or shutil.which("callgrind_control") is None:
            raise BenchServerError("valgrind is not installed (apt-get install valgrind)")
        out = str(Path(self.dir) / "callgrind.out")
        return [valgrind, "--tool=callgrind", f"--callgrind-out-file={out}", *super().command()]

    def _control(self, *args: str) -> None:
        assert self.process is not None
        subprocess.run(["callgrind_control", *args, str(self.process.pid)], check=True, capture_output=True)

    def zero(self) -> None:
        self._control("--zero")

    def dump(self) -> int:
        """Instructions since the last zero (callgrind writes one more numbered dump file)."""
        before = set(Path(self.dir).glob("callgrind.out*"))
        self._control("--dump")
        for _ in range(200):
            new = set(Path(self.dir).glob("callgrind.out*")) - before
            if new:
                match = TOTALS.search(new.pop().read_text())
                if match:
                    return int(match.group(1))
            time.sleep(0.05)
        raise BenchServerError("callgrind wrote no dump")


@dataclass(frozen=True)
class Case:
    """One measured operation: ``setup(buf, calls)`` runs uncounted, then ``step(buf, i)`` for
    each measured call ``i``; the floor sends ``entries`` entries per call."""

    name: str
    setup: Callable[[SignalBuffer, int], None]
    step: Callable[[SignalBuffer, int], object]
    entries: int


def task(slot: int, request_id: str) -> CacheTask:
    return CacheTask(INSTANCE, RANK, slot, request_id, need_prefill_tokens=NEED, num_layers=NUM_LAYERS)


def batch(size: int) -> list[tuple[int, int]]:
    return [(slot, TOKENS + slot) for slot in range(size)]


def nothing(_buf: SignalBuffer, _calls: int) -> None:
    """No set-up: record's buffered path (no task on the rank)."""


def live_tasks(size: int) -> Callable[[SignalBuffer, int], None]:
    def setup(buf: SignalBuffer, _calls: int) -> None:
        for slot in range(size):
            buf.register(task(slot, f"r{slot}"))

    return setup


def pending_layers(layers: int) -> Callable[[SignalBuffer, int], None]:
    def setup(buf: SignalBuffer, calls: int) -> None:
        for layer in range(layers):
            for slot in range(calls):
                buf.record(INSTANCE, RANK, layer, [(slot, TOKENS)])

    return setup


def recording(size: int) -> Callable[[SignalBuffer, int], object]:
    entries = batch(size)
    return lambda buf, _i: buf.record(INSTANCE, RANK, 0, entries)


def registering(buf: SignalBuffer, i: int) -> object:
    return buf.register(task(i, f"q{i}"))


def finishing(buf: SignalBuffer, i: int) -> object:
    return buf.finish(INSTANCE, RANK, i, f"r{i}")


def all_cases() -> list[Case]:
    """The timed benchmark's cases: record buffered (no task: the same layer again, newest
    wins) and delivered (live tasks); register of a slot holding 0, 1 or 61 pending layers;
    finish of a registered slot. Register and finish use a slot of their own per call."""
    cases = []
    for size in (1, 32, 512):
        cases.append(Case(f"record.buffered.{size}", nothing, recording(size), size))
        cases.append(Case(f"record.delivered.{size}", live_tasks(size), recording(size), size))
    for layers in (0, 1, 61):
        cases.append(Case(f"register.{layers}", pending_layers(layers), registering, 1))
    cases.append(Case("finish", lambda buf, calls: live_tasks(calls)(buf, calls), finishing, 1))
    return cases


def calls_for(case: Case, calls: int) -> int:
    """Fewer calls where one call is long (valgrind runs the server about 50 times slower)."""
    heavy = case.name.endswith(".512") or case.name == "register.61"
    return max(10, calls // 8) if heavy else calls


def measure(server: CallgrindRedis, case: Case, calls: int, run_id: int) -> dict[str, float | str]:
    buf = SignalBuffer.from_url(server.url, namespace=f"ir{run_id}", env={})
    client = redis.Redis.from_url(server.url)
    floor = Floor(client, f"rls:ir-floor:{run_id}")
    args = Floor.flat(batch(case.entries))
    try:
        case.setup(buf, calls + 1)
        case.step(buf, calls)  # warm-up on a spare slot: script loaded, keys and markers created
        floor.call(args)
        server.zero()
        for i in range(calls):
            case.step(buf, i)
        ours = server.dump() / calls
        server.zero()
        for _ in range(calls):
            floor.call(args)
        floor_ir = server.dump() / calls
    finally:
        buf.close()
        client.close()
    return {"case": case.name, "calls": calls, "ours": ours, "floor": floor_ir, "ratio": ours / floor_ir}


def run(calls: int, only: list[str] | None = None) -> list[dict[str, float | str]]:
    rows = []
    server = CallgrindRedis()
    server.start()
    try:
        for run_id, case in enumerate(all_cases()):
            if not only or case.name in only:
                rows.append(measure(server, case, calls_for(case, calls), run_id))
    finally:
        server.cleanup()
    return rows


def markdown(rows: list[dict[str, float | str]]) -> str:
    lines = [
        "| case | ours (instructions/call) | floor | ours / floor |",
        "|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row['case']} | {row['ours']:,.0f} | {row['floor']:,.0f} | {row['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--calls", type=int, default=200, help="measured calls per case (fewer for 512 and 61)")
    cli.add_argument("--only", default="", help="comma-separated case names")
    cli.add_argument("--out", type=Path, default=None, help="write instructions.md and instructions.json here")
    options = cli.parse_args()
    rows = run(options.calls, [name for name in options.only.split(",") if name] or None)
    table = markdown(rows)
    print(table, end="")
    if options.out is not None:
        options.out.mkdir(parents=True, exist_ok=True)
        (options.out / "instructions.md").write_text("# Server instructions per call (callgrind)\n\n" + table)
        (options.out / "instructions.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
