"""Redis Cluster calls routed by the buffer: the key's node from the client's slot table,
redirections followed locally, the table refreshed on a thread of its own.

redis-py's ``RedisCluster.fcall`` asks the cluster's default node ``COMMAND GETKEYS`` before
every ``FCALL`` (FCALL's keys are "movable"), so each call cost two extra round trips to a node
that may not even serve it; when that node was cut off, calls to the other primaries spent
their whole budget connecting to it. And after a timeout or a refused connection it refreshes
its slot table (``CLUSTER SLOTS``) on the calling thread, holding a lock the other threads'
refreshes wait on, asking the nodes in random order (the cut one among them).

So the buffer's function calls, with ``wait_replicas`` or without, take one path here
(``on_key_node``): the node that owns the call's first key (all of a call's keys share one hash
tag), that node's own client, and

- ``MOVED``: the slot table is patched from the redirection itself (no round trip) and the call
  raises ``SlotMoved``, which the buffer's retry loop resends after its first backoff (10 ms);
- ``ASK``: followed once, ``ASKING`` and the call on one connection;
- a node that does not answer (timeout, reset, refused, a partition): the call raises into the
  retry loop and the table is refreshed on a thread of its own (``SlotRefresher``), asking the
  node that failed last. No caller pays for a refresh nor waits behind another's. One refresh
  runs at a time per client; a failure while it runs asks for none more.

Clients made by ``connection`` also hand redis-py's own refreshes (its reads, ``FUNCTION
LOAD``, the eviction check) to the same refresher (``refresh_in_background``). The asyncio
buffer names the slot's node to redis.asyncio's Cluster client (``target_nodes``), which asks
``COMMAND GETKEYS`` on every ``FCALL`` too; its redirections and refreshes stay redis-py's.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from redis.exceptions import AskError, ConnectionError, MovedError, ResponseError, SlotNotCoveredError, TimeoutError

from ..errors import SignalBufferError

T = TypeVar("T")


class SlotMoved(SignalBufferError):
    """The hash slot moved while a call ran on Redis Cluster (retryable)."""


class SlotRefresher:
    """Refreshes one Cluster client's slot table, on a thread of its own, one refresh at a time."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        # The class's own method: ``refresh_in_background`` replaces the instance's.
        self._initialize: Callable[..., None] = type(manager).initialize.__get__(manager)
        self._lock = threading.Lock()
        self._running = False
        self._pid = os.getpid()

    def request(self, failed: str | None = None, extra: Sequence[tuple[str, int]] = ()) -> threading.Thread | None:
        """Start a refresh that asks the node named ``failed`` (``host:port``) last, and the
        ``extra`` nodes too (a ``MOVED`` target); None when one is already running."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's refresh thread is not here
                self._pid, self._running = os.getpid(), False
            if self._running:
                return None
            self._running = True
        thread = threading.Thread(
            target=self._refresh, args=(failed, list(extra)), name="rls-slot-refresh", daemon=True
        )
        thread.start()
        return thread

    def now(self) -> None:
        """Refresh on the calling thread (a tool that needs the table before going on)."""
        self._initialize()

    def _refresh(self, failed: str | None, extra: list[tuple[str, int]]) -> None:
        try:
            self._initialize(
                additional_startup_nodes_info=extra or None,
                last_failed_node_name=failed,
                disconnect_startup_nodes_pools=False,  # the other nodes' connections left alone
            )
        except Exception:  # the next call that fails asks again
            pass
        finally:
            with self._lock:
                self._running = False


_made_lock = threading.Lock()


def refresher_of(client: Any) -> SlotRefresher:
    """The one refresher of ``client``'s slot table (made on first use)."""
    manager = client.nodes_manager
    found: SlotRefresher | None = getattr(manager, "_rls_refresher", None)
    if found is None:
        with _made_lock:
            found = getattr(manager, "_rls_refresher", None)
            if found is None:
                found = SlotRefresher(manager)
                manager._rls_refresher = found
    return found


def refresh_slots(client: Any, failed: str | None) -> threading.Thread | None:
    """Refresh ``client``'s slot table in the background, asking ``failed`` last."""
    return refresher_of(client).request(failed)


def refresh_in_background(client: Any) -> None:
    """Make redis-py's own refreshes of ``client``'s table (after a timeout, a ``MOVED``, a
    ``CLUSTERDOWN``) requests to its refresher: they return at once, the call raises into the
    buffer's retry loop with the table it had, and the refresh runs on the refresher's thread."""
    refresher = refresher_of(client)

    def initialize(
        additional_startup_nodes_info: Sequence[tuple[str, int]] | None = None,
        disconnect_startup_nodes_pools: bool = True,
        last_failed_node_name: str | None = None,
    ) -> None:
        refresher.request(last_failed_node_name, additional_startup_nodes_info or ())

    client.nodes_manager.initialize = initialize


def on_key_node(client: Any, key: str, operation: str, send: Callable[[Any, bool], T]) -> T:
    """``send(node_client, asking)`` on the Cluster node that owns ``key``; see the module
    docstring for redirections and failures."""
    try:
        node = client.get_node_from_key(key)
    except SlotNotCoveredError:  # a table refreshed while the slot had no owner
        refresh_slots(client, None)
        raise
    try:
        return send(client.get_redis_connection(node), False)
    except MovedError as exc:  # before AskError, its base class
        client.nodes_manager.move_slot(exc)
        raise SlotMoved(f"{operation}: slot moved to {exc.host}:{exc.port}") from exc
    except AskError as exc:
        target = client.get_node(host=exc.host, port=exc.port)
        if target is None:
            refresh_slots(client, None)
            raise SlotMoved(f"{operation}: slot migrating to unknown node {exc.host}:{exc.port}") from exc
        return send(client.get_redis_connection(target), True)
    except (ConnectionError, TimeoutError, OSError):
        refresh_slots(client, node.name)
        raise


def send_commands(client: Any, commands: Sequence[tuple[Any, ...]], read_until: float | None) -> list[Any]:
    """``commands`` in one write on one of ``client``'s pooled connections, each reply read by
    ``read_until`` (a ``time.monotonic()`` reading) when given; error replies come back in the
    list, as ``raise_on_error=False`` gives them."""
    pool = client.connection_pool
    connection = pool.get_connection()
    results: list[Any] = []
    try:
        connection.send_packed_command(connection.pack_commands(commands), check_health=False)
        for _ in commands:
            try:
                if read_until is None:
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


def fcall(node_client: Any, function: str, keys: Sequence[str], args: Sequence[str], asking: bool) -> Any:
    """``FCALL`` on one node's client, after ``ASKING`` on the same connection when asked."""
    if not asking:
        return node_client.fcall(function, len(keys), *keys, *args)
    reply = send_commands(node_client, [("ASKING",), ("FCALL", function, len(keys), *keys, *args)], None)[-1]
    if isinstance(reply, BaseException):
        raise reply
    return reply
