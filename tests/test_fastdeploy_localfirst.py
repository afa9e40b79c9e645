"""Layer0Bridge where the process owns its rank (``registers_tasks``, FastDeploy's layout): the
hooks decide in the process and a background writer copies the decisions to Redis. On real
redis-server processes: Redis ends exactly as synchronous calls would have left it, no hook
waits for a Redis that hangs, and what an outage leaves to write is bounded and written back in
one call."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
import redis
from hypothesis import HealthCheck, given, settings

from redis_layer_signals import CacheTask, InvalidConfig, SignalBuffer, SlotOccupied
from redis_layer_signals.fastdeploy import Layer0Bridge
from redis_layer_signals.fastdeploy.signals import encode_kv_signal
from tests.servers import RedisServer, wait_until

LAYERS = 4
WAIT_S = 15.0
TTL_S = 2.0
BOOKKEEPING = ("replayed", "overridden", "degraded_ms", "served_locally", "reconciled")
"""Counters of the machinery, not of the signals' fates."""


class Clock:
    """A clock both sides read, moved by hand."""

    def __init__(self) -> None:
        self.ms = 1_800_000_000_000

    def __call__(self) -> int:
        return self.ms


def kv(*entries: tuple[int, int, int]) -> Any:
    return encode_kv_signal(0, entries)


def cache_info(slot: int, request_id: str, need: int = 300) -> dict[str, Any]:
    return {"request_id": request_id, "current_id": slot, "need_prefill_tokens": need}


def task(slot: int, request_id: str, need: int = 300) -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=need, num_layers=LAYERS)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    started = RedisServer().start()
    yield started
    started.cleanup()


def buffer_on(server: RedisServer, clock: Clock | None = None, retry_s: float = 0.5) -> SignalBuffer:
    return SignalBuffer.from_url(
        server.url, namespace=f"lf-{uuid.uuid4().hex[:8]}", pending_ttl_s=TTL_S, retry_s=retry_s, clock=clock, env={}
    )


def state(buffer: SignalBuffer, slots: range) -> tuple[dict[str, int], list[Any], list[Any]]:
    stats = {name: n for name, n in buffer.stats().items() if n and name not in BOOKKEEPING}
    tasks = [(t.slot, t.request_id) if (t := buffer.task("p0", 0, slot)) else None for slot in slots]
    pending = [[(s.tokens, s.request_id, s.recorded_at_ms) for s in buffer.pending("p0", 0, slot)] for slot in slots]
    return stats, tasks, pending


def test_without_a_fault_redis_ends_exactly_as_synchronous_calls_leave_it(server: RedisServer) -> None:
    """The same story told twice on one clock, through the bridge and through synchronous
    buffer calls (a takeover as the bridge did it: refused, then replaced): early signals,
    newest wins, a signal expiring, over_need, a finish dropping an aborted request's signal, a
    late finish fenced, a request registered twice. Same tasks, same pending signals (their
    recording times too), same counters."""
    clock = Clock()
    bridged, direct = buffer_on(server, clock), buffer_on(server, clock)
    bridge = Layer0Bridge(bridged, "p0", 0, num_layers=LAYERS)

    def sync_register(t: CacheTask) -> None:
        try:
            direct.register(t)
        except SlotOccupied:
            direct.register(t, replace=True)

    steps: list[tuple[Any, Any]] = [
        (
            lambda: bridge.on_kv_signal(kv((1, 0, 64), (2, 0, 128))),
            lambda: direct.record("p0", 0, 0, [(1, 64), (2, 128)]),
        ),
        (lambda: bridge.on_kv_signal(kv((1, 64, 64))), lambda: direct.record("p0", 0, 0, [(1, 128)])),
        (lambda: bridge.on_cache_task(cache_info(1, "req-1")), lambda: sync_register(task(1, "req-1"))),
        (
            lambda: bridge.on_kv_signal(kv((1, 128, 64), (3, 0, 900))),
            lambda: direct.record("p0", 0, 0, [(1, 192), (3, 900)]),
        ),
        (lambda: bridge.on_cache_task(cache_info(3, "req-3", 300)), lambda: sync_register(task(3, "req-3", 300))),
        (lambda: bridge.on_cache_task(cache_info(1, "req-1")), lambda: sync_register(task(1, "req-1"))),
        (lambda: bridge.on_cache_task(cache_info(1, "req-1b")), lambda: sync_register(task(1, "req-1b"))),
        (lambda: bridge.on_task_finished(1, "req-1"), lambda: direct.finish("p0", 0, 1, "req-1")),
        (lambda: bridge.on_kv_signal(kv((4, 0, 32))), lambda: direct.record("p0", 0, 0, [(4, 32)])),
        (lambda: bridge.on_task_finished(4, "req-4"), lambda: direct.finish("p0", 0, 4, "req-4")),
        (lambda: bridge.on_kv_signal(kv((5, 0, 16), (6, 0, 8))), lambda: direct.record("p0", 0, 0, [(5, 16), (6, 8)])),
        (None, None),  # the clock passes the TTL of slot 2's, 5's and 6's signals
        (lambda: bridge.on_cache_task(cache_info(2, "req-2")), lambda: sync_register(task(2, "req-2"))),
        (
            lambda: bridge.on_kv_signal(kv((6, 0, 24), (7, 0, 40))),
            lambda: direct.record("p0", 0, 0, [(6, 24), (7, 40)]),
        ),
        (lambda: bridge.on_task_finished(3, "req-3"), lambda: direct.finish("p0", 0, 3, "req-3")),
    ]
    try:
        for via_bridge, via_calls in steps:
            if via_bridge is None:
                clock.ms += int(TTL_S * 1000) + 1
                continue
            via_bridge()
            via_calls()
            clock.ms += 7
        assert bridge.flush(WAIT_S)
        bridged_state, direct_state = state(bridged, range(8)), state(direct, range(8))
        assert bridged_state == direct_state
        stats = bridged_state[0]
        assert stats["expired"] == 3 and stats["fenced"] == 1 and stats["dropped_over_need"] == 1
        assert stats["finish_dropped"] == 1 and stats["reregistered"] == 1 and stats["replaced"] == 1
    finally:
        bridge.close()
        bridged.close()
        direct.close()


SLOTS = range(3)
REQUESTS = ("req-a", "req-b", "req-c")
STORY = st.lists(
    st.one_of(
        st.tuples(
            st.just("record"),
            st.lists(st.tuples(st.sampled_from(SLOTS), st.integers(0, 400)), min_size=1, max_size=3),
            st.one_of(st.none(), st.sampled_from(REQUESTS)),
        ),
        st.tuples(st.just("register"), st.sampled_from(SLOTS), st.sampled_from(REQUESTS), st.sampled_from((100, 300))),
        st.tuples(st.just("finish"), st.sampled_from(SLOTS), st.sampled_from(REQUESTS)),
        st.tuples(st.just("clock"), st.sampled_from((7, int(TTL_S * 1000) + 1))),
        st.tuples(st.just("flush")),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(story=STORY)
def test_any_story_leaves_redis_as_synchronous_calls_leave_it(server: RedisServer, story: list[Any]) -> None:
    """What the hooks decide in the process, and what the writer copies to Redis, whenever it
    copies it (``flush`` at random points: a signal the process ends is then one Redis holds or
    one it never saw): Redis ends with the tasks, pending signals and counters that the same
    story told as synchronous calls leaves, and each hook queues only what Redis handed out."""
    clock = Clock()
    bridged, direct = buffer_on(server, clock), buffer_on(server, clock)
    bridge = Layer0Bridge(bridged, "p0", 0, num_layers=LAYERS)
    try:
        for step in story:
            if step[0] == "record":
                _, entries, request_id = step
                names = None if request_id is None else {slot: request_id for slot, _tokens in entries}
                queued = bridge.on_kv_signal(kv(*[(slot, 0, tokens) for slot, tokens in entries]), names)
                result = direct.record("p0", 0, 0, [(slot, tokens, request_id) for slot, tokens in entries])
                assert set(queued) <= {(s.slot, s.tokens) for s in result.delivered}
            elif step[0] == "register":
                _, slot, request_id, need = step
                queued = bridge.on_cache_task(cache_info(slot, request_id, need))
                try:
                    registered = direct.register(task(slot, request_id, need))
                except SlotOccupied:
                    registered = direct.register(task(slot, request_id, need), replace=True)
                handed = [] if registered.repeated else [(s.slot, s.tokens) for s in registered.recovered]
                assert queued == handed
            elif step[0] == "finish":
                _, slot, request_id = step
                assert bridge.on_task_finished(slot, request_id) == direct.finish("p0", 0, slot, request_id)
            elif step[0] == "clock":
                clock.ms += step[1]
            else:
                assert bridge.flush(WAIT_S)
            clock.ms += 1
        assert bridge.flush(WAIT_S)
        assert state(bridged, SLOTS) == state(direct, SLOTS)
    finally:
        bridge.close()
        bridged.close()
        direct.close()


def test_signal_the_bridge_dropped_as_expired_is_not_counted_recovered_by_redis(server: RedisServer) -> None:
    """The failure of the replaying write-back: a signal whose TTL ran out during an outage
    lived again in Redis when its record was replayed at the replay's time, and Redis counted
    recovered=1 for a signal the bridge had dropped as expired. The writer sends decisions,
    with the time they were made at: Redis counts it expired, once, and nothing pending."""
    clock = Clock()
    buffer = buffer_on(server, clock, retry_s=0.3)
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05)
    try:
        server.kill()
        assert bridge.on_kv_signal(kv((5, 0, 128))) == []
        clock.ms += int(TTL_S * 1000) + 1
        assert bridge.on_cache_task(cache_info(5, "req-1")) == []  # expired: not sent
        wait_until(lambda: bridge.health().degraded, WAIT_S, what="the writer to notice the outage")
        server.start()
        wait_until(lambda: bridge.flush(0.05), WAIT_S, what="the write-back")
        stats = buffer.stats()
        assert (stats["recorded"], stats["buffered"], stats["expired"], stats["recovered"]) == (1, 1, 1, 0)
        assert buffer.pending("p0", 0, 5) == []
        live = buffer.task("p0", 0, 5)
        assert live is not None and live.request_id == "req-1"
    finally:
        bridge.close()
        buffer.close()


def test_no_hook_waits_for_a_redis_that_stopped_answering(server: RedisServer) -> None:
    """A hung Redis (SIGSTOP: sockets stay open, replies never come), the first call of the
    outage included: every hook returns at once with the process's decision; the writer, which
    waits, catches up once Redis answers again."""
    buffer = buffer_on(server, retry_s=0.5)
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05)
    assert server.process is not None
    server.process.send_signal(signal.SIGSTOP)
    try:
        slowest = 0.0
        for slot in range(16):
            for call in (
                lambda s=slot: bridge.on_kv_signal(kv((s, 0, 64))),
                lambda s=slot: bridge.on_cache_task(cache_info(s, f"req-{s}")),
                lambda s=slot: bridge.on_kv_signal(kv((s, 64, 64))),
                lambda s=slot: bridge.on_task_finished(s, f"req-{s}"),
            ):
                started = time.perf_counter()
                call()
                slowest = max(slowest, time.perf_counter() - started)
        assert slowest < 0.1, f"a hook waited {slowest:.3f}s"
        assert bridge.health().unwritten > 0 and not bridge.flush(0.2)
    finally:
        server.process.send_signal(signal.SIGCONT)
    try:
        wait_until(lambda: bridge.flush(0.05), WAIT_S, what="the write-back")
        stats = buffer.stats()
        assert (stats["registered"], stats["recovered"], stats["delivered"], stats["finished"]) == (16, 16, 16, 16)
    finally:
        bridge.close()
        buffer.close()


REQUESTS_PER_S = 40
IN_FLIGHT = 8
OUTAGE_S = 60
WRITE_BACK_BOUND_S = 1.0
"""The contract: a 60 s outage at full load is written back well under a second."""


def test_sixty_second_outage_at_full_load_holds_a_bounded_state_and_writes_back_in_one_call(
    server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """The failure of the journal: 60,000 hook calls while degraded made 75,000 entries and a
    15 s write-back. Here: a minute of full load for one rank (40 requests a second, 8 in
    flight per forward step, each prefilled in 2 chunks, its first chunk's signal before its
    task) while Redis is down. What the bridge holds stays bounded by the slots; once Redis is
    back, one call writes it back, and every decision is counted."""
    buffer = buffer_on(server, retry_s=0.3)
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05)
    owned = bridge.owned
    assert owned is not None
    server.kill()
    requests = REQUESTS_PER_S * OUTAGE_S
    largest = 0
    try:
        for first in range(0, requests, IN_FLIGHT):
            batch = range(first, first + IN_FLIGHT)
            bridge.on_kv_signal(kv(*[(r % 64, 0, 128) for r in batch]))  # first chunks, before their tasks
            for r in batch:
                bridge.on_cache_task(cache_info(r % 64, f"req-{r}", need=256))
            bridge.on_kv_signal(kv(*[(r % 64, 128, 128) for r in batch]))  # second chunks
            for r in batch:
                bridge.on_task_finished(r % 64, f"req-{r}")
            largest = max(largest, owned.held())
        assert largest <= 4 * 64 + 64 + 20, f"the bridge held {largest} entries"
        wait_until(lambda: bridge.health().degraded, WAIT_S, what="the writer to notice the outage")
        assert bridge.health().unwritten == requests * 2 + requests // IN_FLIGHT * 2
        server.start()
        started = time.monotonic()
        wait_until(lambda: bridge.flush(0.01), WAIT_S, interval=0.001, what="the write-back")
        seconds = time.monotonic() - started
        with capsys.disabled():
            print(f"\nwrite-back of a {OUTAGE_S}s outage at full load: {seconds * 1000:.0f} ms after the restart")
        assert seconds < WRITE_BACK_BOUND_S + bridge.probe_s
        stats = buffer.stats()
        assert (stats["registered"], stats["finished"], stats["recovered"]) == (requests, requests, requests)
        assert (stats["recorded"], stats["delivered"], stats["buffered"]) == (2 * requests, requests, requests)
    finally:
        bridge.close()
        buffer.close()


@dataclasses.dataclass
class TwoProcesses:
    """A consumer and an adder bridge on buffers of their own (two processes of one rank, the
    adder registering), sharing one test clock and one sender queue."""

    clock: Clock
    ready: queue.Queue[Any]
    buffers: list[SignalBuffer]
    consumer: Layer0Bridge
    adder: Layer0Bridge

    def write_back(self, first: str) -> None:
        """Redis answers again: ``first`` ("consumer" or "adder") writes back, then the other."""
        order = (self.consumer, self.adder) if first == "consumer" else (self.adder, self.consumer)
        for bridge in order:
            assert bridge.reconcile()


@contextlib.contextmanager
def two_processes(server: RedisServer) -> Iterator[TwoProcesses]:
    clock = Clock()
    ready: queue.Queue[Any] = queue.Queue()
    namespace = f"xproc-{uuid.uuid4().hex[:8]}"
    buffers = [
        SignalBuffer.from_url(server.url, namespace=namespace, pending_ttl_s=TTL_S, retry_s=0.2, clock=clock, env={})
        for _ in range(2)
    ]
    consumer, adder = (
        Layer0Bridge(b, "p0", 0, num_layers=LAYERS, ready=ready, registers_tasks=False, probe_s=60) for b in buffers
    )
    try:
        yield TwoProcesses(clock, ready, buffers, consumer, adder)
    finally:
        for bridge in (consumer, adder):
            bridge.close()
        for buffer in buffers:
            buffer.close()


@pytest.mark.parametrize("first", ["consumer", "adder"])
def test_expired_signal_is_not_queued_to_the_next_request_when_the_adder_runs_in_another_process(
    server: RedisServer, first: str
) -> None:
    """The failure: with the adder in another process, a replayed ``record`` took the replay's
    time as its recording time, so a signal whose TTL ran out during the outage lived again and
    the next request on the slot was queued ``(6, 4096)``, blocks the GPU never wrote for it.
    A replay keeps the time of the decision it replays: whichever process writes back first,
    the signal stays expired and nothing is queued."""
    with two_processes(server) as run:
        clock, ready, buffers, consumer, adder = run.clock, run.ready, run.buffers, run.consumer, run.adder
        server.kill()
        consumer.on_kv_signal(kv((6, 0, 4096)))  # recorded for a request that then went away
        clock.ms += int(TTL_S * 1000) + 1
        adder.on_cache_task(cache_info(6, "req-next", need=8192))
        server.start()
        run.write_back(first)
        assert ready.empty(), f"queued {ready.get_nowait()}"
        stats = buffers[0].stats()
        assert (stats["recorded"], stats["expired"] + stats.get("dropped_expired", 0), stats["recovered"]) == (1, 1, 0)
        assert stats["delivered"] == 0


@pytest.mark.parametrize("first", ["consumer", "adder"])
def test_signal_in_time_stays_in_time_whichever_process_writes_back_first(server: RedisServer, first: str) -> None:
    """The other half: a signal that met its task within the TTL is handed over exactly once,
    even when both write-backs reach Redis after the TTL has run out."""
    with two_processes(server) as run:
        clock, ready, buffers, consumer, adder = run.clock, run.ready, run.buffers, run.consumer, run.adder
        server.kill()
        consumer.on_kv_signal(kv((6, 0, 4096)))
        clock.ms += 500
        adder.on_cache_task(cache_info(6, "req-1", need=4096))
        clock.ms += int(TTL_S * 1000) * 3  # the outage outlasts the TTL
        server.start()
        run.write_back(first)
        assert ready.get_nowait() == [(6, 4096)]
        assert ready.empty()
        stats = buffers[0].stats()
        assert stats["recovered"] + stats["delivered"] == 1 and stats["expired"] == 0


@pytest.mark.parametrize("first", ["consumer", "adder"])
def test_signal_of_a_finished_request_is_not_left_for_the_next_one_whichever_writes_back_first(
    server: RedisServer, first: str
) -> None:
    """An outage shorter than the TTL, the adder in another process: a signal, then its task
    registered and finished (aborted: it never met the signal across the processes). When the
    adder wrote back the registration and the finish before the consumer wrote back the signal,
    the signal was pending again and the slot's next request took it. The finish leaves a mark
    in Redis, so the signal recorded before it ends as that finish would have ended it
    (``finish_dropped``); written back first, the signal is popped by the replayed registration
    (``recovered``) and not queued, since the request has finished in the adder's process.
    Either way the signal ends once and the next request gets nothing."""
    with two_processes(server) as run:
        clock, ready, buffers, consumer, adder = run.clock, run.ready, run.buffers, run.consumer, run.adder
        server.kill()
        consumer.on_kv_signal(kv((6, 0, 4096)))
        clock.ms += 100
        adder.on_cache_task(cache_info(6, "req-1", need=8192))
        clock.ms += 100
        adder.on_task_finished(6, "req-1")
        clock.ms += 100
        # The outage outlasts the calls that were on their way (each gives up after retry_s),
        # so each write-back is one process's journal: the order is the test's.
        in_flight = [op.future for bridge in (consumer, adder) for op in bridge._journal if hasattr(op, "future")]
        wait_until(lambda: all(future.done() for future in in_flight), WAIT_S, what="the calls on their way to fail")
        server.start()
        run.write_back(first)
        assert buffers[0].pending("p0", 0, 6) == []
        adder.on_cache_task(cache_info(6, "req-2", need=8192))
        assert ready.empty(), f"queued {ready.get_nowait()}"
        stats = buffers[0].stats()
        ended = {"finish_dropped": stats.get("finish_dropped", 0), "recovered": stats.get("recovered", 0)}
        assert ended == (
            {"finish_dropped": 1, "recovered": 0} if first == "adder" else {"finish_dropped": 0, "recovered": 1}
        )
        assert (stats["recorded"], stats.get("delivered", 0)) == (1, 0)


def test_a_task_registered_during_an_outage_and_finished_elsewhere_does_not_hide_the_next_ones_signal(
    server: RedisServer,
) -> None:
    """The adder registers req-a while Redis is down; once Redis answers, its write-back hands
    req-a the signal, and req-a is finished by the consumer's process. The next request on the
    slot, registered by the adder with Redis healthy, gets its own signal: the adder's note of
    what it queued for req-a does not cover req-b (before, req-b's batch was left out and the
    request hung)."""
    with two_processes(server) as run:
        clock, ready, consumer, adder = run.clock, run.ready, run.consumer, run.adder
        server.kill()
        adder.on_cache_task(cache_info(5, "req-a", need=4096))
        in_flight = [op.future for op in adder._journal if hasattr(op, "future")]
        wait_until(lambda: all(future.done() for future in in_flight), WAIT_S, what="the call on its way to fail")
        server.start()
        clock.ms += 100
        assert consumer.on_kv_signal(kv((5, 0, 200))) == []  # buffered: Redis has no task yet
        assert adder.reconcile()
        assert ready.get_nowait() == [(5, 200)]
        consumer.on_task_finished(5, "req-a")
        clock.ms += 100
        assert consumer.on_kv_signal(kv((5, 0, 64))) == []
        assert adder.on_cache_task(cache_info(5, "req-b", need=4096)) == [(5, 64)]
        assert ready.get_nowait() == [(5, 64)]


def test_hook_that_waits_past_its_budget_journals_and_the_call_counts_once(server: RedisServer) -> None:
    """Where Redis judges (the adder in another process), a hook waits for its call at most
    ``hook_budget_ms``: with Redis hung (SIGSTOP), it returns within the budget and the bridge
    serves locally; once Redis answers, the call that was on its way is the write-back, so the
    signal is recorded once and handed over once."""
    ready: queue.Queue[Any] = queue.Queue()
    namespace = f"budget-{uuid.uuid4().hex[:8]}"
    buffers = [SignalBuffer.from_url(server.url, namespace=namespace, retry_s=5.0, env={}) for _ in range(2)]
    consumer, adder = (
        Layer0Bridge(b, "p0", 0, num_layers=LAYERS, ready=ready, registers_tasks=False, probe_s=0.05, hook_budget_ms=50)
        for b in buffers
    )
    assert server.process is not None
    try:
        adder.on_cache_task(cache_info(6, "req-1", need=128))
        server.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert consumer.on_kv_signal(kv((6, 0, 128))) == []
            assert time.monotonic() - started < 0.05 + 0.25, "the hook waited past its budget"
            assert consumer.health().degraded and consumer.health().journal == 1
        finally:
            server.process.send_signal(signal.SIGCONT)
        assert ready.get(timeout=WAIT_S) == [(6, 128)]
        wait_until(lambda: not consumer.health().degraded, WAIT_S, what="the write-back")
        with pytest.raises(queue.Empty):
            ready.get(timeout=0.3)
        stats = buffers[0].stats()
        assert (stats["recorded"], stats["delivered"]) == (1, 1)
    finally:
        for bridge in (consumer, adder):
            bridge.close()
        for buffer in buffers:
            buffer.close()


@pytest.mark.parametrize("value", [0, -1, True, "50", 60_001])
def test_bad_hook_budget_is_refused(value: Any) -> None:
    buffer = SignalBuffer.from_url(f"memory://{uuid.uuid4().hex}", env={})
    with pytest.raises(InvalidConfig) as caught:
        Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, hook_budget_ms=value)
    assert caught.value.field == "hook_budget_ms"


def test_batch_resent_after_a_long_outage_adds_its_counters_once(server: RedisServer) -> None:
    """Redis applies a batch and the reply is lost; the writer resends it only after an outage
    longer than any per-call reply key lives (here: every reply key of the namespace deleted
    before the resend). The resend is recognised by the writer's batch number, so the counters
    advance once and the later batches still apply."""

    class ReplyLost(SignalBuffer):
        lost = 0

        def apply(self, prepared: Any) -> Any:
            result = super().apply(prepared)
            if not self.lost:
                self.lost += 1
                for key in self.client.scan_iter(match=self.protocol.keys.pattern("reply:*")):
                    self.client.delete(key)
                raise redis.ConnectionError("the reply was lost on its way back")
            return result

    buffer = ReplyLost.from_url(server.url, namespace=f"lost-{uuid.uuid4().hex[:8]}", retry_s=0.5, env={})
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05)
    try:
        assert bridge.on_kv_signal(kv((3, 0, 128))) == []
        assert bridge.on_cache_task(cache_info(3, "req-1", need=128)) == [(3, 128)]
        assert bridge.flush(WAIT_S)
        assert buffer.lost == 1
        bridge.on_task_finished(3, "req-1")
        assert bridge.flush(WAIT_S)
        stats = buffer.stats()
        fates = {name: stats.get(name, 0) for name in ("recorded", "buffered", "registered", "recovered", "finished")}
        assert fates == {"recorded": 1, "buffered": 1, "registered": 1, "recovered": 1, "finished": 1}
        assert stats["replayed"] >= 1
        assert buffer.task("p0", 0, 3) is None and buffer.pending("p0", 0, 3) == []
    finally:
        bridge.close()
        buffer.close()


def test_writer_that_meets_a_bug_of_its_own_goes_on_and_redis_ends_exact(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in the writer (here: building its first call raises) is logged and counted, the
    writer thread lives on, and the batch it held goes with the next one: Redis ends with the
    same tasks, signals and counters as without the bug."""
    buffer = buffer_on(server)
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05)
    build = buffer.protocol.apply
    failures = iter([RuntimeError("a bug in the writer")])

    def apply_once_broken(*args: Any, **kwargs: Any) -> Any:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return build(*args, **kwargs)

    buffer.protocol.apply = apply_once_broken  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.ERROR, logger="redis_layer_signals.fastdeploy"):
            assert bridge.on_kv_signal(kv((3, 0, 128), (4, 0, 64))) == []
            assert bridge.on_cache_task(cache_info(3, "req-1", need=128)) == [(3, 128)]
            bridge.on_task_finished(3, "req-1")
            assert bridge.flush(WAIT_S)
        assert "writer failed in the bridge itself" in caplog.text
        assert bridge.health().errors == {"writer": 1}
        stats, tasks, pending = state(buffer, range(3, 5))
        assert stats == {"recorded": 2, "buffered": 2, "registered": 1, "recovered": 1, "finished": 1}
        assert tasks == [None, None] and [len(p) for p in pending] == [0, 1]
    finally:
        bridge.close()
        buffer.close()
