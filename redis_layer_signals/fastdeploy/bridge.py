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

import logging
import queue
from collections.abc import Mapping, Sequence
from typing import Any

from .. import validation
from ..buffer.sync import SignalBuffer
from ..config import require_shared
from ..constants import MAX_INT
from ..errors import InvalidConfig, InvalidSignal, InvalidTask
from ..models import CacheTask, FinishResult
from ..server import eviction
from .agreement import Member
from .cache_info import META_DEST_BLOCKS, META_PASSTHROUGH, META_SRC_BLOCKS, block_ids
from .cache_info import cache_task as _cache_task
from .context import (
    STATS_DEGRADED_MS,
    STATS_RECONCILED,
    STATS_SERVED_LOCALLY,
    Batch,
    QueueLike,
    RankContext,
    ReadySource,
)
from .health import BridgeHealth
from .identity import DEFAULT_LEASE_S, IdentityClaim, lease_seconds
from .local import LocalState
from .logs import BridgeLog
from .owned_layout import OwnedLayout
from .owner import OwnedRank
from .shared_layout import SharedLayout
from .signals import SIGNAL_LAYER, KvSignal, decode_kv_signal

logger = logging.getLogger(__name__)
_module_logger = logger

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "META_DEST_BLOCKS",
    "META_PASSTHROUGH",
    "META_SRC_BLOCKS",
    "STATS_DEGRADED_MS",
    "STATS_RECONCILED",
    "STATS_SERVED_LOCALLY",
    "Batch",
    "Layer0Bridge",
    "QueueLike",
    "ReadySource",
    "block_ids",
    "layer0_entries",
]

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
    this module's logger; ``bridge_for_messager`` passes FastDeploy's): any object with
    ``debug``, ``info``, ``warning`` and ``error`` taking one string.
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
        logger: Any = None,
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
        if ready is not None and not hasattr(ready, "put") and not callable(ready):
            raise InvalidConfig("ready", ready, "must be a queue or a callable returning one")
        nranks = validation.integer(nranks, "nranks", InvalidConfig, 1, MAX_NRANKS + 1)
        if nranks > 1 and not registers_tasks:
            raise InvalidConfig("nranks", nranks, "above 1 needs registers_tasks=True (FastDeploy's layout)")
        self.logger = BridgeLog(logger if logger is not None else _module_logger)
        """Where the bridge logs: the logger given (FastDeploy's, from ``bridge_for_messager``),
        each line formatted here and passed as one string (see ``logs``)."""
        self.buffer = buffer
        self.instance = instance
        self.rank = rank
        self.block_size = block_size
        self.num_layers = num_layers
        self.registers_tasks = registers_tasks
        self.probe_s = float(probe_s)
        self.hook_budget_s = float(hook_budget_ms) / 1000
        self._max_slots = buffer.config.max_slots
        self._bridge_error: InvalidTask | None = None
        """Why no task of this bridge is valid (its instance, rank or num_layers), else None:
        checked once, each registration then refused with it."""
        try:
            buffer.protocol.task_keys(CacheTask(instance, rank, 0, "probe", 0, num_layers))
        except InvalidTask as exc:
            self._bridge_error = exc
        self._ctx = RankContext(
            buffer, instance, rank, ready if ready is not None else queue.Queue(), self.probe_s, self.logger
        )
        self._layout: OwnedLayout | SharedLayout = (
            OwnedLayout(self._ctx, nranks, lease_s) if registers_tasks else SharedLayout(self._ctx, self.hook_budget_s)
        )
        """The layout, chosen once: this process owns its rank, or shares it and Redis judges."""

    @property
    def ready(self) -> QueueLike:
        """The sender's queue as of now (a callable ``ready`` is called each time)."""
        return self._ctx.ready

    @property
    def local(self) -> LocalState:
        """What the process knows of its rank's slots (the sender's queue checks it)."""
        return self._ctx.local

    @property
    def owned(self) -> OwnedRank | None:
        """This process's decisions for its rank, which the writer copies to Redis; None when
        Redis judges (the adder runs in another process)."""
        return self._layout.owned if isinstance(self._layout, OwnedLayout) else None

    @property
    def identity(self) -> IdentityClaim | None:
        """The claim on (instance, rank) the writer holds in Redis; None where Redis judges."""
        return self._layout.identity if isinstance(self._layout, OwnedLayout) else None

    @property
    def group(self) -> Member | None:
        """A tensor-parallel rank's layer-0 entries in the group's order; None otherwise."""
        return self._layout.group if isinstance(self._layout, OwnedLayout) else None

    @property
    def _gates(self) -> Mapping[int, Batch]:
        return self._layout.gates if isinstance(self._layout, SharedLayout) else {}

    @property
    def _journal(self) -> Sequence[Any]:
        return self._layout.journal if isinstance(self._layout, SharedLayout) else ()

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
            pairs = _layer0(kv_signal_data)
        except InvalidSignal as exc:
            self._ctx.invalid("on_kv_signal", exc)
            return []
        except Exception as exc:  # a bug of ours: logged, never raised into FastDeploy's loop
            self._ctx.bug("on_kv_signal", exc)
            return []
        if not pairs:
            return []
        try:
            return self._layout.record(pairs, request_ids)
        except Exception as exc:  # a bug of ours: logged, never raised into FastDeploy's loop
            self._ctx.bug("on_kv_signal", exc)
            return []

    def on_cache_task(self, cache_info: Mapping[str, Any]) -> Batch:
        """In ``_add_cache_task_thread``, once both halves are merged and the task is in
        ``idx_cache_task_dict``, outside FastDeploy's lock: register the task and queue the
        layer-0 batch that waited for it (returned too, already queued; ``[]`` if none).

        A slot still held by another request is taken over, as FastDeploy overwrites it, with
        a warning naming both requests. Early signals the buffer refused (over
        ``need_prefill_tokens``, expired, ...) are logged with their reason.
        """
        try:
            task = self.cache_task(cache_info)
        except InvalidTask as exc:
            self._ctx.invalid("on_cache_task", exc)
            return []
        except Exception as exc:  # a bug of ours: logged, never raised into FastDeploy's loop
            self._ctx.bug("on_cache_task", exc)
            return []
        try:
            return self._layout.register(task)
        except Exception as exc:  # a bug of ours: logged, never raised into FastDeploy's loop
            self._ctx.bug("on_cache_task", exc)
            return []

    def on_task_finished(self, current_id: int, request_id: str) -> FinishResult:
        """In the sender, for each request it completed, before FastDeploy's lock block that
        reports it (``put_finished_req``) and deletes ``idx_cache_task_dict[current_id]``:
        release the slot, fenced by ``request_id`` (a late call for an older request never
        touches the request that now holds the slot), and drop signals still waiting for an
        aborted request. Returns what happened (decided locally while degraded)."""
        try:
            validation.slot(current_id, self._max_slots, InvalidTask)
            validation.identifier(request_id, "request_id", InvalidTask)
        except InvalidTask as exc:
            self._ctx.invalid("on_task_finished", exc)
            return FinishResult(removed=False, dropped=0, fenced=False)
        try:
            return self._layout.finish(current_id, request_id)
        except Exception as exc:  # a bug of ours: logged, never raised into FastDeploy's loop
            self._ctx.bug("on_task_finished", exc)
            return FinishResult(removed=False, dropped=0, fenced=False)

    def cache_task(self, cache_info: Mapping[str, Any]) -> CacheTask:
        """Map FastDeploy's merged ``cache_info`` dict to a ``CacheTask`` (no I/O), every
        field checked before any state changes (the bridge's own fields once, at start)."""
        if self._bridge_error is not None and (type(cache_info) is dict or isinstance(cache_info, Mapping)):
            raise self._bridge_error
        return _cache_task(cache_info, self.instance, self.rank, self.num_layers, self._max_slots)

    # -- state ----------------------------------------------------------------------------

    def health(self) -> BridgeHealth:
        ctx = self._ctx
        with ctx.lock:
            return BridgeHealth(
                degraded=ctx.degraded_since is not None,
                episodes=ctx.episodes,
                degraded_seconds=ctx.degraded_seconds(),
                local_calls=dict(ctx.local_calls),
                reconciled_entries=ctx.reconciled,
                errors=dict(ctx.errors),
                suppressed=ctx.suppressed,
                evicting=eviction.evicting(self.buffer.policies),
                **self._layout.health_fields(),
            )

    def flush(self, timeout_s: float) -> bool:
        """Wait until Redis holds every decision made so far (True), or ``timeout_s`` passes
        (False); False at once while another process owns the identity (nothing is written
        then). Where the process owns its rank, also until the writer has claimed the identity
        and adopted what a predecessor left. For tests, shutdown and operators; no hook ever
        waits for Redis."""
        return self._layout.flush(timeout_s)

    def claimed(self, timeout_s: float) -> bool:
        """Wait for the outcome of the identity's claim: True once this bridge owns its
        (instance, rank) in Redis (at once where Redis judges: no process owns the rank then);
        False when Redis gave no answer within ``timeout_s``. Raises ``IdentityTaken`` while
        another live process holds the identity."""
        return self._layout.claimed(timeout_s)

    def reconcile(self) -> bool:
        """Write back what was decided locally, if Redis answers; True once the bridge serves
        from Redis again (also when it was never degraded). The background thread calls this
        every ``probe_s`` while degraded; calling it yourself is harmless. Where the process
        owns its rank the writer does this: it waits for it (see ``flush``), at most the
        buffer's ``retry_s``."""
        return self._layout.reconcile()

    def close(self) -> None:
        """Stop the background writers, once what was decided is written (waiting at most the
        buffer's ``retry_s``, none while Redis does not answer): what is left stays unwritten.
        Then give the identity up, so that a successor claims it at once."""
        self._layout.close()


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
