"""Operator reads and cleanup: what ``rls inspect`` shows and what ``rls purge`` removes.

Reads go straight to the namespace's hashes (one HGETALL per rank and kind) and never write;
purge walks the namespace with SCAN (never KEYS, never FLUSHDB) so other namespaces and the
rest of the database are untouched.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..buffer.sync import SignalBuffer
from ..protocol.keys import KeySpace
from ..protocol.replies import decode_task, pending_records, split_holder, text

PURGE_BATCH = 500
"""Keys removed per UNLINK: bounds one command's work on the server."""


@dataclass(frozen=True)
class TaskRow:
    instance: str
    rank: int
    slot: int
    request_id: str
    need_prefill_tokens: int | None
    num_layers: int | None
    lease_left_ms: int


@dataclass(frozen=True)
class PendingRow:
    instance: str
    rank: int
    slot: int
    layer: int
    tokens: int
    request_id: str | None
    age_ms: int
    ttl_ms: int


@dataclass
class Snapshot:
    namespace: str
    now_ms: int
    tasks: list[TaskRow] = field(default_factory=list)
    pending: list[PendingRow] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def snapshot(
    buf: SignalBuffer, instance: str | None = None, rank: int | None = None, slot: int | None = None
) -> Snapshot:
    """Live tasks and pending signals of the namespace, optionally narrowed to one instance,
    rank or slot, with their ages and what is left of their TTLs (server time)."""
    now = buf.now_ms()
    shot = Snapshot(buf.config.namespace, now)
    for inst, rk in buf.ranks():
        if (instance is not None and inst != instance) or (rank is not None and rk != rank):
            continue
        keys = buf.protocol.keys.rank(inst, rk)
        live = buf.client.hgetall(keys.live)
        documents = {text(name): doc for name, doc in live.items()}
        for s, holder in slot_fields(live, slot):
            request_id, deadline = split_holder(holder)
            if deadline <= now:
                continue  # a lapsed lease is no live task
            task = decode_task(inst, rk, s, holder, documents.get(f"{s}:doc"), now)
            shot.tasks.append(
                TaskRow(
                    inst,
                    rk,
                    s,
                    request_id,
                    task.need_prefill_tokens if task else None,
                    task.num_layers if task else None,
                    deadline - now,
                )
            )
        by_slot: dict[int, list[tuple[int, str]]] = {}
        for (s, layer), value in signal_fields(buf.client.hgetall(keys.pending), slot):
            by_slot.setdefault(s, []).append((layer, value))
        for s, signals in by_slot.items():
            shot.pending.extend(_pending_rows(inst, rk, s, signals, now))
    shot.tasks.sort(key=lambda t: (t.instance, t.rank, t.slot))
    shot.pending.sort(key=lambda p: (p.instance, p.rank, p.slot, p.layer))
    return shot


def slot_fields(fields: dict[Any, Any], slot: int | None = None) -> list[tuple[int, str]]:
    """The per-slot fields of the live hash as (slot, value), only ``slot``'s when given."""
    found = []
    for name, value in fields.items():
        key = text(name)
        if key.isdigit() and (slot is None or int(key) == slot):
            found.append((int(key), text(value)))
    return found


def signal_fields(fields: dict[Any, Any], slot: int | None = None) -> list[tuple[tuple[int, int], str]]:
    """The pending hash's signals as ((slot, layer), value), only ``slot``'s when given; the
    "layers" field is the list of the rank's layers, not a signal."""
    found = []
    for name, value in fields.items():
        s, colon, layer = text(name).partition(":")
        if colon and s.isdigit() and layer.isdigit() and (slot is None or int(s) == slot):
            found.append(((int(s), int(layer)), text(value)))
    return found


def _pending_rows(instance: str, rank: int, slot: int, signals: list[tuple[int, str]], now: int) -> list[PendingRow]:
    """One slot's pending signals with their age and the TTL each has left."""
    return [
        PendingRow(instance, rank, slot, s.layer, s.tokens, s.request_id, now - s.recorded_at_ms, deadline - now)
        for s, deadline in pending_records(instance, rank, slot, signals)
    ]


def namespace_keys(client: Any, namespace: str) -> list[str]:
    """Every key of ``namespace`` (SCAN by its prefix, then checked against the key layout)."""
    space = KeySpace(namespace)
    found = []
    for key in client.scan_iter(match=space.pattern(), count=1000):
        if space.owner(key) is not None:
            found.append(text(key))
    return sorted(found)


def purge(client: Any, namespace: str) -> int:
    """Remove every key of ``namespace``, counters included; returns how many were removed."""
    keys = namespace_keys(client, namespace)
    removed = 0
    for start in range(0, len(keys), PURGE_BATCH):
        removed += int(client.unlink(*keys[start : start + PURGE_BATCH]))
    return removed
