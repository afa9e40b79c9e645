"""The FastDeploy bridge's two layouts, driven directly (no ``Layer0Bridge`` around them), each
on a ``RankContext`` of its own.

``OwnedLayout``: the hooks decide in the process, an early signal waits in
the process until its task registers, a finish of another request is fenced, the writer claims
the identity (a second owner is refused) and copies every decision to Redis (``flush``), and
``close`` stops the writer and gives the identity up, also while Redis does not answer.

``SharedLayout``: Redis judges each hook's call (its state shows each one at once), a
registration on its way holds later batches of its slot behind its gate, and while Redis does
not answer a hook returns the process's decision, journals it, and
``reconcile`` writes the journal back once Redis answers, handing nothing out twice.

On fakeredis (``memory://``) and on redis-server processes started by the tests."""

from __future__ import annotations

import logging
import queue
import signal
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from redis_layer_signals import BufferUnavailable, CacheTask, IdentityTaken, SignalBuffer
from redis_layer_signals.fastdeploy.context import Batch, RankContext
from redis_layer_signals.fastdeploy.journal import FinishOp, PendingCall, RecordOp, RegisterOp
from redis_layer_signals.fastdeploy.owned_layout import OwnedLayout
from redis_layer_signals.fastdeploy.shared_layout import SharedLayout
from redis_layer_signals.models import FinishResult, RegisterResult
from redis_layer_signals.protocol.calls import ScriptCall
from tests.servers import RedisServer, wait_until

INSTANCE, RANK = "p0", 0
LAYERS = 4
WAIT_S = 15.0
LEASE_S = 6.0
BUDGET_S = 0.05
HANG_S = 0.1
"""How long one attempt waits for a reply from a Redis that does not answer, then times out."""
LOGGER = logging.getLogger("tests.fastdeploy_layouts")


def task(slot: int, request_id: str, need: int = 300) -> CacheTask:
    return CacheTask(INSTANCE, RANK, slot, request_id, need_prefill_tokens=need, num_layers=LAYERS)


def context(buffer: SignalBuffer, probe_s: float = 0.05) -> RankContext:
    """A rank's context as ``Layer0Bridge`` builds it, with a queue of its own for the sender."""
    ready: queue.Queue[Batch] = queue.Queue()
    return RankContext(buffer, INSTANCE, RANK, ready, probe_s, LOGGER)


def drained(ctx: RankContext) -> list[Batch]:
    """Every batch put on the sender's queue so far, in order."""
    out: list[Batch] = []
    while True:
        try:
            out.append(ctx.ready.get(block=False))
        except queue.Empty:
            return out


def memory_buffer(cls: type[SignalBuffer] = SignalBuffer, retry_s: float = 1.0) -> SignalBuffer:
    return cls.from_url(f"memory://{uuid.uuid4().hex}", namespace="layouts", retry_s=retry_s, env={})


def fates(buffer: SignalBuffer, *names: str) -> dict[str, int]:
    stats = buffer.stats()
    return {name: stats.get(name, 0) for name in names}


def health(layout: OwnedLayout | SharedLayout) -> dict[str, Any]:
    with layout.ctx.lock:
        return layout.health_fields()


def identity_value(buffer: SignalBuffer) -> str | None:
    raw = buffer.client.get(buffer.protocol.keys.rank(INSTANCE, RANK).identity)
    return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)


class Unanswered(SignalBuffer):
    """A buffer whose Redis can stop answering: while ``answering`` is clear, each call waits
    ``HANG_S`` for a reply that does not come, then times out (and is resent until
    ``retry_s``, as on a hung server); a call on its way when it answers again goes through.
    Reads (``task``, ``pending``, ``stats``) are not affected."""

    answering: threading.Event

    def _run_script(self, call: ScriptCall) -> Any:
        if not self.answering.wait(HANG_S):
            raise redis.TimeoutError("no reply: the server does not answer")
        return super()._run_script(call)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A redis-server of this test alone (the test stops it with SIGSTOP)."""
    started = RedisServer().start()
    yield started
    started.cleanup()


# -- OwnedLayout: a rank this process owns --------------------------------------------------------


def test_owned_early_signal_waits_in_the_process_until_register_releases_it() -> None:
    """Signal first, task second: the record keeps it in the process (nothing queued), the
    registration returns and queues it; a later chunk is delivered at once, one no further
    along is suppressed. After ``flush`` Redis holds the same task and counts every decision."""
    buffer = memory_buffer()
    layout = OwnedLayout(context(buffer), nranks=1, lease_s=LEASE_S)
    ctx = layout.ctx
    try:
        assert layout.record([(5, 128)], None) == []
        assert drained(ctx) == [] and 5 not in layout.owned.tasks
        assert layout.register(task(5, "req-1")) == [(5, 128)]
        assert drained(ctx) == [[(5, 128)]]
        assert ctx.local.tasks is layout.owned.tasks and layout.owned.tasks[5].task.request_id == "req-1"
        assert layout.record([(5, 192)], {5: "req-1"}) == [(5, 192)]
        assert layout.record([(5, 192)], None) == []  # the sender has these blocks already
        assert ctx.suppressed == 1
        assert drained(ctx) == [[(5, 192)]]

        assert layout.flush(WAIT_S)
        live = buffer.task(INSTANCE, RANK, 5)
        assert live is not None and live.request_id == "req-1"
        assert buffer.pending(INSTANCE, RANK, 5) == []
        assert fates(buffer, "buffered", "delivered", "registered", "recovered") == {
            "buffered": 1,
            "delivered": 2,
            "registered": 1,
            "recovered": 1,
        }
        fields = health(layout)
        assert (fields["unwritten"], fields["lag_seconds"], fields["journal"]) == (0, 0.0, 0)
        assert layout.owned.unwritten_counts() == {}
    finally:
        layout.close()
        buffer.close()


def test_owned_finish_of_another_request_is_fenced_and_redis_follows() -> None:
    """A late finish for another request leaves the slot's holder alone (fenced); a finish of
    a request with an early signal drops it; the holder's own finish removes its task. Redis,
    after ``flush``, agrees on each."""
    buffer = memory_buffer()
    layout = OwnedLayout(context(buffer), nranks=1, lease_s=LEASE_S)
    try:
        assert layout.register(task(3, "req-a")) == []
        assert layout.finish(3, "req-b") == FinishResult(removed=False, dropped=0, fenced=True)
        assert layout.owned.tasks[3].task.request_id == "req-a"
        assert layout.flush(WAIT_S)
        held = buffer.task(INSTANCE, RANK, 3)
        assert held is not None and held.request_id == "req-a"

        assert layout.record([(4, 64)], {4: "req-x"}) == []  # early, for a request that is aborted
        assert layout.finish(4, "req-x") == FinishResult(removed=False, dropped=1, fenced=False)
        assert layout.finish(3, "req-a") == FinishResult(removed=True, dropped=0, fenced=False)
        assert 3 not in layout.owned.tasks

        assert layout.flush(WAIT_S)
        assert buffer.task(INSTANCE, RANK, 3) is None
        assert buffer.pending(INSTANCE, RANK, 4) == []
        assert fates(buffer, "fenced", "finished", "finish_dropped") == {
            "fenced": 1,
            "finished": 1,
            "finish_dropped": 1,
        }
        assert drained(layout.ctx) == []
    finally:
        layout.close()
        buffer.close()


def test_owned_identity_is_claimed_held_refused_to_a_second_owner_and_released_on_close() -> None:
    """The writer claims (instance, rank): ``claimed`` turns True, ``health_fields`` says held,
    and Redis names its writer. A second owner of the same identity is refused (``claimed``
    raises ``IdentityTaken``) and writes nothing. ``close`` stops the writer thread and gives
    the identity up, so a successor claims it at once."""
    buffer = memory_buffer()
    first = OwnedLayout(context(buffer), nranks=1, lease_s=LEASE_S)
    second: OwnedLayout | None = None
    successor: OwnedLayout | None = None
    try:
        assert first.claimed(WAIT_S)
        fields = health(first)
        assert (fields["identity"], fields["identity_holder"], fields["identity_refusals"]) == ("held", "", 0)
        value = identity_value(buffer)
        assert value is not None and value.startswith(first.identity.me.token)

        second = OwnedLayout(context(buffer), nranks=1, lease_s=LEASE_S)
        with pytest.raises(IdentityTaken) as caught:
            second.claimed(WAIT_S)
        assert first.identity.me.describe() in str(caught.value)
        refused = health(second)
        assert (refused["identity"], refused["identity_refusals"]) == ("refused", 1)
        assert refused["identity_holder"] == first.identity.me.describe()
        assert second.register(task(9, "req-second")) == []  # decided in its process
        assert not second.flush(1.0), "a refused layout writes nothing"
        assert buffer.task(INSTANCE, RANK, 9) is None
        second.close()
        assert not second._writer.is_alive()

        first.close()
        assert not first._writer.is_alive()
        assert identity_value(buffer) is None, "close gives the identity up"
        successor = OwnedLayout(context(buffer), nranks=1, lease_s=LEASE_S)
        assert successor.claimed(WAIT_S)
    finally:
        for layout in (first, second, successor):
            if layout is not None:
                layout.close()
        buffer.close()


def test_owned_hooks_decide_while_redis_does_not_answer_and_close_stops_the_writer() -> None:
    """A server that accepts connections and never replies: every hook returns the
    process's decision; the claim stays unanswered (``claimed`` False, identity
    "claiming"), ``flush`` cannot succeed, the writer counts an outage; ``close`` still stops
    the writer."""
    black_hole = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody answers
    port = black_hole.getsockname()[1]
    # One attempt per call, each bounded: the buffer resends until its retry_s (0.5 s).
    client = redis.Redis(port=port, socket_timeout=0.1, socket_connect_timeout=0.1, retry=Retry(NoBackoff(), 0))
    buffer = SignalBuffer(client, namespace="hole", retry_s=0.5, env={})
    layout = OwnedLayout(context(buffer), nranks=1, lease_s=LEASE_S)
    ctx = layout.ctx
    try:
        assert layout.record([(2, 64)], None) == []
        assert layout.register(task(2, "req-1")) == [(2, 64)]
        assert layout.finish(2, "req-1") == FinishResult(removed=True, dropped=0, fenced=False)
        assert drained(ctx) == [[(2, 64)]]
        assert not layout.claimed(0.2)
        assert not layout.flush(0.2)
        wait_until(lambda: ctx.degraded_since is not None, WAIT_S, what="the writer to meet the outage")
        fields = health(layout)
        assert fields["identity"] == "claiming" and fields["unwritten"] > 0
        assert ctx.errors["writer"] >= 1
        assert layout.owned.unwritten_counts() == {
            "recorded": 1,
            "buffered": 1,
            "registered": 1,
            "recovered": 1,
            "finished": 1,
        }
    finally:
        layout.close()
        buffer.close()
        black_hole.close()
    assert not layout._writer.is_alive()


def test_owned_on_a_real_server_redis_follows_the_process(redis_server: RedisServer, namespace: str) -> None:
    """On redis-server: a holder an earlier process left in Redis is not this process's task
    (an early signal on its slot waits, and the writer removes it, counted overridden), the
    new request recovers the signal, and after ``flush`` Redis holds exactly the process's
    tasks and signals."""
    buffer = SignalBuffer.from_url(redis_server.url, namespace=namespace, retry_s=1.0, env={})
    buffer.register(task(7, "req-dead"))  # left by a messager that died
    layout = OwnedLayout(context(buffer), nranks=1, lease_s=LEASE_S)
    try:
        assert layout.record([(7, 64), (8, 32)], None) == []
        assert layout.flush(WAIT_S)
        assert buffer.task(INSTANCE, RANK, 7) is None
        assert [s.tokens for s in buffer.pending(INSTANCE, RANK, 7)] == [64]
        assert fates(buffer, "overridden")["overridden"] == 1

        assert layout.register(task(7, "req-new", need=64)) == [(7, 64)]
        assert layout.register(task(1, "req-1")) == []
        assert layout.record([(1, 256)], {1: "req-1"}) == [(1, 256)]
        assert layout.finish(1, "req-1").removed
        assert layout.claimed(0) and layout.flush(WAIT_S)

        live = buffer.task(INSTANCE, RANK, 7)
        assert live is not None and live.request_id == "req-new"
        assert buffer.task(INSTANCE, RANK, 1) is None
        assert buffer.pending(INSTANCE, RANK, 7) == []
        assert [s.tokens for s in buffer.pending(INSTANCE, RANK, 8)] == [32]
        assert fates(buffer, "buffered", "delivered", "recovered", "finished") == {
            "buffered": 2,
            "delivered": 1,
            "recovered": 1,
            "finished": 1,
        }
        assert drained(layout.ctx) == [[(7, 64)], [(1, 256)]]
    finally:
        layout.close()
        buffer.close()
    assert not layout._writer.is_alive()


# -- SharedLayout: Redis judges ----------------------------------------------------------------


def test_shared_hooks_are_judged_by_redis() -> None:
    """Each hook's call runs in Redis before it returns: an early signal is pending there, the
    registration pops it, a later chunk is delivered, a finish of another request is fenced by
    Redis and the holder's own removes the task. Nothing is journaled, no gate stays."""
    buffer = memory_buffer()
    layout = SharedLayout(context(buffer), hook_budget_s=WAIT_S)
    try:
        assert layout.record([(4, 64)], None) == []
        assert [s.tokens for s in buffer.pending(INSTANCE, RANK, 4)] == [64]
        assert layout.register(task(4, "req-a")) == [(4, 64)]
        assert buffer.pending(INSTANCE, RANK, 4) == []
        live = buffer.task(INSTANCE, RANK, 4)
        assert live is not None and live.request_id == "req-a"
        assert layout.record([(4, 128)], {4: "req-a"}) == [(4, 128)]
        assert layout.finish(4, "req-b") == FinishResult(removed=False, dropped=0, fenced=True)
        assert buffer.task(INSTANCE, RANK, 4) is not None
        assert layout.finish(4, "req-a").removed
        assert buffer.task(INSTANCE, RANK, 4) is None

        assert drained(layout.ctx) == [[(4, 64)], [(4, 128)]]
        assert layout.gates == {} and not layout.journal
        assert health(layout) == {"journal": 0, "unwritten": 0, "lag_seconds": 0.0, "identity": "none"}
        assert layout.claimed(0) and layout.reconcile()
        assert layout.ctx.degraded_since is None
        assert fates(buffer, "buffered", "delivered", "registered", "recovered", "fenced", "finished") == {
            "buffered": 1,
            "delivered": 1,
            "registered": 1,
            "recovered": 1,
            "fenced": 1,
            "finished": 1,
        }
    finally:
        layout.close()
        buffer.close()


def test_shared_registration_on_its_way_holds_later_batches_behind_its_gate() -> None:
    """While a registration's call is in Redis, a batch of its slot that Redis delivers waits
    in ``gates``; once the reply comes, the recovered batch is queued first, then the held one."""
    registered, release = threading.Event(), threading.Event()

    class HeldReply(SignalBuffer):
        def register(self, task: CacheTask, replace: bool = False, at_ms: int | None = None) -> RegisterResult:
            result = super().register(task, replace, at_ms)
            registered.set()
            release.wait(WAIT_S)
            return result

    buffer = memory_buffer(HeldReply)
    layout = SharedLayout(context(buffer), hook_budget_s=WAIT_S)
    results: list[Batch] = []
    adder = threading.Thread(target=lambda: results.append(layout.register(task(3, "req-1", need=192))))
    try:
        assert layout.record([(3, 128)], None) == []
        adder.start()
        assert registered.wait(WAIT_S)
        assert layout.gates == {3: []}
        assert layout.record([(3, 192)], None) == []  # delivered by Redis, held behind the gate
        assert layout.gates == {3: [(3, 192)]}
        assert drained(layout.ctx) == []
        release.set()
        adder.join(WAIT_S)
        assert results == [[(3, 128), (3, 192)]]
        assert drained(layout.ctx) == [[(3, 128)], [(3, 192)]]
        assert layout.gates == {}
    finally:
        release.set()
        adder.join(WAIT_S)
        layout.close()
        buffer.close()


def test_shared_hooks_journal_while_redis_is_silent_and_reconcile_writes_back() -> None:
    """Redis stops answering: the first hook returns the process's decision and
    journals its call; the next hooks decide in the process (the early
    signal reaches its task here). ``reconcile`` cannot write back while Redis does not
    answer; once it answers, it writes every operation back, as of when it was decided, and
    empties the journal. Redis ends as if it had answered all along; nothing is queued twice."""
    buffer = memory_buffer(Unanswered, retry_s=0.5)
    assert isinstance(buffer, Unanswered)
    buffer.answering = threading.Event()
    buffer.answering.set()
    layout = SharedLayout(context(buffer, probe_s=60), hook_budget_s=BUDGET_S)  # no background write-back
    ctx = layout.ctx
    try:
        assert layout.register(task(2, "req-a")) == []
        buffer.answering.clear()

        assert layout.record([(5, 128)], None) == []
        assert ctx.degraded_since is not None
        assert health(layout) == {"journal": 1, "unwritten": 1, "lag_seconds": 0.0, "identity": "none"}
        assert layout.register(task(5, "req-b")) == [(5, 128)]  # handed over in the process
        assert layout.finish(2, "req-a") == FinishResult(removed=False, dropped=0, fenced=False)
        assert drained(ctx) == [[(5, 128)]]

        first, registration, finish = layout.journal
        assert isinstance(first, PendingCall) and isinstance(first.fallback, RecordOp)
        assert first.fallback.entries == ((5, 128),)
        assert isinstance(registration, RegisterOp) and registration.task.request_id == "req-b"
        assert isinstance(finish, FinishOp) and (finish.slot, finish.request_id) == (2, "req-a")
        assert ctx.local_calls == {"on_kv_signal": 1, "on_cache_task": 1, "on_task_finished": 1}

        wait_until(first.future.done, WAIT_S, what="the call on its way to give up")
        with pytest.raises(BufferUnavailable):
            layout.reconcile()
        assert len(layout.journal) == 3 and ctx.degraded_since is not None

        buffer.answering.set()
        assert layout.reconcile()
        assert not layout.journal and ctx.degraded_since is None
        assert ctx.reconciled == 3
        assert buffer.task(INSTANCE, RANK, 2) is None
        live = buffer.task(INSTANCE, RANK, 5)
        assert live is not None and live.request_id == "req-b"
        assert buffer.pending(INSTANCE, RANK, 5) == []
        names = ("buffered", "registered", "recovered", "finished", "served_locally", "reconciled")
        assert fates(buffer, *names) == {
            "buffered": 1,
            "registered": 2,
            "recovered": 1,
            "finished": 1,
            "served_locally": 3,
            "reconciled": 3,
        }
        assert drained(ctx) == [], "the write-back queued nothing twice"
        assert layout.flush(0)
    finally:
        buffer.answering.set()
        layout.close()
        buffer.close()


def test_shared_on_a_real_server_a_hung_redis_is_journaled_and_written_back(server: RedisServer) -> None:
    """On redis-server stopped with SIGSTOP (sockets open, no reply): a record returns,
    journaled as the call on its way; after SIGCONT ``reconcile`` writes it back,
    the journal empties and the delivered batch reaches the sender once."""
    buffer = SignalBuffer.from_url(server.url, namespace=f"lay-{uuid.uuid4().hex[:8]}", retry_s=1.0, env={})
    layout = SharedLayout(context(buffer, probe_s=60), hook_budget_s=BUDGET_S)
    ctx = layout.ctx
    assert server.process is not None
    try:
        assert layout.register(task(6, "req-1", need=128)) == []
        server.process.send_signal(signal.SIGSTOP)
        try:
            assert layout.record([(6, 128)], None) == []  # no task of this process: kept here
            assert len(layout.journal) == 1 and isinstance(layout.journal[0], PendingCall)
            assert health(layout)["journal"] == 1 and ctx.degraded_since is not None
        finally:
            server.process.send_signal(signal.SIGCONT)
        wait_until(layout.reconcile, WAIT_S, what="the write-back")
        assert not layout.journal and ctx.degraded_since is None
        assert drained(ctx) == [[(6, 128)]]
        assert buffer.pending(INSTANCE, RANK, 6) == []
        assert fates(buffer, "recorded", "delivered", "buffered") == {"recorded": 1, "delivered": 1, "buffered": 0}
    finally:
        layout.close()
        buffer.close()
