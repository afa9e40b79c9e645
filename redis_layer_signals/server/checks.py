"""What a buffer learns of its servers before it writes, and keeps until a reconnect.

- Each server's eviction policy and the settings that decide what a restart or failover
  loses, read before the first call (every primary of a Cluster) and again after a
  reconnect (only the node of the call's key, so a cut-off primary never holds up calls to
  the others); warned about once per process and server, and in ``refuse`` mode an evicting
  server refuses the call (see ``eviction`` and ``durability``).
- Each rank's ACL permissions, before its first call on a connection. A Lua function that
  meets a command its caller may not run stops there, and what it wrote before stays
  written; so the sender first calls ``rls_v2_permissions`` with the rank's keys
  (``lua/permissions.lua``), which asks the server (``redis.acl_check_cmd``) about every
  command the rank's functions may run, and a refused one raises ``NoPermissionError``
  before any write. This holds the ranks found allowed.

  What this cannot cover: a permission taken away while the buffers run (``ACL SETUSER``
  does not close the user's connections) is found only by the function that meets it.
  Remove permissions with the clients stopped, or with ``ACL DELUSER``, which closes them.

The library is checked where it is found missing: the sender loads it (``transport.senders``).
A call pays for all of this with two tests: ``servers_due`` and a set lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..constants import WARN
from ..protocol.calls import PermissionCheck, ScriptCall
from . import durability, eviction
from .durability import ServerPolicies
from .nodes import is_cluster, is_fake, servers

Found = tuple[dict[str, str], dict[str, dict[str, str]]]
"""Each server's eviction policy, and its durability settings, by server name."""


class ServerChecks:
    """One buffer's checks: what is due, and what was found (the sender runs them)."""

    def __init__(
        self, eviction_mode: str, wait_replicas: int, permission_check: Callable[[ScriptCall], PermissionCheck]
    ) -> None:
        self.eviction_mode = eviction_mode
        self.wait_replicas = wait_replicas
        self.permission_check = permission_check
        """Builds the permission check of a call's rank (``Protocol.permissions``)."""
        self.servers_due = True
        """Set until the servers are read, and again after a retryable error."""
        self.allowed: set[str] = set()
        """The first key of each rank whose permissions were checked since the last reconnect."""
        self.policies: dict[str, str] = {}
        """Each server's maxmemory-policy as last read."""
        self.durability: dict[str, dict[str, str]] = {}
        """Each server's settings that decide what a restart or failover loses, as last read."""

    def forget(self) -> None:
        """After a retryable error: the next attempt may reach another node, or a new connection."""
        self.servers_due = True
        self.allowed.clear()

    def read(self, client: Any, key: str) -> None:
        """Read the servers before a call on ``key`` (see the module docstring)."""
        self._found(*read_servers(client, self.wait_replicas, key if self.policies else None))

    async def async_read(self, client: Any, key: str) -> None:
        """``read`` on a redis.asyncio client."""
        self._found(*await async_read_servers(client, self.wait_replicas, key if self.policies else None))

    def _found(self, policies: dict[str, str], settings: dict[str, dict[str, str]]) -> None:
        self.policies = {**self.policies, **policies}
        self.durability = {**self.durability, **settings}
        eviction.judge(policies, self.eviction_mode)
        durability.judge(settings)
        self.servers_due = False

    def report(self, policies: dict[str, str], settings: dict[str, dict[str, str]]) -> ServerPolicies:
        """Every server read on request (``server_policies``): warned about, never refused."""
        self.policies = policies
        self.durability = settings
        eviction.judge(policies, WARN)
        durability.judge(settings)
        return ServerPolicies(policies, settings)


def read_servers(client: Any, wait_replicas: int, key: str | None = None) -> Found:
    """The servers' policies and settings (see ``servers``). ``memory://`` lives and dies with
    its process: it never evicts, and has no durability to read."""
    if is_fake(client):
        return {"memory": eviction.SAFE_POLICY}, {}
    kind = durability.topology(client)
    policies, settings = {}, {}
    for name, target in servers(client, key):
        policies[name] = eviction.read_policy(client, **target)
        settings[name] = durability.read_settings(client, kind, wait_replicas, **target)
    return policies, settings


async def async_read_servers(client: Any, wait_replicas: int, key: str | None = None) -> Found:
    """``read_servers`` on a redis.asyncio client."""
    if is_fake(client):
        return {"memory": eviction.SAFE_POLICY}, {}
    if is_cluster(client) and not client.get_primaries():
        await client.initialize()
    kind = durability.topology(client)
    policies, settings = {}, {}
    for name, target in servers(client, key):
        policies[name] = await eviction.async_read_policy(client, **target)
        settings[name] = await durability.async_read_settings(client, kind, wait_replicas, **target)
    return policies, settings
