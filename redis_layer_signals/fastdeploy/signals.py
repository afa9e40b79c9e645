"""Decoding FastDeploy's ``kv_signal_data`` buffer into a ``KvSignal``.

The GPU side reports, once per layer per forward step, which engine slots have that layer
written and up to how many tokens. FastDeploy reads that message into an ``int32`` tensor of
``512 * 3 + 2`` values: ``[tasks_count, layer_id, (engine_idx, chunk_token_offset,
current_seq_len) * tasks_count]``, with ``tasks_count == -1`` meaning "no message". Decoding is
strict because a garbled message would otherwise send the wrong blocks to a decode node.

paddle is never imported here: a paddle tensor is recognised only if paddle is already loaded,
so this module works with numpy alone.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidSignal
from ..extras import install_hint

FASTDEPLOY_EXTRA_HINT = install_hint("fastdeploy")
"""How to get numpy, which FastDeploy's tensors need and the base install leaves out."""

try:
    import numpy as np
except ModuleNotFoundError as error:  # the base install has no numpy: only this bridge needs it
    raise ModuleNotFoundError(
        f"redis_layer_signals.fastdeploy needs numpy, which the base install leaves out: {FASTDEPLOY_EXTRA_HINT}",
        name="numpy",
    ) from error

KV_SIGNAL_MAX_TASKS = 512
"""Entries one message can carry: FastDeploy's bound on engine slots per step."""
KV_SIGNAL_HEADER = 2
"""``tasks_count`` and ``layer_id`` precede the entries."""
KV_SIGNAL_ENTRY_WIDTH = 3
"""Each entry is ``(engine_idx, chunk_token_offset, current_seq_len)``."""
KV_SIGNAL_LENGTH = KV_SIGNAL_MAX_TASKS * KV_SIGNAL_ENTRY_WIDTH + KV_SIGNAL_HEADER
"""Length of the buffer FastDeploy allocates (1538)."""
NO_SIGNAL = -1
"""``tasks_count`` of an empty read: the queue had no message."""
SIGNAL_LAYER = 0
"""Only layer-0 signals start a send; later layers just advance progress."""


@dataclass(frozen=True)
class KvSignal:
    """One decoded message: layer ``layer`` is written for each ``(slot, prefilled_tokens)``."""

    layer: int
    entries: tuple[tuple[int, int], ...]


def decode_kv_signal(kv_signal_data: Any, only_layer: int | None = None) -> KvSignal | None:
    """Turn a ``kv_signal_data`` tensor or array into a ``KvSignal``; None if it is empty.

    Returns a [`KvSignal`][redis_layer_signals.fastdeploy.KvSignal], or None when
    ``tasks_count`` is -1 (no message).

    ``prefilled_tokens`` is ``chunk_token_offset + current_seq_len``, summed in 64 bits so it
    cannot wrap. Anything malformed raises ``InvalidSignal`` naming the field. With
    ``only_layer``, a message of another layer is None once its header is checked: a caller
    that wants one layer of the ~61 the engine reports skips decoding the rest's entries.
    """
    values = _as_int32_vector(kv_signal_data)
    if values.shape[0] < KV_SIGNAL_HEADER:
        raise InvalidSignal("length", int(values.shape[0]), f"must hold at least {KV_SIGNAL_HEADER} values")
    count = int(values[0])
    if count == NO_SIGNAL:
        return None
    if count < 0 or count > KV_SIGNAL_MAX_TASKS:
        raise InvalidSignal("tasks_count", count, f"must be -1 or in [0, {KV_SIGNAL_MAX_TASKS}]")
    needed = KV_SIGNAL_HEADER + KV_SIGNAL_ENTRY_WIDTH * count
    if values.shape[0] < needed:
        raise InvalidSignal("length", int(values.shape[0]), f"tasks_count={count} needs at least {needed} values")
    layer = int(values[1])
    if layer < 0:
        raise InvalidSignal("layer_id", layer, "must be >= 0")
    if only_layer is not None and layer != only_layer:
        return None
    # Checked and summed as whole columns (int64, so the sum cannot wrap): a full message of
    # 512 entries decodes in tens of microseconds, and this runs for every layer.
    rows = values[KV_SIGNAL_HEADER:needed].reshape(count, KV_SIGNAL_ENTRY_WIDTH).astype(np.int64)
    slots, offsets, lengths = rows[:, 0], rows[:, 1], rows[:, 2]
    if rows.min(initial=0) < 0 or slots.max(initial=0) >= KV_SIGNAL_MAX_TASKS:
        bad_slots = (slots < 0) | (slots >= KV_SIGNAL_MAX_TASKS)
        _check_column(slots, bad_slots, "engine_idx", f"in [0, {KV_SIGNAL_MAX_TASKS})")
        _check_column(offsets, offsets < 0, "chunk_token_offset", ">= 0")
        _check_column(lengths, lengths < 0, "current_seq_len", ">= 0")
    return KvSignal(layer, tuple(zip(slots.tolist(), (offsets + lengths).tolist(), strict=True)))


def encode_kv_signal(layer: int, entries: Sequence[tuple[int, int, int]]) -> np.ndarray[Any, np.dtype[np.int32]]:
    """The inverse of ``decode_kv_signal``: a ``kv_signal_data`` array for ``layer`` with
    ``(engine_idx, chunk_token_offset, current_seq_len)`` entries, the unused tail left at -1,
    as the engine's signal op fills it. For stand-ins and tests; nothing is checked."""
    values = np.full(KV_SIGNAL_LENGTH, NO_SIGNAL, dtype=np.int32)
    values[0] = len(entries)
    values[1] = layer
    end = KV_SIGNAL_HEADER + KV_SIGNAL_ENTRY_WIDTH * len(entries)
    values[KV_SIGNAL_HEADER:end] = np.asarray(entries, dtype=np.int32).reshape(-1)
    return values


def _check_column(column: np.ndarray[Any, Any], bad: np.ndarray[Any, Any], name: str, rule: str) -> None:
    """Raise for the first entry whose value breaks ``rule``."""
    if bad.any():
        index = int(np.argmax(bad))
        raise InvalidSignal(f"entries[{index}].{name}", int(column[index]), f"must be {rule}")


def _as_int32_vector(data: Any) -> np.ndarray[Any, np.dtype[np.int32]]:
    """A 1-D int32 numpy view of a paddle tensor or array-like; no silent casts."""
    if _is_paddle_tensor(data):
        data = data.numpy()
    if isinstance(data, (str, bytes)) or not hasattr(data, "__len__"):
        raise InvalidSignal("kv_signal_data", type(data).__name__, "must be a paddle tensor or an int32 array")
    array: np.ndarray[Any, Any] = np.asarray(data)
    if array.dtype != np.int32:
        raise InvalidSignal("dtype", str(array.dtype), "must be int32")
    if array.ndim != 1:
        raise InvalidSignal("shape", tuple(array.shape), "must be one-dimensional")
    return array


def _is_paddle_tensor(data: Any) -> bool:
    paddle = sys.modules.get("paddle")
    return paddle is not None and isinstance(data, paddle.Tensor)
