"""Finishes owed to Redis: a ``finish`` that raised ``BufferUnavailable`` is kept and sent
again, the same call with the same token, before the buffer's next call on the same rank.

A finish lost to a partition would otherwise leave the finished request holding its slot until
the task TTL: the next request's signals, which carry no request id, would be delivered to the
finished request's task, and the next ``register`` on the slot refused ``SlotOccupied``. In
FastDeploy's layout one process registers, feeds and finishes every task of its rank, so that
process sends the finish before anything of the next request: the finish survives the
partition. A resend that still fails makes the new call raise ``BufferUnavailable`` without
sending it (Redis is unreachable for that rank anyway: one rank's keys live on one node).
Replaying a finish is safe: it is fenced by request id (it never touches another request's
task) and its token replays its first reply if it had run.

What is kept is bounded:

- one finish per (rank, slot, request id): a caller that calls ``finish`` again for the same
  request while Redis is away owes nothing more. The first is kept: if it ran, its token
  replays its reply; a second finish of the same request would find the slot released and
  change nothing, so either ends the same.
- finishes of other requests on the same slot are all kept, in order: only the request that
  holds the slot when they are resent is released by its own, and which one that is cannot be
  known here (another process may have registered on the slot meanwhile).
- at most ``limit`` per rank (the buffer's ``max_slots``: one live request per slot, one
  finish each). One more is not kept, and never silently: ``finish`` raises
  ``OwedFinishesFull`` (a ``BufferUnavailable``: the caller must send that finish again
  itself), a warning is logged, and ``refused`` counts it (the exporter's
  ``rls_owed_finishes_refused_total``). What was already owed stays owed.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from ..errors import BufferUnavailable, OwedFinishesFull
from ..protocol.calls import Prepared

logger = logging.getLogger("redis_layer_signals")


def rank_tag(key: str) -> str:
    """The hash tag ``{namespace/instance/rank}`` of one of a rank's keys."""
    return key[key.index("{") : key.index("}") + 1]


@dataclass(frozen=True)
class OwedFinish:
    """One owed finish: the prepared call (same token on every resend) and what identifies it."""

    prepared: Prepared[Any]
    slot: int
    request_id: str

    def same_as(self, other: OwedFinish) -> bool:
        return self.slot == other.slot and self.request_id == other.request_id


class OwedFinishes:
    """The finishes still owed, in the order they failed, per rank (hash tag), at most
    ``limit`` per rank. Empty, it is falsy: the common call pays one truth test."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.refused = 0
        """Finishes not kept because their rank owed ``limit`` already (each raised ``OwedFinishesFull``)."""
        self._owed: dict[str, list[OwedFinish]] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._owed)

    def owe(self, finish: OwedFinish, error: BufferUnavailable) -> None:
        """Keep ``finish``, which raised ``error``; raises ``OwedFinishesFull`` (carrying
        ``error``'s cause) when its rank is full. See the module docstring."""
        call = finish.prepared.call
        assert call is not None  # a finish always sends
        tag = rank_tag(call.keys[0])
        with self._lock:
            owed = self._owed.setdefault(tag, [])
            if any(item.same_as(finish) for item in owed):
                return
            if len(owed) < self.limit:
                owed.append(finish)
                return
            self.refused += 1
        logger.warning(
            "finish of %r on slot %d of %s not kept to be resent: the rank owes %d finishes already",
            finish.request_id,
            finish.slot,
            tag,
            self.limit,
        )
        raise OwedFinishesFull(error, tag, finish.slot, finish.request_id, self.limit) from error.__cause__

    def take(self, key: str) -> list[OwedFinish]:
        """The owed finishes of ``key``'s rank, removed: the caller sends them or gives them back."""
        with self._lock:
            return self._owed.pop(rank_tag(key), [])

    def give_back(self, key: str, unsent: list[OwedFinish]) -> None:
        """Put back what could not be sent, ahead of anything owed since (a finish owed again
        since is kept once; ``limit`` does not apply: these were owed already)."""
        if not unsent:
            return
        with self._lock:
            tag = rank_tag(key)
            since = [item for item in self._owed.get(tag, []) if not any(item.same_as(back) for back in unsent)]
            self._owed[tag] = unsent + since

    def count(self) -> int:
        with self._lock:
            return sum(len(items) for items in self._owed.values())
