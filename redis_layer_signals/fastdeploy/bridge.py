"""The three hook points of FastDeploy's ``CacheMessagerV1``, served by a shared buffer.

``CacheMessagerV1`` queues a batch ``[(engine_idx, prefilled_token_num), ...]`` for its
layer-wise sender whenever a layer-0 signal arrives. A layer-0 signal that arrives before its
cache task used to be lost; FastDeploy's fix keeps it in a dict of its process.
``Layer0Bridge`` records it in the buffer instead, and the task's registration pops it
back, atomically, so each layer-0 batch reaches the sender exactly once whichever side came
first, even when the signal consumer and the task adder run in different processes or hosts.

Three promises to FastDeploy's loops:

- **The hooks never raise.** An error is logged (once per episode, with its cause), counted in
  ``Layer0Bridge.health``, and the loop goes on.
- **Never less available, nor slower, than FastDeploy's own fix.** Where the process owns its
  rank (``registers_tasks``, FastDeploy's layout) it decides every hook call itself
  (``owner.OwnedRank``), with the semantics of that fix, and never waits for Redis; a
  background writer copies the decisions to Redis in one call per batch (``rls_v2_apply``),
  so Redis, ``rls inspect`` and the counters follow, behind by the writer's lag. Where the adder
  runs in another process Redis judges: a hook waits for its call at most ``hook_budget_ms``,
  and when Redis cannot answer the bridge serves its process from ``local.LocalState``
  and writes what it decided back once Redis answers (``journal``), each call as of the
  time it was decided. Nothing handled locally is handed out a second time.
- **Order per slot.** The bridge puts batches on the sender's queue itself, under a lock of its
  own that is never held across a Redis round trip: a batch a registration recovers is queued
  before any later batch of its slot, and a batch the sender already has something as far
  along for is not queued again. With ``nranks > 1`` the order is the GPU's instead, the same on
  every tensor-parallel rank (``group``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

from .. import eviction, replies, validation
from ..buffer import SignalBuffer
from ..config import require_shared
from ..constants import MAX_INT
from ..errors import IdentityTaken, InvalidConfig, InvalidSignal, InvalidTask, SlotOccupied
from ..models import CacheTask, FinishResult, RecordResult, RegisterResult
from ..protocol import new_token
from .group import GroupQueue, Progress
from .health import BridgeHealth
from .identity import DEFAULT_LEASE_S, TAKEN, TOOK, ClaimResult, IdentityClaim, lease_seconds, release_quietly
from .journal import FinishOp, Operation, PendingCall, RecordOp, RegisterOp, entries_in, registered_by, replay
from .local import EarlySignal, LocalState
from .owner import OwnedRank
from .signals import SIGNAL_LAYER, KvSignal, decode_kv_signal
from .voting import GroupVoter

logger = logging.getLogger(__name__)
_module_logger = logger

Batch = list[tuple[int, int]]
"""What ``cache_prefilled_engine_ids_queue`` carries: ``[(engine_idx, prefilled_token_num)]``."""

DEFAULT_BLOCK_SIZE = 64
"""FastDeploy's default KV-cache block size in tokens."""
DEFAULT_HOOK_BUDGET_MS = 50.0
"""Where Redis judges (the adder in another process), how long a hook waits for its call
before it stops waiting and journals, as for an outage. A healthy Redis answers in about a
millisecond (loopback) to a few (across hosts), so 50 ms never triggers there, and it bounds a
stall of FastDeploy's signal consumer to about one forward step."""
MAX_NRANKS = 64
"""Tensor-parallel ranks an instance may have (``nranks``)."""
DEFAULT_PROBE_S = 0.5
"""While degraded, how often the bridge tries to reach Redis and write back what it decided."""
OFFSET_MAX_ROUND_TRIP_S = 1.0
"""A reply that took longer (resent after errors) says too little about the clocks' offset."""
META_SRC_BLOCKS = "src_block_ids"
META_DEST_BLOCKS = "dest_block_ids"
"""Task meta fields holding the block ids, comma-joined, so a sender in another process can
read where to write from the buffer alone."""
META_PASSTHROUGH = ("transfer_protocol", "ip")
"""Scalar ``cache_info`` fields copied into the task meta when present, for operators."""
STATS_DEGRADED_MS, STATS_SERVED_LOCALLY, STATS_RECONCILED = "degraded_ms", "served_locally", "reconciled"
"""Fields the bridge adds to its rank's ``stats`` hash when an episode ends."""


_FINISHED = {
    (removed, dropped, fenced): FinishResult(removed=removed, dropped=dropped, fenced=fenced)
    for removed in (False, True)
    for dropped in (0, 1)
    for fenced in (False, True)
}
"""The results a finish decided in the process can have (frozen: one of each is shared)."""

T = TypeVar("T")
_D = TypeVar("_D")


class OverBudget(Exception):
    """A hook's Redis call took longer than ``hook_budget_ms``; it may still complete."""

    def __init__(self, budget_s: float, future: concurrent.futures.Future[Any]) -> None:
        super().__init__(f"no reply within the hook budget of {budget_s * 1000:.0f} ms")
        self.future = future


class QueueLike(Protocol):
    """Either a ``queue.Queue`` or a ``multiprocessing`` queue."""

    def put(self, item: Any) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...


ReadySource = QueueLike | Callable[[], QueueLike]
"""The sender's queue, or a zero-argument callable returning the current one (looked up at
each put): ``ready=lambda: self.cache_prefilled_engine_ids_queue`` follows the messager's
attribute when code replaces the queue later."""


class Layer0Bridge:
    """Routes ``CacheMessagerV1``'s layer-0 signals and cache tasks through a buffer.

    ``buffer`` is a [`SignalBuffer`][redis_layer_signals.SignalBuffer] (sync: the hooks run on
    FastDeploy's threads).

    ``rank`` is the messager's ``rank_id`` (``rank + local_data_parallel_id * nranks``), the
    same number FastDeploy reads signals with. ``ready`` is the sender's queue
    (``cache_prefilled_engine_ids_queue``), or a zero-argument callable returning it, called at
    each put (``ready=lambda: self.cache_prefilled_engine_ids_queue``: code that replaces the
    messager's queue later, as FastDeploy's own unit test does, does not cut the bridge off):
    the bridge puts every batch on it itself (a queue of its own when not given).
    ``registers_tasks`` says that this bridge registers every task
    of its instance and rank, as in FastDeploy, where one process runs the signal consumer,
    the task adder and the sender: the bridge then queues a signal only for a task this process
    registered, as FastDeploy's sender requires. Pass False to the bridges of a deployment whose
    adder runs in another process (see ``reference.run_adder_process``). ``nranks`` (1 to
    64) is the instance's tensor-parallel size: above 1, every rank of the group (the ranks
    sharing ``rank // nranks``) queues the same batches in the same order, one per layer-0
    entry, whatever each rank's timing, as the senders' shared barriers require (see
    ``group``; it needs ``registers_tasks``). Every method is safe to call from any thread,
    and none raises.

    Where the process owns its rank, the writer claims the (instance, rank) in Redis before its
    first write, under a lease of ``lease_s`` (see ``identity``): a second live process given
    the same identity is refused (``IdentityTaken``, see ``claimed``) and serves its process
    locally. The constructor makes no Redis call. ``logger``: where the bridge logs (default
    this module's logger; ``bridge_for_messager`` passes FastDeploy's).
    """

    def __init__(
        self,
        buffer: SignalBuffer,
        instance: str,
        rank: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        num_layers: int,
        ready: ReadySource | None = None,
        registers_tasks: bool = True,
        probe_s: float = DEFAULT_PROBE_S,
        hook_budget_ms: float = DEFAULT_HOOK_BUDGET_MS,
        nranks: int = 1,
        lease_s: float = DEFAULT_LEASE_S,
        logger: logging.Logger | None = None,
    ) -> None:
        # A buffer on the default memory:// would be this process's alone, and nothing would say so.
        require_shared(buffer.config, "the FastDeploy bridge")
        validation.integer(block_size, "block_size", InvalidConfig, 1, MAX_INT)
        validation.integer(num_layers, "num_layers", InvalidConfig, 1, MAX_INT)
        if not isinstance(probe_s, (int, float)) or isinstance(probe_s, bool) or not 0 < probe_s <= 60:
            raise InvalidConfig("probe_s", probe_s, "must be a number of seconds in (0, 60]")
        budget_ok = isinstance(hook_budget_ms, (int, float)) and not isinstance(hook_budget_ms, bool)
        if not budget_ok or not 0 < hook_budget_ms <= 60_000:
            raise InvalidConfig("hook_budget_ms", hook_budget_ms, "must be a number of milliseconds in (0, 60000]")
        lease_seconds(lease_s)
        self.logger = logger if logger is not None else _module_logger
        """Where the bridge logs (FastDeploy's own logger, given by ``bridge_for_messager``)."""
        self.buffer = buffer
        self.instance = instance
        self.rank = rank
        self.block_size = block_size
        self.num_layers = num_layers
        self._max_slots = buffer.config.max_slots
        self._bridge_error: InvalidTask | None = None
        """Why no task of this bridge is valid (its instance, rank or num_layers), else None:
        checked once, each registration then refused with it."""
        try:
            buffer.protocol.task_keys(CacheTask(instance, rank, 0, "probe", 0, num_layers))
        except InvalidTask as exc:
            self._bridge_error = exc
        if ready is not None and not hasattr(ready, "put") and not callable(ready):
            raise InvalidConfig("ready", ready, "must be a queue or a callable returning one")
        self._ready: ReadySource = ready if ready is not None else queue.Queue()
        self.registers_tasks = registers_tasks
        self.probe_s = float(probe_s)
        self.hook_budget_s = float(hook_budget_ms) / 1000
        self._caller: concurrent.futures.ThreadPoolExecutor | None = None
        """Where Redis judges: runs each hook's call, which the hook waits for within its budget.
        A worker per hook thread of FastDeploy's (consumer, adder, sender) and a spare: calls of
        different threads run side by side, as they did without the budget. Made here, before
        any hook thread runs (its threads start with the first call)."""
        if not registers_tasks:
            self._caller = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="rls-hook")
        self.local = LocalState()
        self._pending_ttl_ms = round(buffer.config.pending_ttl_s * 1000)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        """Wakes the writer (a decision to write) and flush (Redis caught up)."""
        self.owned: OwnedRank | None = None
        """This process's decisions for its rank (``registers_tasks``), which the writer copies
        to Redis; None when Redis judges (the adder runs in another process)."""
        self._offset_ms = 0
        """The server's clock minus this host's, from the last reply (the decisions' time)."""
        self._writer_waits = False
        """The writer waits for a decision (only then does a hook wake it)."""
        self._pending_since: float | None = None
        """When the oldest decision not yet taken by the writer was made (monotonic)."""
        self._in_flight: tuple[float, int] | None = None
        """(oldest decision, decisions) of the batch the writer is sending."""
        self._resync = False
        """Redis holds other slots than the process believes: the next batch lists them all."""
        self._writer_token = new_token()
        """Names this process's writer in Redis: its batches are numbered under it (apply.lua)."""
        self._batches = 0
        self._gates: dict[int, Batch] = {}
        """Slots whose registration is on its way to Redis: later batches wait here."""
        self._journal: collections.deque[Operation] = collections.deque()
        self._degraded_since: float | None = None
        self._degraded_total = 0.0
        self._episodes = 0
        self._episode_calls = 0
        self._episode_reconciled = 0
        self._local_calls: collections.Counter[str] = collections.Counter()
        self._errors: collections.Counter[str] = collections.Counter()
        self._reconciled = 0
        self._suppressed = 0
        self._logged: set[str] = set()
        """Kinds of error already logged (bad input per hook, a bug per hook and type): each is
        logged once, until its hook succeeds again."""
        self._closed = threading.Event()
        self._reconciler: threading.Thread | None = None
        self._replaying = threading.Lock()
        """One writer at a time: a journaled operation is replayed once."""
        self._writer: threading.Thread | None = None
        self.identity: IdentityClaim | None = None
        """The claim on (instance, rank) the writer holds in Redis (``registers_tasks``): one
        identity, one owner. See ``identity``."""
        self._claim = "none" if not registers_tasks else "claiming"
        """"claiming" until the writer's first claim is answered, then "held" or "refused";
        "none" where Redis judges (several processes share the rank, none owns it)."""
        self._refusal: IdentityTaken | None = None
        """Why the identity is refused (another live process holds it), while it is."""
        self._refusals = 0
        """Refusal episodes: times the bridge found another live process holding its identity."""
        self._adopted = False
        """The writer claimed the identity and adopted what a predecessor left: until then the
        hooks decide in the process, as they always do, and nothing is written."""
        self.group: GroupQueue | None = None
        """The layer-0 entries of a tensor-parallel rank (``nranks > 1``), released in the
        group's order (see ``group``); None for a rank of its own."""
        self._voter: GroupVoter | None = None
        if validation.integer(nranks, "nranks", InvalidConfig, 1, MAX_NRANKS + 1) > 1:
            if not registers_tasks:
                raise InvalidConfig("nranks", nranks, "above 1 needs registers_tasks=True (FastDeploy's layout)")
            self.group = GroupQueue(give_up_s=buffer.config.pending_ttl_s)
            self._voter = GroupVoter(self, self.group, nranks, interval_s=self.probe_s)
        if registers_tasks:
            self.owned = OwnedRank(self._pending_ttl_ms, buffer.protocol.task_ttl_ms)
            self.local.tasks = self.owned.tasks  # one map: what the sender's queue checks
            # No Redis call here: the writer claims and adopts before its first batch, so a
            # Redis that accepts connections and never answers delays no start.
            self.identity = IdentityClaim(buffer, instance, rank, self._writer_token, lease_s)
            self._writer = threading.Thread(target=self._write_loop, name="rls-writer", daemon=True)
            self._writer.start()
        if self._voter is not None:
            self._voter.start()

    @property
    def ready(self) -> QueueLike:
        """The sender's queue as of now (a callable ``ready`` is called each time)."""
        source = self._ready
        if hasattr(source, "put"):
            return source  # type: ignore[return-value]
        return source()

    # -- the three hooks ------------------------------------------------------------------

    def on_kv_signal(self, kv_signal_data: Any, request_ids: Mapping[int, str] | None = None) -> Batch:
        """In ``consume_signals``, outside FastDeploy's lock: record a layer-0 message.

        Takes the raw ``kv_signal_data`` tensor or an already decoded ``KvSignal``. Queues
        the entries whose task is live and returns them (already queued: for logs); the others
        wait for their task. Empty reads and later layers return ``[]`` and touch nothing.

        ``request_ids`` (slot -> the request the GPU computed in that slot) is what FastDeploy's
        signal does not carry today: with it, a signal is only ever handed to its own request
        (a late signal of an aborted request is dropped as ``request_mismatch`` instead of
        being recovered by the next request on the slot).
        """
        try:
            return self._on_kv_signal(kv_signal_data, request_ids)
        except Exception as exc:  # a bug of ours: logged, never raised into FastDeploy's loop
            self._bug("on_kv_signal", exc)
            return []

    def _on_kv_signal(self, kv_signal_data: Any, request_ids: Mapping[int, str] | None) -> Batch:
        operation = "on_kv_signal"
        try:
            pairs = _layer0(kv_signal_data)
        except InvalidSignal as exc:
            self._invalid(operation, exc)
            return []
        if not pairs:
            return []
        if self.owned is not None:
            with self._lock:
                if self.group is not None:
                    first = self.group.next_seq
                    progress = self.group.arrive(pairs, request_ids, time.monotonic())
                    self._decided(operation)
                    return self._settle_group(progress, first, len(pairs))
                queued, suppressed = self.owned.record(pairs, request_ids, self._server_ms())
                if queued:
                    self.ready.put(queued)
                self._suppressed += suppressed
                self._decided(operation)
            return queued
        entries: list[tuple[Any, ...]] = list(pairs)
        if request_ids is not None:
            entries = [(slot, tokens, request_ids.get(slot)) for slot, tokens in entries]
        with self._lock:
            if self._degraded_since is not None:
                return self._record_locally(entries)
        try:
            result = self._within_budget(partial(self.buffer.record, self.instance, self.rank, SIGNAL_LAYER, entries))
        except Exception as exc:
            with self._lock:
                self._degrade(operation, exc)
                return self._pending(exc, self._record_locally(entries))
        self._logged.discard(operation)
        with self._lock:
            self._heard_from_server(result)
            return self._queue([(signal.slot, signal.tokens) for signal in result.delivered])

    def on_cache_task(self, cache_info: Mapping[str, Any]) -> Batch:
        """In ``_add_cache_task_thread``, once both halves are merged and the task is in
        ``idx_cache_task_dict``, outside FastDeploy's lock: register the task and queue the
        layer-0 batch that waited for it (returned too, already queued; ``[]`` if none).

        A slot still held by another request is taken over, as FastDeploy overwrites it, with
        a warning naming both requests. Early signals the buffer refused (over
        ``need_prefill_tokens``, expired, ...) are logged with their reason.
        """
        try:
            return self._on_cache_task(cache_info)
        except Exception as exc:  # a bug of ours: logged, never raised into FastDeploy's loop
            self._bug("on_cache_task", exc)
            return []

    def _on_cache_task(self, cache_info: Mapping[str, Any]) -> Batch:
        operation = "on_cache_task"
        try:
            task = self.cache_task(cache_info)
        except InvalidTask as exc:
            self._invalid(operation, exc)
            return []
        slot = task.slot
        if self.owned is not None:
            return self._register_owned(task)
        try:
            return self._register_task(task)
        finally:
            with self._lock:  # whatever happened, nothing stays held behind this registration
                held = self._gates.pop(slot, None)
                if held:
                    self._queue(held)

    def _register_task(self, task: CacheTask) -> Batch:
        operation = "on_cache_task"
        slot = task.slot
        with self._lock:
            if self._degraded_since is not None:
                return self._register_locally(task)
            self._gates.setdefault(slot, [])
        try:
            result = self._within_budget(partial(self._register, task))
        except Exception as exc:
            with self._lock:
                self._degrade(operation, exc)
                held = self._gates.pop(slot, [])
                queued = self._pending(exc, self._register_locally(task))
                return queued + self._queue(held)
        self._logged.discard(operation)
        with self._lock:
            return self._settle_register(task, result)

    def _register_owned(self, task: CacheTask) -> Batch:
        assert self.owned is not None
        with self._lock:
            taken_from, tokens, reason = self.owned.register(task, self._server_ms())
            self._decided("on_cache_task")
            if taken_from is not None:
                self._log_takeover(task, taken_from)
            if self.group is not None:  # its early signals wait in the group's queue
                return self._settle_group(self.group.registered(task), self.group.next_seq)
            if tokens is None:
                return []
            if reason is not None:
                self._log_dropped(task, tokens, reason)
                return []
            batch = [(task.slot, tokens)]
            self.ready.put(batch)
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug(
                "slot %d: early layer-0 signal (%d tokens) handed to %s", task.slot, tokens, task.request_id
            )
        return batch

    def on_task_finished(self, current_id: int, request_id: str) -> FinishResult:
        """In the sender, for each request it completed, before FastDeploy's lock block that
        reports it (``put_finished_req``) and deletes ``idx_cache_task_dict[current_id]``:
        release the slot, fenced by ``request_id`` (a late call for an older request never
        touches the request that now holds the slot), and drop signals still waiting for an
        aborted request. Returns what happened (decided locally while degraded)."""
        try:
            return self._on_task_finished(current_id, request_id)
        except Exception as exc:  # a bug of ours: logged, never raised into FastDeploy's loop
            self._bug("on_task_finished", exc)
            return FinishResult(removed=False, dropped=0, fenced=False)

    def _on_task_finished(self, current_id: int, request_id: str) -> FinishResult:
        operation = "on_task_finished"
        try:
            validation.slot(current_id, self._max_slots, InvalidTask)
            validation.identifier(request_id, "request_id", InvalidTask)
        except InvalidTask as exc:
            self._invalid(operation, exc)
            return FinishResult(removed=False, dropped=0, fenced=False)
        if self.owned is not None:
            with self._lock:
                outcome = self.owned.finish(current_id, request_id, self._server_ms())
                if self.group is not None:
                    self.group.finished(current_id, request_id)
                self._decided(operation)
            if outcome[2]:
                self.logger.info("finish of %s on slot %d fenced: another request holds it", request_id, current_id)
            return _FINISHED[outcome]
        with self._lock:
            if self._degraded_since is not None:
                return self._finish_locally(current_id, request_id)
            removed, dropped, fenced = self.local.finish(current_id, request_id)
        try:
            result = self._within_budget(partial(self.buffer.finish, self.instance, self.rank, current_id, request_id))
        except Exception as exc:
            with self._lock:
                self._degrade(operation, exc)
                self._note_local(operation, FinishOp(current_id, request_id, self._server_ms()))
                self._pending(exc, None)
            return FinishResult(removed=removed, dropped=dropped, fenced=fenced)  # decided here
        if result.fenced:
            self.logger.info("finish of %s on slot %d fenced: another request holds it", request_id, current_id)
        return result

    def _within_budget(self, call: Callable[[], T]) -> T:
        """Run a hook's Redis call; past ``hook_budget_ms`` stop waiting (``OverBudget``:
        the hook journals, as for an outage, and the write-back takes the call's own outcome)."""
        assert self._caller is not None  # only where Redis judges
        future = self._caller.submit(call)
        try:
            return future.result(timeout=self.hook_budget_s)
        except concurrent.futures.TimeoutError:
            raise OverBudget(self.hook_budget_s, future) from None

    def _pending(self, exc: BaseException, decided: _D) -> _D:
        """Under the lock, after a local decision journaled its operation: when the hook stopped
        waiting (the call may still run in Redis), journal the call instead, with that
        operation to replay should the call fail."""
        last = self._journal[-1] if self._journal else None
        if isinstance(exc, OverBudget) and last is not None and not isinstance(last, PendingCall):
            self._journal[-1] = PendingCall(exc.future, last)
        return decided

    # -- state ----------------------------------------------------------------------------

    def health(self) -> BridgeHealth:
        with self._lock:
            since = self._degraded_since
            current = time.monotonic() - since if since is not None else 0.0
            return BridgeHealth(
                degraded=since is not None,
                episodes=self._episodes,
                degraded_seconds=self._degraded_total + current,
                local_calls=dict(self._local_calls),
                reconciled_entries=self._reconciled,
                journal=len(self._journal),
                errors=dict(self._errors),
                suppressed=self._suppressed,
                unwritten=self._unwritten(),
                lag_seconds=self._lag_seconds(),
                evicting=eviction.evicting(self.buffer.policies),
                identity=self._claim,
                identity_holder=self._refusal.holder if self._refusal is not None else "",
                identity_refusals=self._refusals,
                **self._group_health(),
            )

    def _group_health(self) -> dict[str, Any]:
        """Under the lock: the ``group_*`` fields of ``health`` (nothing for a rank of its own)."""
        if self.group is None or self._voter is None:
            return {}
        return {
            "group_waiting": self.group.waiting(),
            "group_voting": len(self.group.voting()),
            "group_unreachable": self._voter.unreachable,
        }

    def flush(self, timeout_s: float) -> bool:
        """Wait until Redis holds every decision made so far (True), or ``timeout_s`` passes
        (False); False at once while another process owns the identity (nothing is written
        then). Where the process owns its rank, also until the writer has claimed the identity
        and adopted what a predecessor left. For tests, shutdown and operators; no hook ever
        waits for Redis."""
        deadline = time.monotonic() + timeout_s
        with self._wake:
            while (self.owned is not None and not self._adopted) or self._unwritten():
                left = deadline - time.monotonic()
                if left <= 0 or self._refusal is not None:
                    return False
                self._wake.wait(left)
            return True

    def claimed(self, timeout_s: float) -> bool:
        """Wait for the outcome of the identity's claim: True once this bridge owns its
        (instance, rank) in Redis (at once where Redis judges: no process owns the rank then);
        False when Redis gave no answer within ``timeout_s``. Raises ``IdentityTaken`` while
        another live process holds the identity."""
        deadline = time.monotonic() + timeout_s
        with self._wake:
            while True:
                if self._refusal is not None:
                    raise self._refusal
                if self._claim in ("held", "none"):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)

    def reconcile(self) -> bool:
        """Write back what was decided locally, if Redis answers; True once the bridge serves
        from Redis again (also when it was never degraded). The background thread calls this
        every ``probe_s`` while degraded; calling it yourself is harmless. Where the process
        owns its rank the writer does this: it waits for it (see ``flush``), at most the
        buffer's ``retry_s``."""
        if self.owned is not None:
            return self.flush(self.buffer.config.retry_s) and not self.health().degraded
        with self._replaying:
            return self._reconcile()

    def _reconcile(self) -> bool:
        while True:
            with self._lock:
                if self._degraded_since is None:
                    return True
                op = self._journal[0] if self._journal else None
            if op is None:
                with self._lock:
                    if self._journal:
                        continue  # served something locally meanwhile: write that back too
                    episode = self._end_episode()
                self._write_episode(*episode)
                return True
            handed = replay(self.buffer, self.instance, self.rank, op)
            with self._lock:
                self._journal.popleft()
                self._wake.notify_all()  # flush waits for the journal to empty
                moved = entries_in(op)
                self._reconciled += moved
                self._episode_reconciled += moved
                task = registered_by(op)
                if task is not None and not self._holds(task):
                    # Finished (or replaced) here since: its blocks must not reach the sender,
                    # which would send them for whatever holds the slot now.
                    handed = []
                # Nothing of these was queued here: the task or the signal was in another process.
                self._queue(handed)

    def close(self) -> None:
        """Stop the background writers, once what was decided is written (waiting at most the
        buffer's ``retry_s``, none while Redis does not answer): what is left stays unwritten.
        Then give the identity up, so that a successor claims it at once."""
        if self._caller is not None:
            self._caller.shutdown(wait=False)
        if self._writer is not None and self._degraded_since is None:
            self.flush(self.buffer.config.retry_s)
        self._closed.set()
        with self._wake:
            self._wake.notify_all()
        for thread in (self._reconciler, self._writer):
            if thread is not None:
                thread.join(5)
        stopped = self._writer is not None and not self._writer.is_alive()
        if self.identity is not None and stopped and self._claim == "held" and self._degraded_since is None:
            release_quietly(self.identity)

    # -- the writer (registers_tasks): Redis follows the process's decisions ---------------

    def _server_ms(self) -> int:
        """Now on the server's clock: the buffer's injected clock, else this host's clock
        corrected by the offset the last reply showed."""
        clock = self.buffer.protocol.clock
        if clock is not None:
            return int(clock())
        return int(time.time() * 1000) + self._offset_ms

    def _heard_from_server(self, result: RecordResult) -> None:
        """Under the lock: a record's signals carry the server's time: keep the clocks' offset
        (what a journaled decision is dated with)."""
        signals = result.delivered or result.buffered
        if signals and self.buffer.protocol.clock is None:
            self._offset_ms = signals[0].recorded_at_ms - int(time.time() * 1000)

    def _decided(self, operation: str) -> None:
        """Under the lock: a hook decided; wake the writer with the first decision it has not
        taken yet (it takes everything decided until then in one batch)."""
        if self._pending_since is None:
            self._pending_since = time.monotonic()
            if self._writer_waits:
                self._wake.notify_all()
        if self._degraded_since is not None:
            self._local_calls[operation] += 1
            self._episode_calls += 1

    def _unwritten(self) -> int:
        """Under the lock: hook decisions Redis does not hold yet."""
        if self.owned is None:
            return len(self._journal)
        in_flight = max(1, self._in_flight[1]) if self._in_flight is not None else 0
        rest = int(not self.owned.decisions and (self._resync or self.owned.unwritten()))
        return self.owned.decisions + in_flight + rest

    def _lag_seconds(self) -> float:
        """Under the lock: the age of the oldest decision Redis does not hold yet."""
        times = [t for t in (self._pending_since, self._in_flight[0] if self._in_flight else None) if t is not None]
        return time.monotonic() - min(times) if times else 0.0

    def _adopt(self, claim: ClaimResult) -> None:
        """With the identity claimed: what an earlier process of this rank left in Redis (see
        ``OwnedRank.adopt``); raises what reading it raised."""
        assert self.owned is not None
        if claim.outcome == TOOK and claim.holder is not None:
            self.logger.warning(
                "%s/%d: took the identity over from %s, which is gone (its pid is not alive on this host)",
                self.instance,
                self.rank,
                claim.holder.describe(),
            )
        elif self._refusal is not None:
            self.logger.warning(
                "%s/%d: claimed the identity %s held (its lease ran out)",
                self.instance,
                self.rank,
                self._refusal.holder,
            )
        keys = self.buffer.protocol.keys.rank(self.instance, self.rank)
        client = self.buffer.client
        pending_raw = client.hgetall(keys.pending)
        live_raw = client.hgetall(keys.live)
        sent = time.time()
        now = self.buffer.now_ms()
        midway = (sent + time.time()) / 2
        pending: dict[int, str] = {}
        suffix = f":{SIGNAL_LAYER}"
        for field, value in pending_raw.items():
            name, text = _text(field), _text(value)
            if name.endswith(suffix) and name[: -len(suffix)].isdigit():
                pending[int(name[: -len(suffix)])] = text
        holders = {int(_text(f)): _text(v)[17:] for f, v in live_raw.items() if _text(f).isdigit()}
        with self._lock:
            if self.buffer.protocol.clock is None:
                self._offset_ms = now - int(midway * 1000)
            late = self.owned.adopt(pending, holders, self._server_ms(), keep_early=self.group is None)
            if late:
                self.ready.put(late)
            if self.owned.unwritten() and self._pending_since is None:
                self._pending_since = time.monotonic()
            if self._refusal is not None:
                self._resync = True  # the other process wrote the rank meanwhile
            self._claim, self._refusal, self._adopted = "held", None, True
            self._wake.notify_all()

    def _write_loop(self) -> None:
        """The writer thread, until the bridge closes: claims the identity and adopts, then
        writes. A bug of its own is logged and counted (``health().errors["writer"]``) and the
        writer goes on: the batch it held is sent with the next, which lists every slot of the
        rank. An identity lost to another process (its lease ran out meanwhile) is claimed
        again, as at start."""
        if not self._start():
            return
        while True:
            try:
                self._write_batches()
                return
            except IdentityTaken:
                self._give_back()
                if not self._start():
                    return
            except Exception as exc:
                self._bug("writer", exc)
                self._give_back()
                if self._closed.wait(self.probe_s):
                    return

    def _give_back(self) -> None:
        """The batch in flight will not be confirmed: it goes with the next, which lists every slot."""
        with self._wake:
            assert self.owned is not None
            self.owned.give_back()
            self._in_flight = None
            self._resync = True
            if self._pending_since is None:
                self._pending_since = time.monotonic()

    def _start(self) -> bool:
        """Claim the identity, then adopt what a predecessor left, before the first batch; False
        when the bridge closed first. Refused (another live process holds the identity), the
        bridge writes nothing, serves its process locally and claims again every third of the
        lease. Unanswered, it counts as an outage, and tries again every ``probe_s``."""
        assert self.identity is not None
        refused = self._refusal is not None  # lost while running: counted and logged already
        while not self._closed.is_set():
            try:
                result = self.identity.claim(count_refusal=not refused)
                if result.outcome == TAKEN:
                    self._refused(result, first=not refused)
                    refused = True
                    if self._closed.wait(self.identity.renew_s):
                        return False
                    continue
                self._adopt(result)
                return True
            except Exception as exc:
                with self._lock:
                    started = self._degrade("writer", exc, log=False)
                if started:
                    self._log_degraded("writer", exc)
                if self._closed.wait(self.probe_s):
                    return False
        return False

    def _refused(self, result: ClaimResult, first: bool) -> None:
        """Another live process holds the identity: say so (once per episode, at ERROR)."""
        assert self.identity is not None
        holder = result.holder.describe() if result.holder is not None else "another process"
        error = IdentityTaken(self.instance, self.rank, holder, self.identity.me.describe())
        if first:  # logged before anyone waiting in ``claimed`` hears of it
            self.logger.error("%s", error)
        with self._wake:
            if self._refusal is None:
                self._refusals += 1
            self._refusal = error
            self._claim = "refused"
            self._adopted = False
            if self._degraded_since is not None and self.owned is not None:
                # Redis answers (it refused): the outage is over; counted with the next batch.
                seconds, calls, _entries = self._end_episode()
                self.owned.counts[STATS_DEGRADED_MS] += max(1, round(seconds * 1000))
                self.owned.counts[STATS_SERVED_LOCALLY] += calls
            self._wake.notify_all()

    def _renew(self, before_write: bool) -> None:
        """Renew the claim; raises ``IdentityTaken`` when another process holds it now (this
        one's lease ran out meanwhile), what the call raises when Redis does not answer.
        ``before_write``: only when the lease might end before a write sent now is done."""
        assert self.identity is not None
        if before_write and self.identity.valid_for(self.buffer.config.retry_s + self.probe_s):
            return
        if not before_write and not self.identity.renewal_due():
            return
        result = self.identity.claim(count_refusal=True)
        if result.outcome == TAKEN:
            self._refused(result, first=True)
            assert self._refusal is not None
            raise self._refusal

    def _renew_quietly(self) -> None:
        """The idle writer's renewal: a Redis that does not answer is tried again later (the
        lease is checked again before the next write)."""
        try:
            self._renew(before_write=False)
        except IdentityTaken:
            raise
        except Exception as exc:
            self.logger.debug("%s/%d: could not renew the identity's lease: %s", self.instance, self.rank, exc)

    def _write_batches(self) -> None:
        """Take what the process decided and not yet written, send it as one ``apply``, again
        until Redis has it; the next batch holds what was decided meanwhile, compacted."""
        owned = self.owned
        assert owned is not None
        identity = self.identity
        assert identity is not None
        every_slot = False
        while True:
            self._renew_quietly()  # outside the lock, when a third of the lease has passed
            with self._wake:
                # Degraded (the start met an outage): a batch, even empty, ends the episode.
                while not (self._closed.is_set() or owned.unwritten() or self._resync or self._degraded_since):
                    if identity.renewal_due():
                        break
                    self._writer_waits = True
                    self._wake.wait(self.probe_s)
                    self._writer_waits = False
                    owned.expire(self._server_ms())  # the local sweep, also when the rank is idle
                if self._closed.is_set():
                    return
                if not (owned.unwritten() or self._resync or self._degraded_since):
                    continue  # woke to renew the lease
                started = self._pending_since or time.monotonic()
                batch = owned.take(every_slot, range(self.buffer.config.max_slots) if self._resync else range(0))
                self._resync = False
                self._in_flight = (started, batch.decisions)
                self._pending_since = None
            keys = self.buffer.protocol.keys.rank(self.instance, self.rank)
            self._batches += 1
            prepared = self.buffer.protocol.apply(
                keys, SIGNAL_LAYER, batch.counts, batch.slots, self._writer_token, self._batches
            )
            every_slot = False
            while True:
                try:
                    self._renew(before_write=True)  # no write without the lease (IdentityTaken)
                    sent = time.time()
                    applied = self.buffer.apply(prepared)
                    took = time.time() - sent
                    midway = sent + took / 2  # the server read its clock about halfway
                    break
                except IdentityTaken:
                    raise
                except Exception as exc:
                    with self._lock:
                        started = self._degrade("writer", exc, log=False)
                    if started:  # a traceback formatted while the hooks wait for the lock: not here
                        self._log_degraded("writer", exc)
                    every_slot = True  # Redis may have lost what it held: send every slot next
                    if self._closed.wait(self.probe_s):
                        return
            with self._wake:
                if self.buffer.protocol.clock is None and took < OFFSET_MAX_ROUND_TRIP_S:
                    self._offset_ms = applied.now_ms - int(midway * 1000)
                self._in_flight = None
                owned.written()
                if (applied.tasks, applied.pending) != owned.believed() and not batch.everything:
                    # Redis lost slots this batch did not list (a restart, a failover) or holds
                    # some the process never wrote: the next batch lists every slot of the rank.
                    self._resync = True
                overridden = applied.overridden
                if overridden:
                    self.logger.warning(
                        "%s/%d: %d slots in Redis did not hold what this process last wrote there "
                        "(a restart, a failover, or a holder left by an earlier process): this "
                        "process's state written over them, counted as overridden",
                        self.instance,
                        self.rank,
                        overridden,
                    )
                if self._degraded_since is not None:
                    # The episode's counters go with the next batch: exact, under its token.
                    behind = batch.decisions + owned.decisions  # Redis missed them: written back now
                    self._reconciled += behind
                    self._episode_reconciled += behind
                    seconds, calls, entries = self._end_episode()
                    owned.counts[STATS_DEGRADED_MS] += max(1, round(seconds * 1000))
                    owned.counts[STATS_SERVED_LOCALLY] += calls
                    owned.counts[STATS_RECONCILED] += entries
                    if self._pending_since is None:
                        self._pending_since = time.monotonic()
                self._wake.notify_all()

    # -- mapping ---------------------------------------------------------------------------

    def cache_task(self, cache_info: Mapping[str, Any]) -> CacheTask:
        """Map FastDeploy's merged ``cache_info`` dict to a ``CacheTask`` (no I/O), every
        field checked before any state changes (the bridge's own fields once, at start)."""
        if type(cache_info) is not dict and not isinstance(cache_info, Mapping):
            raise InvalidTask("cache_info", type(cache_info).__name__, "must be a mapping")
        if self._bridge_error is not None:
            raise self._bridge_error
        meta: dict[str, str] = {}
        for field in (META_SRC_BLOCKS, META_DEST_BLOCKS):
            if field in cache_info:
                meta[field] = _join_ints(cache_info[field], field)
        for field in META_PASSTHROUGH:
            value = cache_info.get(field)
            if isinstance(value, str):
                meta[field] = value
        slot = _int_in(cache_info, "current_id", self._max_slots, name="slot")
        request_id = validation.identifier(_required(cache_info, "request_id"), "request_id", InvalidTask)
        need = _int_in(cache_info, "need_prefill_tokens", MAX_INT)
        cached = _int_in(cache_info, "decode_cached_tokens", MAX_INT, default=0)
        # In CacheTask's field order (see replies.cache_task); the meta is valid as built.
        return replies.cache_task(
            {
                "instance": self.instance,
                "rank": self.rank,
                "slot": slot,
                "request_id": request_id,
                "need_prefill_tokens": need,
                "num_layers": self.num_layers,
                "decode_cached_tokens": cached,
                "meta": meta,
            }
        )

    # -- from Redis (callers hold no lock but where it says "under the lock") --------------

    def _register(self, task: CacheTask) -> RegisterResult:
        try:
            return self.buffer.register(task)
        except SlotOccupied as occupied:
            self._log_takeover(task, occupied.holder)
            return self.buffer.register(task, replace=True)

    def _log_takeover(self, task: CacheTask, holder: str) -> None:
        self.logger.warning(
            "slot %d of %s/%d still held by request %s: registering %s over it, as FastDeploy does",
            task.slot,
            self.instance,
            self.rank,
            holder,
            task.request_id,
        )

    def _settle_register(self, task: CacheTask, result: RegisterResult) -> Batch:
        """Under the lock: queue the recovered batch, then what waited behind the registration."""
        for signal, reason in result.dropped:
            self.logger.warning(
                "dropped early layer-%d signal of slot %d (%d tokens) for request %s: %s",
                signal.layer,
                signal.slot,
                signal.tokens,
                task.request_id,
                reason.value,
            )
        recovered = [(s.slot, s.tokens) for s in result.recovered if s.layer == SIGNAL_LAYER]
        self.local.early.pop(task.slot, None)  # what the journal kept for it: Redis answered
        holder = self.local.tasks.get(task.slot)
        if holder is not None and holder.task.request_id != task.request_id:
            # A request registered here while degraded, finished by another process: what was
            # queued for it must not count as queued for the request that holds the slot now.
            del self.local.tasks[task.slot]
        if result.repeated:
            recovered = []  # the same handoff: its batch was queued the first time
        held = self._gates.pop(task.slot, [])
        return self._queue(recovered) + self._queue(held)

    # -- locally (under the lock) ------------------------------------------------------------

    def _record_locally(self, entries: list[tuple[Any, ...]]) -> Batch:
        deliver: Batch = []
        now = _now_ms()
        for slot, tokens, *named in entries:
            request_id = named[0] if named else None
            if slot in self._gates:  # its registration is on its way from this process
                self.local.count_delivered()
                deliver.append((slot, tokens))
            else:
                early = EarlySignal(tokens, now + self._pending_ttl_ms, shared=False, request_id=request_id)
                self.local.keep_early(slot, early, counted=True)
        self._note_local("on_kv_signal", RecordOp(tuple(entries), self._server_ms()))
        return self._queue(deliver)

    def _register_locally(self, task: CacheTask) -> Batch:
        holder = self.local.tasks.get(task.slot)
        if holder is not None and holder.task.request_id != task.request_id:
            self.logger.warning(
                "slot %d of %s/%d still held by request %s: registering %s over it, as FastDeploy does",
                task.slot,
                self.instance,
                self.rank,
                holder.task.request_id,
                task.request_id,
            )
        early, reason = self.local.register(task, _now_ms())
        self._note_local("on_cache_task", RegisterOp(task, self._server_ms()))
        if early is None:
            return []
        self._log_local_verdict(task, early, reason)
        return self._queue([(task.slot, early.tokens)]) if reason is None else []

    def _finish_locally(self, slot: int, request_id: str) -> FinishResult:
        removed, dropped, fenced = self.local.finish(slot, request_id)
        self._note_local("on_task_finished", FinishOp(slot, request_id, self._server_ms()))
        return FinishResult(removed=removed, dropped=dropped, fenced=fenced)

    def _note_local(self, operation: str, op: Operation) -> None:
        self._journal.append(op)
        self._local_calls[operation] += 1
        self._episode_calls += 1

    def _holds(self, task: CacheTask) -> bool:
        """Under the lock: ``task`` is still its slot's task in this process."""
        holder = self.local.tasks.get(task.slot)
        return holder is not None and holder.task.request_id == task.request_id

    def _settle_group(self, progress: Progress, first_new: int, arrived: int = 0) -> Batch:
        """Under the lock, for a tensor-parallel rank: queue each released entry as its own
        batch, in order, log the dropped ones, and count both for Redis (see
        ``Progress.counts``). Returns the released entries (already queued)."""
        assert self.owned is not None
        released: Batch = []
        for entry in progress.released:
            batch = [(entry.slot, entry.tokens)]
            self.ready.put(batch)
            released.extend(batch)
        for entry, reason in progress.dropped:
            self.logger.warning(
                "%s/%d: dropped layer-0 entry %d (slot %d, %d tokens): %s",
                self.instance,
                self.rank,
                entry.seq,
                entry.slot,
                entry.tokens,
                reason.value,
            )
        counts = progress.counts(first_new, arrived)
        if counts:
            self.owned.count(counts)
            if self._pending_since is None:  # a decision of the group thread: wake the writer
                self._pending_since = time.monotonic()
                if self._writer_waits:
                    self._wake.notify_all()
        return released

    def _queue(self, entries: Iterable[tuple[int, int]]) -> Batch:
        """Put one batch on the sender's queue: entries of a slot whose registration is on its
        way wait behind it; an entry no further along than what the sender already has for
        its request is dropped (its blocks are covered). Where the process owns its rank there
        are no gates, and ``OwnedRank.record`` leaves out the same entries in its own loop."""
        batch: Batch = []
        for slot, tokens in entries:
            gate = self._gates.get(slot)
            if gate is not None:
                gate.append((slot, tokens))
                continue
            holder = self.local.tasks.get(slot)
            if holder is not None:
                if tokens <= holder.queued_tokens:
                    self._suppressed += 1
                    continue
                holder.queued_tokens = tokens
            batch.append((slot, tokens))
        if batch:
            self.ready.put(batch)
        return batch

    # -- episodes --------------------------------------------------------------------------

    def _degrade(self, operation: str, exc: BaseException, log: bool = True) -> bool:
        """Under the lock: count the error; start an episode (logged once, with its cause,
        unless ``log`` is False: the caller then logs it with ``_log_degraded`` once it released
        the lock, which the hooks wait for). True when the episode started here."""
        self._errors[operation] += 1
        if self._degraded_since is not None:
            return False
        self._degraded_since = time.monotonic()
        self.local.counting = True
        self._episodes += 1
        self._episode_calls = self._episode_reconciled = 0
        if log:
            self._log_degraded(operation, exc)
        if self.owned is None and (self._reconciler is None or not self._reconciler.is_alive()):
            self._reconciler = threading.Thread(target=self._reconcile_loop, name="rls-reconcile", daemon=True)
            self._reconciler.start()
        return True

    def _log_degraded(self, operation: str, exc: BaseException) -> None:
        self.logger.warning(
            "%s/%d: Redis failed in %s (%s: %s); serving this process locally until it answers",
            self.instance,
            self.rank,
            operation,
            type(exc).__name__,
            exc,
            exc_info=exc,
        )

    def _reconcile_loop(self) -> None:
        while not self._closed.wait(self.probe_s):
            try:
                if self.reconcile():
                    return
            except Exception as exc:  # still unreachable: the next probe tries again
                self.logger.debug("%s/%d: still degraded: %s", self.instance, self.rank, exc)

    def _end_episode(self) -> tuple[float, int, int]:
        """Under the lock, with the journal written back: serve from Redis again. Returns the
        episode's seconds, calls served locally and entries written back."""
        assert self._degraded_since is not None
        seconds = time.monotonic() - self._degraded_since
        self._degraded_total += seconds
        self._degraded_since = None
        # Every local decision is in Redis now, counted there: the local signals are Redis's too.
        self.local.counting = False
        self.local.counts.clear()
        self.local.early = {slot: dataclasses.replace(s, shared=True) for slot, s in self.local.early.items()}
        calls, entries = self._episode_calls, self._episode_reconciled
        self.logger.warning(
            "%s/%d: Redis answers again after %.1fs degraded: %d calls served locally, %d entries written back",
            self.instance,
            self.rank,
            seconds,
            calls,
            entries,
        )
        return seconds, calls, entries

    def _write_episode(self, seconds: float, calls: int, entries: int) -> None:
        """Add the episode to the rank's counters, best effort and never resent (a counter
        increment has no idempotency token)."""
        stats = self.buffer.protocol.keys.rank(self.instance, self.rank).stats
        client = self.buffer.client
        try:
            client.hincrby(stats, STATS_DEGRADED_MS, round(seconds * 1000))
            client.hincrby(stats, STATS_SERVED_LOCALLY, calls)
            client.hincrby(stats, STATS_RECONCILED, entries)
        except Exception as exc:
            self.logger.warning("%s/%d: could not add the episode to the counters: %s", self.instance, self.rank, exc)

    def _bug(self, operation: str, exc: Exception) -> None:
        """An error of the bridge itself, after the Redis call: count it, log it with its
        traceback once per kind, and let FastDeploy's loop go on."""
        with self._lock:
            self._errors[operation] += 1
            kind = f"bug:{operation}:{type(exc).__name__}"
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            self.logger.error(
                "%s/%d: %s failed in the bridge itself", self.instance, self.rank, operation, exc_info=exc
            )

    def _invalid(self, operation: str, exc: InvalidSignal | InvalidTask) -> None:
        """Count bad input; log it once until the same hook succeeds again."""
        with self._lock:
            self._errors[operation] += 1
            first = operation not in self._logged
            self._logged.add(operation)
        if first:
            self.logger.error("%s/%d: %s skipped invalid input: %s", self.instance, self.rank, operation, exc)
        else:
            self.logger.debug("%s/%d: %s skipped invalid input: %s", self.instance, self.rank, operation, exc)

    def _log_local_verdict(self, task: CacheTask, early: EarlySignal, reason: Any) -> None:
        if reason is None:
            self.logger.debug(
                "slot %d: early layer-0 signal (%d tokens) handed to %s", task.slot, early.tokens, task.request_id
            )
        else:
            self._log_dropped(task, early.tokens, reason)

    def _log_dropped(self, task: CacheTask, tokens: int, reason: Any) -> None:
        self.logger.warning(
            "dropped early layer-0 signal of slot %d (%d tokens) for request %s: %s",
            task.slot,
            tokens,
            task.request_id,
            reason.value,
        )


def layer0_entries(kv_signal_data: Any) -> Batch:
    """The ``(slot, prefilled_tokens)`` entries of a layer-0 message (raw or decoded); ``[]``
    for an empty read or a later layer, whose entries are not decoded (this runs once per layer
    and chunk). A list, the batch shape ``record`` checks fastest."""
    return list(_layer0(kv_signal_data))


def _layer0(kv_signal_data: Any) -> Sequence[tuple[int, int]]:
    """``layer0_entries`` without the copy."""
    if type(kv_signal_data) is KvSignal or isinstance(kv_signal_data, KvSignal):
        signal: KvSignal | None = kv_signal_data
    else:
        signal = decode_kv_signal(kv_signal_data, only_layer=SIGNAL_LAYER)
    if signal is None or signal.layer != SIGNAL_LAYER:
        return ()
    return signal.entries


def block_ids(task: CacheTask, field: str) -> list[int]:
    """The block ids a task's meta carries (``src_block_ids`` or ``dest_block_ids``)."""
    text = task.meta.get(field, "")
    return [int(part) for part in text.split(",")] if text else []


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _required(cache_info: Mapping[str, Any], field: str) -> Any:
    if field not in cache_info:
        raise InvalidTask(field, None, "missing from cache_info")
    return cache_info[field]


def _int_in(cache_info: Mapping[str, Any], field: str, high: int, default: int | None = None, name: str = "") -> int:
    """``cache_info[field]`` (``default`` when missing, if given), an int in ``[0, high)``;
    the error names ``name`` (the task's field) for a value out of range. A plain int in
    range, every registration's case, is settled by the first test."""
    value = cache_info.get(field, default)
    if type(value) is int and 0 <= value < high:
        return value
    if field in cache_info or default is None:
        value = _as_int(_required(cache_info, field), field)
    return validation.integer(value, name or field, InvalidTask, 0, high)


def _join_ints(values: Any, field: str) -> str:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise InvalidTask(field, values, "must be a list of block ids")
    return ",".join([str(_as_int(value, f"{field}[{index}]")) for index, value in enumerate(values)])


def _as_int(value: Any, field: str) -> int:
    """An int; numpy and paddle scalars are accepted through ``__index__``, bools are not."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidTask(field, value, "must be an int")
    return int(value.__index__())
