"""How what the functions return and store becomes result objects: replies split into their
parts, batches of LayerSignals built cheaply, register's recovery payload, a slot's pending
signals and live entries decoded. The layouts are documented in lua/_lib.lua and the
functions' headers; ``protocol`` builds the calls whose replies are read here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import fields
from itertools import repeat
from typing import Any

from ..errors import NoPermissionError
from ..models import (
    CacheTask,
    DropReason,
    FinishResult,
    LayerSignal,
    RecordResult,
    RegisterResult,
)


def text(value: Any) -> str:
    """A reply as text, whether the client decodes responses or not (None: empty)."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def refused(operation: str, reply: Any) -> NoPermissionError | None:
    """The error for ``rls_v2_permissions``' reply ("<command> <key>", the first command the
    user may not run), or None when everything is allowed (``""``)."""
    message = text(reply)
    if not message:
        return None
    command, _, key = message.partition(" ")
    return NoPermissionError(operation, command, f"on {key}" if key else "")


def split_reply(reply: Any) -> tuple[str, int, str]:
    """A function's reply, "<status>|<now_ms>|<payload>", in its three parts."""
    status, now, payload = (reply.decode() if type(reply) is bytes else text(reply)).split("|", 2)
    return status, int(now), payload


def _fills_dict(cls: type, names: tuple[str, ...]) -> bool:
    """Whether instances of the frozen dataclass ``cls`` may be built by setting ``__dict__``:
    only while it has exactly these fields, no slots and no ``__post_init__`` other than one
    that only checks the fields (``models.only_checks``; the values given here were checked
    on their way in or come from the server). Checked once, at import. The result equals the
    one ``__init__`` builds (equal, hashable, immutable)."""
    post_init = getattr(cls, "__post_init__", None)
    return (
        tuple(f.name for f in fields(cls)) == names
        and "__slots__" not in vars(cls)
        and (post_init is None or getattr(post_init, "only_checks", False))
    )


_SIGNAL_FIELDS = ("instance", "rank", "slot", "layer", "tokens", "request_id", "recorded_at_ms")
_FAST_SIGNALS = _fills_dict(LayerSignal, _SIGNAL_FIELDS)
_FAST_RESULTS = (
    _fills_dict(RecordResult, ("delivered", "buffered"))
    and _fills_dict(RegisterResult, ("task", "recovered", "dropped", "repeated", "replaced"))
    and _fills_dict(FinishResult, ("removed", "dropped", "fenced"))
)
_new = object.__new__
_setattr = object.__setattr__


def _set_dict(obj: object, state: dict[str, Any]) -> None:
    _setattr(obj, "__dict__", state)


_set_signal_dict: Callable[[Any, dict[str, Any]], None] = (
    vars(LayerSignal)["__dict__"].__set__ if _FAST_SIGNALS else _set_dict
)
"""Sets a LayerSignal's ``__dict__``: the class's own descriptor, called directly."""


def _signal(state: dict[str, Any]) -> LayerSignal:
    """A LayerSignal from its fields: ``__dict__`` set directly (a quarter of ``__init__``'s
    time, which sets each field through ``object.__setattr__``) when ``_FAST_SIGNALS``."""
    if not _FAST_SIGNALS:
        return LayerSignal(**state)
    signal: LayerSignal = _new(LayerSignal)
    _setattr(signal, "__dict__", state)
    return signal


_FAST_TASKS = _fills_dict(
    CacheTask,
    ("instance", "rank", "slot", "request_id", "need_prefill_tokens", "num_layers", "decode_cached_tokens", "meta"),
)


def cache_task(state: dict[str, Any]) -> CacheTask:
    """A CacheTask from all its fields, in declaration order: ``__dict__`` set directly (a
    fifth of ``__init__``'s time, which sets its eight fields through ``object.__setattr__``)
    when ``_FAST_TASKS``. One is built per registration on FastDeploy's task adder."""
    if not _FAST_TASKS:
        return CacheTask(**state)
    task: CacheTask = _new(CacheTask)
    _setattr(task, "__dict__", state)
    return task


def _prototype(instance: str, rank: int, slot: int, layer: int, at: int) -> dict[str, Any]:
    """A signal's fields, in declaration order, for a batch's signals to copy and complete:
    ``dict.copy`` of a same-sized dict and two stores cost half of a 7-entry dict display."""
    return {
        "instance": instance,
        "rank": rank,
        "slot": slot,
        "layer": layer,
        "tokens": 0,
        "request_id": None,
        "recorded_at_ms": at,
    }


def batch_signals(
    instance: str, rank: int, layer: int, at: int, batch: Sequence[tuple[Any, ...]], rids: bool
) -> list[LayerSignal]:
    """One LayerSignal per ``(slot, tokens[, request_id])`` entry, in order; up to 512 per
    record call. ``rids``: entries may carry a request id (else they are pairs).

    The objects are allocated by one ``map`` and each ``__dict__`` is a copy of one prototype
    with two or three fields stored: about 30 % less than filling a fresh ``__dict__``."""
    if not _FAST_SIGNALS:
        return [LayerSignal(instance, rank, e[0], layer, e[1], e[2] if len(e) > 2 else None, at) for e in batch]
    if len(batch) == 1:  # the most common batch: no prototype to build and copy
        entry = batch[0]
        state = _prototype(instance, rank, entry[0], layer, at)
        state["tokens"] = entry[1]
        if rids and len(entry) > 2:
            state["request_id"] = entry[2]
        return [_signal(state)]
    copy = _prototype(instance, rank, 0, layer, at).copy
    signals: list[LayerSignal] = list(map(_new, repeat(LayerSignal, len(batch))))
    set_dict = _set_signal_dict
    if rids:
        for signal, entry in zip(signals, batch, strict=True):
            state = copy()
            state["slot"] = entry[0]
            state["tokens"] = entry[1]
            if len(entry) > 2:
                state["request_id"] = entry[2]
            set_dict(signal, state)
    else:
        for signal, (slot, count) in zip(signals, batch, strict=True):
            state = copy()
            state["slot"] = slot
            state["tokens"] = count
            set_dict(signal, state)
    return signals


def by_flag(signals: list[LayerSignal], flags: str) -> tuple[list[LayerSignal], list[LayerSignal]]:
    """(delivered, buffered): "D" flags the delivered ones, any other flag a buffered one. A
    batch is often all one or the other, which two C-speed scans detect."""
    if len(flags) != len(signals):
        raise ValueError(f"record reply has {len(flags)} flags for {len(signals)} entries")
    delivered = flags.count("D")
    if delivered == len(flags):
        return signals, []
    if delivered == 0:
        return [], signals
    return (
        [signal for signal, flag in zip(signals, flags, strict=True) if flag == "D"],
        [signal for signal, flag in zip(signals, flags, strict=True) if flag != "D"],
    )


def split_signals(
    instance: str, rank: int, layer: int, at: int, batch: Sequence[tuple[Any, ...]], flags: str
) -> tuple[list[LayerSignal], list[LayerSignal]]:
    """The batch's signals split by the script's flags (D delivered, B buffered), in order."""
    return by_flag(batch_signals(instance, rank, layer, at, batch, rids=True), flags)


def record_result(delivered: list[LayerSignal], buffered: list[LayerSignal]) -> RecordResult:
    """A RecordResult, built like the signals when ``_FAST_RESULTS``."""
    if not _FAST_RESULTS:
        return RecordResult(delivered, buffered)
    result: RecordResult = _new(RecordResult)
    _setattr(result, "__dict__", {"delivered": delivered, "buffered": buffered})
    return result


def register_result(
    task: CacheTask,
    recovered: list[LayerSignal],
    dropped: list[tuple[LayerSignal, DropReason]],
    repeated: bool,
    replaced: bool,
) -> RegisterResult:
    """A RegisterResult, built like the signals when ``_FAST_RESULTS``."""
    if not _FAST_RESULTS:
        return RegisterResult(task, recovered, dropped, repeated=repeated, replaced=replaced)
    result: RegisterResult = _new(RegisterResult)
    state = {"task": task, "recovered": recovered, "dropped": dropped, "repeated": repeated, "replaced": replaced}
    _setattr(result, "__dict__", state)
    return result


def finish_result(removed: bool, dropped: int, fenced: bool) -> FinishResult:
    """A FinishResult, built like the signals when ``_FAST_RESULTS``."""
    if not _FAST_RESULTS:
        return FinishResult(removed=removed, dropped=dropped, fenced=fenced)
    result: FinishResult = _new(FinishResult)
    _setattr(result, "__dict__", {"removed": removed, "dropped": dropped, "fenced": fenced})
    return result


_REASONS = {reason.value: reason for reason in DropReason}


def recovery(
    instance: str, rank: int, slot: int, payload: str
) -> tuple[list[LayerSignal], list[tuple[LayerSignal, DropReason]]]:
    """register's payload ("layer,tokens,request_id,recorded_at,reason;" per popped signal, in
    layer order) as recovered signals and dropped ones with their reasons."""
    recovered: list[LayerSignal] = []
    dropped: list[tuple[LayerSignal, DropReason]] = []
    if not payload:
        return recovered, dropped
    copy = _prototype(instance, rank, slot, 0, 0).copy
    for record in payload.split(";"):
        if not record:
            continue
        layer, tokens, rid, at, reason = record.split(",")
        state = copy()
        state["layer"] = int(layer)
        state["tokens"] = int(tokens)
        state["request_id"] = rid or None
        state["recorded_at_ms"] = int(at)
        signal = _signal(state)
        if reason:
            dropped.append((signal, _REASONS[reason]))
        else:
            recovered.append(signal)
    return recovered, dropped


def pending_records(
    instance: str, rank: int, slot: int, signals: Sequence[tuple[int, Any]]
) -> list[tuple[LayerSignal, int]]:
    """One slot's pending signals, given as (layer, stored value) pairs (layout in lua/_lib.lua:
    "<tokens>,<request id>,<recorded at ms>,<deadline ms>"), as (signal, expiry deadline in ms),
    ordered by layer. The deadline is per signal: each keeps the TTL it was recorded with."""
    records = []
    for layer, value in signals:
        tokens, rid, at, deadline = text(value).split(",")
        signal = LayerSignal(instance, rank, slot, layer, int(tokens), rid or None, int(at))
        records.append((signal, int(deadline)))
    return sorted(records, key=lambda item: item[0].layer)


def pending_layers(value: Any) -> list[int]:
    """The pending hash's "layers" field, ",0,1,5,": the layers buffered on the rank."""
    return [int(layer) for layer in text(value).split(",") if layer]


def slot_signal_fields(slot: int, layers: Sequence[int]) -> list[str]:
    """The pending hash's fields of one slot's signals, "<slot>:<layer>", one per layer."""
    return [f"{slot}:{layer}" for layer in layers]


def parse_pending(
    instance: str, rank: int, slot: int, layers: Sequence[int], values: Sequence[Any]
) -> list[LayerSignal]:
    """One slot's pending signals, ordered by layer, from an HMGET of its fields for ``layers``."""
    found = [(layer, value) for layer, value in zip(layers, values, strict=True) if value is not None]
    return [signal for signal, _deadline in pending_records(instance, rank, slot, found)]


def task_fields(slot: int) -> list[str]:
    """The live hash's fields of one slot's task: its lease entry and its document."""
    return [str(slot), f"{slot}:doc"]


def split_holder(holder: Any) -> tuple[str, int]:
    """A live entry, ``"<lease deadline ms, 16 digits>|<request id>"``, as (request id, deadline)."""
    value = text(holder)
    return value[17:], int(value[:16])


def decode_task(instance: str, rank: int, slot: int, holder: Any, document: Any, now_ms: int) -> CacheTask | None:
    """The live task of a slot from its live entry and document, or None when absent or lapsed."""
    if holder is None or document is None:
        return None
    request_id, deadline = split_holder(holder)
    if deadline <= now_ms:
        return None
    doc = json.loads(text(document))
    if doc["request_id"] != request_id:
        return None
    return CacheTask(
        instance=instance,
        rank=rank,
        slot=slot,
        request_id=request_id,
        need_prefill_tokens=int(doc["need_prefill_tokens"]),
        num_layers=int(doc["num_layers"]),
        decode_cached_tokens=int(doc["decode_cached_tokens"]),
        meta={str(k): str(v) for k, v in doc["meta"].items()},
    )
