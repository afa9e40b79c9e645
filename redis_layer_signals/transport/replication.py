"""Optional synchronous replication: call a function, then ``WAIT`` for replicas, on one connection.

Redis replicates asynchronously: a primary that dies right after answering takes the last
writes with it, and a failover promotes a replica that never saw them. With ``wait_replicas``
set, ``record``, ``register`` and ``finish`` run ``FCALL`` and ``WAIT n timeout`` in one pipeline (WAIT
only counts the writes of its own connection, so both must share it). Fewer acknowledgements
than asked raise ``NotReplicated``, which the buffer's retry loop treats like a lost
reply: it resends the same call (the function replays its stored reply, a write that WAIT then
covers) until the replicas confirm or ``retry_s`` runs out (``BufferUnavailable``).

The buffer's sender is wrapped in a ``senders.WaitingSender`` when ``wait_replicas`` is set:
the waited calls take the pipeline, the others the sender's own path.

On Redis Cluster the pipeline goes to the node that owns the call's hash slot, on the path
every function call of the buffer takes there (``routing.on_key_node``): a ``MOVED`` patches the
slot table and retries, an ``ASK`` is followed once with ``ASKING``, and a node that does not
answer makes the table be refreshed on a thread of its own while the call raises into the retry
loop, so no caller pays for a refresh nor waits behind another's.

Each attempt reads its replies for at most the time its call has left (``deadline``) plus the
WAIT timeout and ``READ_SLACK_S``, so an attempt that starts just before the deadline does
not wait a whole socket timeout past it: a waited call returns or raises within ``retry_s``
plus ``wait_timeout_ms`` plus 0.25 s.
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import InvalidConfig, SignalBufferError
from ..protocol.calls import ScriptCall
from ..server.library import FUNCTIONS, LibraryMissing, async_ensure_library, ensure_library, function_missing
from ..server.nodes import is_cluster
from . import routing

WAITED_OPERATIONS = ("record", "register", "finish")
"""Calls whose effects a caller acts on right away: worth a replica's confirmation. ``finish``
too: a finish the failover loses leaves the finished request holding its slot, so the next
request's signals would be delivered to it and its ``register`` refused."""


class NotReplicated(SignalBufferError):
    """Fewer replicas than ``wait_replicas`` confirmed a write in time (retryable)."""

    def __init__(self, operation: str, wanted: int, acked: int, timeout_ms: int) -> None:
        self.operation = operation
        self.wanted = wanted
        self.acked = acked
        super().__init__(f"{operation}: {acked} of {wanted} replicas confirmed the write within {timeout_ms} ms")


def _check(operation: str, results: list[Any], wanted: int, timeout_ms: int) -> Any:
    reply, acked = results[-2], results[-1]
    for item in (reply, acked):
        if isinstance(item, BaseException):
            raise item
    if int(acked) < wanted:
        raise NotReplicated(operation, wanted, int(acked), timeout_ms)
    return reply


READ_SLACK_S = 0.25
"""What an attempt may read past its call's deadline and WAIT's timeout: the replies' way back
on a loaded machine, so the last attempt still hears WAIT's count (``NotReplicated``)."""


def _pipelined(
    client: Any, call: ScriptCall, wanted: int, timeout_ms: int, asking: bool, deadline: float | None
) -> list[Any]:
    """FCALL then WAIT (after ASKING when asked) in one write on one of ``client``'s pooled
    connections, read for at most the call's time left plus the WAIT timeout and ``READ_SLACK_S``."""
    commands: list[tuple[Any, ...]] = [("ASKING",)] if asking else []
    commands.append(("FCALL", FUNCTIONS[call.script], len(call.keys), *call.keys, *call.args))
    commands.append(("WAIT", wanted, timeout_ms))
    read_until = None
    if deadline is not None:
        read_until = max(deadline, time.monotonic()) + timeout_ms / 1000 + READ_SLACK_S
    return routing.send_commands(client, commands, read_until)


def run_and_wait(
    client: Any, call: ScriptCall, operation: str, wanted: int, timeout_ms: int, deadline: float | None = None
) -> Any:
    """One function call followed by ``WAIT`` on the same connection, reading for at most
    until ``deadline`` (a ``time.monotonic()`` reading); see the module docstring."""
    if not is_cluster(client):
        return _run_on(client, call, operation, wanted, timeout_ms, False, deadline)

    def on_node(node_client: Any, asking: bool) -> Any:
        return _run_on(node_client, call, operation, wanted, timeout_ms, asking, deadline)

    return routing.on_key_node(client, call.keys[0], operation, on_node)


def _run_on(
    client: Any, call: ScriptCall, operation: str, wanted: int, timeout_ms: int, asking: bool, deadline: float | None
) -> Any:
    results = _pipelined(client, call, wanted, timeout_ms, asking, deadline)
    if function_missing(results[-2]):
        ensure_library(client)  # this node's own client: the node that answered
        results = _pipelined(client, call, wanted, timeout_ms, asking, deadline)
        _missing_again(operation, results)
    return _check(operation, results, wanted, timeout_ms)


def _missing_again(operation: str, results: list[Any]) -> None:
    """The library went missing between its load and the resend: nothing ran, retry (as the
    direct path does)."""
    if function_missing(results[-2]):
        raise LibraryMissing(operation) from results[-2]


async def async_run_and_wait(client: Any, call: ScriptCall, operation: str, wanted: int, timeout_ms: int) -> Any:
    """``run_and_wait`` for redis.asyncio (single server or Sentinel)."""
    if is_cluster(client):  # raised before anything is sent
        raise InvalidConfig("wait_replicas", wanted, "is not supported on an asyncio Redis Cluster client yet")
    results = await _async_pipelined(client, call, wanted, timeout_ms)
    if function_missing(results[-2]):
        await async_ensure_library(client)
        results = await _async_pipelined(client, call, wanted, timeout_ms)
        _missing_again(operation, results)
    return _check(operation, results, wanted, timeout_ms)


async def _async_pipelined(client: Any, call: ScriptCall, wanted: int, timeout_ms: int) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    pipe.fcall(FUNCTIONS[call.script], len(call.keys), *call.keys, *call.args)
    pipe.execute_command("WAIT", wanted, timeout_ms)
    results: list[Any] = await pipe.execute(raise_on_error=False)
    return results
