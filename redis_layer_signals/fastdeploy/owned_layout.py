"""The owned layout: this process registers every task of its rank, and decides every hook.

FastDeploy's layout: one process runs the signal consumer, the task adder and the sender of
its rank. Every hook call is decided in the process (``owner.OwnedRank``), with the semantics
of FastDeploy's own fix, and never waits for Redis; a background writer claims the rank's
identity, adopts what a predecessor left, then copies the decisions to Redis in one call per
batch (``rls_v2_apply``), so Redis, ``rls inspect`` and the counters follow, behind by the
writer's lag. With ``nranks > 1`` the layer-0 entries are queued in the order the
tensor-parallel group agrees on (``agreement``, carried by ``group_link``); Redis still holds
each early signal and counts it, as for a rank of its own.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..errors import IdentityTaken, OwnershipLost
from ..models import CacheTask, FinishResult
from ..protocol.calls import Claim, new_token
from ..protocol.replies import text
from .agreement import Member, Progress
from .context import STATS_DEGRADED_MS, STATS_RECONCILED, STATS_SERVED_LOCALLY, Batch, RankContext
from .group_link import GroupLink
from .health import WaitHistogram
from .identity import (
    LAPSED,
    TAKEN,
    TOOK,
    ClaimResult,
    IdentityClaim,
    clash_message,
    lapsed_message,
    release_quietly,
)
from .owner import OwnedRank
from .signals import SIGNAL_LAYER

NO_CLAIM = Claim("", 0, "")
"""What a batch carries when the writer holds no claim (never sent: the claim is checked first)."""
OFFSET_MAX_ROUND_TRIP_S = 1.0
"""A reply that took longer (resent after errors) says too little about the clocks' offset."""

_WHY = {
    "lost": "a rank of the group restarted while its request was in flight",
    "abandoned": "not every rank of the group had its task in time",
    "expired": "its task never registered within pending_ttl_s",
}
"""The words a dropped group entry is logged with (else the drop reason's value)."""


def _always() -> bool:
    return True


_FINISHED = {
    (removed, dropped, fenced): FinishResult(removed=removed, dropped=dropped, fenced=fenced)
    for removed in (False, True)
    for dropped in (0, 1)
    for fenced in (False, True)
}
"""The results a finish decided in the process can have (frozen: one of each is shared)."""


class OwnedLayout:
    """One owned rank: its decisions (``owned``), its writer thread and its identity claim.

    The constructor makes no Redis call: the writer claims and adopts before its first batch,
    so a Redis that accepts connections and never answers delays no start."""

    def __init__(self, ctx: RankContext, nranks: int, lease_s: float) -> None:
        self.ctx = ctx
        buffer = ctx.buffer
        self.owned = OwnedRank(ctx.pending_ttl_ms, buffer.protocol.task_ttl_ms)
        ctx.local.tasks = self.owned.tasks  # one map: what the sender's queue checks
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
        self.identity = IdentityClaim(buffer, ctx.instance, ctx.rank, self._writer_token, lease_s)
        """The claim on (instance, rank) the writer holds in Redis: one identity, one owner."""
        self._claim = "claiming"
        """"claiming" until the writer's first claim is answered, then "held" or "refused"."""
        self._refusal: IdentityTaken | None = None
        """Why the identity is refused (another live process holds it), while it is."""
        self._refusals = 0
        """Refusal episodes: times the bridge found another live process holding its identity."""
        self._adopted = False
        """The writer claimed the identity and adopted what a predecessor left: until then the
        hooks decide in the process, as they always do, and nothing is written."""
        self.group: Member | None = None
        """A tensor-parallel rank's side of its group (``nranks > 1``): what it queues is what
        the group agreed on (see ``agreement``); None for a rank of its own."""
        self._link: GroupLink | None = None
        self.group_outcomes: collections.Counter[str] = collections.Counter()
        """Entries the group queued (``released``) or dropped, by why (see ``settle_group``)."""
        self.group_wait = WaitHistogram()
        """How long each entry the group released waited, once ready here, for the others."""
        if nranks > 1:
            self.group = Member(give_up_ms=ctx.pending_ttl_ms)
            namespace = buffer.protocol.keys.namespace
            self._link = GroupLink(ctx, self.group, nranks, self._writer_token, namespace, self.settle_group)
        self._writer = threading.Thread(target=self._write_loop, name="rls-writer", daemon=True)
        self._writer.start()
        if self._link is not None:
            self._link.start()

    # -- the hooks' decisions ----------------------------------------------------------------

    def record(self, pairs: Any, request_ids: Mapping[int, str] | None) -> Batch:
        ctx = self.ctx
        with ctx.lock:
            now_ms = ctx.mono_ms()
            queued, suppressed = self.owned.record(pairs, request_ids, now_ms)
            if self.group is not None and self._link is not None:
                # Redis holds and counts the early signals as for a rank of its own; what is
                # queued is the group's to decide.
                progress = self.group.arrive(pairs, request_ids, now_ms)
                self._link.post(progress)
                self.settle_group(progress)
                self._decided("on_kv_signal")
                return []
            if queued:
                ctx.ready.put(queued)
            ctx.suppressed += suppressed
            self._decided("on_kv_signal")
        return queued

    def register(self, task: CacheTask) -> Batch:
        ctx = self.ctx
        with ctx.lock:
            # An early signal Redis holds is handed out only while the claim surely holds (see
            # ``identity``): past it, another owner may have adopted the signal.
            # A tensor-parallel rank never hands out a signal Redis holds on its own (the group
            # does, once every rank has it), so it has nothing to hold back.
            usable = self.identity.holds if self.group is None else _always
            taken_from, tokens, reason = self.owned.register(task, ctx.mono_ms(), usable)
            self._decided("on_cache_task")
            if taken_from is not None:
                ctx.log_takeover(task, taken_from)
            if self.group is not None and self._link is not None:
                progress = self.group.registered(task, ctx.mono_ms())
                self._link.post(progress)
                self.settle_group(progress)
                return []
            if tokens is None:
                return []
            if reason is not None:
                ctx.log_dropped(task, tokens, reason)
                return []
            batch = [(task.slot, tokens)]
            ctx.ready.put(batch)
        if ctx.logger.enabled("debug"):
            ctx.logger.debug(
                "slot %d: early layer-0 signal (%d tokens) handed to %s", task.slot, tokens, task.request_id
            )
        return batch

    def finish(self, slot: int, request_id: str) -> FinishResult:
        ctx = self.ctx
        with ctx.lock:
            outcome = self.owned.finish(slot, request_id, ctx.mono_ms())
            if self.group is not None:
                self.group.finished(slot, request_id)
            self._decided("on_task_finished")
        if outcome[2]:
            ctx.logger.info("finish of %s on slot %d fenced: another request holds it", request_id, slot)
        return _FINISHED[outcome]

    def settle_group(self, progress: Progress) -> None:
        """Under the lock, for a tensor-parallel rank: queue each entry the group released as
        its own batch, in the group's order, and log the ones dropped (the group's counts are
        ``group_outcomes``; Redis counts the early signals as for a rank of its own)."""
        ctx = self.ctx
        outcomes = self.group_outcomes
        now_ms = ctx.mono_ms() if progress.released else 0
        for entry in progress.released:
            ctx.ready.put([(entry.slot, entry.tokens)])
            if entry.ready_ms:
                self.group_wait.observe((now_ms - entry.ready_ms) / 1000)
        if progress.released:
            outcomes["released"] += len(progress.released)
        for entry, why in progress.dropped:
            outcomes[why] += 1
            log = ctx.logger.error if why == "lost" else ctx.logger.warning
            log(
                "%s/%d: dropped layer-0 entry (slot %d, %d tokens, request %s): %s",
                ctx.instance,
                ctx.rank,
                entry.slot,
                entry.tokens,
                entry.key[0] if entry.key else entry.request_id or "?",
                _WHY.get(why, why),
            )

    def _decided(self, operation: str) -> None:
        """Under the lock: a hook decided; wake the writer with the first decision it has not
        taken yet (it takes everything decided until then in one batch)."""
        ctx = self.ctx
        if self._pending_since is None:
            self._pending_since = time.monotonic()
            if self._writer_waits:
                ctx.wake.notify_all()
        if ctx.degraded_since is not None:
            ctx.local_calls[operation] += 1
            ctx.episode_calls += 1

    # -- state ---------------------------------------------------------------------------------

    def health_fields(self) -> dict[str, Any]:
        """Under the lock: this layout's fields of ``BridgeHealth``."""
        fields: dict[str, Any] = {
            "journal": 0,
            "unwritten": self._unwritten(),
            "lag_seconds": self._lag_seconds(),
            "identity": self._claim,
            "identity_holder": self._refusal.holder if self._refusal is not None else "",
            "identity_refusals": self._refusals,
            "early_wait": self.owned.early_wait.snapshot(),
        }
        if self.group is not None and self._link is not None:
            state = self._link.state
            fields["group_waiting"] = len(self.group.waiting)
            fields["group_reported"] = len(self.group.reported)
            fields["group_generation"] = state.generation
            fields["group_sequencer"] = state.sequencer
            fields["group_connected"] = state.connected
            fields["group_problem"] = state.problem
            fields["group_events"] = dict(state.events)
            fields["group_outcomes"] = dict(self.group_outcomes)
            fields["group_wait"] = self.group_wait.snapshot()
        return fields

    def _unwritten(self) -> int:
        """Under the lock: hook decisions Redis does not hold yet."""
        in_flight = max(1, self._in_flight[1]) if self._in_flight is not None else 0
        rest = int(not self.owned.decisions and (self._resync or self.owned.unwritten()))
        return self.owned.decisions + in_flight + rest

    def _lag_seconds(self) -> float:
        """Under the lock: the age of the oldest decision Redis does not hold yet."""
        times = [t for t in (self._pending_since, self._in_flight[0] if self._in_flight else None) if t is not None]
        return time.monotonic() - min(times) if times else 0.0

    def flush(self, timeout_s: float) -> bool:
        """Wait until the writer has claimed the identity, adopted, and Redis holds every
        decision made so far (True), or ``timeout_s`` passes (False); False at once while
        another process owns the identity (nothing is written then)."""
        deadline = time.monotonic() + timeout_s
        with self.ctx.wake:
            while not self._adopted or self._unwritten():
                left = deadline - time.monotonic()
                if left <= 0 or self._refusal is not None:
                    return False
                self.ctx.wake.wait(left)
            return True

    def claimed(self, timeout_s: float) -> bool:
        """Wait for the outcome of the identity's claim (see ``Layer0Bridge.claimed``)."""
        deadline = time.monotonic() + timeout_s
        with self.ctx.wake:
            while True:
                if self._refusal is not None:
                    raise self._refusal
                if self._claim == "held":
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.ctx.wake.wait(left)

    def reconcile(self) -> bool:
        """The writer writes back: wait for it, at most the buffer's ``retry_s``."""
        if not self.flush(self.ctx.buffer.config.retry_s):
            return False
        with self.ctx.lock:
            return self.ctx.degraded_since is None

    def close(self) -> None:
        """Stop the writer once what was decided is written (at most the buffer's ``retry_s``,
        none while Redis does not answer), then give the identity up."""
        ctx = self.ctx
        if ctx.degraded_since is None:
            self.flush(ctx.buffer.config.retry_s)
        ctx.closed.set()
        with ctx.wake:
            ctx.wake.notify_all()
        self._writer.join(5)
        if self._link is not None:
            self._link.join(5)
        stopped = not self._writer.is_alive()
        if stopped and self._claim == "held" and ctx.degraded_since is None:
            release_quietly(self.identity)

    # -- the writer: Redis follows the process's decisions ---------------------------------------

    def _adopt(self, claim: ClaimResult) -> None:
        """With the identity claimed: what an earlier process of this rank left in Redis (see
        ``OwnedRank.adopt``); raises what reading it raised."""
        ctx = self.ctx
        if claim.outcome == TOOK and claim.holder is not None:
            ctx.logger.warning(
                "%s/%d: took the identity over from %s, which is gone (its pid is not alive on this host)",
                ctx.instance,
                ctx.rank,
                claim.holder.describe(),
            )
        elif claim.outcome == LAPSED:
            ctx.logger.warning("%s", lapsed_message(ctx.instance, ctx.rank, claim))
        elif self._refusal is not None:
            ctx.logger.warning(
                "%s/%d: claimed the identity %s held (its lease ran out)",
                ctx.instance,
                ctx.rank,
                self._refusal.holder,
            )
        buffer = ctx.buffer
        keys = buffer.protocol.keys.rank(ctx.instance, ctx.rank)
        pending_raw = buffer.client.hgetall(keys.pending)
        live_raw = buffer.client.hgetall(keys.live)
        sent = time.monotonic()
        now = buffer.now_ms()
        received = time.monotonic()
        pending: dict[int, str] = {}
        suffix = f":{SIGNAL_LAYER}"
        for field, value in pending_raw.items():
            name, value_text = text(field), text(value)
            if name.endswith(suffix) and name[: -len(suffix)].isdigit():
                pending[int(name[: -len(suffix)])] = value_text
        holders = {int(text(f)): text(v)[17:] for f, v in live_raw.items() if text(f).isdigit()}
        with ctx.lock:
            ctx.anchor(now, sent, received)
            late = self.owned.adopt(pending, holders, ctx.mono_ms(), ctx.to_mono, keep_early=self.group is None)
            if late and self.group is None:
                ctx.ready.put(late)
            self._settle_held_back()
            if self.owned.unwritten() and self._pending_since is None:
                self._pending_since = time.monotonic()
            if self._refusal is not None:
                self._resync = True  # the other process wrote the rank meanwhile
            self._claim, self._refusal, self._adopted = "held", None, True
            ctx.wake.notify_all()

    def _write_loop(self) -> None:
        """The writer thread, until the bridge closes: claims the identity and adopts, then
        writes. A bug of its own is logged and counted (``health().errors["writer"]``) and the
        writer goes on: the batch it held is sent with the next, which lists every slot of the
        rank. An identity lost to another process (its lease ran out meanwhile: the server
        refused a write or a renewal) is claimed again, as at start."""
        if not self._start():
            return
        while True:
            try:
                self._write_batches()
                return
            except OwnershipLost as lost:
                self._give_back()
                self._lose(lost)
                if not self._start():
                    return
            except Exception as exc:
                self.ctx.bug("writer", exc)
                self._give_back()
                if self.ctx.closed.wait(self.ctx.probe_s):
                    return

    def _give_back(self) -> None:
        """The batch in flight will not be confirmed: it goes with the next, which lists every slot."""
        with self.ctx.wake:
            self.owned.give_back()
            self._in_flight = None
            self._resync = True
            if self._pending_since is None:
                self._pending_since = time.monotonic()

    def _outage(self, exc: BaseException) -> None:
        """The writer's call failed: an episode (a traceback is formatted outside the lock)."""
        with self.ctx.lock:
            started = self.ctx.degrade("writer", exc, log=False)
        if started:
            self.ctx.log_degraded("writer", exc)

    def _start(self) -> bool:
        """Claim the identity, then adopt what a predecessor left, before the first batch; False
        when the bridge closed first. Refused (another live process holds the identity), the
        bridge writes nothing, serves its process locally and claims again every third of the
        lease. Unanswered, it counts as an outage, and tries again every ``probe_s``."""
        ctx = self.ctx
        refused = self._refusal is not None  # lost while running: counted and logged already
        while not ctx.closed.is_set():
            try:
                result = self.identity.claim(count_refusal=not refused)
                if result.outcome == TAKEN:
                    self._refused(result, first=not refused)
                    refused = True
                    if ctx.closed.wait(self.identity.renew_s):
                        return False
                    continue
                self._adopt(result)
                return True
            except Exception as exc:
                self._outage(exc)
                if ctx.closed.wait(ctx.probe_s):
                    return False
        return False

    def _refused(self, result: ClaimResult, first: bool) -> None:
        """Another live process holds the identity: say so (once per episode, at ERROR)."""
        ctx = self.ctx
        holder = result.holder.describe() if result.holder is not None else "another process"
        error = IdentityTaken(ctx.instance, ctx.rank, holder, self.identity.me.describe())
        if first:  # logged before anyone waiting in ``claimed`` hears of it
            ctx.logger.error("%s", error)
        with ctx.wake:
            if self._refusal is None:
                self._refusals += 1
            if not isinstance(self._refusal, OwnershipLost):  # what ``claimed`` raises: the loss
                self._refusal = error
            self._claim = "refused"
            self._adopted = False
            if ctx.degraded_since is not None:
                # Redis answers (it refused): the outage is over; counted with the next batch.
                seconds, calls, _entries = ctx.end_episode()
                self.owned.counts[STATS_DEGRADED_MS] += max(1, round(seconds * 1000))
                self.owned.counts[STATS_SERVED_LOCALLY] += calls
            ctx.wake.notify_all()

    def _lose(self, lost: OwnershipLost) -> None:
        """The server refused this process's write or renewal: another process claimed the rank
        since. Say so once (ERROR, naming it), give up what Redis holds for the rank (the new
        owner's now: no early signal handed out by both) and serve the process locally, as a
        refused claimant does; the writer then claims again every third of the lease."""
        ctx = self.ctx
        ctx.logger.error("%s", lost)
        with ctx.wake:
            given_up = self.owned.disown()
            if self._refusal is None:
                self._refusals += 1
            self._refusal = lost
            self._claim = "refused"
            self._adopted = False
            ctx.wake.notify_all()
        if given_up:
            ctx.logger.warning(
                "%s/%d: gave up %d early signals Redis holds for the rank: its new owner hands them out",
                ctx.instance,
                ctx.rank,
                given_up,
            )

    def _settle_held_back(self) -> None:
        """Under the lock, the claim just renewed: early signals held back from their tasks
        while it might have lapsed go to them now (see ``OwnedRank.settle_held_back``)."""
        if not self.owned.held_back:
            return
        ctx = self.ctx
        queued, dropped = self.owned.settle_held_back(ctx.mono_ms())
        for task, tokens, reason in dropped:
            ctx.log_dropped(task, tokens, reason)
        if queued:
            ctx.ready.put(queued)
        self.owned.decisions += 1
        if self._pending_since is None:
            self._pending_since = time.monotonic()

    def _renew(self, before_write: bool) -> None:
        """Renew the claim; raises ``OwnershipLost`` when another process holds it now (this
        one's lease ran out meanwhile), what the call raises when Redis does not answer.
        ``before_write``: only when the lease might end before a write sent now is done. A
        process the server refused the rank since is logged, naming it."""
        if before_write and self.identity.valid_for(self.ctx.buffer.config.retry_s + self.ctx.probe_s):
            return
        if not before_write and not self.identity.renewal_due():
            return
        result = self.identity.claim(count_refusal=True)
        if result.outcome == TAKEN:
            raise self.identity.lost(result.holder, "renewal")
        if result.clash is not None:
            self.ctx.logger.error("%s", clash_message(self.ctx.instance, self.ctx.rank, self.identity.me, result.clash))
        with self.ctx.lock:
            self._settle_held_back()

    def _renew_quietly(self) -> None:
        """The idle writer's renewal: a Redis that does not answer is tried again later (the
        lease is checked again before the next write)."""
        try:
            self._renew(before_write=False)
        except OwnershipLost:
            raise
        except Exception as exc:
            self.ctx.logger.debug(
                "%s/%d: could not renew the identity's lease: %s", self.ctx.instance, self.ctx.rank, exc
            )

    def _write_batches(self) -> None:
        """Take what the process decided and not yet written, send it as one ``apply``, again
        until Redis has it; the next batch holds what was decided meanwhile, compacted."""
        ctx, owned, identity, buffer = self.ctx, self.owned, self.identity, self.ctx.buffer
        every_slot = False
        while True:
            self._renew_quietly()  # outside the lock, when a third of the lease has passed
            with ctx.wake:
                # Degraded (the start met an outage): a batch, even empty, ends the episode.
                while not (ctx.closed.is_set() or owned.unwritten() or self._resync or ctx.degraded_since):
                    if identity.renewal_due():
                        break
                    self._writer_waits = True
                    ctx.wake.wait(ctx.probe_s)
                    self._writer_waits = False
                    owned.expire(ctx.mono_ms())  # the local sweep, also when the rank is idle
                if ctx.closed.is_set():
                    return
                if not (owned.unwritten() or self._resync or ctx.degraded_since):
                    continue  # woke to renew the lease
                started = self._pending_since or time.monotonic()
                also = range(buffer.config.max_slots) if self._resync else range(0)
                batch = owned.take(ctx.to_server, every_slot, also)
                self._resync = False
                self._in_flight = (started, batch.decisions)
                self._pending_since = None
            keys = buffer.protocol.keys.rank(ctx.instance, ctx.rank)
            self._batches += 1
            claim = identity.held()
            prepared = buffer.protocol.apply(
                keys, SIGNAL_LAYER, batch.counts, batch.slots, self._writer_token, self._batches, claim or NO_CLAIM
            )
            every_slot = False
            while True:
                try:
                    self._renew(before_write=True)  # no write without the lease (OwnershipLost)
                    current = identity.held()
                    if current is None:  # no claim held (given up meanwhile): nothing is written without one
                        raise identity.lost(None)
                    if current is not claim:  # claimed anew (Redis had lost the key)
                        claim = current
                        prepared = buffer.protocol.apply(
                            keys, SIGNAL_LAYER, batch.counts, batch.slots, self._writer_token, self._batches, claim
                        )
                    sent = time.monotonic()
                    applied = buffer.apply(prepared)
                    received = time.monotonic()
                    identity.check_applied(applied.fenced_by)  # refused by the fence: OwnershipLost
                    break
                except OwnershipLost:
                    raise
                except Exception as exc:
                    self._outage(exc)
                    every_slot = True  # Redis may have lost what it held: send every slot next
                    if ctx.closed.wait(ctx.probe_s):
                        return
            with ctx.wake:
                if received - sent < OFFSET_MAX_ROUND_TRIP_S:
                    ctx.anchor(applied.now_ms, sent, received)
                self._in_flight = None
                owned.written()
                if (applied.tasks, applied.pending) != owned.believed() and not batch.everything:
                    # Redis lost slots this batch did not list (a restart, a failover) or holds
                    # some the process never wrote: the next batch lists every slot of the rank.
                    self._resync = True
                if applied.overridden:
                    ctx.logger.warning(
                        "%s/%d: %d slots in Redis did not hold what this process last wrote there "
                        "(a restart, a failover, or a holder left by an earlier process): this "
                        "process's state written over them, counted as overridden",
                        ctx.instance,
                        ctx.rank,
                        applied.overridden,
                    )
                if ctx.degraded_since is not None:
                    # The episode's counters go with the next batch: exact, under its token.
                    behind = batch.decisions + owned.decisions  # Redis missed them: written back now
                    ctx.reconciled += behind
                    ctx.episode_reconciled += behind
                    seconds, calls, entries = ctx.end_episode()
                    owned.counts[STATS_DEGRADED_MS] += max(1, round(seconds * 1000))
                    owned.counts[STATS_SERVED_LOCALLY] += calls
                    owned.counts[STATS_RECONCILED] += entries
                    if self._pending_since is None:
                        self._pending_since = time.monotonic()
                ctx.wake.notify_all()
