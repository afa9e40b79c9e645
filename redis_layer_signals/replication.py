"""Optional synchronous replication: call a function, then ``WAIT`` for replicas, on one connection.

Redis replicates asynchronously: a primary that dies right after answering takes the last
writes with it, and a failover promotes a replica that never saw them. With ``wait_replicas``
set, ``record`` and ``register`` run ``FCALL`` and ``WAIT n timeout`` in one pipeline (WAIT
only counts the writes of its own connection, so both must share it). Fewer acknowledgements
than asked raise :class:`NotReplicated`, which the buffer's retry loop treats like a lost
reply: it resends the same call (the function replays its stored reply, a write that WAIT then
covers) until the replicas confirm or ``retry_s`` runs out (``BufferUnavailable``).

On Redis Cluster the pipeline goes to the node that owns the call's hash slot; a ``MOVED``
refreshes the slot table and retries, an ``ASK`` is followed once with ``ASKING``.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import AskError, ConnectionError, MovedError, TimeoutError

from .errors import InvalidConfig, SignalBufferError
from .protocol import ScriptCall
from .scripts import FUNCTIONS, LibraryMissing, async_ensure_library, ensure_library, function_missing

WAITED_OPERATIONS = ("record", "register")
"""Calls whose effects a caller acts on right away, so they are worth a replica's confirmation."""


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


def _pipelined(client: Any, call: ScriptCall, wanted: int, timeout_ms: int, asking: bool) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    if asking:
        pipe.execute_command("ASKING")
    pipe.fcall(FUNCTIONS[call.script], len(call.keys), *call.keys, *call.args)
    pipe.execute_command("WAIT", wanted, timeout_ms)
    results: list[Any] = pipe.execute(raise_on_error=False)
    return results


def run_and_wait(client: Any, call: ScriptCall, operation: str, wanted: int, timeout_ms: int) -> Any:
    """One function call followed by ``WAIT`` on the same connection; see the module docstring."""
    if not _is_cluster(client):
        return _run_on(client, call, operation, wanted, timeout_ms, asking=False)
    node = client.get_node_from_key(call.keys[0])
    try:
        return _run_on(node.redis_connection, call, operation, wanted, timeout_ms, asking=False)
    except MovedError as exc:  # before AskError, its base class
        client.nodes_manager.initialize()
        raise SlotMoved(f"{operation}: slot moved to {exc.host}:{exc.port}") from exc
    except AskError as exc:
        target = client.get_node(host=exc.host, port=exc.port)
        if target is None:
            client.nodes_manager.initialize()
            raise SlotMoved(f"{operation}: slot migrating to unknown node {exc.host}:{exc.port}") from exc
        return _run_on(target.redis_connection, call, operation, wanted, timeout_ms, asking=True)
    except (ConnectionError, TimeoutError, OSError):
        client.nodes_manager.initialize()
        raise


def _run_on(client: Any, call: ScriptCall, operation: str, wanted: int, timeout_ms: int, asking: bool) -> Any:
    results = _pipelined(client, call, wanted, timeout_ms, asking)
    if function_missing(results[-2]):
        ensure_library(client)  # this node's own client: the node that answered
        results = _pipelined(client, call, wanted, timeout_ms, asking)
        _missing_again(operation, results)
    return _check(operation, results, wanted, timeout_ms)


def _missing_again(operation: str, results: list[Any]) -> None:
    """The library went missing between its load and the resend: nothing ran, retry (as the
    direct path does)."""
    if function_missing(results[-2]):
        raise LibraryMissing(f"{operation}: the library went missing again after loading it") from results[-2]


async def async_run_and_wait(client: Any, call: ScriptCall, operation: str, wanted: int, timeout_ms: int) -> Any:
    """:func:`run_and_wait` for redis.asyncio (single server or Sentinel)."""
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
