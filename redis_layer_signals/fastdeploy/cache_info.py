"""FastDeploy's ``cache_info`` dict as a ``CacheTask``, every field checked before any I/O."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .. import validation
from ..constants import MAX_INT
from ..errors import InvalidTask
from ..models import CacheTask
from ..protocol import replies

META_SRC_BLOCKS = "src_block_ids"
META_DEST_BLOCKS = "dest_block_ids"
"""Task meta fields holding the block ids, comma-joined, so a sender in another process can
read where to write from the buffer alone."""
META_PASSTHROUGH = ("transfer_protocol", "ip")
"""Scalar ``cache_info`` fields copied into the task meta when present, for operators."""


def cache_task(cache_info: Mapping[str, Any], instance: str, rank: int, num_layers: int, max_slots: int) -> CacheTask:
    """Map FastDeploy's merged ``cache_info`` dict to a ``CacheTask`` of ``instance`` and
    ``rank`` (no I/O)."""
    if type(cache_info) is not dict and not isinstance(cache_info, Mapping):
        raise InvalidTask("cache_info", type(cache_info).__name__, "must be a mapping")
    meta: dict[str, str] = {}
    for field in (META_SRC_BLOCKS, META_DEST_BLOCKS):
        if field in cache_info:
            meta[field] = _join_ints(cache_info[field], field)
    for field in META_PASSTHROUGH:
        value = cache_info.get(field)
        if isinstance(value, str):
            meta[field] = value
    slot = _int_in(cache_info, "current_id", max_slots, name="slot")
    request_id = validation.identifier(_required(cache_info, "request_id"), "request_id", InvalidTask)
    need = _int_in(cache_info, "need_prefill_tokens", MAX_INT)
    cached = _int_in(cache_info, "decode_cached_tokens", MAX_INT, default=0)
    # In CacheTask's field order (see replies.cache_task); the meta is valid as built.
    return replies.cache_task(
        {
            "instance": instance,
            "rank": rank,
            "slot": slot,
            "request_id": request_id,
            "need_prefill_tokens": need,
            "num_layers": num_layers,
            "decode_cached_tokens": cached,
            "meta": meta,
        }
    )


def block_ids(task: CacheTask, field: str) -> list[int]:
    """The block ids a task's meta carries (``src_block_ids`` or ``dest_block_ids``)."""
    text = task.meta.get(field, "")
    return [int(part) for part in text.split(",")] if text else []


def _required(cache_info: Mapping[str, Any], field: str) -> Any:
    if field not in cache_info:
        raise InvalidTask(field, None, "missing from cache_info")
    return cache_info[field]


def _int_in(cache_info: Mapping[str, Any], field: str, high: int, default: int | None = None, name: str = "") -> int:
    """``cache_info[field]`` (``default`` when missing, if given), an int in ``[0, high)``;
    the error names ``name`` (the task's field) for a value out of range. A plain int in
    range, every registration's case, is settled by the first test."""
    value = cache_info.get(field, default)
    if type(value) is int and 0 <= value < high:
        return value
    if field in cache_info or default is None:
        value = _as_int(_required(cache_info, field), field)
    return validation.integer(value, name or field, InvalidTask, 0, high, "max_slots" if name == "slot" else "")


def _join_ints(values: Any, field: str) -> str:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise InvalidTask(field, values, "must be a list of block ids")
    return ",".join([str(_as_int(value, f"{field}[{index}]")) for index, value in enumerate(values)])


def _as_int(value: Any, field: str) -> int:
    """An int; numpy and paddle scalars are accepted through ``__index__``, bools are not."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidTask(field, value, "must be an int")
    return int(value.__index__())
