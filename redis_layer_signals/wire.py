"""Script calls sent straight down a pooled connection, packed by hiredis.

redis-py 8's ``execute_command`` wraps every command in a pool checkout (a lock, a ``poll``
to make sure the connection holds no stale data, and connection-count metrics), a retry
wrapper and operation-duration metrics; measured here, that is about 35 µs a call, a quarter
of a round trip and more than our scripts' own server time. The buffer already owns what that
machinery is for: its own retry loop, time bound and idempotency tokens. So for a plain
``redis.Redis`` client (one server, TLS, unix socket or Sentinel) it takes connections from the
client's pool once, keeps them, and sends each call as one packed ``EVALSHA`` on one of them.

What stays redis-py's: connecting (and, for Sentinel, asking the sentinels for the primary),
TLS, authentication, the reply parser, and turning socket failures into ``ConnectionError`` or
``TimeoutError``. A connection whose call failed on the way (not by a whole error reply) is
closed and handed back to the pool, so one kept here is always idle and clean, and a new
checkout connects as the client would.
Other clients (Cluster, fakeredis, client-side caching, RESP3) keep the ordinary path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import redis
from hiredis import pack_command
from redis.exceptions import ResponseError

_generation = 0
"""Counts forks: a child must never send on its parent's sockets (they are shared)."""


def _forked() -> None:
    global _generation
    _generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def evalsha(sha: str, keys: Sequence[str], args: Sequence[str]) -> bytes:
    """The RESP form of ``EVALSHA sha len(keys) *keys *args``, what redis-py would send."""
    command: Any = ("EVALSHA", sha, str(len(keys)), *keys, *args)
    packed: bytes = pack_command(command)
    return packed


def supports(client: Any) -> bool:
    """Whether ``client`` is a plain redis-py client whose connections may be used directly."""
    if type(client) is not redis.Redis:
        return False
    pool = client.connection_pool
    if getattr(pool, "cache", None) is not None or getattr(client, "_single_connection_client", False):
        return False
    # RESP3 connections may receive push messages (client tracking, maintenance notices)
    # between replies; those stay with redis-py's command path.
    return pool.connection_kwargs.get("protocol") in (None, 2, "2")


class DirectCalls:
    """Packed commands on connections borrowed from ``client``'s pool and kept.

    Thread-safe: ``list.pop`` and ``list.append`` are atomic, so each connection serves one
    call at a time; a thread that finds none idle borrows one more from the pool (bounded by
    the pool's own ``max_connections``).
    """

    def __init__(self, client: Any) -> None:
        self._pool = client.connection_pool
        self._idle: list[Any] = []
        self._generation = _generation

    def run(self, packed: bytes) -> Any:
        """Send one packed command and return its reply; error replies are raised as redis-py
        raises them (``NoScriptError``, ``ResponseError``...)."""
        if self._generation != _generation:
            self._forget_parent()
        idle = self._idle
        try:
            connection = idle.pop()
        except IndexError:
            connection = self._pool.get_connection()
        try:
            connection.send_packed_command((packed,), check_health=False)
            reply = connection.read_response()
        except ResponseError:
            idle.append(connection)  # a whole error reply was read: the connection is clean
            raise
        except BaseException:
            # Closed, and handed back to the pool: its next checkout connects again the way
            # the client connects (a Sentinel connection asks the sentinels for the primary).
            connection.disconnect()
            self._pool.release(connection)
            raise
        idle.append(connection)
        return reply

    def _forget_parent(self) -> None:
        """In a forked child: drop the parent's connections without closing them (closing
        would shut the parent's sockets); the pool makes fresh ones for this process."""
        self._idle = []
        self._generation = _generation

    def close(self) -> None:
        """Give the kept connections back to the pool (the client's ``close`` disconnects them)."""
        if self._generation != _generation:
            self._forget_parent()
        idle, self._idle = self._idle, []
        for connection in idle:
            self._pool.release(connection)
