"""The thread that carries one rank's side of its tensor-parallel group to Redis.

A rank releases its layer-0 entries in the hooks, without Redis (``group.GroupQueue``). Only
giving up on an entry needs the group: this thread gives up on the head once it has waited
``give_up_s``, votes for it in Redis (lua/group.lua), asks again every ``interval_s`` until the
group has decided, and hands the outcome back to the bridge. It also reports how far the rank
got (``handled``), which tells the voters of other ranks that this rank released an entry.
While Redis does not answer, releases go on in the hooks; only a give-up waits.

It writes under its rank's claim (``identity``): nothing while the process does not own its
rank, and a call carries the claim's token and generation, which lua/group.lua checks with the
ownership fence, so a process that lost its rank changes nothing of the group.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from .context import Batch, RankContext
from .group import GroupQueue, Outcome, Progress
from .identity import IdentityClaim

REFRESH_S = 5.0
"""An idle rank reports again this often: what the group keeps of it comes back after Redis
lost it (a restart without persistence) or another rank's process reset the keys."""
ABANDONED_KEPT = 64
"""Entries the rank gave up on whose votes it sends again with each report, so that a group
that lost its keys cannot read this rank's progress past them as releases."""


class GroupVoter:
    """Votes and reports of one rank of a group of ``nranks`` (member ``rank % nranks`` of
    group ``rank // nranks``, as FastDeploy numbers ``rank_id`` across data-parallel groups)."""

    def __init__(
        self,
        rank: RankContext,
        settle: Callable[[Progress, int], Batch],
        group: GroupQueue,
        nranks: int,
        interval_s: float,
        identity: IdentityClaim,
    ) -> None:
        self.bridge = rank
        self.settle = settle
        """Queues what the group decided (the owned layout's ``settle_group``), under the lock."""
        self.group = group
        self.nranks = nranks
        self.member = rank.rank % nranks
        self.keys = rank.buffer.protocol.keys.group(rank.instance, rank.rank // nranks)
        self.interval_s = interval_s
        self.identity = identity
        """The rank's claim: its token tells the group which process speaks for the member (a
        new one: the ranks started again), its generation lets the fence refuse a stale one."""
        self.unreachable = False
        """The last call failed, or could not be made without a claim: give-ups wait for Redis
        (releases do not)."""
        self._warned = False
        """The failure was logged (once, until a call succeeds)."""
        self._reported: int | None = None
        """The ``handled`` the group last heard from this rank (None: nothing heard yet)."""
        self._reported_at = 0.0
        self._abandoned: collections.deque[int] = collections.deque(maxlen=ABANDONED_KEPT)
        self._thread = threading.Thread(target=self._run, name="rls-group", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            try:
                self.step()
            except Exception as exc:  # Redis unreachable or a bug: logged once, tried again
                self._failed(exc)
            if self.bridge.closed.wait(self.interval_s):
                return

    def step(self) -> None:
        """Give up on the head if it is due, then send the votes and the report, if any, and
        settle the outcomes the group has decided."""
        bridge = self.bridge
        with bridge.lock:
            seq = self.group.give_up(time.monotonic())
            votes = self.group.voting()
            handled = self.group.handled
        if seq is not None:
            bridge.logger.warning(
                "%s/%d: layer-0 entry %d waited %gs for its task: asking the tensor-parallel group to give it up",
                bridge.instance,
                bridge.rank,
                seq,
                self.group.give_up_s,
            )
        due = time.monotonic() - self._reported_at >= REFRESH_S
        if not votes and handled == self._reported and not due:
            return
        claim = self.identity.held()
        if claim is None:
            # The process does not own its rank (Redis has not answered its claim yet, or another
            # process holds the rank): it writes nothing, and a give-up waits as for an outage.
            self.unreachable = True
            return
        protocol = bridge.buffer.protocol
        sent = [*votes, *self._abandoned]
        prepared = protocol.group(self.keys, self.nranks, self.member, claim, handled, sent)
        answer = bridge.buffer.execute(prepared)
        if answer.fenced_by is not None:
            # A later claim of this rank wrote here: this process lost it. The writer's next
            # renewal finds out and says so; until the rank is claimed again, nothing is sent.
            self.identity.lost(None)
            bridge.logger.warning(
                "%s/%d: the tensor-parallel group refused this rank's report: another process claimed the rank",
                bridge.instance,
                bridge.rank,
            )
            return
        if self._warned:
            bridge.logger.warning("%s/%d: the tensor-parallel group's keys answer again", bridge.instance, bridge.rank)
        self.unreachable = self._warned = False
        if answer.reset and self._reported is not None:
            bridge.logger.warning(
                "%s/%d: another process of this rank started in the tensor-parallel group: its keys were reset",
                bridge.instance,
                bridge.rank,
            )
        self._reported, self._reported_at = handled, time.monotonic()
        with bridge.lock:
            for voted, outcome in zip(votes, answer.outcomes, strict=False):
                if outcome == Outcome.ABANDONED:
                    self._abandoned.append(voted)
                self.settle(self.group.decided(voted, Outcome(outcome)), self.group.next_seq)

    def _failed(self, exc: Exception) -> None:
        bridge = self.bridge
        if bridge.closed.is_set():
            return  # the bridge closed (its buffer too, maybe) while this call was on its way
        with bridge.lock:
            bridge.errors["group"] += 1
        if not self._warned:
            self._warned = True
            bridge.logger.warning(
                "%s/%d: the tensor-parallel group's keys cannot be reached (%s: %s): releases go on, "
                "giving up on an entry waits until Redis answers",
                bridge.instance,
                bridge.rank,
                type(exc).__name__,
                exc,
            )
        self.unreachable = True
