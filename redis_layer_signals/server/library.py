"""The Lua code: one Redis Functions library, loaded once per server, called with FCALL.

The wheel ships ``lua/`` inside the package (``redis_layer_signals/lua``); a source checkout
keeps it at the top level, which is where an editable install finds it. The library is the
files of ``FILES`` joined in order: ``_lib.lua`` opens with the ``#!lua name=rls_v2``
line and defines the shared helpers, each operation file defines its function and registers
it as ``rls_v2_<operation>``.

The version in the names (``LIBRARY_NAME``) changes whenever a release changes what a
function does, so two client releases never replace each other's functions on a shared server,
each calling its own library. Both read and write the same keys: a release that changes the
key layout must also put a layout version in the key names (``keys``), which this first
released layout does not need.

On a shared server another client may have loaded a different ``rls_v2`` (another build, a
copy edited by hand). Each function is registered as ``rls_v2_<operation>_<digest>``, the
digest being the SHA-256 of the code (``DIGEST_PLACEHOLDER``), so a buffer only ever calls
the code it ships: other code has other names, and the call is answered "Function not found"
without running anything.

A server without the library (a restart without persistence, a new Cluster node, a replica
promoted before it got it, ``FUNCTION FLUSH``) answers the same. The buffers then ask
``rls_v2_digest`` which code the server has (``ensure_library``): none, and they load it,
without REPLACE, on the node that answered, and resend the call with the same idempotency
token; another digest, and they raise ``LibraryMismatch`` naming both, never calling it
and never replacing it (the clients of that other build would replace it back). Replacing it
is the operator's decision: ``rls library load --replace``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis.exceptions import ResponseError

from ..errors import LibraryMismatch, SignalBufferError
from ..protocol.replies import text
from .nodes import is_cluster

if TYPE_CHECKING:  # importlib.resources.abc is 3.11+; the annotation is only read by type checkers
    from importlib.resources.abc import Traversable

LIBRARY_NAME = "rls_v2"
OPERATIONS = ("record", "register", "finish", "sweep", "apply", "claim")
CHECKS = ("permissions",)
"""Functions that write nothing and that the buffers call before an operation's first call."""
FILES = ("_lib.lua", *(f"{name}.lua" for name in (*OPERATIONS, *CHECKS)), "digest.lua")
DIGEST_PLACEHOLDER = "@DIGEST@"
"""Where ``_lib.lua`` holds the digest: the digest is the SHA-256 of the joined files as they
stand, placeholder included, and the built library has the digest in its place."""
DIGEST_FUNCTION = f"{LIBRARY_NAME}_digest"
"""The one function without the digest in its name: every build answers it with its digest."""

_MISSING = "function not found"
_EXISTS = "already exists"


@dataclass(frozen=True)
class Library:
    name: str
    code: str
    digest: str
    functions: dict[str, str]


def _lua_dir() -> Traversable:
    packaged = resources.files("redis_layer_signals") / "lua"
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parents[2] / "lua"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError("redis_layer_signals: Lua code not found in the package or checkout")


def build(source: str) -> Library:
    """The library built from ``source`` (the files joined): its digest put in place, and the
    name of each function, ``rls_v2_<name>_<digest>`` (``rls_v2_digest`` for the digest's)."""
    if source.count(DIGEST_PLACEHOLDER) != 1:
        raise ValueError(f"the library code must hold {DIGEST_PLACEHOLDER!r} exactly once")
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()
    functions = {name: f"{LIBRARY_NAME}_{name}_{digest}" for name in (*OPERATIONS, *CHECKS)}
    functions["digest"] = DIGEST_FUNCTION
    return Library(LIBRARY_NAME, source.replace(DIGEST_PLACEHOLDER, digest), digest, functions)


@cache
def library() -> Library:
    """The library's code, read once."""
    folder = _lua_dir()
    return build("\n".join((folder / name).read_text(encoding="utf-8") for name in FILES))


FUNCTIONS = library().functions
"""The function each operation (and check) calls."""


class LibraryMissing(SignalBufferError):
    """The library went missing again between loading it and resending the call (a
    ``FUNCTION FLUSH`` or a failover in between): the call never ran, and is resent (retryable)."""

    def __init__(self, called: str) -> None:
        super().__init__(f"{called}: the library went missing again after loading it")


def function_missing(error: BaseException) -> bool:
    """Whether ``error`` is a server's answer that our function is not loaded."""
    return isinstance(error, ResponseError) and _MISSING in str(error).lower()


def _already_loaded(error: BaseException) -> bool:
    return isinstance(error, ResponseError) and _EXISTS in str(error).lower()


def _node_of(client: Any, key: str | None) -> dict[str, Any]:
    """``execute_command`` options that send a library command to ``key``'s node of a Cluster
    client (the node that answered "Function not found"); nothing for one server."""
    if key is None or not is_cluster(client):
        return {}
    return {"target_nodes": client.get_node_from_key(key)}


def served_digest(client: Any, key: str | None = None) -> str | None:
    """The digest the server's (or ``key``'s Cluster node's) ``rls_v2`` reports, None when it
    has no ``rls_v2_digest`` (no library, or one that reports none)."""
    keys = [] if key is None else [key]
    try:
        return text(client.fcall(DIGEST_FUNCTION, len(keys), *keys))
    except ResponseError as exc:
        if function_missing(exc):
            return None
        raise


async def async_served_digest(client: Any, key: str | None = None) -> str | None:
    """``served_digest`` for redis.asyncio clients."""
    keys = [] if key is None else [key]
    try:
        return text(await client.fcall(DIGEST_FUNCTION, len(keys), *keys))
    except ResponseError as exc:
        if function_missing(exc):
            return None
        raise


def _judge(served: str | None, cause: BaseException | None = None) -> bool:
    """True when the server has our library already; raises when it has another one."""
    ours = library().digest
    if served == ours:
        return True
    if served is not None or cause is not None:
        raise LibraryMismatch(ours, served) from cause
    return False


def ensure_library(client: Any, key: str | None = None) -> bool:
    """Make sure the server (``key``'s node on a Cluster) has this client's library: load it
    where there is none (True), raise ``LibraryMismatch`` where there is another. Loaded
    without REPLACE, so a library another build loaded meanwhile is never overwritten."""
    if _judge(served_digest(client, key)):
        return False
    try:
        client.execute_command("FUNCTION LOAD", library().code, **_node_of(client, key))
    except ResponseError as exc:
        if not _already_loaded(exc):
            raise
        # Loaded meanwhile: by a buffer of ours (fine) or of another build (refused).
        served = served_digest(client, key)
        _judge(served, None if served == library().digest else exc)
        return False
    return True


async def async_ensure_library(client: Any, key: str | None = None) -> None:
    """``ensure_library`` for redis.asyncio clients."""
    if _judge(await async_served_digest(client, key)):
        return
    try:
        await client.execute_command("FUNCTION LOAD", library().code, **_node_of(client, key))
    except ResponseError as exc:
        if not _already_loaded(exc):
            raise
        served = await async_served_digest(client, key)
        _judge(served, None if served == library().digest else exc)


def load_library(client: Any, replace: bool = False) -> None:
    """``FUNCTION LOAD`` the library on one server, or on every primary of a Cluster client.
    ``replace`` overwrites whatever ``rls_v2`` is there, another build's included: the
    operator's call, never the buffers'."""
    client.function_load(library().code, replace=replace)


def nodes(client: Any) -> list[tuple[str, Any]]:
    """(name, client of that node) for each primary of a Cluster client, else the one server:
    where the library lives (each primary keeps its own)."""
    if is_cluster(client):
        return [(node.name, node.redis_connection) for node in client.get_primaries()]
    kwargs = client.connection_pool.connection_kwargs
    return [(f"{kwargs.get('host', kwargs.get('path', 'server'))}:{kwargs.get('port', '')}".rstrip(":"), client)]


def served_code(client: Any) -> str | None:
    """The code of the server's ``rls_v2`` (``FUNCTION LIST ... WITHCODE``), None without one.
    Exact, unlike the digest a library reports of itself, and what ``rls library status`` reads."""
    for entry in client.function_list(library=LIBRARY_NAME, withcode=True):
        fields = dict(zip(entry[::2], entry[1::2], strict=True))
        name = fields.get(b"library_name", fields.get("library_name"))
        if name is not None and text(name) == LIBRARY_NAME:
            return text(fields.get(b"library_code", fields.get("library_code")))
    return None
