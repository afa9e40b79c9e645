"""The least-privilege Redis ACL for the library's user, in one place so the docs, the tests and
an operator's ``ACL SETUSER`` agree.

Redis checks a function's commands against the calling user too, so the user needs the
commands the Lua functions call as well as the ones the client sends. Keys are limited to ``rls:*``, or to
one namespace's keys (``rls:{<namespace>/*``, the hash tag's opening): a user of namespace A
can then neither read nor write namespace B. ``SCAN`` is not key-checked, so such a user can
still see the names (not the contents) of other keys.

Three roles (``role=``): ``owner``, a client with a server of its own, which loads the library
itself where it is missing (``function|load``); ``tenant``, one of several clients sharing a
server, which may not load functions: whoever may load functions can replace any library,
and every other user then runs that code with its own permissions; and ``operator``, who
loads the library once (``rls library load``) and checks it (``rls library status``).
"""

from __future__ import annotations

from .. import validation
from ..constants import KEY_PREFIX
from ..errors import InvalidConfig

SCRIPT_COMMANDS = (
    "get",
    "set",
    "del",
    "hget",
    "hset",
    "hdel",
    "hlen",
    "hmget",
    "hincrby",
    "zadd",
    "zrem",
    "zrangebyscore",
    "pexpire",
    "pttl",
    "time",
)
"""Exactly the commands ``lua/*.lua`` calls: a test fails when a function adds or drops one."""

CLIENT_COMMANDS = (
    "fcall",
    "hget",
    "hmget",
    "hgetall",
    "scan",
    "time",
    "ping",
    "info",  # INFO memory: the maxmemory-policy where CONFIG GET is not granted (see eviction.py)
    "wait",  # only with wait_replicas
)
"""Commands the buffers send themselves. redis-py also sends ``CLIENT SETINFO`` on connect
(Redis 7.2+) and ignores a refusal, so it is left out."""

LOAD_COMMANDS = ("function|load",)
"""What an owner adds: loading the library after "Function not found" (a restart without
persistence, a new node, FUNCTION FLUSH)."""

OPERATOR_COMMANDS = ("fcall", "function|load", "function|list", "ping")
"""What ``rls library load`` and ``rls library status`` send; the operator needs no keys."""

ROLES = ("owner", "tenant", "operator")

CLUSTER_COMMANDS = ("cluster|slots", "cluster|shards", "cluster|nodes", "command", "readonly", "asking")
"""What a Redis Cluster client needs to learn the slot map and follow ASK redirections."""


def key_pattern(namespace: str | None = None) -> str:
    """``rls:*``, or the keys of one namespace: every key of it starts ``rls:{<namespace>/``."""
    if namespace is None:
        return f"{KEY_PREFIX}:*"
    validation.identifier(namespace, "namespace", InvalidConfig)
    return f"{KEY_PREFIX}:{{{namespace}/*"


def rules(namespace: str | None = None, cluster: bool = False, role: str = "owner") -> list[str]:
    """ACL rules for ``ACL SETUSER <user> on ><password> <rules...>`` (password not included),
    for one of ``ROLES`` (see the module docstring)."""
    if role not in ROLES:
        raise InvalidConfig("role", role, f"must be one of {', '.join(ROLES)}")
    cluster_commands = CLUSTER_COMMANDS if cluster else ()
    if role == "operator":
        commands = dict.fromkeys((*OPERATOR_COMMANDS, *cluster_commands))
        return ["resetkeys", "resetchannels", "-@all", *(f"+{c}" for c in commands)]
    loading = LOAD_COMMANDS if role == "owner" else ()
    client = (CLIENT_COMMANDS[0], *loading, *CLIENT_COMMANDS[1:])
    commands = dict.fromkeys((*client, *SCRIPT_COMMANDS, *cluster_commands))
    return ["resetkeys", f"~{key_pattern(namespace)}", "resetchannels", "-@all", *(f"+{c}" for c in commands)]


EXPORTER_COMMANDS = ("scan", "hgetall", "hlen", "multi", "exec", "info", "time", "ping")
"""What ``rls metrics`` sends: the counters and pending counts of each rank (one MULTI per
rank), and ``INFO memory stats`` for each server's eviction policy and ``evicted_keys``."""


def exporter_rules(namespace: str | None = None, cluster: bool = False) -> list[str]:
    """Read-only ACL rules for the ``rls metrics`` exporter's user (see ``rules``)."""
    commands = dict.fromkeys((*EXPORTER_COMMANDS, *(CLUSTER_COMMANDS if cluster else ())))
    return ["resetkeys", f"%R~{key_pattern(namespace)}", "resetchannels", "-@all", *(f"+{c}" for c in commands)]
