"""The three places an early signal can wait, behind one interface so the same simulated
deployment runs on each: the Redis buffer, the pre-fix drop and FastDeploy's local dict."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from ..buffer.sync import SignalBuffer
from ..constants import KEY_PREFIX
from ..models import CacheTask, DropReason, FinishResult, LayerSignal, RecordResult, RegisterResult
from ..ops.admin import signal_fields, slot_fields
from ..protocol.replies import text
from ..server.nodes import is_cluster
from .channels import FAILOVER_ERRORS, PAUSE_S, RESEND_S
from .config import Mode, SimConfig

T = TypeVar("T")

Slot = tuple[str, int, int]

NO_TASK = "no_task"
"""Drop reason of the pre-fix behaviour: the slot had no task when the signal came."""


class Handoff(Protocol):
    """record / register / finish as the simulation uses them, plus what the checks read."""

    def record(self, instance: str, rank: int, layer: int, entries: Sequence[tuple[int, int]]) -> RecordResult: ...

    def register(self, task: CacheTask) -> RegisterResult: ...

    def finish(self, instance: str, rank: int, slot: int, request_id: str) -> FinishResult: ...

    def learn(self, task: CacheTask) -> None:
        """This process heard, from another one, that ``task`` registered."""

    def counters(self, instance: str, rank: int) -> dict[str, int]:
        """Counters only the store knows (superseded, expired, silent drops) for one rank."""

    def leftovers(self, instance: str, rank: int) -> tuple[list[int], int]:
        """(slots still holding a task, signals still pending) on one rank."""

    def stray_keys(self, instance: str, rank: int) -> list[str]:
        """Keys of one rank the store still holds at the end, but its counters (and retry
        tokens on their TTL): none where the store is this process's dicts."""

    def close(self) -> None: ...


def through_failover(call: Callable[..., T], *args: Any) -> T:
    """A check's read (not the library's calls, which resend on their own), tried again while a
    failover is under way: a Cluster answers CLUSTERDOWN until a replica took the stopped
    primary's slots."""
    deadline = time.monotonic() + RESEND_S
    while True:
        try:
            return call(*args)
        except FAILOVER_ERRORS:
            if time.monotonic() >= deadline:
                raise
            time.sleep(PAUSE_S)


class RedisHandoff:
    def __init__(self, config: SimConfig) -> None:
        self.buffer = SignalBuffer.from_url(config.url, namespace=config.namespace)

    def record(self, instance: str, rank: int, layer: int, entries: Sequence[tuple[int, int]]) -> RecordResult:
        return self.buffer.record(instance, rank, layer, entries)

    def register(self, task: CacheTask) -> RegisterResult:
        return self.buffer.register(task)

    def finish(self, instance: str, rank: int, slot: int, request_id: str) -> FinishResult:
        return self.buffer.finish(instance, rank, slot, request_id)

    def learn(self, task: CacheTask) -> None:
        """Redis already knows: the registration was written there."""

    def counters(self, instance: str, rank: int) -> dict[str, int]:
        raw = through_failover(self.buffer.client.hgetall, self.buffer.protocol.keys.rank(instance, rank).stats)
        return {text(k): int(v) for k, v in raw.items()}

    def leftovers(self, instance: str, rank: int) -> tuple[list[int], int]:
        keys = self.buffer.protocol.keys.rank(instance, rank)
        client = self.buffer.client
        live = sorted(slot for slot, _holder in slot_fields(through_failover(client.hgetall, keys.live)))
        pending = len(signal_fields(through_failover(client.hgetall, keys.pending)))
        return live, pending

    def stray_keys(self, instance: str, rank: int) -> list[str]:
        return through_failover(self._stray_keys, instance, rank)

    def _stray_keys(self, instance: str, rank: int) -> list[str]:
        client = self.buffer.client
        tag = self.buffer.protocol.keys.rank(instance, rank).tag
        pattern = f"{KEY_PREFIX}:{tag}:*"
        # Every key of a rank shares its hash tag: on a Cluster one node holds them all, and only it
        # is scanned (a primary stopped mid-run, even one that never held this rank, would fail
        # a scan of every node).
        where = {"target_nodes": client.get_node_from_key(pattern)} if is_cluster(client) else {}
        stray = []
        for raw in client.scan_iter(match=pattern, count=1000, **where):
            key = text(raw)
            # Marks that expire on their own: replies, a writer's last batch, the finishes.
            # PTTL -1: no TTL, left for good; -2: the key expired since SCAN listed it.
            marks = ":reply:" in key or ":writer:" in key or key.endswith(":ended")
            if key.endswith(":stats") or (marks and int(client.pttl(key)) != -1):
                continue
            stray.append(key)
        return stray

    def close(self) -> None:
        self.buffer.close()


class DropHandoff:
    """Before the fix: a signal whose slot has no task is dropped, so its request hangs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: dict[Slot, str] = {}
        self.dropped: dict[tuple[str, int], int] = {}

    def record(self, instance: str, rank: int, layer: int, entries: Sequence[tuple[int, int]]) -> RecordResult:
        now = _now_ms()
        delivered = []
        with self.lock:
            for slot, tokens in entries:
                if (instance, rank, slot) in self.live:
                    delivered.append(LayerSignal(instance, rank, slot, layer, tokens, None, now))
                else:
                    self.dropped[(instance, rank)] = self.dropped.get((instance, rank), 0) + 1
        return RecordResult(delivered=delivered, buffered=[])

    def register(self, task: CacheTask) -> RegisterResult:
        self.learn(task)
        return RegisterResult(task, [], [])

    def finish(self, instance: str, rank: int, slot: int, request_id: str) -> FinishResult:
        with self.lock:
            holder = self.live.get((instance, rank, slot))
            if holder not in (None, request_id):
                return FinishResult(removed=False, dropped=0, fenced=True)
            removed = self.live.pop((instance, rank, slot), None) is not None
        return FinishResult(removed=removed, dropped=0, fenced=False)

    def learn(self, task: CacheTask) -> None:
        with self.lock:
            self.live[(task.instance, task.rank, task.slot)] = task.request_id

    def counters(self, instance: str, rank: int) -> dict[str, int]:
        with self.lock:
            return {f"dropped_{NO_TASK}": self.dropped.get((instance, rank), 0)}

    def leftovers(self, instance: str, rank: int) -> tuple[list[int], int]:
        with self.lock:
            return sorted(s for (i, r, s) in self.live if (i, r) == (instance, rank)), 0

    def stray_keys(self, instance: str, rank: int) -> list[str]:
        return []

    def close(self) -> None:
        pass


class LocalHandoff(DropHandoff):
    """FastDeploy's fix, kept to every layer: early signals wait in a dict of this process
    (newest per slot and layer wins) and are popped when the task registers here."""

    def __init__(self) -> None:
        super().__init__()
        self.early: dict[Slot, dict[int, LayerSignal]] = {}
        self.superseded: dict[tuple[str, int], int] = {}

    def record(self, instance: str, rank: int, layer: int, entries: Sequence[tuple[int, int]]) -> RecordResult:
        now = _now_ms()
        delivered, buffered = [], []
        with self.lock:
            for slot, tokens in entries:
                signal = LayerSignal(instance, rank, slot, layer, tokens, None, now)
                if (instance, rank, slot) in self.live:
                    delivered.append(signal)
                    continue
                layers = self.early.setdefault((instance, rank, slot), {})
                if layer in layers:
                    self.superseded[(instance, rank)] = self.superseded.get((instance, rank), 0) + 1
                layers[layer] = signal
                buffered.append(signal)
        return RecordResult(delivered=delivered, buffered=buffered)

    def register(self, task: CacheTask) -> RegisterResult:
        recovered: list[LayerSignal] = []
        dropped: list[tuple[LayerSignal, DropReason]] = []
        with self.lock:
            self.live[(task.instance, task.rank, task.slot)] = task.request_id
            early = self.early.pop((task.instance, task.rank, task.slot), {})
        for layer in sorted(early):
            signal = early[layer]
            if signal.tokens > task.need_prefill_tokens:
                dropped.append((signal, DropReason.OVER_NEED))
            else:
                recovered.append(signal)
        return RegisterResult(task, recovered, dropped)

    def finish(self, instance: str, rank: int, slot: int, request_id: str) -> FinishResult:
        result = super().finish(instance, rank, slot, request_id)
        if result.fenced:
            return result
        with self.lock:
            dropped = len(self.early.pop((instance, rank, slot), {}))
        return FinishResult(removed=result.removed, dropped=dropped, fenced=False)

    def counters(self, instance: str, rank: int) -> dict[str, int]:
        with self.lock:
            return {"superseded": self.superseded.get((instance, rank), 0)}

    def leftovers(self, instance: str, rank: int) -> tuple[list[int], int]:
        live, _ = super().leftovers(instance, rank)
        with self.lock:
            pending = sum(len(v) for (i, r, _s), v in self.early.items() if (i, r) == (instance, rank))
        return live, pending


def make_handoff(config: SimConfig) -> Handoff:
    if config.mode is Mode.REDIS:
        return RedisHandoff(config)
    if config.mode is Mode.DROP:
        return DropHandoff()
    return LocalHandoff()


def _now_ms() -> int:
    return int(time.time() * 1000)
