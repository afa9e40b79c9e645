"""Worker for the race test: one process recording, registering and finishing on shared slots
in random order, logging every signal it recorded and every outcome it was told about."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from redis_layer_signals import CacheTask, SignalBuffer, SlotOccupied

SLOTS = 4
LAYERS = 3
Sig = tuple[int, int, int]  # slot, layer, tokens (tokens unique per signal across workers)


@dataclass
class Log:
    recorded: list[Sig] = field(default_factory=list)
    delivered: list[Sig] = field(default_factory=list)
    buffered: list[Sig] = field(default_factory=list)
    recovered: list[Sig] = field(default_factory=list)
    dropped: list[Sig] = field(default_factory=list)
    finish_dropped: int = 0
    registered: int = 0
    occupied: int = 0


def ended(stats: dict[str, int]) -> int:
    """Buffered signals that have ended somewhere, by a namespace's counters: recovered, dropped
    with a reason, superseded, finish_dropped or expired (invariant 1: buffered = ended + pending)."""
    total = stats["recovered"] + stats["superseded"] + stats["finish_dropped"] + stats["expired"]
    return total + sum(v for k, v in stats.items() if k.startswith("dropped_"))


class Worker:
    """One worker's random operations on the shared slots of p0/0, every outcome logged."""

    def __init__(self, buf: SignalBuffer, worker: int, seed: int) -> None:
        self.buf = buf
        self.worker = worker
        self.rng = random.Random(seed * 1000 + worker)
        self.log = Log()
        self.mine: dict[int, str] = {}  # slot -> request id this worker registered there
        self.serial = 0

    def step(self, op: int) -> None:
        """One random record (55 %), register (25 %) or finish (20 %)."""
        rng, log = self.rng, self.log
        choice = rng.random()
        if choice < 0.55:
            layer = rng.randrange(LAYERS)
            entries = []
            for slot in rng.sample(range(SLOTS), rng.randint(1, SLOTS)):
                self.serial += 1
                entries.append((slot, self.worker * 1_000_000 + self.serial))
            res = self.buf.record("p0", 0, layer, entries)
            log.recorded += [(s, layer, t) for s, t in entries]
            log.delivered += [(s.slot, s.layer, s.tokens) for s in res.delivered]
            log.buffered += [(s.slot, s.layer, s.tokens) for s in res.buffered]
        elif choice < 0.8:
            slot = rng.randrange(SLOTS)
            request_id = f"w{self.worker}-{op}"
            try:
                rec = self.buf.register(
                    CacheTask("p0", 0, slot, request_id, need_prefill_tokens=2**40, num_layers=LAYERS)
                )
            except SlotOccupied:
                log.occupied += 1
                return
            self.mine[slot] = request_id
            log.registered += 1
            log.recovered += [(s.slot, s.layer, s.tokens) for s in rec.recovered]
            log.dropped += [(s.slot, s.layer, s.tokens) for s, _ in rec.dropped]
        else:
            slot = rng.randrange(SLOTS)
            request_id = self.mine.pop(slot, f"w{self.worker}-gone-{op}")
            log.finish_dropped += self.buf.finish("p0", 0, slot, request_id).dropped


def work(url: str, namespace: str, worker: int, operations: int, seed: int) -> Log:
    """A race-test process: ``operations`` random steps on its own client."""
    buf = SignalBuffer.from_url(url, namespace=namespace, env={})
    runner = Worker(buf, worker, seed)
    for op in range(operations):
        runner.step(op)
    buf.close()
    return runner.log
