"""Bounded resending. A call whose reply was lost is sent again with the same idempotency
token (the scripts replay their first reply), until ``retry_s`` runs out."""

from __future__ import annotations

import random
import time

from redis import exceptions as rx

from ..errors import BufferUnavailable
from ..server.library import LibraryMissing
from . import deadline
from .replication import NotReplicated
from .routing import SlotMoved

RETRYABLE: tuple[type[BaseException], ...] = (
    rx.ConnectionError,  # includes BusyLoadingError (a restarted server loading its AOF)
    rx.TimeoutError,
    rx.TryAgainError,  # Cluster: keys of a slot in migration
    rx.ClusterDownError,
    rx.MasterDownError,
    rx.ReadOnlyError,  # Sentinel: the old primary became a replica
    rx.SlotNotCoveredError,
    rx.ClusterError,  # Cluster: redirections (TRYAGAIN during a migration) exhausted for now
    LibraryMissing,  # a FUNCTION FLUSH between loading the library and resending: nothing ran
    OSError,
    NotReplicated,  # wait_replicas: resend; the function replays its reply and WAIT runs again
    SlotMoved,
)
"""Errors after which the same call may succeed when sent again."""

AT_DEADLINE_S = 0.05
"""An error this close to the deadline (or past it) counts as the deadline's."""

FIRST_BACKOFF_S = 0.01
MAX_BACKOFF_S = 0.25


class Attempts:
    """Tracks one call's retry budget; ``next_delay`` says how long to wait or gives up.

    ``started`` (a ``time.monotonic()`` reading) is when the call began: the buffers send once
    before building this, only after a retryable error, and the budget must still count from
    the first attempt, so a slow first attempt does not extend the bound.
    """

    def __init__(self, operation: str, retry_s: float, started: float | None = None) -> None:
        self.operation = operation
        self.retry_s = retry_s
        self.deadline = (time.monotonic() if started is None else started) + retry_s
        # Inside a read of several round trips, the whole read's deadline comes first.
        left = deadline.remaining()
        if left is not None:
            self.deadline = min(self.deadline, time.monotonic() + left)
        self.count = 0

    def keep(self, previous: BaseException, error: BaseException) -> BaseException:
        """The error to report if this one is the last: a timeout that ends at the deadline is
        the bound cutting the last attempt short, so the error before it says more (the
        connection refused, the replica that did not confirm)."""
        if (
            isinstance(error, rx.TimeoutError)
            and not isinstance(previous, rx.TimeoutError)
            and self.deadline - time.monotonic() <= AT_DEADLINE_S
        ):
            return previous
        return error

    def next_delay(self, cause: BaseException) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise BufferUnavailable(self.operation, self.retry_s, cause) from cause
        backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2**self.count)
        self.count += 1
        return float(min(remaining, backoff * random.uniform(0.5, 1.0)))


def cut_by_deadline() -> bool:
    """Whether the call in progress (sync) is at its deadline: a Cluster client that
    refreshes its slot map after a timeout and cannot reach a node in the time left raises
    ``RedisClusterException``, which is then the bound's doing, not a misconfiguration."""
    left = deadline.remaining()
    return left is not None and left <= AT_DEADLINE_S
