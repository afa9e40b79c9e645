"""Optional synchronous replication: call a function, then ``WAIT`` for replicas, on one connection.

Redis replicates asynchronously: a primary that dies right after answering takes the last
writes with it, and a failover promotes a replica that never saw them. With ``wait_replicas``
set, ``record``, ``register`` and ``finish`` run ``FCALL`` and ``WAIT n timeout`` in one pipeline (WAIT
only counts the writes of its own connection, so both must share it). Fewer acknowledgements
than asked raise ``NotReplicated``, which the buffer's retry loop treats like a lost
reply: it resends the same call (the function replays its stored reply, a write that WAIT then
covers) until the replicas confirm or ``retry_s`` runs out (``BufferUnavailable``).

On Redis Cluster the pipeline goes to the node that owns the call's hash slot. A ``MOVED``
patches the slot table from the redirection itself (no round trip) and retries; an ``ASK`` is
followed once with ``ASKING``. A node that does not answer (timeout, reset, a partition) makes
the slot table be refreshed on a thread of its own, asking the other nodes first: the call that
failed raises at once into the retry loop, which resends, and no caller pays for the refresh
(a refresh that asked the unreachable node first used to add its connect timeout to the call)
nor waits behind another's. One refresh runs at a time per client; a failure while it runs asks
for none more.

Each attempt reads its replies for at most the time its call has left (``deadline``) plus the
WAIT timeout and ``READ_SLACK_S``, so an attempt that starts just before the deadline does
not wait a whole socket timeout past it: a waited call returns or raises within ``retry_s``
plus ``wait_timeout_ms`` plus 0.25 s.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from redis.exceptions import AskError, ConnectionError, MovedError, ResponseError, TimeoutError

from .errors import InvalidConfig, SignalBufferError
from .protocol import ScriptCall
from .scripts import FUNCTIONS, LibraryMissing, async_ensure_library, ensure_library, function_missing

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


class SlotMoved(SignalBufferError):
    """The hash slot moved while a waited call ran on Redis Cluster (retryable)."""


def _is_cluster(client: Any) -> bool:
    return hasattr(client, "get_node_from_key") and hasattr(client, "nodes_manager")


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

_refreshing: set[int] = set()
"""The slot tables (``id`` of a client's nodes manager) a background refresh is working on."""
_refreshing_lock = threading.Lock()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_refreshing.clear)  # the refresh threads stay with the parent


def refresh_slots(client: Any, failed: str | None) -> threading.Thread | None:
    """Refresh ``client``'s slot table on a thread of its own, asking the node named ``failed``
    (``host:port``) last; None when a refresh is already running for this client."""
    manager = client.nodes_manager
    key = id(manager)
    with _refreshing_lock:
        if key in _refreshing:
            return None
        _refreshing.add(key)

    def refresh() -> None:
        try:
            try:  # redis-py 6+: the failed node last, and the other nodes' connections left alone
                manager.initialize(last_failed_node_name=failed, disconnect_startup_nodes_pools=False)
            except TypeError:
                manager.initialize()
        except Exception:  # the next call that fails asks again
            pass
        finally:
            with _refreshing_lock:
                _refreshing.discard(key)

    thread = threading.Thread(target=refresh, name="rls-slot-refresh", daemon=True)
    thread.start()
    return thread


def _pipelined(
    client: Any, call: ScriptCall, wanted: int, timeout_ms: int, asking: bool, deadline: float | None
) -> list[Any]:
    """FCALL then WAIT (after ASKING when asked) in one write on one of ``client``'s pooled
    connections; error replies come back in the list, as ``raise_on_error=False`` gives them."""
    commands: list[tuple[Any, ...]] = [("ASKING",)] if asking else []
    commands.append(("FCALL", FUNCTIONS[call.script], len(call.keys), *call.keys, *call.args))
    commands.append(("WAIT", wanted, timeout_ms))
    pool = client.connection_pool
    connection = pool.get_connection()
    results: list[Any] = []
    if deadline is not None:
        read_until = max(deadline, time.monotonic()) + timeout_ms / 1000 + READ_SLACK_S
    try:
        connection.send_packed_command(connection.pack_commands(commands), check_health=False)
        for _ in commands:
            try:
                if deadline is None:
                    results.append(connection.read_response())
                else:
                    results.append(connection.read_response(timeout=max(0.001, read_until - time.monotonic())))
            except ResponseError as exc:  # a whole error reply was read: the connection is clean
                results.append(exc)
    except BaseException:
        connection.disconnect()  # a reply may still be on its way: never reuse this socket
        raise
    finally:
        pool.release(connection)
    return results


def run_and_wait(
    client: Any, call: ScriptCall, operation: str, wanted: int, timeout_ms: int, deadline: float | None = None
) -> Any:
    """One function call followed by ``WAIT`` on the same connection, reading for at most
    until ``deadline`` (a ``time.monotonic()`` reading); see the module docstring."""
    if not _is_cluster(client):
        return _run_on(client, call, operation, wanted, timeout_ms, False, deadline)
    node = client.get_node_from_key(call.keys[0])
    try:
        return _run_on(client.get_redis_connection(node), call, operation, wanted, timeout_ms, False, deadline)
    except MovedError as exc:  # before AskError, its base class
        client.nodes_manager.move_slot(exc)
        raise SlotMoved(f"{operation}: slot moved to {exc.host}:{exc.port}") from exc
    except AskError as exc:
        target = client.get_node(host=exc.host, port=exc.port)
        if target is None:
            refresh_slots(client, None)
            raise SlotMoved(f"{operation}: slot migrating to unknown node {exc.host}:{exc.port}") from exc
        return _run_on(client.get_redis_connection(target), call, operation, wanted, timeout_ms, True, deadline)
    except (ConnectionError, TimeoutError, OSError):
        refresh_slots(client, node.name)
        raise


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
        raise LibraryMissing(f"{operation}: the library went missing again after loading it") from results[-2]


async def async_run_and_wait(client: Any, call: ScriptCall, operation: str, wanted: int, timeout_ms: int) -> Any:
    """``run_and_wait`` for redis.asyncio (single server or Sentinel)."""
    if _is_cluster(client):  # raised before anything is sent
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
