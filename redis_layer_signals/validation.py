"""Argument checks that run before any command is sent: bad input never writes anything."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from .constants import IDENTIFIER_PATTERN, MAX_BATCH, MAX_INT, MAX_RANK, MAX_SLOTS_LIMIT
from .errors import InvalidConfig, InvalidSignal, InvalidTask, _InvalidValue

_IDENTIFIER = re.compile(IDENTIFIER_PATTERN)
_IDENTIFIER_RULE = f"must be a string matching {IDENTIFIER_PATTERN}"

Entry = tuple[int, int] | tuple[int, int, str | None]
"""One ``record`` entry: ``(slot, tokens)`` or ``(slot, tokens, request_id)``."""


def identifier(value: Any, field: str, error: type[_InvalidValue]) -> str:
    if not isinstance(value, str):
        raise error(field, value, f"{_IDENTIFIER_RULE}, not {type(value).__name__}")
    if _IDENTIFIER.fullmatch(value) is None:
        raise error(field, value, _IDENTIFIER_RULE)
    return value


def bound_text(low: int, high: int, bound: str = "", closed: bool = False) -> str:
    """``[low, high)`` as the messages say it (``[low, high - 1]`` when ``closed``): ``2**53``
    by name, and what sets the bound (``max_layers``...) after it when an option does."""
    shown = f"{high - 1}]" if closed else ("2**53)" if high == MAX_INT else f"{high})")
    return f"[{low}, {shown}" + (f" ({bound})" if bound else "")


def integer(
    value: Any, field: str, error: type[_InvalidValue], low: int, high: int, bound: str = "", closed: bool = False
) -> int:
    """An int (bools refused) in ``[low, high)``; ``bound`` names what sets ``high`` (an
    option such as ``max_layers``), so one message gives the whole range and its source, and
    ``closed`` says it as ``[low, high - 1]`` (an option that is the largest value allowed).
    The plain int in range, the case of every call on the hot path, is settled by the first test.

    An int subclass passes only if its text is its digits: keys and the Lua arguments are built
    with ``str()``, and an ``IntEnum`` on Python 3.10 prints as ``Layer.FIRST``."""
    if type(value) is int and low <= value < high:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        expected = bound_text(low, high, bound, closed)
        raise error(field, value, f"must be an int in {expected}, not {type(value).__name__}")
    if type(value) is not int and str(value) != int.__repr__(value):
        raise error(field, value, f"must be an int whose text is its digits, not {type(value).__name__} {str(value)!r}")
    if not low <= value < high:
        raise error(field, value, f"must be in {bound_text(low, high, bound, closed)}")
    return value


def rank(value: Any, error: type[_InvalidValue]) -> int:
    return integer(value, "rank", error, 0, MAX_RANK + 1)


def slot(value: Any, max_slots: int, error: type[_InvalidValue]) -> int:
    return integer(value, "slot", error, 0, max_slots, "max_slots")


ANY_SLOT = f"max_slots is at most {MAX_SLOTS_LIMIT}"
"""What bounds a slot before a buffer's ``max_slots`` is known (a CacheTask, a LayerSignal)."""


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
        slot_value = integer(item[0], f"entries[{index}].slot", InvalidSignal, 0, max_slots, "max_slots")
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


def signal_fields(signal: Any) -> None:
    """What a ``LayerSignal`` is checked for when built: every field, against the bounds that
    hold whatever the buffer (a ``record`` call checks its slots against ``max_slots`` and its
    layer against ``max_layers``)."""
    identifier(signal.instance, "instance", InvalidSignal)
    rank(signal.rank, InvalidSignal)
    integer(signal.slot, "slot", InvalidSignal, 0, MAX_SLOTS_LIMIT, ANY_SLOT)
    integer(signal.layer, "layer", InvalidSignal, 0, MAX_INT)
    integer(signal.tokens, "tokens", InvalidSignal, 0, MAX_INT)
    if signal.request_id is not None:
        identifier(signal.request_id, "request_id", InvalidSignal)
    integer(signal.recorded_at_ms, "recorded_at_ms", InvalidSignal, 0, MAX_INT)


def task_fields(task: Any) -> None:
    """What a ``CacheTask`` is checked for when built: every field, against the bounds that
    hold whatever the buffer (``register`` checks the slot against ``max_slots`` and
    ``num_layers`` against ``max_layers``)."""
    identifier(task.instance, "instance", InvalidTask)
    rank(task.rank, InvalidTask)
    integer(task.slot, "slot", InvalidTask, 0, MAX_SLOTS_LIMIT, ANY_SLOT)
    identifier(task.request_id, "request_id", InvalidTask)
    integer(task.need_prefill_tokens, "need_prefill_tokens", InvalidTask, 0, MAX_INT)
    integer(task.num_layers, "num_layers", InvalidTask, 1, MAX_INT)
    integer(task.decode_cached_tokens, "decode_cached_tokens", InvalidTask, 0, MAX_INT)
    if type(task.meta) is not dict or task.meta:  # an empty dict is valid meta
        meta(task.meta)
