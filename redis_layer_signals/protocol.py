"""What each operation sends and how its reply is read, shared by the sync and async buffers.

Only the transport differs between :class:`SignalBuffer` and :class:`AsyncSignalBuffer`: both
validate, build a :class:`Prepared` call here, run it, and hand the reply back to ``parse``.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from itertools import repeat
from typing import Any, Generic, TypeVar

from . import validation
from .config import BufferConfig
from .constants import (
    MAX_BATCH,
    MAX_INT,
    PENDING_KEY_GRACE_S,
    REPLY_GRACE_S,
    SWEEP_LIMIT,
    TASK_KEY_GRACE_S,
)
from .errors import InvalidSignal, InvalidTask, SlotOccupied
from .keys import KeySpace, RankKeys
from .models import (
    CacheTask,
    DropReason,
    FinishResult,
    LayerSignal,
    RecordResult,
    RegisterResult,
)

T = TypeVar("T")
Clock = Callable[[], int]
"""Milliseconds since the epoch; when given, scripts use it instead of the server's TIME."""


class ScriptCall:
    """One script run: the script's name, its KEYS and its ARGV. A plain slotted class: one is
    built per call, and a frozen dataclass takes three times as long to build."""

    __slots__ = ("args", "keys", "script")

    def __init__(self, script: str, keys: list[str], args: list[str]) -> None:
        self.script = script
        self.keys = keys
        self.args = args

    def __repr__(self) -> str:
        return f"ScriptCall({self.script!r}, {self.keys!r}, {self.args!r})"


class Prepared(Generic[T]):
    """A validated call, ready to run; ``parse`` turns its reply into a result.

    Each operation subclasses this with the fields its parse needs, so a call builds one small
    object instead of a closure and a dataclass. ``call`` is None when there is nothing to send
    (an empty batch), and ``parse(None)`` then gives the empty result.
    """

    __slots__ = ("call", "operation")

    def __init__(self, operation: str, call: ScriptCall | None) -> None:
        self.operation = operation
        self.call = call

    def parse(self, reply: Any) -> T:
        raise NotImplementedError


# Idempotency tokens come from a private generator seeded from os.urandom: as cheap as
# random.getrandbits (secrets.token_hex reads the OS's random source on every call), immune to an
# application's random.seed() (two processes seeded alike would otherwise send the same tokens
# to one rank's reply keys), and reseeded in a forked child, as the random module does for its
# own generator, so a parent and its child never share a sequence. Not a counter with a
# per-process prefix: a fork would duplicate it.
_tokens = random.Random()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_tokens.seed)
_token_bits = _tokens.getrandbits


def new_token() -> str:
    """A fresh idempotency token: 64 random bits as 16 hex digits, one per call (a resend
    reuses its call's, since it resends the same :class:`ScriptCall`)."""
    return f"{_token_bits(64):016x}"


def text(value: Any) -> str:
    """A reply as text, whether the client decodes responses or not (None: empty)."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def _split(reply: Any) -> tuple[str, int, str]:
    status, now, payload = (reply.decode() if type(reply) is bytes else text(reply)).split("|", 2)
    return status, int(now), payload


def _ms(seconds: float) -> str:
    return str(max(1, round(seconds * 1000)))


def _fills_dict(cls: type, names: tuple[str, ...]) -> bool:
    """Whether instances of the frozen dataclass ``cls`` may be built by setting ``__dict__``:
    only while it has exactly these fields, no slots and no ``__post_init__`` (checked once, at
    import). The result equals the one ``__init__`` builds (equal, hashable, immutable)."""
    return (
        tuple(f.name for f in fields(cls)) == names
        and "__slots__" not in vars(cls)
        and not hasattr(cls, "__post_init__")
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
    time, which sets each field through ``object.__setattr__``) when :data:`_FAST_SIGNALS`."""
    if not _FAST_SIGNALS:
        return LayerSignal(**state)
    signal: LayerSignal = _new(LayerSignal)
    _setattr(signal, "__dict__", state)
    return signal


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


def _batch_signals(
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


def _by_flag(signals: list[LayerSignal], flags: str) -> tuple[list[LayerSignal], list[LayerSignal]]:
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
    return _by_flag(_batch_signals(instance, rank, layer, at, batch, rids=True), flags)


def _record_result(delivered: list[LayerSignal], buffered: list[LayerSignal]) -> RecordResult:
    if not _FAST_RESULTS:
        return RecordResult(delivered, buffered)
    result: RecordResult = _new(RecordResult)
    _setattr(result, "__dict__", {"delivered": delivered, "buffered": buffered})
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


def plain_batch(raw: Any, max_slots: int) -> list[tuple[int, int]] | None:
    """``raw`` itself when it is the common batch, a list of ``(slot, tokens)`` tuples of plain
    ints in range; else None, and :func:`validation.entries` checks it (and names what is wrong).

    The full check builds a field name per entry for its error messages; on a 512-entry batch
    that costs more than the round trip. This accepts a subset of what the full check accepts.
    (Column checks at C speed, ``set(map(type, ...))``, ``min``/``max`` of slices, measured
    slower here than this loop: 80 against 50 us for 512 entries, 1.3 against 0.2 for one.)
    """
    if type(raw) is not list or len(raw) > MAX_BATCH:
        return None
    for item in raw:
        if type(item) is not tuple or len(item) != 2:
            return None
        slot, tokens = item
        if type(slot) is not int or type(tokens) is not int:
            return None
        if not (0 <= slot < max_slots and 0 <= tokens < MAX_INT):
            return None
    return raw


def pack_entries(batch: Sequence[tuple[Any, ...]]) -> str:
    """The wire form of a batch, "slot,tokens,request_id;" per entry (lua/record.lua parses
    it). An f-string join measured as fast as ``("%d,%d,;" * n) % flat`` once flattening is
    counted."""
    if batch and len(batch[0]) == 2:  # a plain batch: pairs only
        return "".join([f"{slot},{tokens},;" for slot, tokens in batch])
    return "".join([f"{slot},{tokens},{rid or ''};" for slot, tokens, rid in batch])


def pending_records(instance: str, rank: int, slot: int, packed: str) -> list[tuple[LayerSignal, int]]:
    """Decode one slot's packed pending records (layout in lua/_lib.lua) as (signal, expiry
    deadline in ms), ordered by layer. The deadline is per signal: each keeps the TTL it was
    recorded with."""
    records = []
    for record in packed.split(";")[1:]:
        layer, tokens, rid, at, deadline = record.split(",")
        signal = LayerSignal(instance, rank, slot, int(layer), int(tokens), rid or None, int(at))
        records.append((signal, int(deadline)))
    return sorted(records, key=lambda item: item[0].layer)


def parse_pending(instance: str, rank: int, slot: int, packed: str) -> list[LayerSignal]:
    """One slot's pending signals, ordered by layer."""
    return [signal for signal, _deadline in pending_records(instance, rank, slot, packed)]


class _Record(Prepared[RecordResult]):
    __slots__ = ("batch", "instance", "layer", "rank", "rids")

    def __init__(
        self,
        call: ScriptCall | None,
        instance: str,
        rank: int,
        layer: int,
        batch: Sequence[tuple[Any, ...]],
        rids: bool,
    ) -> None:
        self.operation = "record"
        self.call = call
        self.instance = instance
        self.rank = rank
        self.layer = layer
        self.batch = batch
        self.rids = rids  # entries are (slot, tokens, request_id) triples; False: plain pairs

    def parse(self, reply: Any) -> RecordResult:
        if self.call is None:
            return _record_result([], [])
        _status, now, flags = _split(reply)
        signals = _batch_signals(self.instance, self.rank, self.layer, now, self.batch, self.rids)
        delivered, buffered = _by_flag(signals, flags)
        return _record_result(delivered, buffered)


class _Register(Prepared[RegisterResult]):
    __slots__ = ("task",)

    def __init__(self, call: ScriptCall, task: CacheTask) -> None:
        self.operation = "register"
        self.call = call
        self.task = task

    def parse(self, reply: Any) -> RegisterResult:
        status, _now, payload = _split(reply)
        task = self.task
        if status == "occupied":
            raise SlotOccupied(task.instance, task.rank, task.slot, payload, task.request_id)
        recovered, dropped = recovery(task.instance, task.rank, task.slot, payload)
        repeated, replaced = status == "again", status == "replaced"
        if not _FAST_RESULTS:
            return RegisterResult(task, recovered, dropped, repeated=repeated, replaced=replaced)
        result: RegisterResult = _new(RegisterResult)
        state = {"task": task, "recovered": recovered, "dropped": dropped, "repeated": repeated, "replaced": replaced}
        _setattr(result, "__dict__", state)
        return result


class _Finish(Prepared[FinishResult]):
    __slots__ = ()

    def __init__(self, call: ScriptCall) -> None:
        self.operation = "finish"
        self.call = call

    def parse(self, reply: Any) -> FinishResult:
        removed, dropped, fenced = _split(reply)[2].split(",")
        if not _FAST_RESULTS:
            return FinishResult(removed=removed == "1", dropped=int(dropped), fenced=fenced == "1")
        result: FinishResult = _new(FinishResult)
        _setattr(result, "__dict__", {"removed": removed == "1", "dropped": int(dropped), "fenced": fenced == "1"})
        return result


class Protocol:
    """Validation, key selection, argument packing and reply parsing for one buffer."""

    def __init__(self, config: BufferConfig, clock: Clock | None = None) -> None:
        self.config = config
        self.keys = KeySpace(config.namespace)
        self.clock = clock
        self._pending_ttl = _ms(config.pending_ttl_s)
        self._pending_key_ttl = _ms(config.pending_ttl_s + PENDING_KEY_GRACE_S)
        self._task_ttl = _ms(config.task_ttl_s)
        self._task_key_ttl = _ms(config.task_ttl_s + TASK_KEY_GRACE_S)
        self._reply_ttl = _ms(config.retry_s + REPLY_GRACE_S)
        self._sweep = str(SWEEP_LIMIT)
        self._valid: dict[tuple[str, int], RankKeys] = {}
        """(instance, rank) pairs that passed validation, keyed by exact str and int only."""

    def _now(self) -> str:
        return "" if self.clock is None else str(int(self.clock()))

    def rank_keys(self, instance: Any, rank: Any, error: type[InvalidSignal] | type[InvalidTask]) -> RankKeys:
        """The keys of a validated (instance, rank). A pair already validated is looked up, but
        only for an exact ``str`` and ``int``: True or 0.0 equal 0 as dict keys, yet are refused."""
        exact = type(instance) is str and type(rank) is int
        if exact:
            keys = self._valid.get((instance, rank))
            if keys is not None:
                return keys
        validation.identifier(instance, "instance", error)
        validation.rank(rank, error)
        keys = self.keys.rank(instance, rank)
        if exact:
            self._valid[(instance, rank)] = keys
        return keys

    # -- record ----------------------------------------------------------------------------

    def record(self, instance: Any, rank: Any, layer: Any, entries: Iterable[Any]) -> Prepared[RecordResult]:
        keys = self.rank_keys(instance, rank, InvalidSignal)
        if type(layer) is not int or not 0 <= layer < MAX_INT:
            validation.integer(layer, "layer", InvalidSignal, 0, MAX_INT)
        batch: Sequence[tuple[Any, ...]] | None = plain_batch(entries, self.config.max_slots)
        triples = batch is None  # else a plain batch of (slot, tokens) pairs
        with_rids = "0"
        if batch is None:
            batch = validation.entries(entries, self.config.max_slots)
            with_rids = "1" if any(rid for _slot, _tokens, rid in batch) else "0"
        if not batch:
            return _Record(None, instance, rank, layer, batch, triples)
        packed = pack_entries(batch)
        call = ScriptCall(
            "record",
            [keys.live, keys.pending, keys.expiry, keys.stats, keys.reply(new_token())],
            [
                "" if self.clock is None else str(int(self.clock())),
                str(layer),
                self._pending_ttl,
                self._pending_key_ttl,
                self._reply_ttl,
                self._sweep,
                packed,
                with_rids,
            ],
        )
        return _Record(call, instance, rank, layer, batch, triples)

    # -- register --------------------------------------------------------------------------

    def validate_task(self, task: Any) -> CacheTask:
        """``task`` once every field is checked. Plain ints in range skip the full check, which
        would only confirm them."""
        if not isinstance(task, CacheTask):
            raise InvalidTask("task", task, "must be a CacheTask")
        self.rank_keys(task.instance, task.rank, InvalidTask)
        slot, max_slots = task.slot, self.config.max_slots
        if type(slot) is not int or not 0 <= slot < max_slots:
            validation.slot(slot, max_slots, InvalidTask)
        validation.identifier(task.request_id, "request_id", InvalidTask)
        need, layers, cached = task.need_prefill_tokens, task.num_layers, task.decode_cached_tokens
        if type(need) is not int or not 0 <= need < MAX_INT:
            validation.integer(need, "need_prefill_tokens", InvalidTask, 0, MAX_INT)
        if type(layers) is not int or not 1 <= layers < MAX_INT:
            validation.integer(layers, "num_layers", InvalidTask, 1, MAX_INT)
        if type(cached) is not int or not 0 <= cached < MAX_INT:
            validation.integer(cached, "decode_cached_tokens", InvalidTask, 0, MAX_INT)
        if type(task.meta) is not dict or task.meta:  # an empty dict is valid meta
            validation.meta(task.meta)
        return task

    def register(self, task: Any, replace: bool = False) -> Prepared[RegisterResult]:
        task = self.validate_task(task)
        if not isinstance(replace, bool):
            raise InvalidTask("replace", replace, "must be a bool")
        keys = self.rank_keys(task.instance, task.rank, InvalidTask)
        call = ScriptCall(
            "register",
            [keys.live, keys.tasks, keys.pending, keys.expiry, keys.stats, keys.reply(new_token())],
            [
                "" if self.clock is None else str(int(self.clock())),
                str(task.slot),
                task.request_id,
                str(task.need_prefill_tokens),
                str(task.num_layers),
                encode_task(task),
                self._task_ttl,
                self._reply_ttl,
                "1" if replace else "0",
                self._sweep,
                self._task_key_ttl,
            ],
        )
        return _Register(call, task)

    # -- finish ----------------------------------------------------------------------------

    def finish(self, instance: Any, rank: Any, slot: Any, request_id: Any) -> Prepared[FinishResult]:
        keys = self.rank_keys(instance, rank, InvalidTask)
        max_slots = self.config.max_slots
        if type(slot) is not int or not 0 <= slot < max_slots:
            validation.slot(slot, max_slots, InvalidTask)
        validation.identifier(request_id, "request_id", InvalidTask)
        call = ScriptCall(
            "finish",
            [keys.live, keys.tasks, keys.pending, keys.expiry, keys.stats, keys.reply(new_token())],
            [
                "" if self.clock is None else str(int(self.clock())),
                str(slot),
                request_id,
                self._reply_ttl,
                self._sweep,
            ],
        )
        return _Finish(call)

    # -- sweep and reads -------------------------------------------------------------------

    def sweep(self, keys: RankKeys) -> ScriptCall:
        return ScriptCall("sweep", [keys.pending, keys.expiry, keys.stats], [self._now(), self._sweep])

    def slot_keys(self, instance: Any, rank: Any, slot: Any) -> RankKeys:
        keys = self.rank_keys(instance, rank, InvalidTask)
        validation.slot(slot, self.config.max_slots, InvalidTask)
        return keys


_TASK_ENCODER = json.JSONEncoder(separators=(",", ":"), sort_keys=True)
"""``json.dumps`` with these options builds a new encoder per call; one, built once, writes the
same text."""


def encode_task(task: CacheTask) -> str:
    return _TASK_ENCODER.encode(
        {
            "request_id": task.request_id,
            "need_prefill_tokens": task.need_prefill_tokens,
            "num_layers": task.num_layers,
            "decode_cached_tokens": task.decode_cached_tokens,
            "meta": task.meta,
        }
    )


def split_holder(holder: Any) -> tuple[str, int]:
    """A live entry, ``"<lease deadline ms, 16 digits>|<request id>"``, as (request id, deadline).
    The deadline comes first so that record.lua compares whole entries with a time stamp."""
    value = text(holder)
    if value[16:17] != "|" or not value[:16].isdigit():
        # the layout before the deadline came first: "<request id>|<deadline>"
        request_id, _, deadline = value.rpartition("|")
        return request_id, int(deadline)
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


def sum_stats(hashes: Sequence[dict[Any, Any]]) -> dict[str, int]:
    """Add up the per-rank counter hashes into one namespace view, every known counter present."""
    totals = dict.fromkeys(COUNTERS, 0)
    for counters in hashes:
        for name, value in counters.items():
            key = text(name)
            totals[key] = totals.get(key, 0) + int(value)
    # record.lua counts delivered and buffered only: one counter write fewer per call.
    totals["recorded"] = totals["delivered"] + totals["buffered"]
    return totals


COUNTERS = (
    "recorded",
    "delivered",
    "buffered",
    "superseded",
    "registered",
    "recovered",
    *(f"dropped_{reason.value}" for reason in DropReason),
    "finished",
    "finish_dropped",
    "fenced",
    "expired",
    "occupied",
    "replaced",
    "reregistered",
    "replayed",
)
"""Counters a namespace reports. ``buffered`` signals end as recovered, dropped_*,
finish_dropped, superseded or expired (or are still pending): invariant 1 in numbers."""
