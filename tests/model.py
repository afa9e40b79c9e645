"""A plain in-memory reference model of the buffer's semantics (DESIGN.md sections 2 and 3),
written without Redis so the scripts can be checked against it step by step."""

from __future__ import annotations

from dataclasses import dataclass, field

from redis_layer_signals.models import DropReason

Signal = tuple[int, int, str | None, int]  # layer, tokens, request_id, recorded_at_ms


@dataclass
class Pending:
    tokens: int
    request_id: str | None
    at: int
    deadline: int


@dataclass
class Holder:
    request_id: str
    deadline: int
    recovery: list[tuple[Signal, str]]


@dataclass
class Model:
    pending_ttl_ms: int
    task_ttl_ms: int
    now: int = 1_000_000
    live: dict[int, Holder] = field(default_factory=dict)
    pending: dict[int, dict[int, Pending]] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)

    def count(self, name: str, n: int = 1) -> None:
        if n:
            self.stats[name] = self.stats.get(name, 0) + n

    def alive(self, slot: int) -> Holder | None:
        holder = self.live.get(slot)
        return holder if holder is not None and holder.deadline > self.now else None

    def sweep(self) -> None:
        for slot in list(self.pending):
            layers = self.pending[slot]
            for layer in [layer for layer, p in layers.items() if p.deadline <= self.now]:
                del layers[layer]
                self.count("expired")
            if not layers:
                del self.pending[slot]

    def record(self, layer: int, entries: list[tuple[int, int, str | None]]) -> list[str]:
        self.sweep()
        holders = {slot: self.alive(slot) for slot, _, _ in entries}
        flags = []
        for slot, tokens, rid in entries:
            holder = holders[slot]
            if holder is not None and rid in (None, holder.request_id):
                flags.append("D")
                self.count("delivered")
                continue
            flags.append("B")
            self.count("buffered")
            layers = self.pending.setdefault(slot, {})
            if layer in layers:
                self.count("superseded")
            layers[layer] = Pending(tokens, rid, self.now, self.now + self.pending_ttl_ms)
        self.count("recorded", len(entries))
        return flags

    def register(
        self, slot: int, rid: str, need: int, num_layers: int, replace: bool
    ) -> tuple[str, list[tuple[Signal, str]] | str]:
        self.sweep()
        holder = self.alive(slot)
        status = "ok"
        if holder is not None and holder.request_id == rid:
            self.count("reregistered")
            return "again", holder.recovery
        if holder is not None:
            if not replace:
                self.count("occupied")
                return "occupied", holder.request_id
            status = "replaced"
            self.count("replaced")
        out: list[tuple[Signal, str]] = []
        for layer, p in sorted(self.pending.pop(slot, {}).items()):
            if p.deadline <= self.now:
                reason = DropReason.EXPIRED.value
            elif p.request_id is not None and p.request_id != rid:
                reason = DropReason.REQUEST_MISMATCH.value
            elif layer >= num_layers:
                reason = DropReason.LAYER_OUT_OF_RANGE.value
            elif p.tokens <= 0:
                reason = DropReason.NON_POSITIVE.value
            elif p.tokens > need:
                reason = DropReason.OVER_NEED.value
            else:
                reason = ""
            self.count(f"dropped_{reason}" if reason else "recovered")
            out.append(((layer, p.tokens, p.request_id, p.at), reason))
        self.live[slot] = Holder(rid, self.now + self.task_ttl_ms, out)
        self.count("registered")
        return status, out

    def finish(self, slot: int, rid: str) -> tuple[bool, int, bool]:
        self.sweep()
        holder = self.live.get(slot)
        if self.alive(slot) is not None and holder is not None and holder.request_id != rid:
            self.count("fenced")
            return False, 0, True
        removed = holder is not None and holder.request_id == rid
        if removed:
            del self.live[slot]
            self.count("finished")
        layers = self.pending.get(slot, {})
        doomed = [layer for layer, p in layers.items() if p.request_id in (None, rid)]
        for layer in doomed:
            del layers[layer]
        if slot in self.pending and not layers:
            del self.pending[slot]
        self.count("finish_dropped", len(doomed))
        return removed, len(doomed), False
