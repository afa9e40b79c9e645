"""The Lua scripts: read once from package data, SHA computed locally, run by EVALSHA.

The wheel ships ``lua/`` inside the package (``redis_layer_signals/lua``); a source checkout
keeps it at the top level, which is where an editable install finds it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

LIBRARY = "_lib.lua"
OPERATIONS = ("record", "register", "finish", "sweep")


@dataclass(frozen=True)
class Script:
    name: str
    text: str
    sha: str


def _lua_dir() -> Traversable:
    packaged = resources.files("redis_layer_signals") / "lua"
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parent.parent / "lua"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError("redis_layer_signals: Lua scripts not found in the package or checkout")


@cache
def load(name: str) -> Script:
    """The operation script ``name``, with the shared helpers prepended (one SHA for both)."""
    if name not in OPERATIONS:
        raise KeyError(name)
    folder = _lua_dir()
    text = (folder / LIBRARY).read_text(encoding="utf-8") + (folder / f"{name}.lua").read_text(encoding="utf-8")
    return Script(name=name, text=text, sha=hashlib.sha1(text.encode()).hexdigest())


def all_scripts() -> dict[str, Script]:
    return {name: load(name) for name in OPERATIONS}
