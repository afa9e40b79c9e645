"""The server's ``maxmemory-policy``: read once per server, said loudly unless ``noeviction``.

A Redis that evicts deletes pending signals, tasks and even the counters, without an error
anywhere: the exactly-once promise only holds on a server that refuses writes when full. So a
buffer reads the policy the first time it talks to a server (each primary of a Cluster), and
again after a reconnect (a failover or a restart may have put it on another node). It reads
``CONFIG GET maxmemory-policy``, or ``INFO memory`` where ``CONFIG`` is refused (managed
services rename or forbid it). Anything but ``noeviction`` is logged once per process and
server (``said``), exported as a metric, and, with ``eviction="refuse"``, refused with
``errors.EvictingServer``.

The check is not on the hot path: a call tests one attribute, and only the first call (or the
first after a reconnect) sends the two commands.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from redis.exceptions import ResponseError

from ..constants import REFUSE
from ..errors import EvictingServer
from ..protocol.replies import text
from .nodes import is_fake, servers
from .said import warn_once

SAFE_POLICY = "noeviction"
UNKNOWN = "unknown"
"""The policy when neither ``CONFIG GET`` nor ``INFO`` is allowed: not warned as evicting."""


def policy_of_config(reply: Any) -> str | None:
    """``CONFIG GET maxmemory-policy`` as redis-py parses it (a dict), or None."""
    if isinstance(reply, Mapping):
        for name, value in reply.items():
            if text(name) == "maxmemory-policy":
                return text(value)
    return None


def policy_of_info(reply: Any) -> str | None:
    """``INFO memory``'s ``maxmemory_policy``, or None."""
    if isinstance(reply, Mapping):
        value = reply.get("maxmemory_policy")
        if value is not None:
            return text(value)
    return None


def read_policy(client: Any, **target: Any) -> str:
    """The policy of the server ``client`` talks to (``target_nodes=`` for one Cluster node).
    A refusal (no permission, a renamed command) falls back to ``INFO``, then to ``unknown``;
    connection errors propagate, for the caller's retry loop."""
    try:
        policy = policy_of_config(client.config_get("maxmemory-policy", **target))
        if policy is not None:
            return policy
    except ResponseError:
        pass
    try:
        return policy_of_info(client.info("memory", **target)) or UNKNOWN
    except ResponseError:
        return UNKNOWN


async def async_read_policy(client: Any, **target: Any) -> str:
    """``read_policy`` on a redis.asyncio client."""
    try:
        policy = policy_of_config(await client.config_get("maxmemory-policy", **target))
        if policy is not None:
            return policy
    except ResponseError:
        pass
    try:
        return policy_of_info(await client.info("memory", **target)) or UNKNOWN
    except ResponseError:
        return UNKNOWN


def evicting(policies: Mapping[str, str]) -> dict[str, str]:
    """The servers of ``policies`` that may evict keys."""
    return {server: policy for server, policy in policies.items() if policy not in (SAFE_POLICY, UNKNOWN)}


def judge(policies: Mapping[str, str], mode: str) -> None:
    """Warn once per process and server about an evicting server; raise in ``refuse`` mode.
    A policy that could not be read is warned about too (once), but not refused."""
    for server, policy in policies.items():
        if policy == UNKNOWN:
            warn_once(
                f"cannot read the maxmemory-policy of Redis {server} (CONFIG GET and INFO refused): make sure it is "
                "noeviction, or grant +info (see acl.rules())"
            )
    for server, policy in evicting(policies).items():
        if mode == REFUSE:
            raise EvictingServer(server, policy)
        warn_once(
            f"Redis {server} has maxmemory-policy {policy}: it may evict pending signals, tasks and counters "
            "without an error, and the buffer cannot see what it lost. "
            "Set `maxmemory-policy noeviction` (CONFIG SET maxmemory-policy noeviction, and in redis.conf)"
        )


def _figures(info: Any) -> tuple[str, float | None]:
    """(policy, evicted keys) from one server's ``INFO memory stats``."""
    policy = policy_of_info(info) or UNKNOWN
    evicted = info.get("evicted_keys") if isinstance(info, Mapping) else None
    return policy, None if evicted is None else float(evicted)


def server_figures(client: Any) -> dict[str, tuple[str, float | None]]:
    """Each server's policy and ``evicted_keys`` (every primary of a Cluster), from one
    ``INFO memory stats`` per server: what the exporter reports as evidence of eviction.
    Servers that refuse INFO are left out."""
    if is_fake(client):
        return {"memory": (SAFE_POLICY, 0.0)}
    figures = {}
    for server, target in servers(client):
        try:
            figures[server] = _figures(client.info("memory", "stats", **target))
        except ResponseError:
            continue
    return figures
