"""Function calls (FCALL) sent straight down a pooled connection, packed by hiredis.

redis-py 8's ``execute_command`` wraps every command in a pool checkout (a lock, a ``poll``
to make sure the connection holds no stale data, and connection-count metrics), a retry
wrapper and operation-duration metrics; measured here, that is 35 to 55 µs a call, a third of
a round trip and more than our scripts' own server time. The buffer already owns what that
machinery is for: its own retry loop, time bound and idempotency tokens. So for a plain
``redis.Redis`` client (one server, TLS, unix socket or Sentinel) it takes connections from the
client's pool once, keeps them, and sends each call as one packed ``FCALL`` on one of them.

What stays redis-py's: connecting (and, for Sentinel, asking the sentinels for the primary),
TLS, authentication, the reply parser, and turning socket failures into ``ConnectionError`` or
``TimeoutError``. A connection whose call failed on the way (not by a whole error reply) is
closed and handed back to the pool, so one kept here is always idle and clean, and a new
checkout connects as the client would.
Other clients (Cluster, fakeredis, client-side caching, RESP3) keep the ordinary path.

One difference from the pool's checkout: a kept connection is not polled before use, so one the
server closed while it sat idle (its ``timeout`` setting, a restart) fails its next call with
``ConnectionError``. The buffer's retry loop resends that call, with the same idempotency token,
on a fresh connection after its first backoff (10 ms). A poll per call would cost a syscall on
every call to save that once per idle timeout.

``redis.asyncio`` clients get the same treatment (``AsyncDirectCalls``): there a task
cancelled between sending and reading leaves its reply on the socket, so cancellation, too,
closes the connection rather than keeping it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio
from hiredis import pack_command
from redis.exceptions import ResponseError, TimeoutError

from .deadline import call_deadline

_generation = 0
"""Counts forks: a child must never send on its parent's sockets (they are shared)."""


def _forked() -> None:
    global _generation
    _generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def fcall(function: str, keys: Sequence[str], args: Sequence[str]) -> bytes:
    """The RESP form of ``FCALL function len(keys) *keys *args``, what redis-py would send."""
    command: Any = ("FCALL", function, str(len(keys)), *keys, *args)
    packed: bytes = pack_command(command)
    return packed


def evalsha(sha: str, keys: Sequence[str], args: Sequence[str]) -> bytes:
    """The RESP form of ``EVALSHA sha len(keys) *keys *args`` (the benchmark's floor)."""
    command: Any = ("EVALSHA", sha, str(len(keys)), *keys, *args)
    packed: bytes = pack_command(command)
    return packed


def supports(client: Any) -> bool:
    """Whether ``client`` is a plain redis-py client whose connections may be used directly."""
    if type(client) is not redis.Redis:
        return False
    return _plain_pool(client.connection_pool, getattr(client, "_single_connection_client", False))


def supports_async(client: Any) -> bool:
    """``supports`` for ``redis.asyncio`` clients (fakeredis and Cluster are other types)."""
    if type(client) is not redis.asyncio.Redis:
        return False
    return _plain_pool(client.connection_pool, client.single_connection_client)


def _plain_pool(pool: Any, single_connection: bool) -> bool:
    """A pool whose connections carry nothing but our replies: no client-side cache to keep in
    step, no one connection shared with the client's own commands, no RESP3."""
    if getattr(pool, "cache", None) is not None or single_connection:
        return False
    # RESP3 connections may receive push messages (client tracking, maintenance notices)
    # between replies; those stay with redis-py's command path.
    return pool.connection_kwargs.get("protocol") in (None, 2, "2")


class _KeptConnections:
    """What both transports keep: the client's pool, the idle connections borrowed from it,
    and the fork generation they belong to."""

    def __init__(self, client: Any) -> None:
        self._pool = client.connection_pool
        self._idle: list[Any] = []
        self._generation = _generation
        # Kept idle connections count as in use for the pool. At most half its size are kept,
        # so they never starve the client's own commands (FUNCTION LOAD, reads, WAIT): a burst of
        # calls may borrow every connection of a bounded pool (redis.asyncio's default is 100).
        self._keep_limit = self._pool.max_connections // 2
        # Set by close(): a call still in flight then hands its connection back, not keeps it.
        self._closed = False

    def _kept(self) -> list[Any]:
        """This process's idle connections (a forked child starts with none)."""
        if self._generation != _generation:
            self._forget_parent()
        return self._idle

    def _forget_parent(self) -> None:
        """In a forked child: drop the parent's connections without closing them (closing
        would shut the parent's sockets); the pool makes fresh ones for this process."""
        self._idle = []
        self._generation = _generation


class DirectCalls(_KeptConnections):
    """Packed commands on connections borrowed from ``client``'s pool and kept.

    Thread-safe: ``list.pop`` and ``list.append`` are atomic, so each connection serves one
    call at a time; a thread that finds none idle borrows one more from the pool (bounded by
    the pool's own ``max_connections``, of which about half at most stay kept).
    """

    def run(self, packed: bytes) -> Any:
        """Send one packed command and return its reply; error replies are raised as redis-py
        raises them (``ResponseError``: "Function not found"...)."""
        idle = self._kept()
        try:
            connection = idle.pop()
        except IndexError:
            connection = self._pool.get_connection()
        try:
            connection.send_packed_command((packed,), check_health=False)
            reply = connection.read_response()
        except ResponseError:
            self._put_back(idle, connection)  # a whole error reply was read: it is clean
            raise
        except BaseException:
            # Closed, and handed back to the pool: its next checkout connects again the way
            # the client connects (a Sentinel connection asks the sentinels for the primary).
            connection.disconnect()
            self._pool.release(connection)
            raise
        self._put_back(idle, connection)
        return reply

    def _put_back(self, idle: list[Any], connection: Any) -> None:
        """Keep a clean connection for the next call, or return it to the pool past the limit
        or once closed."""
        if self._closed or len(idle) >= self._keep_limit:
            self._pool.release(connection)
            return
        idle.append(connection)
        if self._closed:  # close() ran between the check and the append: its drain may have missed it
            self._release_all(idle)

    def _release_all(self, idle: list[Any]) -> None:
        """Hand every kept connection back; ``pop`` is atomic, so each goes back once."""
        while idle:
            try:
                connection = idle.pop()
            except IndexError:
                return
            self._pool.release(connection)

    def close(self) -> None:
        """Give the kept connections back to the pool (the client's ``close`` disconnects them);
        calls still in flight give theirs back when they end."""
        self._closed = True
        self._release_all(self._kept())


class AsyncDirectCalls(_KeptConnections):
    """``DirectCalls`` on a ``redis.asyncio`` client's pool.

    A task takes a connection off the idle list before its first ``await`` and puts it back
    only after reading the whole reply, so concurrent tasks never share one; a task that finds
    none idle borrows one more from the pool.
    """

    async def run(self, packed: bytes) -> Any:
        """Send one packed command and return its reply; error replies are raised as
        redis.asyncio raises them (``ResponseError``: "Function not found"...)."""
        idle = self._kept()
        ends = call_deadline.get()
        left = None if ends is None else ends - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError("the call's deadline passed before sending")
        if idle:
            connection = idle.pop()
        elif left is None:
            connection = await self._pool.get_connection()
        else:  # connecting, too, within the call's deadline (a client's own connect timeout may be none)
            connection = await asyncio.wait_for(self._pool.get_connection(), left)
        configured = connection.socket_timeout
        if left is not None and (configured is None or left < configured):
            # Sending and the whole reply within the call's deadline, however the reply
            # trickles in (redis.asyncio times a whole reply; see deadline.py). Given as the
            # socket timeout, not read_response's timeout, which returns None when it passes.
            connection.socket_timeout = left
        try:
            await connection.send_packed_command((packed,), check_health=False)
            reply = await connection.read_response()
        except ResponseError:
            connection.socket_timeout = configured
            await self._put_back(idle, connection)  # a whole error reply was read: it is clean
            raise
        except BaseException:
            connection.socket_timeout = configured
            # Also on CancelledError: a task cancelled after sending leaves its reply unread on
            # the socket, where the next call would take it for its own. Closed and handed back,
            # the connection reconnects on its next checkout (Sentinel: asking the sentinels).
            # Closed without waiting for the socket (as redis-py does on errors), and handed
            # back whatever happens: a cancel scope that cancels every later await too would
            # otherwise interrupt the wait and keep the connection checked out for good.
            try:
                await connection.disconnect(nowait=True)
            finally:
                await self._pool.release(connection)
            raise
        connection.socket_timeout = configured
        await self._put_back(idle, connection)
        return reply

    async def _put_back(self, idle: list[Any], connection: Any) -> None:
        """Keep a clean connection for the next call, or return it to the pool past the limit
        or once closed."""
        if self._closed or len(idle) >= self._keep_limit:
            await self._pool.release(connection)
        else:
            idle.append(connection)

    async def close(self) -> None:
        """Give the kept connections back to the pool (the client's ``aclose`` disconnects them);
        tasks still waiting for a reply give theirs back when they end."""
        self._closed = True
        idle = self._kept()
        while idle:
            await self._pool.release(idle.pop())
