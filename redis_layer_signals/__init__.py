"""redis-layer-signals: a distributed buffer for early layer signals in PD-disaggregated serving.

A prefill GPU reports "slot S is written up to T tokens" per layer; the cache task that says
where to send it may arrive later, on another path, even in another process. The buffer keeps
early signals in Redis until their task registers, atomically, so none is lost or sent twice.
"""

from .buffer.aio import AsyncSignalBuffer
from .buffer.sync import SignalBuffer
from .config import BufferConfig
from .errors import (
    BufferUnavailable,
    EvictingServer,
    IdentityTaken,
    InvalidConfig,
    InvalidSignal,
    InvalidTask,
    LibraryMismatch,
    NoPermissionError,
    OwedFinishesFull,
    OwnershipLost,
    ServerOutOfMemory,
    SignalBufferError,
    SlotOccupied,
)
from .models import CacheTask, DropReason, FinishResult, LayerSignal, RecordResult, RegisterResult

__all__ = [
    "AsyncSignalBuffer",
    "BufferConfig",
    "BufferUnavailable",
    "CacheTask",
    "DropReason",
    "EvictingServer",
    "FinishResult",
    "IdentityTaken",
    "OwnershipLost",
    "InvalidConfig",
    "InvalidSignal",
    "InvalidTask",
    "LayerSignal",
    "LibraryMismatch",
    "NoPermissionError",
    "OwedFinishesFull",
    "RecordResult",
    "RegisterResult",
    "ServerOutOfMemory",
    "SignalBuffer",
    "SignalBufferError",
    "SlotOccupied",
]

__version__ = "0.1.0"
