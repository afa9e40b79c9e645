"""A reference cache messager: ``CacheMessagerV1``'s three threads around :class:`Layer0Bridge`.

- the **signal consumer** reads each layer signal, advances per-slot progress, and hands
  layer-0 messages to the bridge, queueing the batch the bridge says is ready;
- the **cache-task adder** merges the prefill and decode halves of each ``cache_info`` and
  registers the task through the bridge, queueing any early signal it recovers;
- the **layer-wise sender** turns each ready ``(slot, prefilled_tokens)`` into block ranges and
  writes them layer by layer as the GPU's progress allows, then finishes the task.

The sender reads the task (need, block ids) from the buffer, not from a local dict, so the
adder can run in another process (:func:`run_adder_process`) and share only Redis and the ready
queue with the rest. :class:`UnbufferedBridge` is the behaviour before the fix, for comparison.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..buffer import SignalBuffer
from .bridge import META_DEST_BLOCKS, META_SRC_BLOCKS, Batch, Layer0Bridge, block_ids, layer0_entries
from .scripted import RecordingTransport
from .signals import KvSignal, decode_kv_signal

logger = logging.getLogger(__name__)

POLL_S = 0.005
"""How long a thread blocks on its queue before it checks whether it should stop."""
ADDER_IDLE_EXIT_S = 120.0
"""A separate adder process exits after this long without a message (its parent is gone)."""
STOP = "stop"
"""Sentinel that ends :func:`run_adder_process`."""


class QueueLike(Protocol):
    """Either a ``queue.Queue`` or a ``multiprocessing`` queue."""

    def put(self, item: Any) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...


class UnbufferedBridge(Layer0Bridge):
    """The pre-fix behaviour: a layer-0 signal whose task is not registered yet is dropped.

    Kept only to show what the buffer fixes: the check and the act are separate, and nothing
    remembers the early signal, so its request is never sent.
    """

    def on_kv_signal(self, kv_signal_data: Any) -> Batch:
        ready = []
        for slot, tokens in layer0_entries(kv_signal_data):
            if self.buffer.task(self.instance, self.rank, slot) is None:
                logger.warning("no cache task for slot %d yet: layer-0 signal dropped", slot)
            else:
                ready.append((slot, tokens))
        return ready

    def on_cache_task(self, cache_info: Mapping[str, Any]) -> Batch:
        self.buffer.register(self.cache_task(cache_info))
        return []


class Progress:
    """Per slot, the newest ``(prefilled_tokens, layer)`` the GPU has signalled: what the
    sender may write. FastDeploy keeps the same in ``engine_cache_tasks``."""

    def __init__(self) -> None:
        self._done: dict[int, tuple[int, int]] = {}
        self._changed = threading.Condition()
        self.waiting_for: tuple[int, int, int] | None = None
        """``(slot, tokens, layer)`` the sender is blocked on, for observers; None when not."""

    def advance(self, signal: KvSignal) -> None:
        """The newest signal wins, as in FastDeploy: a stale signal left by an earlier request
        on the slot is overwritten by the next real one instead of vouching for it."""
        with self._changed:
            for slot, tokens in signal.entries:
                self._done[slot] = (tokens, signal.layer)
            self._changed.notify_all()

    def reset(self, slot: int) -> None:
        with self._changed:
            self._done.pop(slot, None)

    def wait(self, slot: int, tokens: int, layer: int, stop: threading.Event) -> bool:
        """Block until ``layer`` is computed up to ``tokens`` on ``slot``; False if stopping.

        A later chunk having started means every layer of the earlier one is done.
        """
        with self._changed:
            try:
                while not stop.is_set():
                    done_tokens, done_layer = self._done.get(slot, (0, -1))
                    if done_tokens > tokens or (done_tokens == tokens and done_layer >= layer):
                        return True
                    self.waiting_for = (slot, tokens, layer)
                    self._changed.wait(POLL_S)
            finally:
                self.waiting_for = None
        return False


class CacheTaskAdder:
    """Merges the two halves of each ``cache_info`` and registers the task once both are in."""

    def __init__(self, bridge: Layer0Bridge, ready: QueueLike) -> None:
        self.bridge = bridge
        self.ready = ready
        self._halves: dict[str, dict[str, Any]] = {}

    def add(self, half: Mapping[str, Any]) -> Batch | None:
        """Returns the recovered batch once the task registered, None while a half is missing."""
        request_id = str(half["request_id"])
        first = self._halves.pop(request_id, None)
        if first is None:
            self._halves[request_id] = dict(half)
            return None
        merged = {**first, **half}
        cached_blocks = len(merged[META_SRC_BLOCKS]) - len(merged[META_DEST_BLOCKS])
        merged[META_DEST_BLOCKS] = [-1] * cached_blocks + list(merged[META_DEST_BLOCKS])
        merged["decode_cached_tokens"] = cached_blocks * self.bridge.block_size
        batch = self.bridge.on_cache_task(merged)
        if batch:
            self.ready.put(batch)
        return batch


@dataclass
class _Sending:
    request_id: str
    sent_blocks: int


class ReferenceMessager:
    """The prefill side of a cache messager: consumer, adder (optional) and sender threads.

    Feed it ``signals`` (paddle tensors from :class:`ScriptedGpu`) and ``cache_infos`` (halves);
    read ``transport.writes`` and ``finished``. Pass ``ready`` (a multiprocessing queue) and
    ``with_adder=False`` when the adder runs in another process.
    """

    def __init__(
        self,
        bridge: Layer0Bridge,
        transport: RecordingTransport,
        *,
        ready: QueueLike | None = None,
        with_adder: bool = True,
    ) -> None:
        self.bridge = bridge
        self.transport = transport
        self.signals: queue.Queue[Any] = queue.Queue()
        self.cache_infos: queue.Queue[Mapping[str, Any]] = queue.Queue()
        self.ready: QueueLike = ready if ready is not None else queue.Queue()
        self.finished: queue.Queue[str] = queue.Queue()
        self.progress = Progress()
        self.errors: list[BaseException] = []
        self.stale: list[tuple[int, int]] = []
        self.adder = CacheTaskAdder(bridge, self.ready)
        self._sending: dict[int, _Sending] = {}
        self._stop = threading.Event()
        loops: list[tuple[QueueLike, Callable[[Any], object]]] = [
            (self.signals, self._consume_signal),
            (self.ready, self._send_batch),
        ]
        if with_adder:
            loops.append((self.cache_infos, self.adder.add))
        self._threads = [threading.Thread(target=self._serve, args=loop, daemon=True) for loop in loops]

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> ReferenceMessager:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)

    def __enter__(self) -> ReferenceMessager:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_drained(self, timeout: float) -> bool:
        """True once every signal and cache_info put so far has been handled (bounded)."""
        return _poll(lambda: self.signals.unfinished_tasks == 0 and self.cache_infos.unfinished_tasks == 0, timeout)

    def wait_finished(self, request_ids: Iterable[str], timeout: float) -> set[str]:
        """Collect finished requests until all of ``request_ids`` are in or ``timeout`` passes."""
        wanted, seen = set(request_ids), set[str]()
        deadline = time.monotonic() + timeout
        while not wanted <= seen:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                seen.add(self.finished.get(timeout=min(remaining, 0.05)))
            except queue.Empty:
                continue
        return seen

    # -- the three threads -----------------------------------------------------------------

    def _serve(self, inbox: QueueLike, handle: Callable[[Any], object]) -> None:
        """One thread: hand each item of ``inbox`` to ``handle``; an error is kept for the tests
        and the loop goes on."""
        while not self._stop.is_set():
            try:
                self._take(inbox, handle)
            except Exception as exc:
                logger.exception("%s failed", handle.__qualname__)
                self.errors.append(exc)
                self._stop.wait(POLL_S)  # no busy loop while Redis is away

    @staticmethod
    def _take(inbox: QueueLike, handle: Callable[[Any], object]) -> None:
        """Handle the next item, if one comes within :data:`POLL_S`; a ``queue.Queue``'s item is
        then marked done, which :meth:`wait_drained` counts."""
        try:
            item = inbox.get(timeout=POLL_S)
        except queue.Empty:
            return
        try:
            handle(item)
        finally:
            if isinstance(inbox, queue.Queue):
                inbox.task_done()

    def _consume_signal(self, data: Any) -> None:
        signal = decode_kv_signal(data)
        if signal is not None:
            self.progress.advance(signal)
            batch = self.bridge.on_kv_signal(signal)
            if batch:
                self.ready.put(batch)

    def _send_batch(self, batch: Batch) -> None:
        for slot, tokens in batch:
            self._send(slot, tokens)

    def _send(self, slot: int, tokens: int) -> None:
        """Write blocks ``[sent, end)`` of every layer; finish the task after its last chunk."""
        bridge = self.bridge
        task = bridge.buffer.task(bridge.instance, bridge.rank, slot)
        if task is None:
            logger.warning("ready signal for slot %d (%d tokens) has no live task; skipped", slot, tokens)
            self.stale.append((slot, tokens))
            return
        state = self._sending.get(slot)
        if state is None or state.request_id != task.request_id:
            state = _Sending(task.request_id, task.decode_cached_tokens // bridge.block_size)
        src, dest = block_ids(task, META_SRC_BLOCKS), block_ids(task, META_DEST_BLOCKS)
        last_chunk = tokens >= task.need_prefill_tokens
        end = len(src) if last_chunk else min(tokens // bridge.block_size, len(src))
        if end > state.sent_blocks:
            for layer in range(bridge.num_layers):
                if not self.progress.wait(slot, tokens, layer, self._stop):
                    return
                self.transport.write_cache(slot, layer, src[state.sent_blocks : end], dest[state.sent_blocks : end])
            state.sent_blocks = end
        if not last_chunk:
            self._sending[slot] = state
            return
        self._sending.pop(slot, None)
        self.progress.reset(slot)
        bridge.on_task_finished(slot, task.request_id)
        self.finished.put(task.request_id)


def run_adder_process(
    url: str,
    namespace: str,
    instance: str,
    rank: int,
    num_layers: int,
    block_size: int,
    inbox: QueueLike,
    ready: QueueLike,
    registered: QueueLike | None = None,
) -> None:
    """The cache-task adder on its own, for a ``multiprocessing`` child sharing only Redis.

    Reads ``cache_info`` halves from ``inbox`` until :data:`STOP`, puts recovered batches on
    ``ready`` and, when given, each registered request id on ``registered``.
    """
    with SignalBuffer.from_url(url, namespace=namespace) as buffer:
        adder = CacheTaskAdder(Layer0Bridge(buffer, instance, rank, block_size, num_layers=num_layers), ready)
        while True:
            try:
                half = inbox.get(timeout=ADDER_IDLE_EXIT_S)
            except queue.Empty:
                logger.error("adder idle for %ss, exiting", ADDER_IDLE_EXIT_S)
                return
            if half == STOP:
                return
            if adder.add(half) is not None and registered is not None:
                registered.put(half["request_id"])


def _poll(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True
