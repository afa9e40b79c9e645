"""The layer-0 rules a tensor-parallel group (``tp.run_group``) can run, on one messager model.

``ModelMessager`` has the structure of FastDeploy's ``CacheMessagerV1`` prefill threads: the
consumer writes each message's progress under ``engine_cache_task_thread_lock``; the adder
merges the two halves of each cache_info, puts the task in ``idx_cache_task_dict`` under the
lock, acknowledges the batch and waits on ``finish_add_cache_task_barrier``; the sender takes a
batch, waits on ``begin_send_cache_barrier``, sends each entry (asserting its task is known, as
FastDeploy does), and, holding the lock, waits on ``finish_send_cache_barrier`` and reports each
task the batch finished. Run with develop's threads (``tp.run_group(adders="free",
sender="pool")``, modelled in ``tp``'s module doc), the adder neither acknowledges the batch nor
waits on a barrier, and the sender, after ``begin_send_cache_barrier``, waits for each entry's
task instead of asserting it (PR 7724); it writes the batch's layers on a thread pool before it
meets ``finish_send_cache_barrier`` (PR 7931). What to queue for layer 0 is the rule's
(``Layer0Policy``):

- ``ReadySplit``: FastDeploy release/2.6 with PR 7872. The entries of a layer-0 message whose
  task is registered go out as one batch now; the others wait in a dict (newest per slot) and
  are queued one by one as their tasks register. (The test suite also runs FastDeploy's own
  structure of this rule, a fixture executed with stub imports; this model is for
  ``rls simulate --tp``.)
- ``AllPending``: the rule after FastDeploy PR 8034/8035 (release/2.6 from 2026-06-10, develop),
  modelled: see its docstring.
- ``BridgePolicy``: ``Layer0Bridge`` at the three hook points, as ``rls fastdeploy patch``
  places them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ...buffer.sync import SignalBuffer
from ..bridge import Layer0Bridge
from ..signals import SIGNAL_LAYER, KvSignal, decode_kv_signal
from .tp import POLL_S, RankIO, RankMessager, Stopped, new_signal_buffer


class Layer0Policy:
    """What a rank queues for layer 0; the defaults register a task and forget nothing."""

    def on_signal(self, m: ModelMessager, data: Any, signal: KvSignal) -> None:
        """In the consumer, after the message's progress was written under the lock."""

    def register(self, m: ModelMessager, task: dict[str, Any]) -> None:
        """In the adder, once both halves are in: make ``task`` its slot's task."""
        with m.lock:
            m.idx_cache_task_dict[task["current_id"]] = task

    def on_adder_poll(self, m: ModelMessager) -> None:
        """In the adder, once per turn of its loop (about every millisecond when idle)."""

    def before_report(self, m: ModelMessager, slot: int, request_id: str) -> None:
        """In the sender, outside the lock, for each task the batch finished."""

    def forget(self, m: ModelMessager, slot: int) -> None:
        """In the sender, under the lock, as a finished task is deleted."""

    def close(self) -> None:
        pass


class ReadySplit(Layer0Policy):
    """FastDeploy release/2.6 with PR 7872: registered entries now as one batch, the others
    in a dict (newest per slot wins), each recovered as a batch of its own on registration
    (and dropped there if it claims more tokens than the task needs)."""

    def __init__(self) -> None:
        self.pending: dict[int, tuple[int, int]] = {}
        self.pending_lock = threading.Lock()

    def on_signal(self, m: ModelMessager, data: Any, signal: KvSignal) -> None:
        if signal.layer != SIGNAL_LAYER:
            return
        with m.lock:
            ready = [(s, t) for s, t in signal.entries if s in m.idx_cache_task_dict]
            waiting = [(s, t) for s, t in signal.entries if s not in m.idx_cache_task_dict]
            if waiting:
                with self.pending_lock:
                    self.pending.update((s, (s, t)) for s, t in waiting)
        if ready:
            m.io.ready.put(ready)

    def register(self, m: ModelMessager, task: dict[str, Any]) -> None:
        slot = task["current_id"]
        with m.lock:
            m.idx_cache_task_dict[slot] = task
            with self.pending_lock:
                recovered = self.pending.pop(slot, None)
        if recovered is not None and recovered[1] <= task["need_prefill_tokens"]:
            m.io.ready.put([recovered])

    def forget(self, m: ModelMessager, slot: int) -> None:
        with self.pending_lock:
            self.pending.pop(slot, None)


class AllPending(ReadySplit):
    """The rule after FastDeploy PR 8034/8035, as modelled here: every layer-0 entry goes to the
    pending dict (newest per slot wins), whether its task is registered or not, and only the
    adder takes entries out, one batch per entry, dropping one that claims more tokens than
    its task needs.

    The adder takes out an entry whose task is registered at two moments: when it registers the
    task (its early entry, as before), and on every turn of its loop, which polls for
    cache_infos about every millisecond (the entries that came after their task registered, so
    a later chunk of a live request is sent too). Entries taken on one turn go out in the
    dict's order. This is the most literal reading of "all layer-0 signals go through pending,
    recovered one by one by the adder": no signal is queued by the consumer, and nothing but
    the adder's own timing decides when an entry leaves the dict, so each rank still decides
    by its own race (which entries are in the dict when its adder looks, and which newer entry
    of a slot replaced an older one first)."""

    def on_signal(self, m: ModelMessager, data: Any, signal: KvSignal) -> None:
        if signal.layer != SIGNAL_LAYER:
            return
        with m.lock, self.pending_lock:
            self.pending.update((s, (s, t)) for s, t in signal.entries)

    def register(self, m: ModelMessager, task: dict[str, Any]) -> None:
        super().register(m, task)
        self.on_adder_poll(m)

    def on_adder_poll(self, m: ModelMessager) -> None:
        with m.lock, self.pending_lock:
            live = [slot for slot in self.pending if slot in m.idx_cache_task_dict]
            taken = [(self.pending.pop(slot), m.idx_cache_task_dict[slot]) for slot in live]
        for entry, task in taken:
            if entry[1] <= task["need_prefill_tokens"]:
                m.io.ready.put([entry])


class BridgePolicy(Layer0Policy):
    """``Layer0Bridge`` at the three hook points (outside the lock, as the guide places them);
    the bridge puts its batches on the rank's queue itself."""

    def __init__(self, bridge: Layer0Bridge, buffer: SignalBuffer) -> None:
        self.bridge, self.buffer = bridge, buffer

    def on_signal(self, m: ModelMessager, data: Any, signal: KvSignal) -> None:
        self.bridge.on_kv_signal(data)

    def register(self, m: ModelMessager, task: dict[str, Any]) -> None:
        super().register(m, task)
        self.bridge.on_cache_task(task)

    def before_report(self, m: ModelMessager, slot: int, request_id: str) -> None:
        self.bridge.on_task_finished(slot, request_id)

    def close(self) -> None:
        self.bridge.close()
        self.buffer.close()


class ModelMessager:
    """One rank's ``CacheMessagerV1`` prefill threads (see the module doc)."""

    def __init__(self, io: RankIO, policy: Layer0Policy) -> None:
        self.io = io
        self.policy = policy
        self.lock = threading.Lock()
        """``engine_cache_task_thread_lock``."""
        self.idx_cache_task_dict: dict[int, dict[str, Any]] = {}
        self.cache_info: dict[str, dict[str, Any]] = {}
        self.progress: dict[int, tuple[int, int]] = {}
        """``engine_cache_tasks``: per slot, (layer, tokens) of the newest message."""
        self.pool: ThreadPoolExecutor | None = None
        """The pooled sender's threads (``sender="pool"``), None for one sender thread."""
        if io.sender == "pool":
            self.pool = ThreadPoolExecutor(io.pool_workers, thread_name_prefix=f"tp-send-{io.rank}")

    def loops(self) -> list[Callable[[], None]]:
        return [self.consume_signals, self.add_cache_tasks, self.send_batches]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.policy.close()

    def consume_signals(self) -> None:
        data = new_signal_buffer()
        while True:
            self.io.get_output_kv_signal(data)
            try:
                signal = decode_kv_signal(data)
                if signal is None:
                    continue
                with self.lock:
                    for slot, tokens in signal.entries:
                        self.progress[slot] = (signal.layer, tokens)
                self.policy.on_signal(self, data, signal)
            except Exception as exc:  # FastDeploy's loop logs and goes on
                self.io.error("consumer", exc)

    def add_cache_tasks(self) -> None:
        while True:
            infos = self.io.get_cache_info()
            try:
                if infos:
                    self._add(infos)
                self.policy.on_adder_poll(self)
            except Exception as exc:
                self.io.error("adder", exc)

    def _add(self, infos: list[dict[str, Any]]) -> None:
        added = []
        for info in infos:
            request_id = info["request_id"]
            if request_id not in self.cache_info:
                self.cache_info[request_id] = info  # the first half
                continue
            task = self.cache_info[request_id]
            task.update(info)
            task["status"] = "init"
            self.policy.register(self, task)
            added.append(request_id)
        if self.io.adders == "free":
            return  # develop (PR 7724): no acknowledgement, no barrier
        if added:
            self.io.put_finished_add_cache_task_req(added)
        self.io.finish_add_cache_task_barrier.wait()

    def send_batches(self) -> None:
        while True:
            batch = self.io.ready.get()
            try:
                self._send(batch)
            except Exception as exc:
                self.io.error("sender", exc)

    def _send(self, batch: list[tuple[int, int]]) -> None:
        self.io.begin_send_cache_barrier.wait()
        if self.pool is None:
            for slot, tokens in batch:
                task = self._task_of(slot)
                self.io.write_cache(task["request_id"], slot, tokens)
                if tokens >= task["need_prefill_tokens"]:
                    task["status"] = "finished"
        else:
            self._send_on_pool(self.pool, batch)
        self._report(batch)

    def _task_of(self, slot: int) -> dict[str, Any]:
        """The task of an entry the sender took: release/2.6 asserts it is registered; develop
        (``adders="free"``) waits for it (``_maybe_wait_for_cache_task``, PR 7724): it polls
        until the slot's task is registered on this rank, with no time limit (``Stopped`` once
        the run is over)."""
        task = self.idx_cache_task_dict.get(slot)
        if task is not None:
            return task
        if self.io.adders == "lockstep":
            raise AssertionError(f"engine_index {slot} not in idx_cache_task_dict")
        self.io.waited_for_task()
        while task is None:
            if self.io.state.over.wait(POLL_S):
                raise Stopped
            task = self.idx_cache_task_dict.get(slot)
        return task

    def _send_on_pool(self, pool: ThreadPoolExecutor, batch: list[tuple[int, int]]) -> None:
        """develop's sender (PR 7931): every layer of every entry of the batch is a job; a batch
        of one job is written on the sender's thread. The batch is done when every job is."""
        tasks = [self._task_of(slot) for slot, _ in batch]
        jobs = [
            (task, slot, tokens, layer)
            for task, (slot, tokens) in zip(tasks, batch, strict=True)
            for layer in range(self.io.layers)
        ]
        if len(jobs) == 1:
            task, slot, tokens, layer = jobs[0]
            self.io.write_layer(task["request_id"], slot, tokens, layer)
        else:
            futures: list[Future[None]] = [
                pool.submit(self.io.write_layer, task["request_id"], slot, tokens, layer)
                for task, slot, tokens, layer in jobs
            ]
            for future in futures:
                future.result()
        for task, (slot, tokens) in zip(tasks, batch, strict=True):
            self.io.write_cache(task["request_id"], slot, tokens)
            if tokens >= task["need_prefill_tokens"]:
                task["status"] = "finished"

    def _report(self, batch: list[tuple[int, int]]) -> None:
        done = [(slot, self.idx_cache_task_dict[slot]) for slot, _ in batch]
        done = [(slot, task) for slot, task in done if task["status"] == "finished"]
        for slot, task in done:
            self.policy.before_report(self, slot, task["request_id"])
        with self.lock:
            for slot, task in done:
                self.io.finish_send_cache_barrier.wait()
                self.io.put_finished_req(task["request_id"], task["status"])
                del self.idx_cache_task_dict[slot]
                self.cache_info.pop(task["request_id"], None)
                self.progress.pop(slot, None)
                self.policy.forget(self, slot)


class ModelRule:
    """A rule for ``tp.run_group``: ``ModelMessager`` with a policy built per rank."""

    def __init__(self, name: str, policy: Callable[[RankIO, str], Layer0Policy]) -> None:
        self.name = name
        self._policy = policy

    def messager(self, io: RankIO, group: str) -> RankMessager:
        return ModelMessager(io, self._policy(io, group))


def ready_split_rule() -> ModelRule:
    return ModelRule("pre-8034 (model)", lambda _io, _group: ReadySplit())


def all_pending_rule() -> ModelRule:
    return ModelRule("8035 (model)", lambda _io, _group: AllPending())


def bridge_rule(
    url: str, namespace: str, pending_ttl_s: float = 1.0, *, grouped: bool = True, **bridge_options: Any
) -> ModelRule:
    """``Layer0Bridge`` on ``url``, each rank with a client of its own, as separate processes
    would have, told the group's size (``nranks``). ``grouped=False`` builds each rank's bridge
    as if it were alone (``nranks=1``): the single-rank rule, which races at TP > 1, for the
    benchmark's comparison. A short ``pending_ttl_s`` lets a group give up an aborted request's
    signal within a test's time."""

    def policy(io: RankIO, group: str) -> Layer0Policy:
        buffer = SignalBuffer.from_url(url, namespace=namespace, pending_ttl_s=pending_ttl_s)
        options = dict(bridge_options)
        options["nranks"] = io.nranks if grouped else 1
        try:
            bridge = Layer0Bridge(buffer, group, io.rank, num_layers=io.layers, ready=io.ready, **options)
        except BaseException:
            buffer.close()
            raise
        return BridgePolicy(bridge, buffer)

    return ModelRule("bridge", policy)
