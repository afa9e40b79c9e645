"""The Lua code: one Redis Functions library, loaded once per server, called with FCALL.

The wheel ships ``lua/`` inside the package (``redis_layer_signals/lua``); a source checkout
keeps it at the top level, which is where an editable install finds it. The library is the
files of :data:`FILES` joined in order: ``_lib.lua`` opens with the ``#!lua name=rls_v2``
line and defines the shared helpers, each operation file defines its function and registers
it as ``rls_v2_<operation>``.

The version in the names (:data:`LIBRARY_NAME`) changes whenever a release changes what a
function does, so two client releases never replace each other's functions on a shared server,
each calling its own library. Both read and write the same keys: a release that changes the
key layout must also put a layout version in the key names (:mod:`.keys`), which this first
released layout does not need.

A server without the library (a restart without persistence, a new Cluster node, a replica
promoted before it got it, ``FUNCTION FLUSH``) answers an FCALL with "Function not found";
the buffers then load it (:func:`load_library`, on every primary of a Cluster) and resend the
call with the same idempotency token.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from redis.exceptions import ResponseError

from .errors import SignalBufferError

LIBRARY_NAME = "rls_v2"
OPERATIONS = ("record", "register", "finish", "sweep")
CHECKS = ("permissions",)
"""Functions that write nothing and that the buffers call before an operation's first call."""
FILES = ("_lib.lua", *(f"{name}.lua" for name in (*OPERATIONS, *CHECKS)))
FUNCTIONS = {name: f"{LIBRARY_NAME}_{name}" for name in (*OPERATIONS, *CHECKS)}
"""The function each operation (and check) calls."""

_MISSING = "function not found"


@dataclass(frozen=True)
class Library:
    name: str
    code: str
    functions: dict[str, str]


def _lua_dir() -> Traversable:
    packaged = resources.files("redis_layer_signals") / "lua"
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parent.parent / "lua"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError("redis_layer_signals: Lua code not found in the package or checkout")


@cache
def library() -> Library:
    """The library's code, read once."""
    folder = _lua_dir()
    code = "\n".join((folder / name).read_text(encoding="utf-8") for name in FILES)
    return Library(LIBRARY_NAME, code, dict(FUNCTIONS))


class LibraryMissing(SignalBufferError):
    """The library went missing again between loading it and resending the call (a
    ``FUNCTION FLUSH`` or a failover in between): the call never ran, and is resent (retryable)."""


def function_missing(error: BaseException) -> bool:
    """Whether ``error`` is a server's answer that our function is not loaded."""
    return isinstance(error, ResponseError) and _MISSING in str(error).lower()


def load_library(client: Any) -> None:
    """``FUNCTION LOAD REPLACE`` the library; on a Cluster client redis-py sends it to every
    primary. REPLACE makes loading idempotent: a node that has it already (the same name is
    the same version) answers like one that did not, so no primary is left out."""
    client.function_load(library().code, replace=True)


async def async_load_library(client: Any) -> None:
    """:func:`load_library` for redis.asyncio clients."""
    await client.function_load(library().code, replace=True)
