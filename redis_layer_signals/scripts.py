"""The Lua scripts: read once from package data, SHA computed locally, run by EVALSHA.

The wheel ships ``lua/`` inside the package (``redis_layer_signals/lua``); a source checkout
keeps it at the top level, which is where an editable install finds it.

Each operation script is sent with the helpers of ``_lib.lua`` that it uses, directly or
through another helper, and no others. Lua creates every ``local function`` of a script anew
on each call (EVAL keeps no state between calls), so an unused helper is not free: each one
costs about as much server work as a short string operation, on every call. For the same
reason a script can mark where its common path ends (see :func:`link`): helpers only the
rest of it needs are created there.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

LIBRARY = "_lib.lua"
HELPERS_MARKER = "-- @helpers"
_MARKER_LINE = re.compile(rf"^{re.escape(HELPERS_MARKER)}[^\n]*\n", re.MULTILINE)
OPERATIONS = ("record", "register", "finish", "sweep")

_DEFINITION = re.compile(r"^local (?:function (\w+)|([\w, ]+?) =)", re.MULTILINE)
_COMMENT = re.compile(r"--[^\n]*|'(?:\\.|[^'\\\n])*'|\"(?:\\.|[^\"\\\n])*\"")
"""Comments and short strings: neither names a helper, and a ``--`` inside a string starts no comment."""
_NAME = re.compile(r"[A-Za-z_]\w*")
_LOCAL = re.compile(r"\blocal\s+(?:function\s+)?([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)")
_BOUND = re.compile(r"\bfunction\b[\w.: ]*\(([\w, .]*)\)|\bfor\s+([\w, ]+?)\s*(?:=|\bin\b)")


@dataclass(frozen=True)
class Script:
    name: str
    text: str
    sha: str


@dataclass(frozen=True)
class Definition:
    """One top-level ``local`` of the library, with the comment lines just above it."""

    names: frozenset[str]
    text: str
    uses: frozenset[str]


def _lua_dir() -> Traversable:
    packaged = resources.files("redis_layer_signals") / "lua"
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parent.parent / "lua"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError("redis_layer_signals: Lua scripts not found in the package or checkout")


def _names_in(code: str) -> frozenset[str]:
    return frozenset(_NAME.findall(_COMMENT.sub(" ", code)))


def _locals_in(code: str) -> frozenset[str]:
    """Every name ``code`` declares with ``local`` (at any depth: erring on the safe side)."""
    return frozenset(name.strip() for names in _LOCAL.findall(_COMMENT.sub(" ", code)) for name in names.split(","))


def _bound_in(code: str) -> frozenset[str]:
    """The names ``code`` binds itself: its locals, parameters and loop variables."""
    bound = set(_locals_in(code))
    for match in _BOUND.finditer(_COMMENT.sub(" ", code)):
        bound |= set(_NAME.findall(match.group(1) or match.group(2) or ""))
    return frozenset(bound)


def definitions(library: str) -> list[Definition]:
    """The library cut at each top-level ``local``; a definition runs to the next one, and the
    comment block right above a definition belongs to it (the file's header belongs to none)."""
    lines = library.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if _DEFINITION.match(line)]
    out = []
    for index, start in enumerate(starts):
        first = start
        while first > 0 and lines[first - 1].startswith("--") and (index == 0 or first - 1 > starts[index - 1]):
            first -= 1
        if index == 0:
            first = start  # the file header is documentation, not part of the first helper
        end = starts[index + 1] if index + 1 < len(starts) else len(lines)
        while end > start + 1 and lines[end - 1].startswith("--"):
            end -= 1  # the next definition's comment
        match = _DEFINITION.match(lines[start])
        assert match is not None
        names = match.group(1) or match.group(2)
        declared = frozenset(name.strip() for name in names.split(","))
        body = "".join(lines[first:end])
        out.append(Definition(declared, body, _names_in("".join(lines[start:end])) - declared))
    return out


def _closure(defs: list[Definition], names: set[str], taken: set[int]) -> set[int]:
    """Indexes of the definitions that ``names`` need, directly or through each other, leaving
    out those already ``taken``."""
    wanted, needed = set(names), set()
    changed = True
    while changed:
        changed = False
        for index, definition in enumerate(defs):
            if index not in needed and index not in taken and definition.names & wanted:
                needed.add(index)
                wanted |= definition.uses
                changed = True
    return needed


def link(library: str, body: str) -> str:
    """``body`` with the library definitions it needs, each group in library order.

    A body may hold a line ``-- @helpers``: the definitions its code above that line needs
    come first, the others are placed at the line, so a call that returns before it never
    creates them (record's delivering path stops there)."""
    defs = definitions(library)
    found = _MARKER_LINE.search(body)
    head, tail = (body[: found.end()], body[found.end() :]) if found else (body, "")
    top = _closure(defs, set(_names_in(head)), set())
    rest = _closure(defs, set(_names_in(tail)), top)
    # A helper created at the line would see the locals the code above it declares: one that
    # uses a name the code above redeclares goes first, where the whole library used to be.
    declared = _locals_in(head)
    while clash := [index for index in rest if (defs[index].uses - _bound_in(defs[index].text)) & declared]:
        top |= _closure(defs, set().union(*(defs[index].names for index in clash)), top)
        rest = _closure(defs, set(_names_in(tail)), top)

    def block(indexes: set[int]) -> str:
        return "".join(defs[index].text.rstrip("\n") + "\n\n" for index in sorted(indexes))

    return block(top) + head + block(rest) + tail.lstrip("\n")


@cache
def load(name: str) -> Script:
    """The operation script ``name`` with the helpers it uses (one SHA for both)."""
    if name not in OPERATIONS:
        raise KeyError(name)
    folder = _lua_dir()
    library = (folder / LIBRARY).read_text(encoding="utf-8")
    text = link(library, (folder / f"{name}.lua").read_text(encoding="utf-8"))
    return Script(name=name, text=text, sha=hashlib.sha1(text.encode()).hexdigest())


def all_scripts() -> dict[str, Script]:
    return {name: load(name) for name in OPERATIONS}
