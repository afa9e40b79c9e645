"""Server time per script call from ``INFO commandstats``, by difference (never CONFIG RESETSTAT,
so a server given with ``--redis`` keeps its own statistics)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

EVALSHA = "cmdstat_evalsha"


def _evalsha(client: Any) -> tuple[int, int]:
    stats = client.info("commandstats").get(EVALSHA, {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


def server_time(client: Any, action: Callable[[], object]) -> float:
    """Run ``action``; return the server's microseconds per EVALSHA it made."""
    calls_before, usec_before = _evalsha(client)
    action()
    calls_after, usec_after = _evalsha(client)
    calls = calls_after - calls_before
    if calls <= 0:
        raise RuntimeError("no EVALSHA reached the server while measuring its time")
    return (usec_after - usec_before) / calls
