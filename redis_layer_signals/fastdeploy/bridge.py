"""The three hook points of FastDeploy's ``CacheMessagerV1``, served by a shared buffer.

``CacheMessagerV1`` queues a batch ``[(engine_idx, prefilled_token_num), ...]`` for its
layer-wise sender whenever a layer-0 signal arrives. A layer-0 signal that arrives before its
cache task used to be lost; :class:`Layer0Bridge` records it in the buffer instead, and the
task's registration pops it back, atomically, so each layer-0 batch reaches the sender exactly
once whichever side came first, even when the signal consumer and the task adder run in
different processes or hosts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from .. import validation
from ..buffer import SignalBuffer
from ..constants import MAX_INT
from ..errors import InvalidConfig, InvalidTask
from ..models import CacheTask, FinishResult
from .signals import KvSignal, decode_kv_signal

logger = logging.getLogger(__name__)

Batch = list[tuple[int, int]]
"""What ``cache_prefilled_engine_ids_queue`` carries: ``[(engine_idx, prefilled_token_num)]``."""

DEFAULT_BLOCK_SIZE = 64
"""FastDeploy's default KV-cache block size in tokens."""
SIGNAL_LAYER = 0
"""Only layer-0 signals start a send; later layers just advance progress."""
META_SRC_BLOCKS = "src_block_ids"
META_DEST_BLOCKS = "dest_block_ids"
"""Task meta fields holding the block ids, comma-joined, so a sender in another process can
read where to write from the buffer alone."""
META_PASSTHROUGH = ("transfer_protocol", "ip")
"""Scalar ``cache_info`` fields copied into the task meta when present, for operators."""


class Layer0Bridge:
    """Routes ``CacheMessagerV1``'s layer-0 signals and cache tasks through a :class:`SignalBuffer`.

    ``rank`` is the messager's ``rank_id`` (``rank + local_data_parallel_id * nranks``), the
    same number FastDeploy reads signals with. Every method is safe to call from any thread.
    """

    def __init__(
        self,
        buffer: SignalBuffer,
        instance: str,
        rank: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        num_layers: int,
    ) -> None:
        validation.integer(block_size, "block_size", InvalidConfig, 1, MAX_INT)
        validation.integer(num_layers, "num_layers", InvalidConfig, 1, MAX_INT)
        self.buffer = buffer
        self.instance = instance
        self.rank = rank
        self.block_size = block_size
        self.num_layers = num_layers

    def on_kv_signal(self, kv_signal_data: Any) -> Batch:
        """In ``consume_signals``: record a layer-0 message and return the batch to queue now.

        Takes the raw ``kv_signal_data`` tensor or an already decoded :class:`KvSignal`. Slots
        whose task is live come back at once; the others wait in the buffer for their task.
        Empty reads and later layers return ``[]`` and touch nothing.
        """
        entries = layer0_entries(kv_signal_data)
        if not entries:
            return []
        result = self.buffer.record(self.instance, self.rank, SIGNAL_LAYER, entries)
        if result.buffered:
            logger.debug("buffered early layer-0 signals for slots %s", [s.slot for s in result.buffered])
        return [(s.slot, s.tokens) for s in result.delivered]

    def on_cache_task(self, cache_info: Mapping[str, Any]) -> Batch:
        """In ``_add_cache_task_thread``, once both halves are merged: register, return recovery.

        The returned batch holds the slot's early layer-0 signal when one was waiting (empty
        otherwise); put it on ``cache_prefilled_engine_ids_queue``. Signals the buffer refused
        (over ``need_prefill_tokens``, expired, ...) are logged with their reason.
        """
        task = self.cache_task(cache_info)
        result = self.buffer.register(task)
        for signal, reason in result.dropped:
            logger.warning(
                "dropped early layer-%d signal of slot %d (%d tokens) for request %s: %s",
                signal.layer,
                signal.slot,
                signal.tokens,
                task.request_id,
                reason.value,
            )
        return [(s.slot, s.tokens) for s in result.recovered if s.layer == SIGNAL_LAYER]

    def on_task_finished(self, current_id: int, request_id: str) -> FinishResult:
        """Where the sender deletes ``idx_cache_task_dict[current_id]``: release the slot.

        Fenced by ``request_id``: a late call for an older request never touches the request
        that now holds the slot. Also drops signals still waiting for an aborted request.
        """
        result = self.buffer.finish(self.instance, self.rank, current_id, request_id)
        if result.fenced:
            logger.info("finish of %s on slot %d fenced: another request holds it", request_id, current_id)
        return result

    def cache_task(self, cache_info: Mapping[str, Any]) -> CacheTask:
        """Map FastDeploy's merged ``cache_info`` dict to a :class:`CacheTask` (no I/O)."""
        if not isinstance(cache_info, Mapping):
            raise InvalidTask("cache_info", type(cache_info).__name__, "must be a mapping")
        meta: dict[str, str] = {}
        for field in (META_SRC_BLOCKS, META_DEST_BLOCKS):
            if field in cache_info:
                meta[field] = _join_ints(cache_info[field], field)
        for field in META_PASSTHROUGH:
            value = cache_info.get(field)
            if isinstance(value, str):
                meta[field] = value
        return CacheTask(
            instance=self.instance,
            rank=self.rank,
            slot=_int_field(cache_info, "current_id"),
            request_id=_required(cache_info, "request_id"),
            need_prefill_tokens=_int_field(cache_info, "need_prefill_tokens"),
            num_layers=self.num_layers,
            decode_cached_tokens=_int_field(cache_info, "decode_cached_tokens", default=0),
            meta=meta,
        )


def layer0_entries(kv_signal_data: Any) -> Batch:
    """The ``(slot, prefilled_tokens)`` entries of a layer-0 message (raw or decoded); ``[]``
    for an empty read or a later layer, whose entries are not decoded (this runs once per layer
    and chunk). A list, the batch shape ``record`` checks fastest."""
    if isinstance(kv_signal_data, KvSignal):
        signal: KvSignal | None = kv_signal_data
    else:
        signal = decode_kv_signal(kv_signal_data, only_layer=SIGNAL_LAYER)
    if signal is None or signal.layer != SIGNAL_LAYER:
        return []
    return list(signal.entries)


def block_ids(task: CacheTask, field: str) -> list[int]:
    """The block ids a task's meta carries (``src_block_ids`` or ``dest_block_ids``)."""
    text = task.meta.get(field, "")
    return [int(part) for part in text.split(",")] if text else []


def _required(cache_info: Mapping[str, Any], field: str) -> Any:
    if field not in cache_info:
        raise InvalidTask(field, None, "missing from cache_info")
    return cache_info[field]


def _int_field(cache_info: Mapping[str, Any], field: str, default: int | None = None) -> int:
    if field not in cache_info and default is not None:
        return default
    return _as_int(_required(cache_info, field), field)


def _join_ints(values: Any, field: str) -> str:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise InvalidTask(field, values, "must be a list of block ids")
    return ",".join([str(_as_int(value, f"{field}[{index}]")) for index, value in enumerate(values)])


def _as_int(value: Any, field: str) -> int:
    """An int; numpy and paddle scalars are accepted through ``__index__``, bools are not."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidTask(field, value, "must be an int")
    return int(value.__index__())
