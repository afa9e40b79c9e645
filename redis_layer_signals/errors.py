"""Typed errors of the library, and the client's errors that become ours.

Validation errors are also ``ValueError`` so callers that already guard bad input keep working;
they are raised before anything reaches Redis, so a rejected call has written nothing.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, NoReturn

from redis import exceptions as rx


class SignalBufferError(Exception):
    """Base of every error this library raises on purpose."""


class _InvalidValue(SignalBufferError, ValueError):
    """A field failed validation; carries the field name and the offending value."""

    kind = "value"

    def __init__(self, field: str, value: Any, why: str) -> None:
        self.field = field
        self.value = value
        self.why = why
        super().__init__(f"invalid {self.kind} field {field}={value!r}: {why}")


class InvalidSignal(_InvalidValue):
    """A layer signal (or a record batch) is malformed."""

    kind = "signal"


class InvalidTask(_InvalidValue):
    """A cache task, or a slot/request argument of register or finish, is malformed."""

    kind = "task"


class InvalidConfig(_InvalidValue):
    """A buffer option (namespace, TTL, URL, ...) is malformed."""

    kind = "config"


class SlotOccupied(SignalBufferError):
    """Another live request holds the slot; register with ``replace=True`` to take it."""

    def __init__(self, instance: str, rank: int, slot: int, holder: str, request_id: str) -> None:
        self.instance = instance
        self.rank = rank
        self.slot = slot
        self.holder = holder
        self.request_id = request_id
        super().__init__(
            f"slot {slot} of {instance}/{rank} is held by request {holder!r}; "
            f"refusing to register {request_id!r} (pass replace=True to take it over)"
        )


class BufferUnavailable(SignalBufferError):
    """Redis did not answer within the bounded retry time; ``__cause__`` is the last error."""

    def __init__(self, operation: str, retry_s: float, cause: BaseException) -> None:
        self.operation = operation
        self.retry_s = retry_s
        super().__init__(f"{operation}: Redis unavailable after retrying for {retry_s:g}s: {cause}")


class OwedFinishesFull(BufferUnavailable):
    """A ``finish`` raised ``BufferUnavailable`` and, unlike the others, was not kept to be
    sent again: its rank already owes ``limit`` finishes (see ``owed``). Send that finish
    again yourself once Redis answers."""

    def __init__(self, error: BufferUnavailable, rank: str, slot: int, request_id: str, limit: int) -> None:
        super().__init__(error.operation, error.retry_s, error.__cause__ or error)
        self.rank = rank
        self.slot = slot
        self.request_id = request_id
        self.limit = limit
        self.args = (
            f"{self.args[0]}; not kept to be resent: {rank} already owes {limit} finishes "
            f"(slot {slot}, request {request_id!r}), send it again once Redis answers",
        )


class EvictingServer(SignalBufferError):
    """The server may evict keys (its ``maxmemory-policy`` is not ``noeviction``) and the
    buffer was told to refuse such a server (``eviction="refuse"``): nothing was sent."""

    def __init__(self, server: str, policy: str) -> None:
        self.server = server
        self.policy = policy
        super().__init__(
            f"Redis {server} has maxmemory-policy {policy}, which may evict signals silently; "
            f"set `maxmemory-policy noeviction` on it (refusing because eviction='refuse')"
        )


class ServerOutOfMemory(SignalBufferError):
    """The server is at ``maxmemory`` and refuses writes (``noeviction``): the call changed
    nothing. ``finish`` and the sweep still run, so the server drains as requests finish;
    ``__cause__`` is redis-py's ``OutOfMemoryError``."""

    def __init__(self, operation: str, cause: BaseException) -> None:
        self.operation = operation
        super().__init__(
            f"{operation}: Redis is out of memory (maxmemory reached, writes refused; nothing changed): {cause}"
        )


class NoPermissionError(SignalBufferError):
    """The server's ACL refuses the caller a command this call needs (not retried). Nothing was
    written: the buffers ask the server whether every command of a rank's functions is allowed
    before their first call that could write (see ``lua/permissions.lua``). ``command`` is the
    refused command (``hset``, ``fcall``, ``function|load``...); ``__cause__`` the server's error
    when it refused one itself."""

    def __init__(self, operation: str, command: str, detail: str = "") -> None:
        self.operation = operation
        self.command = command
        suffix = f" ({detail})" if detail else ""
        super().__init__(
            f"{operation}: the Redis user may not run {command!r}{suffix}; grant it "
            "(redis_layer_signals.ops.acl.rules() lists what the library needs)"
        )


class LibraryMismatch(SignalBufferError):
    """The server's ``rls_v2`` is other code than this client ships (another build, an edited
    copy): refused, never called and never replaced. ``served`` is the digest it reports, or
    None when it reports none (a build from before digests, or code that is no build of ours)."""

    def __init__(self, ours: str, served: str | None) -> None:
        self.ours = ours
        self.served = served
        theirs = served if served is not None else "none (its code reports no digest)"
        super().__init__(
            f"the server's rls_v2 library is not the code this client ships: digest {theirs}, "
            f"this client's {ours}. Load this client's with `rls library load --replace` once no "
            "client of the other build needs it, or run the matching release"
        )


class IdentityTaken(SignalBufferError):
    """Another live process owns this (instance, rank): two FastDeploy messagers claim one
    identity. The refused bridge writes nothing to Redis and serves its process locally;
    ``holder`` and ``claimant`` say which process is which (host and pid)."""

    def __init__(self, instance: str, rank: int, holder: str, claimant: str) -> None:
        self.instance = instance
        self.rank = rank
        self.holder = holder
        self.claimant = claimant
        super().__init__(
            f"{instance}/{rank} is owned by {holder}; refused to {claimant}: two messagers claim one "
            "identity (same instance name and rank), so this one writes nothing to Redis and serves "
            "its process locally. Give each prefill engine its own pod IP or host name and "
            "engine_worker_queue_port"
        )


class OwnershipLost(IdentityTaken):
    """This process owned its (instance, rank) and another claimed it since (this one's lease
    ran out while it could not reach Redis, or the other proved it gone): the server refused
    this process's write or renewal, and nothing of it landed. The bridge stops writing, gives
    up what Redis held for the rank (its new owner's now) and serves its process locally, as a
    refused claimant does. ``holder`` names the new owner (host and pid)."""

    def __init__(self, instance: str, rank: int, holder: str, claimant: str, refused: str = "write") -> None:
        super().__init__(instance, rank, holder, claimant)
        self.refused = refused
        self.args = (
            f"{instance}/{rank}: this process, {claimant}, lost its identity to {holder}, which claimed "
            f"it after this one's lease ran out: its {refused} was refused by Redis and nothing of it "
            "landed. This process stops writing, no longer hands out the early signals Redis holds "
            "for the rank, and serves its process locally; two messagers serve one identity "
            "(same instance name and rank)",
        )


FAILURES: tuple[type[BaseException], ...] = (rx.OutOfMemoryError, rx.NoPermissionError, rx.RedisClusterException)
"""What a sync call may end with that ``raise_ours`` turns into our errors."""

ASYNC_FAILURES: tuple[type[BaseException], ...] = (rx.OutOfMemoryError, rx.NoPermissionError, asyncio.TimeoutError)
"""The same for an async call, whose deadline is a timeout around it."""


def raise_ours(operation: str, error: BaseException, retry_s: float, cut_short: bool, sent: str = "fcall") -> NoReturn:
    """Raise our error for one of ``FAILURES``: ``ServerOutOfMemory``, ``NoPermissionError``
    (``sent`` names the command when the server names none), ``BufferUnavailable`` for a call
    its deadline ``cut_short`` (or an async call's timeout); anything else as it is."""
    if isinstance(error, rx.OutOfMemoryError):
        raise ServerOutOfMemory(operation, error) from error
    if isinstance(error, rx.NoPermissionError):
        raise from_server(operation, error, sent) from error
    if cut_short or isinstance(error, asyncio.TimeoutError):
        raise BufferUnavailable(operation, retry_s, error) from error
    raise error


_COMMAND = re.compile(r"run the '([^']+)' command")


def from_server(operation: str, error: rx.NoPermissionError, sent: str) -> NoPermissionError:
    """Our error for a server's NOPERM: it names the refused command when the server does
    (``this user has no permissions to run the 'hset' command``), else ``sent``, the command
    the client sent (a refused key is reported without one)."""
    match = _COMMAND.search(str(error))
    command = match.group(1).lower() if match else sent
    return NoPermissionError(operation, command, str(error))
