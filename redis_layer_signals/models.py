"""Value types of the public API: signals, tasks, drop reasons and the results of each call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

from . import validation

Check = TypeVar("Check", bound=Callable[..., None])


def only_checks(check: Check) -> Check:
    """Marks a ``__post_init__`` that checks the fields and sets nothing: the library may
    build an instance from values it checked already without calling it (see
    ``protocol.replies``: a record call builds one signal per entry)."""
    check.only_checks = True  # type: ignore[attr-defined]
    return check


class DropReason(str, Enum):
    """Why ``register`` refused an early signal instead of handing it to the sender."""

    OVER_NEED = "over_need"  # tokens > need_prefill_tokens (FastDeploy's rule)
    NON_POSITIVE = "non_positive"  # tokens <= 0: nothing was written yet
    LAYER_OUT_OF_RANGE = "layer_out_of_range"  # layer >= num_layers of the task
    REQUEST_MISMATCH = "request_mismatch"  # the signal names another request
    EXPIRED = "expired"  # older than the pending TTL it was recorded with


@dataclass(frozen=True)
class LayerSignal:
    """'On engine slot ``slot``, layer ``layer`` is written up to ``tokens`` tokens.'

    Checked when built (``InvalidSignal`` naming the field and value): identifiers match
    ``[A-Za-z0-9._-]{1,128}``, ``rank`` is in ``[0, 65535]``, ``slot`` below 65535 (the
    largest ``max_slots``), ``layer``, ``tokens`` and ``recorded_at_ms`` in ``[0, 2**53)``.
    A signal of 0 tokens is valid: FastDeploy's in-process fix keeps it too, and ``register``
    drops it as ``non_positive`` (counted), so it is accounted for like any other."""

    instance: str
    rank: int
    slot: int
    layer: int
    tokens: int
    request_id: str | None
    recorded_at_ms: int

    @only_checks
    def __post_init__(self) -> None:
        validation.signal_fields(self)


@dataclass(frozen=True)
class CacheTask:
    """Which request holds a slot and how many tokens it needs; the other half of the handoff.

    Checked when built (``InvalidTask`` naming the field and value), so a malformed task
    fails where it is made, not at ``register``: identifiers match ``[A-Za-z0-9._-]{1,128}``,
    ``rank`` is in ``[0, 65535]``, ``slot`` below 65535 (the largest ``max_slots``),
    ``need_prefill_tokens`` and ``decode_cached_tokens`` in ``[0, 2**53)``, ``num_layers``
    at least 1, ``meta`` maps str to str. ``register`` then checks what depends on the
    buffer: ``slot`` below its ``max_slots``, ``num_layers`` at most its ``max_layers``."""

    instance: str
    rank: int
    slot: int
    request_id: str
    need_prefill_tokens: int
    num_layers: int
    decode_cached_tokens: int = 0
    meta: dict[str, str] = field(default_factory=dict)

    @only_checks
    def __post_init__(self) -> None:
        validation.task_fields(self)


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
