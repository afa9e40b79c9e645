"""What the bridge decided while Redis was unreachable, and how it is written back.

Each hook call served locally appends one operation. Once Redis answers again, the operations
are replayed in their order through the buffer's ordinary calls, each as of the time it was
decided (kept on this host's monotonic clock, and turned into the server's time when it is
replayed, with the offset a reply showed: a host wall clock off by minutes changes nothing),
so a replay never changes a decision: a signal keeps the time
it was first recorded (one whose TTL ran out during the outage stays expired, one that met its
task in time stays in time, whichever process writes back first), and a task its registration
time. Redis ends where it would have been had it answered all along: the same tasks live, the
same early signals pending, and the counters advanced by the same decisions. Where the process
owns its rank it does not journal (see ``owner``); here the adder runs in another process,
and what a replay hands out is queued by the process that replays it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..buffer.sync import SignalBuffer
from ..models import CacheTask, RecordResult, RegisterResult
from .signals import SIGNAL_LAYER


@dataclass(frozen=True)
class RecordOp:
    """A layer-0 batch recorded locally: ``(slot, tokens[, request_id])`` entries."""

    entries: tuple[tuple[Any, ...], ...]
    at_mono_ms: int | None = None
    """When it was recorded, on the monotonic clock (``RankContext.mono_ms``)."""


@dataclass(frozen=True)
class RegisterOp:
    """A task registered locally (overwriting the slot's holder, as FastDeploy does)."""

    task: CacheTask
    at_mono_ms: int | None = None
    """When it was registered, on the monotonic clock."""


@dataclass(frozen=True)
class FinishOp:
    """A slot released locally."""

    slot: int
    request_id: str
    at_mono_ms: int | None = None


@dataclass(frozen=True)
class PendingCall:
    """A hook's call that outlived the hook's budget: it may still run in Redis. Its own
    outcome is the write-back; ``fallback`` (what the hook decided locally) is replayed only if
    the call failed."""

    future: Future[Any]
    fallback: RecordOp | RegisterOp | FinishOp


Operation = RecordOp | RegisterOp | FinishOp | PendingCall


def replay(
    buffer: SignalBuffer, instance: str, rank: int, op: Operation, to_server: Callable[[int], int]
) -> list[tuple[int, int]]:
    """Run one journaled operation on Redis, as of its time turned into the server's
    (``to_server``); returns the layer-0 entries Redis handed out (delivered by a record,
    recovered by a register), which the caller queues only when this process could not have
    handed them out itself."""
    if isinstance(op, PendingCall):
        try:
            result = op.future.result()
        except Exception:
            return replay(buffer, instance, rank, op.fallback, to_server)
        if isinstance(result, RecordResult):
            return [(s.slot, s.tokens) for s in result.delivered]
        if isinstance(result, RegisterResult) and not result.repeated:
            return [(s.slot, s.tokens) for s in result.recovered if s.layer == SIGNAL_LAYER]
        return []
    at_ms = None if op.at_mono_ms is None else to_server(op.at_mono_ms)
    if isinstance(op, RecordOp):
        result = buffer.record(instance, rank, SIGNAL_LAYER, list(op.entries), at_ms=at_ms)
        return [(s.slot, s.tokens) for s in result.delivered]
    if isinstance(op, RegisterOp):
        registered = buffer.register(op.task, replace=True, at_ms=at_ms)
        if registered.repeated:
            return []
        return [(s.slot, s.tokens) for s in registered.recovered if s.layer == SIGNAL_LAYER]
    buffer.finish(instance, rank, op.slot, op.request_id, at_ms=at_ms)
    return []


def registered_by(op: Operation) -> CacheTask | None:
    """The task ``op`` registers, if it is a registration."""
    if isinstance(op, PendingCall):
        op = op.fallback
    return op.task if isinstance(op, RegisterOp) else None


def entries_in(op: Operation) -> int:
    """How many entries writing ``op`` back moves (the reconciled-entries metric)."""
    if isinstance(op, PendingCall):
        return entries_in(op.fallback)
    return len(op.entries) if isinstance(op, RecordOp) else 1
