"""How the bridge logs: through whichever logger FastDeploy hands it, one finished line per call.

FastDeploy passes the messager's own logger to the bridge, and FastDeploy's unit tests pass a
stand-in whose ``info`` takes one argument. So the bridge formats every message itself and
calls ``debug``, ``info``, ``warning`` or ``error`` with that one string: no ``%`` arguments,
no keywords (``exc_info``), and ``isEnabledFor`` asked only of a standard ``logging`` logger.
A logger that fails is never FastDeploy's problem: the line goes to this package's logger.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

_fallback = logging.getLogger("redis_layer_signals.fastdeploy")
"""Where a line goes when the given logger raised on it."""


class BridgeLog:
    """The bridge's voice: ``log.warning("slot %d ...", slot)`` formats, then calls
    ``logger.warning(text)`` with the text alone. ``trace`` (``error`` only) appends an
    exception's traceback to the text: kept for the bridge's own bugs; an outage is one line."""

    def __init__(self, logger: Any) -> None:
        self.logger = logger
        """The logger given (FastDeploy's, or this package's)."""
        self._standard = isinstance(logger, (logging.Logger, logging.LoggerAdapter))

    def debug(self, message: str, *args: Any) -> None:
        self._emit("debug", message, args)

    def info(self, message: str, *args: Any) -> None:
        self._emit("info", message, args)

    def warning(self, message: str, *args: Any) -> None:
        self._emit("warning", message, args)

    def error(self, message: str, *args: Any, trace: BaseException | None = None) -> None:
        self._emit("error", message, args, trace)

    def enabled(self, level: str) -> bool:
        """False only when a standard logger says it would drop ``level``: formatting a debug
        line on a hot path can be skipped then. Any other logger gets every line."""
        if not self._standard:
            return True
        try:
            return bool(self.logger.isEnabledFor(LEVELS[level]))
        except Exception:
            return True

    def _emit(self, level: str, message: str, args: tuple[Any, ...], trace: BaseException | None = None) -> None:
        if not self.enabled(level):
            return
        try:
            text = message % args if args else message
        except Exception:  # a message of ours that does not fit its arguments: say both
            text = f"{message} {args!r}"
        if trace is not None:
            text += "\n" + "".join(traceback.format_exception(type(trace), trace, trace.__traceback__)).rstrip()
        try:
            getattr(self.logger, level)(text)
        except Exception:
            try:
                _fallback.log(LEVELS[level], "%s", text)
            except Exception:  # nowhere left to say it; FastDeploy's loop goes on
                return


def one_line(exc: BaseException) -> str:
    """``Type: message`` of an error on one line: what an outage's log line says of its cause."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
