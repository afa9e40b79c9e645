"""What one prefill rank shares between its GPU (producer) thread and its sender thread."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..models import CacheTask
from .channels import Channel, LocalChannel, Message
from .config import SimConfig
from .modes import Handoff
from .workload import Request


@dataclass
class RankContext:
    config: SimConfig
    instance: str
    rank: int
    requests: list[Request]
    handoff: Handoff
    registrar: Channel
    progress: Callable[[int], None]
    deadline: float
    inbox: LocalChannel = field(default_factory=LocalChannel)
    free: queue.Queue[int] = field(default_factory=queue.Queue)
    registered: set[str] = field(default_factory=set)
    slots: dict[str, int] = field(default_factory=dict)  # request -> the slot the GPU gave it
    wakeup: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    record_ms: list[float] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    reply_to: str = ""  # the Redis list the registrar answers on (empty: in-process queues)

    def __post_init__(self) -> None:
        self.counts["requests"] = len(self.requests)
        for slot in range(self.config.batch):
            self.free.put(slot)

    @property
    def name(self) -> str:
        return f"{self.instance}/{self.rank}"

    def count(self, name: str, n: int = 1) -> None:
        if n:
            with self.lock:
                self.counts[name] = self.counts.get(name, 0) + n

    def violation(self, text: str) -> None:
        with self.lock:
            self.violations.append(f"{self.name}: {text}")

    def expired(self) -> bool:
        return time.monotonic() > self.deadline or self.stop.is_set()

    def task_message(self, request: Request, slot: int, delay_ms: float) -> Message:
        return {
            "kind": "task",
            "instance": self.instance,
            "rank": self.rank,
            "slot": slot,
            "request_id": request.request_id,
            "need": request.prompt_tokens,
            "layers": self.config.layers,
            "delay_ms": delay_ms,
            "reply_to": self.reply_to,
        }


def cache_task(message: Message) -> CacheTask:
    """The task a ``task`` message (``RankContext.task_message``) carries."""
    return CacheTask(
        instance=str(message["instance"]),
        rank=int(message["rank"]),
        slot=int(message["slot"]),
        request_id=str(message["request_id"]),
        need_prefill_tokens=int(message["need"]),
        num_layers=int(message["layers"]),
    )
