"""Key names of one benchmark run. Every namespace and key prefix carries the run's id, so the
run removes exactly what it wrote when it ends, even on a server it was given with --redis."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

from ..buffer.sync import SignalBuffer
from ..constants import KEY_PREFIX

RUN_ID = uuid.uuid4().hex[:8]
NAMESPACE_PREFIX = f"bench-{RUN_ID}-"
NAIVE_PREFIX = "rls-bench-naive"
FLOOR_PREFIX = "rls-bench-floor"
CLEANUP_BATCH = 500


def namespace(kind: str = "ns") -> str:
    """A fresh buffer namespace of this run."""
    return f"{NAMESPACE_PREFIX}{kind}-{uuid.uuid4().hex[:6]}"


def naive_prefix() -> str:
    """Key prefix of one naive WATCH/MULTI buffer (its own hash tag)."""
    return f"{NAIVE_PREFIX}:{{{namespace('naive')}}}"


def floor_key() -> str:
    return f"{FLOOR_PREFIX}:{{{NAMESPACE_PREFIX}floor}}"


@contextlib.contextmanager
def scratch_buffer(url: str, namespace: str, instance: str, rank: int, **options: Any) -> Iterator[SignalBuffer]:
    """A buffer of this run for one measurement; the per-request keys it wrote on
    ``instance``/``rank`` are deleted when the block ends, so later cases start clean."""
    buf = SignalBuffer.from_url(url, namespace=namespace, env={}, **options)
    try:
        yield buf
    finally:
        buf.client.delete(*buf.protocol.keys.rank(instance, rank).per_request)
        buf.close()


def cleanup(client: Any) -> int:
    """Remove every key this run wrote (SCAN by the run's prefixes); returns how many."""
    removed = 0
    for pattern in (f"{KEY_PREFIX}:{{{NAMESPACE_PREFIX}*", f"{NAIVE_PREFIX}:{{{NAMESPACE_PREFIX}*"):
        batch: list[Any] = []
        for key in client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= CLEANUP_BATCH:
                removed += int(client.unlink(*batch))
                batch = []
        if batch:
            removed += int(client.unlink(*batch))
    return removed
