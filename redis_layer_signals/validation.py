"""Argument checks that run before any command is sent: bad input never writes anything."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from .constants import IDENTIFIER_PATTERN, MAX_BATCH, MAX_INT, MAX_RANK
from .errors import InvalidConfig, InvalidSignal, InvalidTask, _InvalidValue

_IDENTIFIER = re.compile(IDENTIFIER_PATTERN)

Entry = tuple[int, int] | tuple[int, int, str | None]
"""One ``record`` entry: ``(slot, tokens)`` or ``(slot, tokens, request_id)``."""


def identifier(value: Any, field: str, error: type[_InvalidValue]) -> str:
    if not isinstance(value, str) or _IDENTIFIER.fullmatch(value) is None:
        raise error(field, value, f"must match {IDENTIFIER_PATTERN}")
    return value


def integer(value: Any, field: str, error: type[_InvalidValue], low: int, high: int) -> int:
    """An int (bools refused) in ``[low, high)``. The plain int in range, the case of every
    call on the hot path, is settled by the first test.

    An int subclass passes only if its text is its digits: keys and the Lua arguments are built
    with ``str()``, and an ``IntEnum`` on Python 3.10 prints as ``Layer.FIRST``."""
    if type(value) is int and low <= value < high:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(field, value, f"must be an int, not {type(value).__name__}")
    if type(value) is not int and str(value) != int.__repr__(value):
        raise error(field, value, f"must be an int whose text is its digits, not {type(value).__name__} {str(value)!r}")
    if not low <= value < high:
        raise error(field, value, f"must be in [{low}, {high})")
    return value


def rank(value: Any, error: type[_InvalidValue]) -> int:
    return integer(value, "rank", error, 0, MAX_RANK + 1)


def slot(value: Any, max_slots: int, error: type[_InvalidValue]) -> int:
    return integer(value, "slot", error, 0, max_slots)


def entries(raw: Any, max_slots: int) -> list[tuple[int, int, str | None]]:
    """Normalise a record batch to ``(slot, tokens, request_id | None)`` triples."""
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Iterable):
        raise InvalidSignal("entries", raw, "must be a list of (slot, tokens[, request_id])")
    out: list[tuple[int, int, str | None]] = []
    for index, item in enumerate(raw):
        if len(out) >= MAX_BATCH:
            raise InvalidSignal("entries", f"<more than {MAX_BATCH}>", f"at most {MAX_BATCH} per call")
        if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
            raise InvalidSignal(f"entries[{index}]", item, "must be (slot, tokens[, request_id])")
        slot_value = integer(item[0], f"entries[{index}].slot", InvalidSignal, 0, max_slots)
        tokens = integer(item[1], f"entries[{index}].tokens", InvalidSignal, 0, MAX_INT)
        request_id = item[2] if len(item) == 3 else None
        if request_id is not None:
            identifier(request_id, f"entries[{index}].request_id", InvalidSignal)
        out.append((slot_value, tokens, request_id))
    return out


def positive_seconds(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidConfig(field, value, "must be a positive number of seconds")
    if value > 10 * 365 * 86400:
        raise InvalidConfig(field, value, "must be at most ten years")
    return float(value)


def meta(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise InvalidTask("meta", value, "must be a mapping of str to str")
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise InvalidTask(f"meta[{key!r}]", item, "keys and values must be str")
    return dict(value)
