"""How a packed function call reaches its server: one sender per kind of client, chosen once
when the buffer is built, so no call asks again which kind it has.

- ``ClientSender``: the client's own ``FCALL`` (a plain or Sentinel-managed client, the
  in-memory fake, an asyncio Cluster client, which redirects by itself).
- ``DirectSender``: the same bytes written and read past redis-py's per-command machinery
  (see ``wire``), for a plain TCP or Unix client.
- ``ClusterSender``: a sync Cluster client's call, sent to the node that owns its slot by us
  (see ``routing``): redis-py's own ``fcall`` asks a node ``COMMAND GETKEYS`` first, every time.

``send(call)`` first runs the checks that are due (the servers' settings before the first call
and after a reconnect, a rank's permissions before its first call: see ``server.checks``),
then returns the function's raw reply, for ``protocol.replies`` to judge. A server
without our library answers "Function not found" without running anything: the sender loads
the library on the node that answered (``library.ensure_library``) and sends the same call
(same token) once more. Retries and the deadline are the buffer's, around the sender.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol, TypeVar

from redis.exceptions import ResponseError, SlotNotCoveredError

from ..protocol.calls import ScriptCall
from ..server.checks import ServerChecks
from ..server.library import FUNCTIONS, LibraryMissing, async_ensure_library, ensure_library, function_missing
from ..server.nodes import is_cluster
from . import deadline, replication, routing, wire
from .deadline import within_call

T = TypeVar("T")


class Sender(Protocol):
    @property
    def direct(self) -> wire.DirectCalls | None:
        """The kept connections calls are written on, or None for the client's own path."""

    def send(self, call: ScriptCall) -> Any: ...

    def prepare(self, call: ScriptCall) -> None: ...

    def close(self) -> None: ...


class AsyncSender(Protocol):
    @property
    def direct(self) -> wire.AsyncDirectCalls | None: ...

    async def send(self, call: ScriptCall) -> Any: ...

    async def prepare(self, call: ScriptCall) -> None: ...

    async def close(self) -> None: ...


def sender_for(client: Any, checks: ServerChecks, wait_replicas: int = 0, wait_timeout_ms: int = 0) -> Sender:
    """The sender for a sync client; with ``wait_replicas``, wrapped to wait (see ``replication``)."""
    sender: Sender
    if is_cluster(client):
        sender = ClusterSender(client, checks)
    elif wire.supports(client):
        sender = DirectSender(client, checks, wire.DirectCalls(client))
    else:
        sender = ClientSender(client, checks)
    return WaitingSender(sender, client, wait_replicas, wait_timeout_ms) if wait_replicas else sender


def async_sender_for(
    client: Any, checks: ServerChecks, wait_replicas: int = 0, wait_timeout_ms: int = 0
) -> AsyncSender:
    """The sender for a redis.asyncio client (see ``sender_for``)."""
    sender: AsyncSender
    if is_cluster(client):
        sender = AsyncClusterSender(client, checks)
    elif wire.supports_async(client):
        sender = AsyncDirectSender(client, checks, wire.AsyncDirectCalls(client))
    else:
        sender = AsyncClientSender(client, checks)
    if wait_replicas:
        return AsyncWaitingSender(sender, client, wait_replicas, wait_timeout_ms)
    return sender


def _with_library(send: Callable[[], T], node: Any, function: str) -> T:
    """``send()``; after "Function not found", the library loaded on ``node`` and ``send()`` again."""
    try:
        return send()
    except ResponseError as exc:
        if not function_missing(exc):
            raise
    ensure_library(node)
    try:
        return send()
    except ResponseError as exc:
        if function_missing(exc):
            raise LibraryMissing(function) from exc
        raise


async def _async_with_library(
    send: Callable[[], Awaitable[T]], load: Callable[[], Awaitable[None]], function: str
) -> T:
    """``_with_library`` for redis.asyncio; the load is bounded by the call's deadline."""
    try:
        return await send()
    except ResponseError as exc:
        if not function_missing(exc):
            raise
    await within_call(load())
    try:
        return await send()
    except ResponseError as exc:
        if function_missing(exc):
            raise LibraryMissing(function) from exc
        raise


class ClientSender:
    def __init__(self, client: Any, checks: ServerChecks) -> None:
        self.client = client
        self.checks = checks
        self.direct: wire.DirectCalls | None = None

    def send(self, call: ScriptCall) -> Any:
        """``call``'s reply, once the checks that are due have passed."""
        self.prepare(call)
        return self.run(call)

    def prepare(self, call: ScriptCall) -> None:
        """Read the servers and check the rank's permissions, when due (see ``server.checks``)."""
        checks = self.checks
        if checks.servers_due:
            checks.read(self.client, call.keys[0])
        if call.keys[0] not in checks.allowed:
            check = checks.permission_check(call)
            check.parse(self.run(check.call))
            checks.allowed.add(call.keys[0])

    def run(self, call: ScriptCall) -> Any:
        """One FCALL on the client, the library loaded where it is missing."""
        function = FUNCTIONS[call.script]
        fcall = partial(self.client.fcall, function, len(call.keys), *call.keys, *call.args)
        return _with_library(fcall, self.client, function)

    def close(self) -> None:
        """The client is the buffer's to close."""


class DirectSender(ClientSender):
    direct: wire.DirectCalls

    def __init__(self, client: Any, checks: ServerChecks, direct: wire.DirectCalls) -> None:
        super().__init__(client, checks)
        self.direct = direct

    def run(self, call: ScriptCall) -> Any:
        function = FUNCTIONS[call.script]
        run = partial(self.direct.run, wire.fcall(function, call.keys, call.args))
        return _with_library(run, self.client, function)

    def close(self) -> None:
        self.direct.close()


class ClusterSender(ClientSender):
    def run(self, call: ScriptCall) -> Any:
        function = FUNCTIONS[call.script]

        def on_node(node: Any, asking: bool) -> Any:
            return _with_library(partial(routing.fcall, node, function, call.keys, call.args, asking), node, function)

        return routing.on_key_node(self.client, call.keys[0], call.script, on_node)


class AsyncClientSender:
    def __init__(self, client: Any, checks: ServerChecks) -> None:
        self.client = client
        self.checks = checks
        self.direct: wire.AsyncDirectCalls | None = None

    async def send(self, call: ScriptCall) -> Any:
        await self.prepare(call)
        return await self.run(call)

    async def prepare(self, call: ScriptCall) -> None:
        """``ClientSender.prepare``; each step uses the client's own commands, which the direct
        path's per-read deadline does not reach: each is bounded by the call's."""
        checks = self.checks
        if checks.servers_due:
            await within_call(checks.async_read(self.client, call.keys[0]))
        if call.keys[0] not in checks.allowed:
            check = checks.permission_check(call)
            check.parse(await within_call(self.run(check.call)))
            checks.allowed.add(call.keys[0])

    async def run(self, call: ScriptCall) -> Any:
        function = FUNCTIONS[call.script]
        fcall = partial(self.client.fcall, function, len(call.keys), *call.keys, *call.args)
        return await _async_with_library(fcall, partial(async_ensure_library, self.client), function)

    async def close(self) -> None:
        """The client is the buffer's to close."""


class AsyncDirectSender(AsyncClientSender):
    direct: wire.AsyncDirectCalls

    def __init__(self, client: Any, checks: ServerChecks, direct: wire.AsyncDirectCalls) -> None:
        super().__init__(client, checks)
        self.direct = direct

    async def run(self, call: ScriptCall) -> Any:
        function = FUNCTIONS[call.script]
        run = partial(self.direct.run, wire.fcall(function, call.keys, call.args))
        return await _async_with_library(run, partial(async_ensure_library, self.client), function)

    async def close(self) -> None:
        await self.direct.close()


class AsyncClusterSender(AsyncClientSender):
    """FCALL on the node of the call's slot, named to redis.asyncio's Cluster client (its own
    ``fcall`` asks a node ``COMMAND GETKEYS`` first); redirections stay redis-py's, and
    before its first slot table, so does the routing."""

    async def run(self, call: ScriptCall) -> Any:
        function = FUNCTIONS[call.script]
        load = partial(async_ensure_library, self.client, call.keys[0])
        return await _async_with_library(partial(self._on_key_node, function, call), load, function)

    async def _on_key_node(self, function: str, call: ScriptCall) -> Any:
        command = ("FCALL", function, len(call.keys), *call.keys, *call.args)
        try:
            node = self.client.get_node_from_key(call.keys[0])
        except SlotNotCoveredError:
            return await self.client.execute_command(*command)
        return await self.client.execute_command(*command, target_nodes=node)


class _Waiting:
    """What both waiting senders hold: the sender they wrap, and what to wait for."""

    def __init__(self, client: Any, wanted: int, timeout_ms: int) -> None:
        self.client = client
        self.wanted = wanted
        self.timeout_ms = timeout_ms


class WaitingSender(_Waiting):
    """``sender`` for every call, but the waited ones: those go with a ``WAIT`` (see ``replication``)."""

    def __init__(self, sender: Sender, client: Any, wanted: int, timeout_ms: int) -> None:
        super().__init__(client, wanted, timeout_ms)
        self.sender = sender
        self.direct = sender.direct

    def send(self, call: ScriptCall) -> Any:
        if call.script not in replication.WAITED_OPERATIONS:
            return self.sender.send(call)
        self.sender.prepare(call)
        left = deadline.remaining()
        until = None if left is None else time.monotonic() + left
        return replication.run_and_wait(self.client, call, call.script, self.wanted, self.timeout_ms, until)

    def prepare(self, call: ScriptCall) -> None:
        self.sender.prepare(call)

    def close(self) -> None:
        self.sender.close()


class AsyncWaitingSender(_Waiting):
    """``WaitingSender`` for redis.asyncio; each waited call is bounded by the call's deadline."""

    def __init__(self, sender: AsyncSender, client: Any, wanted: int, timeout_ms: int) -> None:
        super().__init__(client, wanted, timeout_ms)
        self.sender = sender
        self.direct = sender.direct

    async def send(self, call: ScriptCall) -> Any:
        if call.script not in replication.WAITED_OPERATIONS:
            return await self.sender.send(call)
        await self.sender.prepare(call)
        return await within_call(
            replication.async_run_and_wait(self.client, call, call.script, self.wanted, self.timeout_ms)
        )

    async def prepare(self, call: ScriptCall) -> None:
        await self.sender.prepare(call)

    async def close(self) -> None:
        await self.sender.close()
