"""The shared layout: the task adder runs in another process, and Redis judges every hook.

Several processes serve one rank, so none can decide alone: each hook's call runs in Redis,
and the hook waits for it at most ``hook_budget_ms``. When Redis cannot answer in time the
bridge serves its process from ``local.LocalState`` and journals what it decided
(``journal``); a background thread writes the journal back once Redis answers, each call as
of the time it was decided. A registration on its way holds later batches of its slot behind
it (a *gate*), so a recovered batch is queued before them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any, TypeVar

from ..errors import SlotOccupied
from ..models import CacheTask, FinishResult, RecordResult, RegisterResult
from .context import STATS_DEGRADED_MS, STATS_RECONCILED, STATS_SERVED_LOCALLY, Batch, RankContext
from .journal import FinishOp, Operation, PendingCall, RecordOp, RegisterOp, entries_in, registered_by, replay
from .local import EarlySignal
from .signals import SIGNAL_LAYER

T = TypeVar("T")
_D = TypeVar("_D")


class OverBudget(Exception):
    """A hook's Redis call took longer than ``hook_budget_ms``; it may still complete."""

    def __init__(self, budget_s: float, future: concurrent.futures.Future[Any]) -> None:
        super().__init__(f"no reply within the hook budget of {budget_s * 1000:.0f} ms")
        self.future = future


class SharedLayout:
    """One rank shared with other processes: its hook budget, its gates and its journal."""

    def __init__(self, ctx: RankContext, hook_budget_s: float) -> None:
        self.ctx = ctx
        self.hook_budget_s = hook_budget_s
        self._caller = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="rls-hook")
        """Runs each hook's call, which the hook waits for within its budget. A worker per hook
        thread of FastDeploy's (consumer, adder, sender) and a spare: calls of different
        threads run side by side, as they did without the budget. Made here, before any hook
        thread runs (its threads start with the first call)."""
        self.gates: dict[int, Batch] = {}
        """Slots whose registration is on its way to Redis: later batches wait here."""
        self.journal: collections.deque[Operation] = collections.deque()
        """What was decided in the process while Redis did not answer, to write back."""
        self._reconciler: threading.Thread | None = None
        self._replaying = threading.Lock()
        """One writer at a time: a journaled operation is replayed once."""

    # -- the hooks ---------------------------------------------------------------------------

    def record(self, pairs: Any, request_ids: Mapping[int, str] | None) -> Batch:
        ctx = self.ctx
        entries: list[tuple[Any, ...]] = list(pairs)
        if request_ids is not None:
            entries = [(slot, tokens, request_ids.get(slot)) for slot, tokens in entries]
        with ctx.lock:
            if ctx.degraded_since is not None:
                return self._record_locally(entries)
        try:
            result = self._within_budget(partial(ctx.buffer.record, ctx.instance, ctx.rank, SIGNAL_LAYER, entries))
        except Exception as exc:
            with ctx.lock:
                self._degrade("on_kv_signal", exc)
                return self._pending(exc, self._record_locally(entries))
        ctx.logged.discard("on_kv_signal")
        with ctx.lock:
            self._heard_from_server(result)
            return self._queue([(signal.slot, signal.tokens) for signal in result.delivered])

    def register(self, task: CacheTask) -> Batch:
        try:
            return self._register_task(task)
        finally:
            with self.ctx.lock:  # whatever happened, nothing stays held behind this registration
                held = self.gates.pop(task.slot, None)
                if held:
                    self._queue(held)

    def _register_task(self, task: CacheTask) -> Batch:
        ctx = self.ctx
        slot = task.slot
        with ctx.lock:
            if ctx.degraded_since is not None:
                return self._register_locally(task)
            self.gates.setdefault(slot, [])
        try:
            result = self._within_budget(partial(self._register, task))
        except Exception as exc:
            with ctx.lock:
                self._degrade("on_cache_task", exc)
                held = self.gates.pop(slot, [])
                queued = self._pending(exc, self._register_locally(task))
                return queued + self._queue(held)
        ctx.logged.discard("on_cache_task")
        with ctx.lock:
            return self._settle_register(task, result)

    def finish(self, slot: int, request_id: str) -> FinishResult:
        ctx = self.ctx
        with ctx.lock:
            if ctx.degraded_since is not None:
                return self._finish_locally(slot, request_id)
            removed, dropped, fenced = ctx.local.finish(slot, request_id)
        try:
            result = self._within_budget(partial(ctx.buffer.finish, ctx.instance, ctx.rank, slot, request_id))
        except Exception as exc:
            with ctx.lock:
                self._degrade("on_task_finished", exc)
                self._note_local("on_task_finished", FinishOp(slot, request_id, ctx.mono_ms()))
                self._pending(exc, None)
            return FinishResult(removed=removed, dropped=dropped, fenced=fenced)  # decided here
        if result.fenced:
            ctx.logger.info("finish of %s on slot %d fenced: another request holds it", request_id, slot)
        return result

    def _within_budget(self, call: Callable[[], T]) -> T:
        """Run a hook's Redis call; past ``hook_budget_ms`` stop waiting (``OverBudget``:
        the hook journals, as for an outage, and the write-back takes the call's own outcome)."""
        future = self._caller.submit(call)
        try:
            return future.result(timeout=self.hook_budget_s)
        except concurrent.futures.TimeoutError:
            raise OverBudget(self.hook_budget_s, future) from None

    def _pending(self, exc: BaseException, decided: _D) -> _D:
        """Under the lock, after a local decision journaled its operation: when the hook stopped
        waiting (the call may still run in Redis), journal the call instead, with that
        operation to replay should the call fail."""
        last = self.journal[-1] if self.journal else None
        if isinstance(exc, OverBudget) and last is not None and not isinstance(last, PendingCall):
            self.journal[-1] = PendingCall(exc.future, last)
        return decided

    # -- from Redis (callers hold no lock but where it says "under the lock") --------------------

    def _register(self, task: CacheTask) -> RegisterResult:
        try:
            return self.ctx.buffer.register(task)
        except SlotOccupied as occupied:
            self.ctx.log_takeover(task, occupied.holder)
            return self.ctx.buffer.register(task, replace=True)

    def _heard_from_server(self, result: RecordResult) -> None:
        """Under the lock: a record's signals carry the server's time: keep the offset between
        it and the monotonic clock (what turns a journaled decision's time into the server's)."""
        signals = result.delivered or result.buffered
        if signals:
            now = time.monotonic()
            self.ctx.anchor(signals[0].recorded_at_ms, now, now)

    def _settle_register(self, task: CacheTask, result: RegisterResult) -> Batch:
        """Under the lock: queue the recovered batch, then what waited behind the registration."""
        ctx = self.ctx
        for signal, reason in result.dropped:
            ctx.logger.warning(
                "dropped early layer-%d signal of slot %d (%d tokens) for request %s: %s",
                signal.layer,
                signal.slot,
                signal.tokens,
                task.request_id,
                reason.value,
            )
        recovered = [(s.slot, s.tokens) for s in result.recovered if s.layer == SIGNAL_LAYER]
        ctx.local.early.pop(task.slot, None)  # what the journal kept for it: Redis answered
        holder = ctx.local.tasks.get(task.slot)
        if holder is not None and holder.task.request_id != task.request_id:
            # A request registered here while degraded, finished by another process: what was
            # queued for it must not count as queued for the request that holds the slot now.
            del ctx.local.tasks[task.slot]
        if result.repeated:
            recovered = []  # the same handoff: its batch was queued the first time
        held = self.gates.pop(task.slot, [])
        return self._queue(recovered) + self._queue(held)

    # -- locally (under the lock) ----------------------------------------------------------------

    def _record_locally(self, entries: list[tuple[Any, ...]]) -> Batch:
        ctx = self.ctx
        deliver: Batch = []
        now = ctx.mono_ms()
        for slot, tokens, *named in entries:
            request_id = named[0] if named else None
            if slot in self.gates:  # its registration is on its way from this process
                ctx.local.count_delivered()
                deliver.append((slot, tokens))
            else:
                early = EarlySignal(tokens, now + ctx.pending_ttl_ms, shared=False, request_id=request_id)
                ctx.local.keep_early(slot, early, counted=True)
        self._note_local("on_kv_signal", RecordOp(tuple(entries), ctx.mono_ms()))
        return self._queue(deliver)

    def _register_locally(self, task: CacheTask) -> Batch:
        ctx = self.ctx
        holder = ctx.local.tasks.get(task.slot)
        if holder is not None and holder.task.request_id != task.request_id:
            ctx.log_takeover(task, holder.task.request_id)
        early, reason = ctx.local.register(task, ctx.mono_ms())
        self._note_local("on_cache_task", RegisterOp(task, ctx.mono_ms()))
        if early is None:
            return []
        if reason is not None:
            ctx.log_dropped(task, early.tokens, reason)
            return []
        ctx.logger.debug(
            "slot %d: early layer-0 signal (%d tokens) handed to %s", task.slot, early.tokens, task.request_id
        )
        return self._queue([(task.slot, early.tokens)])

    def _finish_locally(self, slot: int, request_id: str) -> FinishResult:
        removed, dropped, fenced = self.ctx.local.finish(slot, request_id)
        self._note_local("on_task_finished", FinishOp(slot, request_id, self.ctx.mono_ms()))
        return FinishResult(removed=removed, dropped=dropped, fenced=fenced)

    def _note_local(self, operation: str, op: Operation) -> None:
        self.journal.append(op)
        self.ctx.local_calls[operation] += 1
        self.ctx.episode_calls += 1

    def _holds(self, task: CacheTask) -> bool:
        """Under the lock: ``task`` is still its slot's task in this process."""
        holder = self.ctx.local.tasks.get(task.slot)
        return holder is not None and holder.task.request_id == task.request_id

    def _queue(self, entries: Iterable[tuple[int, int]]) -> Batch:
        """Put one batch on the sender's queue: entries of a slot whose registration is on its
        way wait behind it; an entry no further along than what the sender already has for
        its request is dropped (its blocks are covered)."""
        ctx = self.ctx
        batch: Batch = []
        for slot, tokens in entries:
            gate = self.gates.get(slot)
            if gate is not None:
                gate.append((slot, tokens))
                continue
            holder = ctx.local.tasks.get(slot)
            if holder is not None:
                if tokens <= holder.queued_tokens:
                    ctx.suppressed += 1
                    continue
                holder.queued_tokens = tokens
            batch.append((slot, tokens))
        if batch:
            ctx.ready.put(batch)
        return batch

    # -- episodes ------------------------------------------------------------------------------

    def _degrade(self, operation: str, exc: BaseException) -> None:
        """Under the lock: an episode (see ``RankContext.degrade``), with its write-back thread."""
        self.ctx.degrade(operation, exc)
        if self._reconciler is None or not self._reconciler.is_alive():
            self._reconciler = threading.Thread(target=self._reconcile_loop, name="rls-reconcile", daemon=True)
            self._reconciler.start()

    def _reconcile_loop(self) -> None:
        ctx = self.ctx
        while not ctx.closed.wait(ctx.probe_s):
            try:
                if self.reconcile():
                    return
            except Exception as exc:  # still unreachable: the next probe tries again
                ctx.logger.debug("%s/%d: still degraded: %s", ctx.instance, ctx.rank, exc)

    def reconcile(self) -> bool:
        """Write the journal back, if Redis answers; True once serving from Redis again."""
        with self._replaying:
            return self._reconcile()

    def _reconcile(self) -> bool:
        ctx = self.ctx
        while True:
            with ctx.lock:
                if ctx.degraded_since is None:
                    return True
                op = self.journal[0] if self.journal else None
            if op is None:
                with ctx.lock:
                    if self.journal:
                        continue  # served something locally meanwhile: write that back too
                    episode = ctx.end_episode()
                self._write_episode(*episode)
                return True
            if not ctx.anchored():  # Redis never answered before: learn its clock first
                sent = time.monotonic()
                server_now = ctx.buffer.now_ms()
                ctx.anchor(server_now, sent, time.monotonic())
            handed = replay(ctx.buffer, ctx.instance, ctx.rank, op, ctx.to_server)
            with ctx.lock:
                self.journal.popleft()
                ctx.wake.notify_all()  # flush waits for the journal to empty
                moved = entries_in(op)
                ctx.reconciled += moved
                ctx.episode_reconciled += moved
                task = registered_by(op)
                if task is not None and not self._holds(task):
                    # Finished (or replaced) here since: its blocks must not reach the sender,
                    # which would send them for whatever holds the slot now.
                    handed = []
                # Nothing of these was queued here: the task or the signal was in another process.
                self._queue(handed)

    def _write_episode(self, seconds: float, calls: int, entries: int) -> None:
        """Add the episode to the rank's counters, best effort and never resent (a counter
        increment has no idempotency token)."""
        ctx = self.ctx
        stats = ctx.buffer.protocol.keys.rank(ctx.instance, ctx.rank).stats
        client = ctx.buffer.client
        try:
            client.hincrby(stats, STATS_DEGRADED_MS, round(seconds * 1000))
            client.hincrby(stats, STATS_SERVED_LOCALLY, calls)
            client.hincrby(stats, STATS_RECONCILED, entries)
        except Exception as exc:
            ctx.logger.warning("%s/%d: could not add the episode to the counters: %s", ctx.instance, ctx.rank, exc)

    # -- state -----------------------------------------------------------------------------------

    def health_fields(self) -> dict[str, Any]:
        """Under the lock: this layout's fields of ``BridgeHealth`` (no process owns the rank)."""
        return {"journal": len(self.journal), "unwritten": len(self.journal), "lag_seconds": 0.0, "identity": "none"}

    def flush(self, timeout_s: float) -> bool:
        """Wait until the journal is written back (True), or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        with self.ctx.wake:
            while self.journal:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.ctx.wake.wait(left)
            return True

    def claimed(self, timeout_s: float) -> bool:
        """No process owns a shared rank: nothing to claim."""
        return True

    def close(self) -> None:
        # Calls not started yet are dropped: each would wait out the buffer's retry_s against a
        # Redis that does not answer, and the interpreter joins these threads at its exit.
        self._caller.shutdown(wait=False, cancel_futures=True)
        self.ctx.closed.set()
        with self.ctx.wake:
            self.ctx.wake.notify_all()
        if self._reconciler is not None:
            self._reconciler.join(5)
