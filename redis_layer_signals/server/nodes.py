"""Which servers a client reaches, and how the logs name one: the one spelling of each.

A plain or Sentinel client talks to one server; a Cluster client to each primary, by key;
fakeredis (``memory://``) to a server in this process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def is_fake(client: Any) -> bool:
    """An in-process fakeredis server (``memory://``): it never evicts, and has no CONFIG."""
    return type(client).__module__.startswith("fakeredis")


def is_cluster(client: Any) -> bool:
    """A ``RedisCluster``, sync or asyncio: it routes by key over a slot table of its nodes."""
    return hasattr(client, "get_node_from_key") and hasattr(client, "nodes_manager")


def label(client: Any) -> str:
    """How the logs and metrics name the server a plain or Sentinel client talks to."""
    pool = getattr(client, "connection_pool", None)
    service = getattr(pool, "service_name", None)
    if service is not None:
        return f"sentinel:{service}"
    kwargs: Mapping[str, Any] = getattr(pool, "connection_kwargs", {})
    if "path" in kwargs:
        return f"unix:{kwargs['path']}"
    return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"


def servers(client: Any, key: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(name, command options) of each server to read: the one of a plain or Sentinel client,
    each primary of a Cluster, or with ``key`` only the Cluster node that serves it."""
    if not is_cluster(client):
        return [(label(client), {})]
    nodes = client.get_primaries() if key is None else [client.get_node_from_key(key)]
    return [(node.name, {"target_nodes": node}) for node in nodes]
