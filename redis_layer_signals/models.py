"""Value types of the public API: signals, tasks, drop reasons and the results of each call."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class DropReason(str, Enum):
    """Why ``register`` refused an early signal instead of handing it to the sender."""

    OVER_NEED = "over_need"  # tokens > need_prefill_tokens (FastDeploy's rule)
    NON_POSITIVE = "non_positive"  # tokens <= 0: nothing was written yet
    LAYER_OUT_OF_RANGE = "layer_out_of_range"  # layer >= num_layers of the task
    REQUEST_MISMATCH = "request_mismatch"  # the signal names another request
    EXPIRED = "expired"  # older than the pending TTL it was recorded with


@dataclass(frozen=True)
class LayerSignal:
    """'On engine slot ``slot``, layer ``layer`` is written up to ``tokens`` tokens.'"""

    instance: str
    rank: int
    slot: int
    layer: int
    tokens: int
    request_id: str | None
    recorded_at_ms: int


@dataclass(frozen=True)
class CacheTask:
    """Which request holds a slot and how many tokens it needs; the other half of the handoff."""

    instance: str
    rank: int
    slot: int
    request_id: str
    need_prefill_tokens: int
    num_layers: int
    decode_cached_tokens: int = 0
    meta: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RecordResult:
    """What ``record`` did with each entry of the batch."""

    delivered: list[LayerSignal]
    buffered: list[LayerSignal]


@dataclass(frozen=True)
class RegisterResult:
    """The early signals a registration popped: to send now, or dropped with a reason.

    ``repeated`` is true when the same request already held the slot and this is its first
    recovery returned again; ``replaced`` when ``replace=True`` took the slot from another.
    """

    task: CacheTask
    recovered: list[LayerSignal]
    dropped: list[tuple[LayerSignal, DropReason]]
    repeated: bool = False
    replaced: bool = False


@dataclass(frozen=True)
class FinishResult:
    """``removed``: the task was this request's and is gone; ``dropped``: pending signals
    discarded; ``fenced``: another request holds the slot, so nothing changed."""

    removed: bool
    dropped: int
    fenced: bool
