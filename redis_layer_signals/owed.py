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
"""

from __future__ import annotations

import threading
from typing import Any

from .protocol import Prepared


def rank_tag(key: str) -> str:
    """The hash tag ``{namespace/instance/rank}`` of one of a rank's keys."""
    return key[key.index("{") : key.index("}") + 1]


class OwedFinishes:
    """The finishes still owed, in the order they failed, per rank (hash tag). Empty, it is
    falsy: the common call pays one truth test."""

    def __init__(self) -> None:
        self._owed: dict[str, list[Prepared[Any]]] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._owed)

    def owe(self, prepared: Prepared[Any]) -> None:
        assert prepared.call is not None  # a finish always sends
        with self._lock:
            self._owed.setdefault(rank_tag(prepared.call.keys[0]), []).append(prepared)

    def take(self, key: str) -> list[Prepared[Any]]:
        """The owed finishes of ``key``'s rank, removed: the caller sends them or gives them back."""
        with self._lock:
            return self._owed.pop(rank_tag(key), [])

    def give_back(self, key: str, unsent: list[Prepared[Any]]) -> None:
        """Put back what could not be sent, ahead of anything owed since."""
        if unsent:
            with self._lock:
                tag = rank_tag(key)
                self._owed[tag] = unsent + self._owed.get(tag, [])

    def count(self) -> int:
        with self._lock:
            return sum(len(items) for items in self._owed.values())
