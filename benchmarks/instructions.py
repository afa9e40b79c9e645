"""Server instructions per call, ours, the commands alone and the floor, counted by callgrind:
the same numbers on a busy machine as on a quiet one.

Latency ratios on a shared VM move by 10 % from run to run; instruction counts do not (the same
binary, workload and arguments give the same total), so a change to a Lua script can be judged
here before the timed benchmark confirms it. It starts its own redis-server under
``valgrind --tool=callgrind`` (free port, temp dir), and for each case runs the set-up calls,
zeroes the counters, makes the measured calls through the public buffer (or the floor's
EVALSHA of ``return 1`` with the entries as ARGV), dumps the counters and divides. The counts
cover everything the server does for a call: reading and parsing the request, the script,
the reply, and the share of background work (expiring reply keys) the calls cause.

"Commands alone" (``bare`` in the JSON) is the least our key layout costs for a case: the
Redis commands our script runs on the measured path, the same commands with the same fields
and value sizes, in the same number, with next to no Lua around them
(``benchmarks/commands_alone/*.lua``; each header lists its commands). It is sent exactly as
ours is: the buffer's protocol prepares the call (KEYS and ARGV, a fresh reply token each, so
the closing ``SET ... PX`` creates a key as ours does) and it goes as an EVALSHA of the bare
script. Ours minus it bounds the Lua logic we could still cut; it minus the floor is what
the layout's commands cost. What makes the comparison fair, and where it is not exact:

- Same request: the same keys and arguments, so parsing the request and building KEYS/ARGV
  cost the same; the replies have the same length.
- Same state: the bare calls run right after ours, on the same namespace. Record's cases keep
  their slots (ours leaves the pending hash as it found it: one record of layer 0 per buffered
  slot). Register and finish take a slot per call, so the set-up prepares twice as many:
  ours uses slots ``[0, calls)``, the bare script ``[calls, 2 * calls)``, and each warms up on
  a spare slot of its own. The hashes are then a little larger or smaller for the bare calls
  (ours' calls added or removed ``calls`` fields), which does not change a command's cost
  per field on hashtable-encoded hashes, but a hash or the keyspace growing past a power of
  two rehashes during either window; the keyspace also holds ours' reply keys.
- Shared background work, not separated out: the server's timer runs about ten times a second
  of wall time while a call under valgrind takes about 50 times longer, so a window pays timer
  work in proportion to its length; reply keys live ``retry_s`` + 5 s, so in a case that runs
  longer than that, ours' keys expire during the bare or floor window; and Lua's incremental
  garbage collector (driven by allocation, plus a step Redis forces every 50 script calls) may
  collect in the bare window some of what ours' calls left. The floor, measured last, is
  exposed to the same.
- The bare scripts mirror the measured state, not the general case: they check no lease,
  request id or deadline, never sweep, refresh a TTL or write a marker (none is due in these
  cases). Every case has one: even register.61's payload, 61 records with their deadlines
  dropped, is one ``gsub``, in C.
- The bare scripts still run some Lua of their own: reading the entries (one gmatch over the
  slots; on the buffered path a second over the rests, "tokens,request_id"), building each
  pending record and the reply, and handing the commands their arguments. For 512 buffered
  entries that Lua is about half of the bare count: the figure is
  the least a Lua script on this layout costs, not the commands' own C alone.

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
from typing import Any

import redis

from redis_layer_signals import CacheTask, SignalBuffer
from redis_layer_signals.bench.baselines import Floor
from redis_layer_signals.bench.server import BenchServerError, LocalRedis
from redis_layer_signals.protocol.calls import ScriptCall

INSTANCE, RANK, NUM_LAYERS, NEED, TOKENS = "ir", 0, 61, 1 << 20, 2048
TOTALS = re.compile(r"^(?:summary|totals):\s+(\d+)", re.MULTILINE)
COMMANDS_ALONE = Path(__file__).resolve().parent / "commands_alone"


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


Operation = Callable[[Any, int], Any]
"""Measured call ``i`` of a case, made on the buffer (it runs) or on the buffer's protocol (it is
only prepared): both have ``record``, ``register`` and ``finish`` with the same arguments."""


@dataclass(frozen=True)
class Case:
    """One measured operation: ``setup(buf, calls)`` runs uncounted, then ``operation(buf, i)``
    for each measured call ``i``; the floor sends ``entries`` entries per call. ``bare`` names
    the case's script in ``commands_alone/``, sent with the call ``operation(buf.protocol, i)``
    prepares, which is what ``operation(buf, i)`` sends."""

    name: str
    setup: Callable[[SignalBuffer, int], None]
    operation: Operation
    entries: int
    bare: str

    def step(self, buf: SignalBuffer, i: int) -> object:
        return self.operation(buf, i)

    def prepare(self, buf: SignalBuffer, i: int) -> ScriptCall | None:
        return self.operation(buf.protocol, i).call  # type: ignore[no-any-return]


def task(slot: int, request_id: str) -> CacheTask:
    return CacheTask(INSTANCE, RANK, slot, request_id, need_prefill_tokens=NEED, num_layers=NUM_LAYERS)


def batch(size: int) -> list[tuple[int, int]]:
    return [(slot, TOKENS + slot) for slot in range(size)]


def nothing(_buf: SignalBuffer, _calls: int) -> None:
    """No set-up: record's buffered path (no task on the rank)."""


def live_tasks(size: int, step: int = 1) -> Callable[[SignalBuffer, int], None]:
    """Live tasks on slots ``range(step - 1, size, step)``: every slot, or every odd one."""

    def setup(buf: SignalBuffer, _calls: int) -> None:
        for slot in range(step - 1, size, step):
            buf.register(task(slot, f"r{slot}"))

    return setup


def crowded(buf: SignalBuffer, _calls: int) -> None:
    """Slots 1..511 hold 61 pending layers each (31,171 signals): record.buffered.1.crowded
    records onto slot 0 as record.buffered.1 does, to show its cost does not follow them."""
    for layer in range(NUM_LAYERS):
        buf.record(INSTANCE, RANK, layer, [(slot, TOKENS) for slot in range(1, 512)])


def holding(size: int, layers: int) -> Callable[[SignalBuffer, int], None]:
    """Slots ``range(size)`` hold ``layers`` pending layers each: record.buffered.<size>.layers<n>
    records layer 0 onto them again, as record.buffered.<size> does onto slots holding one."""

    def setup(buf: SignalBuffer, _calls: int) -> None:
        for layer in range(layers):
            buf.record(INSTANCE, RANK, layer, batch(size))

    return setup


def pending_layers(layers: int) -> Callable[[SignalBuffer, int], None]:
    def setup(buf: SignalBuffer, calls: int) -> None:
        for layer in range(layers):
            for slot in range(calls):
                buf.record(INSTANCE, RANK, layer, [(slot, TOKENS)])

    return setup


def recording(size: int) -> Operation:
    entries = batch(size)
    return lambda target, _i: target.record(INSTANCE, RANK, 0, entries)


def registering(target: Any, i: int) -> Any:
    return target.register(task(i, f"q{i}"))


def finishing(target: Any, i: int) -> Any:
    return target.finish(INSTANCE, RANK, i, f"r{i}")


def all_cases() -> list[Case]:
    """The timed benchmark's cases: record buffered (no task: the same layer again, newest
    wins) and delivered (live tasks); record.half.32, the 4-process benchmark's batch (32
    entries, the odd slots live: 16 delivered, 16 buffered); record.buffered.1 again with
    31,171 signals buffered in the rank's other slots; record.buffered.32 and .512 onto slots
    holding 8 or 61 pending layers each; register of a slot holding 0, 1, 8 or 61 pending
    layers; finish of a registered slot. Register and finish use a slot of their own per call."""
    cases = []
    for size in (1, 32, 512):
        cases.append(Case(f"record.buffered.{size}", nothing, recording(size), size, "record_buffered.lua"))
        cases.append(Case(f"record.delivered.{size}", live_tasks(size), recording(size), size, "record_delivered.lua"))
    cases.append(Case("record.half.32", live_tasks(32, 2), recording(32), 32, "record_buffered.lua"))
    cases.append(Case("record.buffered.1.crowded", crowded, recording(1), 1, "record_buffered.lua"))
    for size in (32, 512):
        for layers in (8, 61):
            name = f"record.buffered.{size}.layers{layers}"
            cases.append(Case(name, holding(size, layers), recording(size), size, "record_buffered.lua"))
    for layers in (0, 1, 8, 61):
        cases.append(Case(f"register.{layers}", pending_layers(layers), registering, 1, "register.lua"))
    cases.append(Case("finish", lambda buf, calls: live_tasks(calls)(buf, calls), finishing, 1, "finish.lua"))
    return cases


def calls_for(case: Case, calls: int) -> int:
    """Fewer calls where one call is long (valgrind runs the server about 50 times slower)."""
    heavy = ".512" in case.name or case.name == "register.61"
    return max(10, calls // 8) if heavy else calls


class Bare:
    """A case's commands-alone script, loaded once, sent as EVALSHA with a prepared call's
    KEYS and ARGV."""

    def __init__(self, client: redis.Redis, name: str) -> None:
        self.client = client
        self.sha = client.script_load((COMMANDS_ALONE / name).read_text())

    def call(self, call: ScriptCall | None) -> object:
        assert call is not None, "the measured calls always send something"
        return self.client.evalsha(self.sha, len(call.keys), *call.keys, *call.args)


def measure(server: CallgrindRedis, case: Case, calls: int, run_id: int) -> dict[str, float | str]:
    """Ours on slots ``[0, calls)`` (where a call takes a slot), then the commands alone on
    ``[calls, 2 * calls)``, then the floor; each warmed up first, ours on slot ``2 * calls``
    and the bare script on ``2 * calls + 1``."""
    buf = SignalBuffer.from_url(server.url, namespace=f"ir{run_id}", env={})
    client = redis.Redis.from_url(server.url)
    floor = Floor(client, f"rls:ir-floor:{run_id}")
    args = Floor.flat(batch(case.entries))
    try:
        case.setup(buf, 2 * calls + 2)
        case.step(buf, 2 * calls)  # warm-up on a spare slot: script loaded, keys and markers created
        floor.call(args)
        server.zero()
        for i in range(calls):
            case.step(buf, i)
        ours = server.dump() / calls
        bare = Bare(client, case.bare)
        bare.call(case.prepare(buf, 2 * calls + 1))
        prepared = [case.prepare(buf, calls + i) for i in range(calls)]  # built before counting
        server.zero()
        for call in prepared:
            bare.call(call)
        bare_ir = server.dump() / calls
        server.zero()
        for _ in range(calls):
            floor.call(args)
        floor_ir = server.dump() / calls
    finally:
        buf.close()
        client.close()
    return {
        "case": case.name,
        "calls": calls,
        "ours": ours,
        "bare": bare_ir,
        "floor": floor_ir,
        "ratio": ours / floor_ir,
    }


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
        "| case | ours (instructions/call) | commands alone | floor | ours / floor | commands alone / ours |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ours, bare = row["ours"], row["bare"]
        assert isinstance(ours, float) and isinstance(bare, float)
        counts = f"{ours:,.0f} | {bare:,.0f} | {row['floor']:,.0f}"
        lines.append(f"| {row['case']} | {counts} | {row['ratio']:.2f} | {bare / ours:.2f} |")
    # Two counts taken in different windows each carry a share of the server's timers and key
    # expiry: an order that comes out the wrong way is reported here, as a measurement, and
    # never fails a run.
    odd = [str(row["case"]) for row in rows if not float(row["floor"]) < float(row["bare"]) < float(row["ours"])]
    if odd:
        note = "Not floor < commands alone < ours in this run (background work in the windows)"
        lines += ["", f"{note}: {', '.join(odd)}."]
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
