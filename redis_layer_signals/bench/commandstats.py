"""Server time per script or function call from ``INFO commandstats``, by difference (never
CONFIG RESETSTAT, so a server given with ``--redis`` keeps its own statistics). Ours are
``FCALL`` calls, the floor's are ``EVALSHA`` calls; a measured action makes only one kind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

EVALSHA = "cmdstat_evalsha"
FCALL = "cmdstat_fcall"


def _calls(client: Any) -> tuple[int, int]:
    """Calls and microseconds of EVALSHA and FCALL together, so far."""
    info = client.info("commandstats")
    calls = usec = 0
    for name in (EVALSHA, FCALL):
        stats = info.get(name, {})
        calls += int(stats.get("calls", 0))
        usec += int(stats.get("usec", 0))
    return calls, usec


def server_time(client: Any, action: Callable[[], object]) -> float:
    """Run ``action``; return the server's microseconds per EVALSHA or FCALL it made."""
    calls_before, usec_before = _calls(client)
    action()
    calls_after, usec_after = _calls(client)
    calls = calls_after - calls_before
    if calls <= 0:
        raise RuntimeError("no EVALSHA or FCALL reached the server while measuring its time")
    return (usec_after - usec_before) / calls
