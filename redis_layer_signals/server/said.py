"""Each warning about a server said once: per process, and per command when a command runs
processes of its own.

A warning's text names its server, the setting and its value, so the same text twice is the
same news: ``warn_once`` logs a text the first time this process meets it. A command that
starts processes (``rls simulate``'s ranks and registrar, ``rls bench``'s contenders) calls
``share_with_children`` first; from then on what this process said is also kept in the
environment its children inherit (``RLS_SAID_WARNINGS``), and a child does not say it again.
A child that meets news of its own (another server) still says it.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger("redis_layer_signals")

SAID_VARIABLE = "RLS_SAID_WARNINGS"
"""The warnings a parent process has said, one per line, for its children to leave unsaid."""


def _parse(value: str) -> frozenset[str]:
    return frozenset(line for line in value.split("\n") if line)


SAID_BY_PARENT = _parse(os.environ.get(SAID_VARIABLE, ""))
"""What the process that started this one had said when it did (read once, at import: the
variable this process sets for its own children is no news to itself)."""
_said: set[str] = set()
_lock = threading.Lock()
_sharing = threading.Event()


def share_with_children() -> None:
    """From now on, keep what this process says where the processes it starts will read it."""
    _sharing.set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning unless this process, or the command's parent process, said it."""
    message = " ".join(message.split())
    with _lock:
        if message in _said or message in SAID_BY_PARENT:
            return
        _said.add(message)
        if _sharing.is_set():
            os.environ[SAID_VARIABLE] = "\n".join(sorted(_said | SAID_BY_PARENT))
    logger.warning("%s", message)
