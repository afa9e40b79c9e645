"""Redis memory per pending signal and per task, from ``MEMORY USAGE`` of the buffer's keys."""

from __future__ import annotations

from typing import Any

from ..buffer.sync import SignalBuffer
from ..models import CacheTask
from .names import scratch_buffer

INSTANCE = "mem"
RANK = 0
LAYERS_FULL = 61


def _usage(client: Any, keys: list[str]) -> int:
    total = 0
    for key in keys:
        used = client.execute_command("MEMORY", "USAGE", key, "SAMPLES", 0)
        total += int(used or 0)
    return total


def pending_bytes(url: str, namespace: str, slots: int, layers: int) -> dict[str, Any]:
    """Buffer ``slots`` x ``layers`` early signals on one rank; bytes of pending + expiry each."""
    with scratch_buffer(url, namespace, INSTANCE, RANK, max_slots=max(slots, 1)) as buf:
        for layer in range(layers):
            buf.record(INSTANCE, RANK, layer, [(slot, 1024 + slot) for slot in range(slots)])
        keys = buf.protocol.keys.rank(INSTANCE, RANK)
        used = _usage(buf.client, [keys.pending, keys.expiry])
    signals = slots * layers
    return {"slots": slots, "layers": layers, "signals": signals, "bytes": used, "per_signal": used / signals}


def task_bytes(url: str, namespace: str, tasks: int) -> dict[str, Any]:
    """Register ``tasks`` tasks (empty meta) on one rank; bytes of the live hash per task."""
    with scratch_buffer(url, namespace, INSTANCE, RANK, max_slots=max(tasks, 1)) as buf:
        for slot in range(tasks):
            buf.register(CacheTask(INSTANCE, RANK, slot, f"req-{slot}", need_prefill_tokens=4096, num_layers=61))
        keys = buf.protocol.keys.rank(INSTANCE, RANK)
        used = _usage(buf.client, [keys.live])
    return {"tasks": tasks, "bytes": used, "per_task": used / tasks}


def reply_bytes(url: str, namespace: str) -> dict[str, Any]:
    """One idempotency reply key, the per-call state kept for retry_s + grace."""
    buf = SignalBuffer.from_url(url, namespace=namespace, env={})
    try:
        buf.record(INSTANCE, RANK, 0, [(1, 10)])
        pattern = f"{buf.protocol.keys.rank(INSTANCE, RANK).reply('*')}"
        replies = list(buf.client.scan_iter(match=pattern, count=1000))
        used = _usage(buf.client, [key.decode() for key in replies[:1]])
        return {"per_call": used}
    finally:
        buf.close()
