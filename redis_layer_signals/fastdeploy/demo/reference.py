"""A reference cache messager: ``CacheMessagerV1``'s three prefill threads around ``Layer0Bridge``.

It follows the structure of FastDeploy's fixed class (release/2.6 with PR 7872) at the three
places the bridge replaces its pending dict, with the bridge calls where the integration guide
puts them, all outside ``engine_cache_task_thread_lock``:

- the **signal consumer** advances per-slot progress under the lock (FastDeploy's
  ``engine_cache_tasks``), then hands the message to the bridge, which queues the layer-0
  batch whose tasks are live;
- the **cache-task adder** merges the two halves of each ``cache_info``, puts the task in
  ``idx_cache_task_dict`` under the lock, then registers it through the bridge (which queues
  the early batch it recovers) and acknowledges it ("task added");
- the **layer-wise sender** takes each batch, asserts that its task is in
  ``idx_cache_task_dict`` (as FastDeploy's sender does), writes the blocks layer by layer as
  the GPU's progress allows and, after a request's last chunk, finishes it through the bridge
  before reporting it and deleting it under the lock.

When the adder runs in another process (``run_adder_process``), the sender reads a task it
does not know from the buffer. ``UnbufferedBridge`` is the behaviour before the fix.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ...buffer.sync import SignalBuffer
from ..bridge import META_DEST_BLOCKS, META_SRC_BLOCKS, Batch, Layer0Bridge, QueueLike, block_ids, layer0_entries
from ..logs import one_line
from ..signals import KvSignal, decode_kv_signal
from .scripted import RecordingTransport

logger = logging.getLogger(__name__)

POLL_S = 0.005
"""How long a thread blocks on its queue before it checks whether it should stop."""
ADDER_IDLE_EXIT_S = 120.0
"""A separate adder process exits after this long without a message (its parent is gone)."""
STOP = "stop"
"""Sentinel that ends ``run_adder_process``."""

__all__ = ["STOP", "CacheTaskAdder", "Progress", "QueueLike", "ReferenceMessager", "UnbufferedBridge"]


class UnbufferedBridge(Layer0Bridge):
    """The pre-fix behaviour: a layer-0 signal whose task is not registered yet is dropped.

    Kept only to show what the buffer fixes: the check and the act are separate, and nothing
    remembers the early signal, so its request is never sent. It registers in Redis itself,
    so no writer copies decisions of the process there (``registers_tasks=False``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "registers_tasks": False})

    def on_kv_signal(self, kv_signal_data: Any, request_ids: Mapping[int, str] | None = None) -> Batch:
        ready = []
        for slot, tokens in layer0_entries(kv_signal_data):
            if self.buffer.task(self.instance, self.rank, slot) is None:
                logger.warning("no cache task for slot %d yet: layer-0 signal dropped", slot)
            else:
                ready.append((slot, tokens))
        if ready:
            self.ready.put(ready)
        return ready

    def on_cache_task(self, cache_info: Mapping[str, Any]) -> Batch:
        self.buffer.register(self.cache_task(cache_info), replace=True)
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
    """``_add_cache_task_thread``: merges the two halves of each ``cache_info``; once both are
    in, puts the task in ``idx_cache_task_dict`` under the lock, registers it through the
    bridge outside it, and acknowledges it on ``acks`` (FastDeploy's
    ``put_finished_add_cache_task_req``)."""

    def __init__(
        self,
        bridge: Layer0Bridge,
        lock: threading.Lock,
        idx_cache_task_dict: dict[int, dict[str, Any]],
        acks: QueueLike,
    ) -> None:
        self.bridge = bridge
        self.lock = lock
        self.idx_cache_task_dict = idx_cache_task_dict
        self.acks = acks
        self.cache_info: dict[str, dict[str, Any]] = {}

    def add(self, half: Mapping[str, Any]) -> dict[str, Any] | None:
        """Returns the merged task once it is registered, None while a half is missing."""
        request_id = str(half["request_id"])
        current = self.cache_info.get(request_id)
        if current is None:
            self.cache_info[request_id] = dict(half)
            return None
        current.update(half)
        cached_blocks = len(current[META_SRC_BLOCKS]) - len(current[META_DEST_BLOCKS])
        current[META_DEST_BLOCKS] = [-1] * cached_blocks + list(current[META_DEST_BLOCKS])
        current["decode_cached_tokens"] = cached_blocks * self.bridge.block_size
        current["sended_block_num"] = cached_blocks
        current["status"] = "init"
        del self.cache_info[request_id]
        with self.lock:
            self.idx_cache_task_dict[current["current_id"]] = current
        # Outside the lock: a Redis round trip must not stall the consumer and the sender. The
        # task is in idx_cache_task_dict already, so whatever the bridge queues finds it.
        self.bridge.on_cache_task(current)
        self.acks.put(request_id)
        return current


class ReferenceMessager:
    """The prefill side of a cache messager: consumer, adder (optional) and sender threads.

    Feed it ``signals`` (tensors from ``ScriptedGpu``) and ``cache_infos`` (halves);
    read ``transport.writes``, ``finished`` and ``acks``. The sender's queue is the bridge's
    ``ready``. Pass ``with_adder=False`` when the adder runs in another process: the sender
    then reads the tasks it does not know from the buffer.
    """

    def __init__(self, bridge: Layer0Bridge, transport: RecordingTransport, *, with_adder: bool = True) -> None:
        self.bridge = bridge
        self.transport = transport
        self.signals: queue.Queue[Any] = queue.Queue()
        self.cache_infos: queue.Queue[Mapping[str, Any]] = queue.Queue()
        self.cache_prefilled_engine_ids_queue: QueueLike = bridge.ready
        self.finished: queue.Queue[str] = queue.Queue()
        self.acks: queue.Queue[str] = queue.Queue()
        self.progress = Progress()
        self.errors: list[BaseException] = []
        self.stale: list[tuple[int, int]] = []
        """Batches skipped because their request had finished (adder in another process only)."""
        self.engine_cache_task_thread_lock = threading.Lock()
        self.idx_cache_task_dict: dict[int, dict[str, Any]] = {}
        self.tasks_from_buffer = not with_adder
        self.adder = CacheTaskAdder(bridge, self.engine_cache_task_thread_lock, self.idx_cache_task_dict, self.acks)
        self._stop = threading.Event()
        loops: list[tuple[QueueLike, Callable[[Any], object]]] = [
            (self.signals, self._consume_signal),
            (self.cache_prefilled_engine_ids_queue, self._send_batch),
        ]
        if with_adder:
            loops.append((self.cache_infos, self.adder.add))
        self.threads = [threading.Thread(target=self._serve, args=loop, daemon=True) for loop in loops]

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> ReferenceMessager:
        for thread in self.threads:
            thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        for thread in self.threads:
            thread.join(timeout)

    def __enter__(self) -> ReferenceMessager:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_drained(self, timeout: float) -> bool:
        """True once every signal and cache_info put so far has been handled (bounded)."""
        return _poll(lambda: self.signals.unfinished_tasks == 0 and self.cache_infos.unfinished_tasks == 0, timeout)

    def wait_idle(self, timeout: float) -> bool:
        """True once every signal, cache_info and ready batch put so far has been handled:
        no hook call and no send is under way (bounded)."""
        ready = self.cache_prefilled_engine_ids_queue

        def idle() -> bool:
            sending = ready.unfinished_tasks if isinstance(ready, queue.Queue) else 0
            return self.signals.unfinished_tasks == 0 and self.cache_infos.unfinished_tasks == 0 and sending == 0

        return _poll(idle, timeout)

    def wait_finished(self, request_ids: Iterable[str], timeout: float) -> set[str]:
        """Collect finished requests until all of ``request_ids`` are in or ``timeout`` passes."""
        return _collect(self.finished, request_ids, timeout)

    # -- the three threads -----------------------------------------------------------------

    def _serve(self, inbox: QueueLike, handle: Callable[[Any], object]) -> None:
        """One thread: hand each item of ``inbox`` to ``handle``; an error is kept for the tests
        and logged, and the loop goes on (FastDeploy's loops catch and log the same way)."""
        while not self._stop.is_set():
            try:
                self._take(inbox, handle)
            except Exception as exc:
                # One line; the traceback only for whoever asks for debug logs.
                logger.error("%s failed: %s", handle.__qualname__, one_line(exc))
                logger.debug("%s failed", handle.__qualname__, exc_info=exc)
                self.errors.append(exc)
                self._stop.wait(POLL_S)

    @staticmethod
    def _take(inbox: QueueLike, handle: Callable[[Any], object]) -> None:
        """Handle the next item, if one comes within ``POLL_S``; a ``queue.Queue``'s item is
        then marked done, which ``wait_drained`` counts."""
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
        """``consume_signals``: progress under the lock, the layer-0 batch through the bridge
        outside it (FastDeploy's ready/pending split and pending dict are gone)."""
        signal = decode_kv_signal(data)
        if signal is None:
            return
        with self.engine_cache_task_thread_lock:
            self.progress.advance(signal)
        self.bridge.on_kv_signal(signal)

    def _send_batch(self, batch: Batch) -> None:
        for engine_index, tokens in batch:
            self._send(engine_index, tokens)

    def _send(self, engine_index: int, tokens: int) -> None:
        """Write blocks ``[sended_block_num, end)`` of every layer; finish after the last chunk."""
        task = self._task(engine_index, tokens)
        if task is None:
            return
        block_size = self.bridge.block_size
        src, dest = task[META_SRC_BLOCKS], task[META_DEST_BLOCKS]
        last_chunk = tokens >= task["need_prefill_tokens"]
        start = task["sended_block_num"]
        end = len(src) if last_chunk else min(tokens // block_size, len(src))
        if end > start:
            for layer in range(self.bridge.num_layers):
                if not self.progress.wait(engine_index, tokens, layer, self._stop):
                    return
                self.transport.write_cache(engine_index, layer, src[start:end], dest[start:end])
            task["sended_block_num"] = end
        if last_chunk:
            self._finish(engine_index, task)

    def _task(self, engine_index: int, tokens: int) -> dict[str, Any] | None:
        """The slot's task as FastDeploy's sender reads it; in FastDeploy's layout a slot
        without one is a bug of the integration, and raises as FastDeploy's assertion does.

        With the adder in another process, batches reach this queue from two processes, and
        no lock orders them: a batch the adder recovered can arrive after a later chunk's batch
        that already finished the request. Its task is gone from Redis then, and its blocks were
        sent with the later chunk's: it is skipped and counted in ``stale``."""
        task = self.idx_cache_task_dict.get(engine_index)
        if task is None and self.tasks_from_buffer:
            task = self._task_from_buffer(engine_index)
            if task is None:
                logger.info("batch (%d, %d) came after its request finished: skipped", engine_index, tokens)
                self.stale.append((engine_index, tokens))
                return None
        assert task is not None, f"engine_index {engine_index} not in idx_cache_task_dict"
        return task

    def _task_from_buffer(self, engine_index: int) -> dict[str, Any] | None:
        """The task registered by an adder in another process, read from Redis (retried while
        Redis is unreachable: the handoff cannot cross processes until it is back)."""
        bridge = self.bridge
        while not self._stop.is_set():
            try:
                found = bridge.buffer.task(bridge.instance, bridge.rank, engine_index)
            except Exception as exc:
                logger.debug("task of slot %d unreadable: %s", engine_index, exc)
                self._stop.wait(bridge.probe_s)
                continue
            if found is None:
                return None
            task = {
                "request_id": found.request_id,
                "current_id": engine_index,
                "need_prefill_tokens": found.need_prefill_tokens,
                META_SRC_BLOCKS: block_ids(found, META_SRC_BLOCKS),
                META_DEST_BLOCKS: block_ids(found, META_DEST_BLOCKS),
                "sended_block_num": found.decode_cached_tokens // bridge.block_size,
            }
            with self.engine_cache_task_thread_lock:
                self.idx_cache_task_dict[engine_index] = task
            return task
        return None

    def _finish(self, engine_index: int, task: dict[str, Any]) -> None:
        """Release the slot in the buffer first (outside the lock), then report the request and
        forget it under the lock: once the engine hears of it and reuses the slot, the buffer
        already treats the slot as free, so the next request's early signals wait for it."""
        self.bridge.on_task_finished(engine_index, task["request_id"])
        with self.engine_cache_task_thread_lock:
            self.finished.put(task["request_id"])
            self.progress.reset(engine_index)
            del self.idx_cache_task_dict[engine_index]


def run_adder_process(
    url: str,
    namespace: str,
    instance: str,
    rank: int,
    num_layers: int,
    block_size: int,
    inbox: QueueLike,
    ready: QueueLike,
    acks: QueueLike | None = None,
    retry_s: float | None = None,
) -> None:
    """The cache-task adder on its own, for a ``multiprocessing`` child sharing only Redis.

    Reads ``cache_info`` halves from ``inbox`` until ``STOP``, lets the bridge put
    recovered batches on ``ready`` and, when given, acknowledges each task on ``acks``.
    """
    with SignalBuffer.from_url(url, namespace=namespace, retry_s=retry_s) as buffer:
        bridge = Layer0Bridge(
            buffer, instance, rank, block_size, num_layers=num_layers, ready=ready, registers_tasks=False
        )
        adder = CacheTaskAdder(bridge, threading.Lock(), {}, acks if acks is not None else queue.Queue())
        try:
            while True:
                try:
                    half = inbox.get(timeout=ADDER_IDLE_EXIT_S)
                except queue.Empty:
                    logger.error("adder idle for %ss, exiting", ADDER_IDLE_EXIT_S)
                    return
                if half == STOP:
                    # Write back what was registered locally before leaving, if Redis answers.
                    _poll(bridge.reconcile, ADDER_IDLE_EXIT_S)
                    return
                adder.add(half)
        finally:
            bridge.close()


def _collect(source: QueueLike, wanted_ids: Iterable[str], timeout: float) -> set[str]:
    """What of ``wanted_ids`` comes within ``timeout``, and whatever is there already when it
    is 0 (a run whose time is up still counts what finished)."""
    wanted, seen = set(wanted_ids), set[str]()
    deadline = time.monotonic() + timeout
    while not wanted <= seen:
        remaining = deadline - time.monotonic()
        try:
            seen.add(source.get(timeout=min(remaining, 0.05)) if remaining > 0 else source.get(block=False))
        except queue.Empty:
            if remaining <= 0:
                break
    return seen


def _poll(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return True
        except Exception as exc:
            logger.debug("still waiting: %s", exc)
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
