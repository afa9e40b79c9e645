"""The settings that decide what a crash or a failover loses: read once per server, said loudly.

A call that returned is only as lasting as the server that answered it. Three settings decide
whether it outlives a restart or a failover:

- ``appendonly`` (every server): without AOF, a restart or crash loses everything written since
  the last RDB snapshot (all of it without one): pending signals, tasks and counters.
- ``min-replicas-to-write`` (a Sentinel primary): at 0 the primary acknowledges writes no
  replica has yet, which a failover then loses, and a demoted primary keeps accepting writes
  until the sentinels reconfigure it.
- ``wait_replicas`` (the buffer's own option, on a Cluster whose primaries have replicas): at 0
  a call returns before any replica has its write, and a failover promotes a replica without it.

They are read when the eviction policy is (``eviction``: the first time a buffer talks to a
server, again after a reconnect), with ``CONFIG GET``, or ``INFO persistence replication``
where ``CONFIG`` is refused (managed services, the tenant ACL), else said to be ``unknown``.
A risky value is logged once per process, server and setting (``said``), naming what can be lost and the
setting that prevents it; it is exported as ``rls_server_durability_risk``. A setting never
fails a call: unlike the eviction policy there is no mode that refuses, since a deployment may
accept the risk (a cache it can refill) and only it can say so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from redis.exceptions import ResponseError

from ..protocol.replies import text
from .nodes import is_cluster
from .said import warn_once

APPENDONLY = "appendonly"
MIN_REPLICAS = "min-replicas-to-write"
MAX_LAG = "min-replicas-max-lag"
WAIT_REPLICAS = "wait_replicas"
UNKNOWN = "unknown"
"""A setting neither ``CONFIG GET`` nor ``INFO`` was allowed to read: warned about, not a risk."""
AT_LEAST_ONE = "at least 1"
"""``min-replicas-to-write`` as ``INFO replication`` tells it: on, without its number."""

RISKY = {APPENDONLY: "no", MIN_REPLICAS: "0", WAIT_REPLICAS: "0"}
"""The value of each setting under which an acknowledged write can be lost."""
LOSES = {
    APPENDONLY: "a restart or crash loses every pending signal, task and counter written since the last "
    "RDB snapshot (all of them without one)",
    MIN_REPLICAS: "a failover loses the writes it acknowledged before a replica had them, and a demoted "
    "primary keeps accepting writes until the sentinels reconfigure it",
    WAIT_REPLICAS: "a failover promotes a replica that may lack the last writes its primary acknowledged",
}
FIXES = {
    APPENDONLY: "Set `appendonly yes` with `appendfsync always` (CONFIG SET appendonly yes, and in redis.conf)",
    MIN_REPLICAS: "Set `min-replicas-to-write 1` (with min-replicas-max-lag 10) on every server of the group, "
    "and run the buffers with wait_replicas=1 (RLS_WAIT_REPLICAS=1)",
    WAIT_REPLICAS: "Run the buffers with wait_replicas=1 (RLS_WAIT_REPLICAS=1)",
}
READ = {APPENDONLY: "appendonly", MIN_REPLICAS: "min-replicas-to-write", WAIT_REPLICAS: "the replicas"}
IF_RISKY = {
    APPENDONLY: "it runs with appendonly no",
    MIN_REPLICAS: "it runs with min-replicas-to-write 0",
    WAIT_REPLICAS: "it has replicas (the buffers run with wait_replicas=0)",
}

SINGLE, SENTINEL, CLUSTER = "single", "sentinel", "cluster"


def topology(client: Any) -> str:
    """Which settings apply: a Cluster client, a Sentinel-managed one, or one server."""
    if is_cluster(client):
        return CLUSTER
    if getattr(getattr(client, "connection_pool", None), "service_name", None) is not None:
        return SENTINEL
    return SINGLE


def config_names(kind: str) -> tuple[str, ...]:
    """The parameters ``CONFIG GET`` asks a server of this topology for."""
    return (APPENDONLY, MIN_REPLICAS, MAX_LAG) if kind == SENTINEL else (APPENDONLY,)


def parse_config(reply: Any) -> dict[str, str]:
    """``CONFIG GET``'s reply as redis-py parses it (a dict), as text."""
    if not isinstance(reply, Mapping):
        return {}
    return {text(name): text(value) for name, value in reply.items()}


def needs_info(kind: str, config: Mapping[str, str]) -> bool:
    """A Cluster's replicas come from ``INFO replication``; elsewhere INFO stands in for a refused CONFIG."""
    return kind == CLUSTER or any(name not in config for name in config_names(kind))


def conclude(kind: str, wait_replicas: int, config: Mapping[str, str], info: Any) -> dict[str, str]:
    """The settings of one server that decide what it can lose, from what could be read:
    ``{"appendonly": "no", ...}``, ``unknown`` where neither reply says."""
    info = info if isinstance(info, Mapping) else None
    settings = {APPENDONLY: config.get(APPENDONLY) or _appendonly_of_info(info)}
    if kind == SENTINEL:
        settings[MIN_REPLICAS] = _min_replicas(config, info)
    if kind == CLUSTER:
        replicas = None if info is None else _count(info.get("connected_slaves"))
        if wait_replicas > 0 or (replicas is not None and replicas > 0):
            settings[WAIT_REPLICAS] = str(wait_replicas)
        elif replicas is None:
            settings[WAIT_REPLICAS] = UNKNOWN
        # else: a primary without replicas has no failover to lose writes in
    return settings


def _count(value: Any) -> int | None:
    """An INFO field as a number, or None: a reply this code does not understand is no reason
    to fail the call that read it."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _appendonly_of_info(info: Mapping[str, Any] | None) -> str:
    enabled = None if info is None else _count(info.get("aof_enabled"))
    if enabled is None:
        return UNKNOWN
    return "yes" if enabled else "no"


def _min_replicas(config: Mapping[str, str], info: Mapping[str, Any] | None) -> str:
    """``min-replicas-to-write``, 0 when ``min-replicas-max-lag`` 0 turns it off; INFO lists
    ``min_slaves_good_slaves`` only while it is on."""
    if MIN_REPLICAS in config and MAX_LAG in config:
        return "0" if config[MAX_LAG] == "0" else config[MIN_REPLICAS]
    if info is None or "role" not in info:
        return UNKNOWN
    return AT_LEAST_ONE if "min_slaves_good_slaves" in info else "0"


def read_settings(client: Any, kind: str, wait_replicas: int, **target: Any) -> dict[str, str]:
    """The settings of the server ``client`` talks to (``target_nodes=`` for one Cluster node).
    A refusal (no permission, a renamed command) falls back to INFO, then to ``unknown``;
    connection errors propagate, for the caller's retry loop."""
    try:
        config = parse_config(client.config_get(*config_names(kind), **target))
    except ResponseError:
        config = {}
    info = None
    if needs_info(kind, config):
        try:
            info = client.info("persistence", "replication", **target)
        except ResponseError:
            info = None
    return conclude(kind, wait_replicas, config, info)


async def async_read_settings(client: Any, kind: str, wait_replicas: int, **target: Any) -> dict[str, str]:
    """``read_settings`` on a redis.asyncio client."""
    try:
        config = parse_config(await client.config_get(*config_names(kind), **target))
    except ResponseError:
        config = {}
    info = None
    if needs_info(kind, config):
        try:
            info = await client.info("persistence", "replication", **target)
        except ResponseError:
            info = None
    return conclude(kind, wait_replicas, config, info)


def at_risk(settings: Mapping[str, str]) -> dict[str, str]:
    """The settings of one server under which an acknowledged write can be lost."""
    return {name: value for name, value in settings.items() if RISKY.get(name) == value}


def warning(server: str, setting: str, value: str) -> str:
    """What the log says about one risky setting: the server, what can be lost, the fix."""
    shown = f"wait_replicas={value}" if setting == WAIT_REPLICAS else f"{setting} {value}"
    where = "its buffers run with" if setting == WAIT_REPLICAS else "has"
    return f"Redis {server} {where} {shown}: {LOSES[setting]}. {FIXES[setting]}"


def unreadable(server: str, setting: str) -> str:
    """What the log says about a setting neither CONFIG GET nor INFO was allowed to read."""
    return (
        f"cannot read {READ[setting]} of Redis {server} (CONFIG GET and INFO refused): if {IF_RISKY[setting]}, "
        f"{LOSES[setting]}. {FIXES[setting]}, or grant +info (see acl.rules()) so that the buffer can check"
    )


def judge(found: Mapping[str, Mapping[str, str]]) -> None:
    """Warn once per process, server and setting about a setting that can lose acknowledged
    writes, and once about one that could not be read. Never raises."""
    for server, settings in found.items():
        for setting, value in settings.items():
            if value == UNKNOWN:
                warn_once(unreadable(server, setting))
        for setting, value in at_risk(settings).items():
            warn_once(warning(server, setting, value))


class ServerPolicies(dict[str, str]):
    """What ``server_policies()`` returns: each server's ``maxmemory-policy`` (the mapping, as
    it always was) and, in ``durability``, each server's settings that decide what a restart or
    a failover loses (see ``durability``), e.g. ``{"10.0.0.5:6379": {"appendonly": "no"}}``."""

    def __init__(self, policies: Mapping[str, str], durability: Mapping[str, Mapping[str, str]]) -> None:
        super().__init__(policies)
        self.durability: dict[str, dict[str, str]] = {server: dict(found) for server, found in durability.items()}

    def durability_risks(self) -> dict[str, dict[str, str]]:
        """The servers with a setting under which an acknowledged write can be lost, and those settings."""
        return {server: risky for server, found in self.durability.items() if (risky := at_risk(found))}
