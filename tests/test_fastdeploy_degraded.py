"""Layer0Bridge while Redis is unreachable, and after: on real redis-server processes that the
tests SIGKILL and restart (empty, or from their AOF). Each test drives the three hooks by hand,
as FastDeploy's threads would, and reads what the bridge queued for the sender."""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from redis_layer_signals import CacheTask, SignalBuffer
from redis_layer_signals.fastdeploy import Layer0Bridge
from redis_layer_signals.fastdeploy.bridge import STATS_DEGRADED_MS, STATS_RECONCILED, STATS_SERVED_LOCALLY
from redis_layer_signals.fastdeploy.health import BridgeMetrics
from redis_layer_signals.fastdeploy.signals import encode_kv_signal
from redis_layer_signals.models import RegisterResult
from tests.servers import RedisServer, wait_until
from tests.topology import AOF_ALWAYS

LAYERS = 4
RETRY_S = 0.3
WAIT_S = 15.0


def kv(*entries: tuple[int, int, int]) -> Any:
    return encode_kv_signal(0, entries)


def cache_info(slot: int, request_id: str, need: int = 300) -> dict[str, Any]:
    blocks = -(-need // 64)
    return {
        "request_id": request_id,
        "current_id": slot,
        "need_prefill_tokens": need,
        "src_block_ids": list(range(blocks)),
        "dest_block_ids": [100 + b for b in range(blocks)],
    }


def restart_empty(server: RedisServer) -> None:
    """SIGKILL, forget every file (as a node replaced with a fresh disk), start on the same port."""
    server.kill()
    server.wipe()
    server.start()


def queued(bridge: Layer0Bridge) -> list[list[tuple[int, int]]]:
    """Every batch the bridge put on the sender's queue so far, in order."""
    out = []
    while True:
        try:
            out.append(bridge.ready.get_nowait())
        except queue.Empty:
            return out


@pytest.fixture
def server() -> Iterator[RedisServer]:
    started = RedisServer(AOF_ALWAYS).start()
    yield started
    started.cleanup()


@pytest.fixture
def rig(server: RedisServer) -> Iterator[tuple[SignalBuffer, Layer0Bridge]]:
    buffer = SignalBuffer.from_url(server.url, namespace=f"deg-{uuid.uuid4().hex[:8]}", retry_s=RETRY_S, env={})
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05)
    yield buffer, bridge
    bridge.close()
    buffer.close()


def recovered_after_restart(bridge: Layer0Bridge) -> None:
    """Once the writer has noticed the outage, Redis answers again and holds every decision."""
    wait_until(
        lambda: not bridge.health().degraded and bridge.flush(0.05),
        WAIT_S,
        what="the bridge's writer to write back",
    )


def test_early_signal_recorded_while_redis_is_down_is_handed_over_locally(
    server: RedisServer, rig: tuple[SignalBuffer, Layer0Bridge]
) -> None:
    """FastDeploy's fix, kept: signal first, Redis gone, task second: the task gets its batch."""
    _buffer, bridge = rig
    server.kill()
    assert bridge.on_kv_signal(kv((5, 0, 128))) == []
    assert bridge.on_cache_task(cache_info(5, "req-1")) == [(5, 128)]
    assert queued(bridge) == [[(5, 128)]]
    assert bridge.owned is not None
    assert bridge.owned.unwritten_counts() == {"recorded": 1, "buffered": 1, "recovered": 1, "registered": 1}


def test_signal_buffered_in_redis_before_the_outage_is_handed_over_during_it(
    server: RedisServer, rig: tuple[SignalBuffer, Layer0Bridge]
) -> None:
    """The bridge keeps a copy of what it buffered in Redis, so an outage between the signal and
    its task does not strand the request; Redis pops its own copy when the bridge writes the
    registration back, and the batch is not queued a second time."""
    buffer, bridge = rig
    assert bridge.owned is not None
    assert bridge.on_kv_signal(kv((5, 0, 128))) == []
    assert bridge.flush(WAIT_S)
    assert [s.tokens for s in buffer.pending("p0", 0, 5)] == [128]
    server.kill()
    assert bridge.on_cache_task(cache_info(5, "req-1")) == [(5, 128)]
    assert bridge.owned.unwritten_counts() == {"registered": 1, "shared_taken": 1}
    server.start()
    recovered_after_restart(bridge)
    assert queued(bridge) == [[(5, 128)]]
    stats = buffer.stats()
    assert (stats["recorded"], stats["buffered"], stats["recovered"]) == (1, 1, 1)
    assert buffer.pending("p0", 0, 5) == []
    assert bridge.owned.unwritten_counts() == {}


def test_write_back_after_aof_restart_makes_redis_match_the_process(
    server: RedisServer, rig: tuple[SignalBuffer, Layer0Bridge]
) -> None:
    """During the outage: a request finishes, another registers, a third's signal waits. After
    the AOF restart the finished task is gone from Redis (not a stale holder for 900 s), the
    registered one is live, the waiting signal is pending, and every signal is counted once."""
    buffer, bridge = rig
    bridge.on_cache_task(cache_info(1, "req-a"))
    assert bridge.on_kv_signal(kv((1, 0, 300))) == [(1, 300)]
    assert bridge.flush(WAIT_S)  # the AOF holds req-a
    server.kill()
    bridge.on_task_finished(1, "req-a")
    bridge.on_cache_task(cache_info(2, "req-b"))
    assert bridge.on_kv_signal(kv((2, 0, 128), (3, 0, 64))) == [(2, 128)]
    wait_until(lambda: bridge.health().degraded, WAIT_S, what="the writer to notice the outage")
    server.start()  # from the AOF: req-a is live again there until the write-back finishes it
    recovered_after_restart(bridge)
    assert buffer.task("p0", 0, 1) is None
    live = buffer.task("p0", 0, 2)
    assert live is not None and live.request_id == "req-b"
    assert [s.tokens for s in buffer.pending("p0", 0, 3)] == [64]
    stats = buffer.stats()
    assert (stats["recorded"], stats["delivered"], stats["buffered"]) == (3, 2, 1)
    # The three decisions Redis missed are written back, counted as such.
    assert (stats["finished"], stats[STATS_RECONCILED]) == (1, 3)
    assert stats[STATS_SERVED_LOCALLY] == sum(bridge.health().local_calls.values())
    assert stats[STATS_DEGRADED_MS] > 0
    assert queued(bridge) == [[(1, 300)], [(2, 128)]], "nothing handed out twice"
    # Redis serves again: slot 3's task recovers its signal from Redis.
    assert bridge.on_cache_task(cache_info(3, "req-c")) == [(3, 64)]


def test_empty_restart_restores_the_process_tasks(server: RedisServer, rig: tuple[SignalBuffer, Layer0Bridge]) -> None:
    """A restart without persistence forgets every task: the write-back registers the
    process's live tasks again, so the next chunk's signal is delivered, not buffered forever."""
    buffer, bridge = rig
    bridge.on_cache_task(cache_info(4, "req-a", need=300))
    assert bridge.on_kv_signal(kv((4, 0, 128))) == [(4, 128)]
    bridge.on_kv_signal(kv((9, 0, 64)))  # buffered in Redis, copied here
    assert bridge.flush(WAIT_S)
    server.kill()
    assert bridge.on_kv_signal(kv((4, 128, 128))) == [(4, 256)]
    restart_empty(server)
    recovered_after_restart(bridge)
    task = buffer.task("p0", 0, 4)
    assert task is not None and task.request_id == "req-a"
    assert bridge.on_kv_signal(kv((4, 256, 44))) == [(4, 300)]
    # Slot 9's early signal was lost with Redis; the process's copy still reaches its task.
    assert bridge.on_cache_task(cache_info(9, "req-9", need=64)) == [(9, 64)]
    assert queued(bridge) == [[(4, 128)], [(4, 256)], [(4, 300)], [(9, 64)]]


def test_bridge_never_raises_on_a_bug_in_the_buffer(caplog: pytest.LogCaptureFixture) -> None:
    """Not only Redis errors: any exception in a hook's shared path is logged once, counted,
    and the call is served locally, FastDeploy's loop never sees it."""

    class Broken(SignalBuffer):
        def apply(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a bug")

    buffer = Broken.from_url(f"memory://{uuid.uuid4().hex}", env={})
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=60)
    assert bridge.owned is not None
    with caplog.at_level(logging.WARNING, logger="redis_layer_signals.fastdeploy"):
        assert bridge.on_kv_signal(kv((5, 0, 128))) == []
        assert bridge.on_kv_signal(kv((5, 128, 64))) == []
        assert bridge.on_cache_task(cache_info(5, "req-1", need=192)) == [(5, 192)]
        wait_until(lambda: bridge.health().degraded, WAIT_S, what="the writer to meet the bug")
        # The writer logs the episode once it released the lock the hooks take.
        wait_until(lambda: any(r.levelno == logging.WARNING for r in caplog.records), WAIT_S, what="the warning")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "RuntimeError: a bug" in warnings[0].getMessage()
    assert bridge.health().errors == {"writer": 1}
    counts = bridge.owned.unwritten_counts()
    # The first signal ends superseded, counted now, or by Redis if the writer had taken it.
    assert counts.pop("superseded", 0) + counts.pop("shared_taken", 0) == 1
    assert counts == {"recorded": 2, "buffered": 2, "recovered": 1, "registered": 1}
    bridge.close()


def test_slot_still_held_is_taken_over_with_a_warning_naming_both(
    rig: tuple[SignalBuffer, Layer0Bridge], caplog: pytest.LogCaptureFixture
) -> None:
    """FastDeploy overwrites a slot's task: so does the bridge, counted and logged."""
    buffer, bridge = rig
    bridge.on_cache_task(cache_info(5, "req-old"))
    with caplog.at_level(logging.WARNING, logger="redis_layer_signals.fastdeploy"):
        bridge.on_cache_task(cache_info(5, "req-new"))
    assert "req-old" in caplog.text and "req-new" in caplog.text
    assert bridge.flush(WAIT_S)
    task = buffer.task("p0", 0, 5)
    assert task is not None and task.request_id == "req-new"
    stats = buffer.stats()
    assert (stats["occupied"], stats["replaced"]) == (1, 1)
    assert bridge.health().errors == {}


def test_cross_process_handoff_waits_for_redis_then_completes(server: RedisServer) -> None:
    """The adder in one process, the signal consumer in another (two bridges that share only
    Redis and the sender's queue): while Redis is down neither can see the other's half, so
    the early signal is not sent; once Redis is back both write back and it is, once."""
    ready: queue.Queue[Any] = queue.Queue()
    namespace = f"xproc-{uuid.uuid4().hex[:8]}"
    buffers = [SignalBuffer.from_url(server.url, namespace=namespace, retry_s=RETRY_S, env={}) for _ in range(2)]
    consumer, adder = (
        Layer0Bridge(b, "p0", 0, num_layers=LAYERS, ready=ready, registers_tasks=False, probe_s=0.05) for b in buffers
    )
    try:
        server.kill()
        consumer.on_kv_signal(kv((5, 0, 128)))
        adder.on_cache_task(cache_info(5, "req-1", need=128))
        assert consumer.health().degraded and adder.health().degraded
        with pytest.raises(queue.Empty):
            ready.get(timeout=3 * RETRY_S)  # the documented limit: no handoff across processes
        server.start()
        assert ready.get(timeout=WAIT_S) == [(5, 128)]
        wait_until(lambda: not consumer.health().degraded and not adder.health().degraded, WAIT_S, what="write-back")
        with pytest.raises(queue.Empty):
            ready.get(timeout=0.3)
        stats = buffers[0].stats()
        assert (stats["recorded"], stats["registered"]) == (1, 1)
        assert stats["recovered"] + stats["delivered"] == 1
    finally:
        for bridge in (consumer, adder):
            bridge.close()
        for buffer in buffers:
            buffer.close()


def test_recovered_batch_is_queued_before_a_later_batch_of_its_slot(server: RedisServer) -> None:
    """The race of the integration outside FastDeploy's lock, forced, where Redis judges (the
    adder in another process; a rank this process owns decides under one lock, with no such
    race): the registration runs in Redis and its reply is held back while the next chunk's
    layer-0 signal is recorded (and delivered, the task being live). The later batch still
    reaches the queue after the recovered one; a hundred forced races, never the other order."""
    release = threading.Event()
    registered = threading.Event()

    class SlowReply(SignalBuffer):
        def register(self, task: CacheTask, replace: bool = False) -> RegisterResult:
            result = super().register(task, replace)
            registered.set()
            release.wait(WAIT_S)
            return result

    buffer = SlowReply.from_url(server.url, namespace=f"order-{uuid.uuid4().hex[:8]}", env={})
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, registers_tasks=False, hook_budget_ms=60_000)
    try:
        for run in range(100):
            slot = run % 500
            request_id = f"req-{run}"
            release.clear()
            registered.clear()
            bridge.on_kv_signal(kv((slot, 0, 128)))
            adder = threading.Thread(target=bridge.on_cache_task, args=(cache_info(slot, request_id, need=192),))
            adder.start()
            assert registered.wait(WAIT_S)
            assert bridge.on_kv_signal(kv((slot, 128, 64))) == []  # delivered by Redis, held back
            release.set()
            adder.join(WAIT_S)
            assert queued(bridge) == [[(slot, 128)], [(slot, 192)]]
            bridge.on_task_finished(slot, request_id)
    finally:
        release.set()
        bridge.close()
        buffer.close()


def test_metrics_show_the_episode_per_instance_and_rank(
    server: RedisServer, rig: tuple[SignalBuffer, Layer0Bridge]
) -> None:
    buffer, bridge = rig
    metrics = BridgeMetrics()
    metrics.track(bridge)
    server.kill()
    bridge.on_kv_signal(kv((5, 0, 128)))
    wait_until(lambda: bridge.health().degraded, WAIT_S, what="the writer to notice the outage")
    bridge.on_kv_signal(kv((6, 0, 128)))
    labels = f'instance="p0",namespace="{buffer.config.namespace}",rank="0"'
    text = metrics.render().decode()
    assert f"rls_bridge_degraded{{{labels}}} 1.0" in text
    assert f"rls_bridge_unwritten{{{labels}}} 2.0" in text
    assert f"rls_bridge_lag_seconds{{{labels}}} 0.0" not in text
    namespace = buffer.config.namespace
    calls = f'instance="p0",namespace="{namespace}",operation="on_kv_signal",rank="0"'
    assert f"rls_bridge_local_calls_total{{{calls}}} 1.0" in text
    server.start()
    recovered_after_restart(bridge)
    text = metrics.render().decode()
    assert f"rls_bridge_degraded{{{labels}}} 0.0" in text
    assert f"rls_bridge_unwritten{{{labels}}} 0.0" in text
    assert f"rls_bridge_lag_seconds{{{labels}}} 0.0" in text
    assert f"rls_bridge_reconciled_entries_total{{{labels}}} 2.0" in text
    assert f"rls_bridge_episodes_total{{{labels}}} 1.0" in text


@pytest.mark.parametrize("redis_up", [True, False], ids=["shared", "degraded"])
def test_known_limit_late_signal_of_an_aborted_request_goes_to_the_next_one(
    server: RedisServer, rig: tuple[SignalBuffer, Layer0Bridge], redis_up: bool
) -> None:
    """FastDeploy's fix and the bridge share this limit: request A is aborted and finished; a
    layer-0 signal computed for A arrives after that, before B registers on the slot; without
    a request id in the signal, B recovers it."""
    _buffer, bridge = rig
    bridge.on_cache_task(cache_info(5, "req-a"))
    bridge.on_task_finished(5, "req-a")
    if not redis_up:
        server.kill()
    bridge.on_kv_signal(kv((5, 0, 64)))  # computed for A, which is gone
    assert bridge.on_cache_task(cache_info(5, "req-b", need=128)) == [(5, 64)]


@pytest.mark.parametrize("redis_up", [True, False], ids=["shared", "degraded"])
def test_with_request_ids_in_the_signal_a_late_signal_is_fenced(
    server: RedisServer, rig: tuple[SignalBuffer, Layer0Bridge], redis_up: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """What FastDeploy would need to put in the signal to lift that limit: the request id per
    slot (or a per-slot generation). The bridge then hands a signal only to its own request."""
    buffer, bridge = rig
    bridge.on_cache_task(cache_info(5, "req-a"))
    bridge.on_task_finished(5, "req-a")
    if not redis_up:
        server.kill()
    bridge.on_kv_signal(kv((5, 0, 64)), request_ids={5: "req-a"})
    with caplog.at_level(logging.WARNING, logger="redis_layer_signals.fastdeploy"):
        assert bridge.on_cache_task(cache_info(5, "req-b", need=128)) == []
    assert "request_mismatch" in caplog.text
    assert bridge.on_kv_signal(kv((5, 0, 128)), request_ids={5: "req-b"}) == [(5, 128)]
    assert bridge.owned is not None
    if redis_up:
        assert bridge.flush(WAIT_S)
        assert buffer.stats()["dropped_request_mismatch"] == 1
    else:
        assert bridge.owned.unwritten_counts()["dropped_request_mismatch"] == 1


def test_stale_holder_left_by_an_earlier_process_never_receives_the_new_requests_signal(
    rig: tuple[SignalBuffer, Layer0Bridge],
) -> None:
    """A messager that died (or an AOF restart) leaves a live task in Redis for 900 s, which
    FastDeploy's sender of the new process does not know. The new process owns the rank: its
    state wins (the stale holder is removed, counted as overridden), and its early signal on
    that slot waits for its own request, which gets it."""
    buffer, earlier = rig
    earlier.close()  # the earlier process stops, giving its identity up
    buffer.register(CacheTask("p0", 0, 5, "req-dead", need_prefill_tokens=300, num_layers=LAYERS))
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS)
    try:
        assert bridge.on_kv_signal(kv((5, 0, 128))) == []  # not queued: no task of this process
        assert bridge.flush(WAIT_S)
        assert buffer.task("p0", 0, 5) is None
        assert buffer.stats()["overridden"] == 1
        assert bridge.on_cache_task(cache_info(5, "req-new", need=128)) == [(5, 128)]
        assert bridge.flush(WAIT_S)
        task = buffer.task("p0", 0, 5)
        assert task is not None and task.request_id == "req-new"
        stats = buffer.stats()
        assert (stats["buffered"], stats["recovered"], stats["delivered"]) == (1, 1, 0)
        assert queued(bridge) == [[(5, 128)]]
    finally:
        bridge.close()


def test_a_bug_after_the_redis_call_is_logged_and_holds_nothing_back(
    rig: tuple[SignalBuffer, Layer0Bridge], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception in the bridge's own bookkeeping (here: after the registration ran in
    Redis) reaches neither FastDeploy's loop nor the slot's later batches."""
    _buffer, bridge = rig

    def broken(*args: Any) -> Any:
        raise RuntimeError("bookkeeping bug")

    assert bridge.owned is not None
    monkeypatch.setattr(bridge.owned, "register", broken)
    with caplog.at_level(logging.ERROR, logger="redis_layer_signals.fastdeploy"):
        assert bridge.on_cache_task(cache_info(5, "req-1")) == []
        assert bridge.on_cache_task(cache_info(6, "req-2")) == []
    # Once, with its traceback in the line's text (the logger may be FastDeploy's: one string a call).
    logged = [r.getMessage() for r in caplog.records if "bookkeeping bug" in r.getMessage()]
    assert len(logged) == 1 and "Traceback" in logged[0], "logged once, with where it failed"
    assert bridge.health().errors == {"on_cache_task": 2}
    assert 5 not in bridge._gates and 6 not in bridge._gates


def test_bridge_serves_locally_while_redis_is_out_of_memory_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """noeviction at maxmemory: the bridge serves as in an outage, logs that Redis is out of
    memory, and writes back once the server has room again."""
    caplog.set_level(logging.WARNING)
    full = RedisServer(["--maxmemory-policy", "noeviction"]).start()
    client = full.client()
    buffer = SignalBuffer.from_url(full.url, namespace=f"oom-{uuid.uuid4().hex[:8]}", retry_s=RETRY_S, env={})
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05)
    try:
        client.config_set("maxmemory", 1)  # every write is refused with OOM
        assert bridge.on_kv_signal(kv((1, 0, 100))) == []  # early: held locally
        assert bridge.on_cache_task(cache_info(1, "r1")) == [(1, 100)]  # decided in the process
        # The writer meets the full server in the background: the bridge says so and why.
        wait_until(lambda: bridge.health().degraded, WAIT_S, what="the writer to meet the full server")
        # The writer logs it once it released the lock the hooks take (just after health() shows it).
        wait_until(
            lambda: any("out of memory" in r.getMessage() and "locally" in r.getMessage() for r in caplog.records),
            WAIT_S,
            what="the warning that says why",
        )
        assert buffer.task("p0", 0, 1) is None  # nothing was written meanwhile
        client.config_set("maxmemory", 0)  # room again
        assert bridge.flush(WAIT_S), "the writer did not catch up once the server had room"
        assert not bridge.health().degraded
        assert buffer.task("p0", 0, 1) is not None  # the task served locally is in Redis now
    finally:
        bridge.close()
        buffer.close()
        client.close()
        full.cleanup()
