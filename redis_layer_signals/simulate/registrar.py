"""The registrar: receives cache tasks, waits each one's delay, registers it and tells the
rank's sender what the registration recovered. In a real deployment this is the scheduler's
path to the cache messager; here it may run in another thread, process or host."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import SlotOccupied
from .channels import Channel, Message
from .modes import Handoff
from .rank import cache_task

POLL_S = 0.05


@dataclass
class RegistrarReport:
    registered: int = 0
    register_ms: list[float] = field(default_factory=list)


def serve(
    handoff: Handoff,
    inbox: Channel,
    outbox: Callable[[Message], Channel],
    should_stop: Callable[[], bool],
    idle_exit_s: float = 0.0,
) -> RegistrarReport:
    """Register tasks until a ``stop`` message, ``should_stop()``, or ``idle_exit_s`` of quiet."""
    report = RegistrarReport()
    due: list[tuple[float, int, Message]] = []
    order = itertools.count()
    last_activity = time.monotonic()
    while not should_stop():
        now = time.monotonic()
        wait = POLL_S if not due else max(0.0, min(POLL_S, due[0][0] - now))
        message = inbox.get(wait) if wait > 0 else None
        if message is not None:
            last_activity = time.monotonic()
            if message["kind"] == "stop":
                break
            heapq.heappush(due, (time.monotonic() + float(message["delay_ms"]) / 1000, next(order), message))
        while due and due[0][0] <= time.monotonic():
            _due, _n, task_message = heapq.heappop(due)
            register(handoff, task_message, outbox, report)
            last_activity = time.monotonic()
        if idle_exit_s and not due and time.monotonic() - last_activity > idle_exit_s:
            break
    return report


def register(handoff: Handoff, message: Message, outbox: Callable[[Message], Channel], report: RegistrarReport) -> None:
    task = cache_task(message)
    notice: Message = {"kind": "registered", "task": message, "recovered": [], "dropped": [], "error": None}
    started = time.perf_counter()
    try:
        result = handoff.register(task)
    except SlotOccupied as exc:
        notice["error"] = str(exc)
    else:
        report.register_ms.append((time.perf_counter() - started) * 1000)
        report.registered += 1
        notice["recovered"] = [[s.layer, s.tokens] for s in result.recovered]
        notice["dropped"] = [[s.layer, s.tokens, reason.value] for s, reason in result.dropped]
    outbox(message).put(notice)
