"""The buffers: ``SignalBuffer`` (``sync``) and ``AsyncSignalBuffer`` (``aio``) over what they
share (``base``), and the finishes owed to Redis (``owed``)."""

from .sync import SignalBuffer

__all__ = ["SignalBuffer"]
