"""A bound on the whole call, not on each read.

``socket_timeout`` bounds one read: a reply trickling back a byte every 0.3 s never trips it,
and a resend started just before the end of ``retry_s`` waited a full timeout more (7.5 s
measured with ``retry_s=0.5``). So the buffers give every call a deadline, its start plus
``retry_s``, and the clients made by ``connection`` enforce it on every socket operation:

- sync: a thread-local deadline (``bounded`` ... ``release``) and connection classes
  (``with_deadline``) whose sockets shorten their timeout, before each send and each read,
  to the time left, and fail at once when none is left; connecting is bounded the same way.
  A timed-out read is redis-py's ``TimeoutError``, and the retry loop, out of time, raises
  ``BufferUnavailable``.
- async: on a plain client each call's send and whole reply get the time left to the
  deadline as their timeout (``call_deadline``; redis.asyncio times a whole reply, not
  each read); on the others (Cluster, the in-memory fake) one timeout covers the whole call
  (``async_timeout``), cancelling whatever the call awaits when the deadline passes.

What is left past ``retry_s`` is the time to notice: ``MARGIN_S`` covers it (a scheduler
that runs the thread late, the close of a connection). A client passed in by the caller keeps
its own timeouts; only ``from_url`` clients get the per-read bound, the async one holds for
every client.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Awaitable
from contextvars import ContextVar
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    from asyncio import timeout as async_timeout
else:  # pragma: no cover - redis-py depends on async-timeout there
    from async_timeout import timeout as async_timeout

__all__ = [
    "BACKSTOP_S",
    "MARGIN_S",
    "DeadlineSocket",
    "async_timeout",
    "bounded",
    "call_deadline",
    "release",
    "remaining",
    "with_deadline",
    "within_call",
]

T = TypeVar("T")

MARGIN_S = 0.25
"""How long past ``retry_s`` a call may take to return or raise, whatever the network does."""

BACKSTOP_S = 0.01
"""The async buffers' timeouts around a call (``call_deadline`` included) end this long after
its ``retry_s``: the resend loop ends at ``retry_s`` itself, with the last error it met."""

_local = threading.local()

call_deadline: ContextVar[float | None] = ContextVar("rls_call_deadline", default=None)
"""The async buffers' deadline of the call in progress, per task (a ``time.monotonic()``
reading): ``redis_layer_signals.transport.wire.AsyncDirectCalls`` reads each reply within it."""


def bounded(deadline: float) -> float | None:
    """Make ``deadline`` (a ``time.monotonic()`` reading) this thread's bound, unless an
    earlier one is set (a call inside a call); returns the previous bound, for ``release``."""
    previous: float | None = getattr(_local, "deadline", None)
    if previous is None or deadline < previous:
        _local.deadline = deadline
    return previous


def release(previous: float | None) -> None:
    _local.deadline = previous


def remaining() -> float | None:
    """Seconds left to this thread's deadline (negative once passed), None without one."""
    deadline: float | None = getattr(_local, "deadline", None)
    return None if deadline is None else deadline - time.monotonic()


async def within_call(step: Awaitable[T]) -> T:
    """``step`` within the async call's deadline (``call_deadline``), when one is set: the
    direct path times its own reads, not what a call sends through the client itself (a
    server check, loading the library, the permission check, WAIT, a resend's reconnect)."""
    ends = call_deadline.get()
    if ends is None:
        return await step
    async with async_timeout(ends - time.monotonic()):
        return await step


SLACK_S = 0.01
"""A socket timeout may end this much after the deadline (part of ``MARGIN_S``): the
common call then changes no timeout at all (``settimeout`` is a system call)."""


class DeadlineSocket:
    """A connected socket whose every send and read waits at most until the thread's deadline.

    redis-py's parsers and ``sendall`` go through ``recv``/``recv_into``/``sendall`` here; any
    other attribute is the socket's own. ``settimeout`` records the timeout redis-py wants,
    which applies as it is when no deadline is set, or when it is the shorter. A timeout is
    changed only when the one in force could end more than ``SLACK_S`` past the deadline:
    on the common call, whose deadline is ``retry_s`` away like the socket timeout, never."""

    __slots__ = ("_applied", "_sock", "_timeout")

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._timeout: float | None = sock.gettimeout()
        self._applied = self._timeout

    def _arm(self) -> None:
        left = remaining()
        wanted = self._timeout
        if left is not None:
            if left <= 0:
                raise TimeoutError("the call's deadline passed")
            applied = self._applied
            if applied is not None and 0 < applied <= left + SLACK_S:
                return  # the timeout in force ends by the deadline (within the slack)
            if wanted is None or left < wanted:
                wanted = left
        if wanted != self._applied:
            self._sock.settimeout(wanted)
            self._applied = wanted

    def recv(self, *args: Any) -> Any:
        self._arm()
        return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> Any:
        self._arm()
        return self._sock.recv_into(*args)

    def sendall(self, *args: Any) -> Any:
        self._arm()
        return self._sock.sendall(*args)

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._applied = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


_classes: dict[type[Any], type[Any]] = {}


def with_deadline(connection_class: type[Any]) -> type[Any]:
    """``connection_class`` (redis-py's TCP, TLS, unix or Sentinel connection) with its socket
    bounded by the thread's deadline, connecting included (one subclass per class)."""
    if getattr(connection_class, "_rls_deadline", False):
        return connection_class
    cached = _classes.get(connection_class)
    if cached is not None:
        return cached

    def _connect(self: Any) -> Any:
        left = remaining()
        if left is None:
            return DeadlineSocket(super(bounded_class, self)._connect())
        if left <= 0:
            raise TimeoutError("the call's deadline passed before connecting")
        configured = self.socket_connect_timeout
        self.socket_connect_timeout = left if configured is None else min(configured, left)
        try:
            return DeadlineSocket(super(bounded_class, self)._connect())
        finally:
            self.socket_connect_timeout = configured

    bounded_class: type[Any] = type(
        f"Bounded{connection_class.__name__}",
        (connection_class,),
        {"_connect": _connect, "_rls_deadline": True, "__module__": __name__},
    )
    _classes[connection_class] = bounded_class
    return bounded_class
