"""One identity per messager: what FastDeploy's patched messager calls (``bridge_for_messager``),
the claim a bridge holds on its (instance, rank), a start that never waits for Redis, and a
``flush`` that returns once Redis holds everything. On real redis-server processes."""

from __future__ import annotations

import logging
import queue
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from redis_layer_signals import IdentityTaken, InvalidConfig, SignalBuffer
from redis_layer_signals.fastdeploy import Layer0Bridge, bridge_for_messager, instance_name
from redis_layer_signals.fastdeploy.health import BridgeMetrics
from redis_layer_signals.fastdeploy.identity import pid_namespace
from redis_layer_signals.fastdeploy.signals import encode_kv_signal
from tests.servers import RedisServer, wait_until

LAYERS = 4
WAIT_S = 15.0
LEASE_S = 1.5
"""Short leases, so a takeover after expiry takes seconds; renewed every 0.5 s."""
FLUSH_TIMEOUT_S = 30.0


def kv(*entries: tuple[int, int, int]) -> Any:
    return encode_kv_signal(0, entries)


def cache_info(slot: int, request_id: str, need: int = 300) -> dict[str, Any]:
    return {"request_id": request_id, "current_id": slot, "need_prefill_tokens": need}


def queued(bridge: Layer0Bridge) -> list[Any]:
    out = []
    while True:
        try:
            out.append(bridge.ready.get_nowait())
        except queue.Empty:
            return out


@pytest.fixture
def server() -> Iterator[RedisServer]:
    started = RedisServer().start()
    yield started
    started.cleanup()


@pytest.fixture
def namespace() -> str:
    return f"id-{uuid.uuid4().hex[:8]}"


def buffer_on(server: RedisServer, namespace: str, retry_s: float = 0.5) -> SignalBuffer:
    return SignalBuffer.from_url(server.url, namespace=namespace, retry_s=retry_s, env={})


# -- the factory ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pod_ip", "port", "expected"),
    [
        ("10.0.0.7", 8021, "10.0.0.7-8021"),
        ("fd00::7", 8021, "fd00--7-8021"),
        ("0.0.0.0", 8021, "node-a-8021"),
        ("::", 8021, "node-a-8021"),
        ("", 8021, "node-a-8021"),
        (None, 8021, "node-a-8021"),
        ("127.0.1.1", 8022, "node-a-8022"),
    ],
)
def test_instance_is_the_pod_ip_or_the_host_name_with_the_port(pod_ip: Any, port: int, expected: str) -> None:
    assert instance_name(pod_ip, port, hostname="node-a") == expected


def test_a_long_host_name_is_cut_to_an_identifier_keeping_the_port() -> None:
    name = instance_name(None, 8021, hostname="h" * 300 + ".example")
    assert len(name) == 128 and name.endswith("-8021")


@pytest.mark.parametrize("role", ["decode", "mixed"])
def test_decode_and_mixed_messagers_start_nothing(role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLS_REDIS_URL", raising=False)  # not even the missing URL is an error
    threads = threading.active_count()
    made = bridge_for_messager(
        splitwise_role=role,
        pod_ip="10.0.0.7",
        engine_worker_queue_port=8021,
        rank=0,
        nranks=1,
        block_size=64,
        num_layers=LAYERS,
        ready=queue.Queue(),
    )
    assert made is None and threading.active_count() == threads


def prefill(**overrides: Any) -> Layer0Bridge | None:
    options: dict[str, Any] = {
        "splitwise_role": "prefill",
        "pod_ip": "10.0.0.7",
        "engine_worker_queue_port": 8021,
        "rank": 1,
        "nranks": 2,
        "block_size": 64,
        "num_layers": LAYERS,
        "ready": queue.Queue(),
        **overrides,
    }
    return bridge_for_messager(**options)


def test_prefill_messager_without_a_redis_url_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a silent buffer private to the process: one line says what to set."""
    monkeypatch.delenv("RLS_REDIS_URL", raising=False)
    with pytest.raises(InvalidConfig) as caught:
        prefill()
    message = str(caught.value)
    assert "RLS_REDIS_URL" in message and "RLS_REDIS_URL=memory://" in message and "\n" not in message


def test_prefill_messager_gets_a_bridge_named_after_its_engine_logging_through_its_logger(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("RLS_REDIS_URL", f"memory://{uuid.uuid4().hex}")  # explicit: accepted
    monkeypatch.setenv("RLS_NAMESPACE", "fd")
    fastdeploy_logger = logging.getLogger("fastdeploy.cache_messager")
    bridge = prefill(logger=fastdeploy_logger)
    assert bridge is not None
    try:
        assert (bridge.instance, bridge.rank, bridge.buffer.config.namespace) == ("10.0.0.7-8021", 1, "fd")
        assert bridge.owned is not None and bridge.claimed(WAIT_S)
        with caplog.at_level(logging.ERROR, logger="fastdeploy.cache_messager"):
            assert bridge.on_cache_task({"current_id": 5}) == []  # invalid: logged, skipped
        assert [r.name for r in caplog.records if r.levelno == logging.ERROR] == ["fastdeploy.cache_messager"]
    finally:
        bridge.close()


def test_the_messager_s_tensor_parallel_size_reaches_its_bridge(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLS_REDIS_URL", f"memory://{uuid.uuid4().hex}")
    bridge = prefill(nranks=4)
    assert bridge is not None
    try:
        assert bridge.group is not None  # one of a group of 4: it queues in the group's order
        assert bridge.health().group_waiting == 0
    finally:
        bridge.close()


@pytest.mark.parametrize("registers_tasks", [True, False])
@pytest.mark.parametrize("value", [0, -1, 3601, True, "15"])
def test_bad_lease_is_refused(value: Any, registers_tasks: bool) -> None:
    buffer = SignalBuffer.from_url(f"memory://{uuid.uuid4().hex}", env={})
    with pytest.raises(InvalidConfig) as caught:
        Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, lease_s=value, registers_tasks=registers_tasks)
    assert caught.value.field == "lease_s"


# -- a start never waits for Redis ---------------------------------------------------------------


class Recording:
    """A redis-py client that notes which thread made each call, then makes it."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self.threads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            self.threads.append(threading.current_thread().name)
            return attribute(*args, **kwargs)

        return call


def test_construction_makes_no_redis_call_even_against_a_black_hole() -> None:
    """A server that accepts connections and never answers: the constructor asks it nothing
    (every Redis call is the writer's, on its own thread), so it returns at once; the hooks
    decide in the process meanwhile, as FastDeploy's fix does."""
    black_hole = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody answers
    port = black_hole.getsockname()[1]
    client = Recording(redis.Redis(port=port, socket_timeout=0.3, socket_connect_timeout=0.3))
    buffer = SignalBuffer(client, namespace="hole", retry_s=0.3, env={})
    started = time.perf_counter()
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05)
    built = time.perf_counter() - started
    constructor = threading.current_thread().name
    try:
        assert constructor not in client.threads
        assert bridge.on_kv_signal(kv((5, 0, 128))) == []
        assert bridge.on_cache_task(cache_info(5, "req-1")) == [(5, 128)]
        wait_until(lambda: "rls-writer" in client.threads, WAIT_S, what="the writer to try Redis")
        assert constructor not in client.threads, "a hook called Redis"
        assert bridge.health().identity == "claiming" and not bridge.claimed(0.1)
        print(f"\nbridge built against a black hole in {built * 1000:.1f} ms")
    finally:
        bridge.close()
        black_hole.close()


# -- one identity, one owner ---------------------------------------------------------------------


def test_a_second_messager_with_the_same_identity_is_refused_and_handed_nothing(
    server: RedisServer, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    buffers = [buffer_on(server, namespace) for _ in range(2)]
    first = Layer0Bridge(buffers[0], "p0", 0, num_layers=LAYERS, probe_s=0.05, lease_s=LEASE_S)
    second_logger = logging.getLogger("fastdeploy.second")
    second = None
    try:
        assert first.claimed(WAIT_S)
        assert first.on_kv_signal(kv((5, 0, 128))) == []  # early: waits for its task
        assert first.flush(WAIT_S)
        with caplog.at_level(logging.ERROR, logger="fastdeploy.second"):
            second = Layer0Bridge(
                buffers[1], "p0", 0, num_layers=LAYERS, probe_s=0.05, lease_s=LEASE_S, logger=second_logger
            )
            with pytest.raises(IdentityTaken) as caught:
                second.claimed(WAIT_S)
        assert first.identity is not None and second.identity is not None
        for owner in (first.identity.me, second.identity.me):
            assert owner.describe() in str(caught.value)
        assert f"pid {second.identity.me.pid}" in str(caught.value) and socket.gethostname() in str(caught.value)
        errors = [r for r in caplog.records if r.name == "fastdeploy.second" and r.levelno == logging.ERROR]
        assert len(errors) == 1 and first.identity.me.describe() in errors[0].getMessage()

        # Refused: the second process is served locally, never given the first's signal.
        assert second.on_cache_task(cache_info(5, "req-x")) == []
        assert second.on_kv_signal(kv((6, 0, 64))) == []
        assert second.on_cache_task(cache_info(6, "req-6", need=64)) == [(6, 64)]
        assert not second.flush(0.1)  # nothing of it will be written

        time.sleep(2 * LEASE_S)  # the first renews its lease: still refused after it
        health = second.health()
        assert (health.identity, health.identity_refusals) == ("refused", 1)
        assert first.identity.me.describe() == health.identity_holder
        buffer = buffers[0]
        assert [s.tokens for s in buffer.pending("p0", 0, 5)] == [128]  # the first's, untouched
        assert buffer.task("p0", 0, 5) is None and buffer.task("p0", 0, 6) is None
        assert buffer.stats()["identity_refused"] == 1

        assert first.on_cache_task(cache_info(5, "req-1")) == [(5, 128)]
        assert first.flush(WAIT_S)
        live = buffer.task("p0", 0, 5)
        assert live is not None and live.request_id == "req-1"

        metrics = BridgeMetrics()
        metrics.track(first)
        metrics.track(second)
        text = metrics.render().decode()
        labels = f'instance="p0",namespace="{namespace}",rank="0"'
        assert f"rls_bridge_identity_refused_total{{{labels}}} 1.0" in text
        assert f"rls_bridge_identity_held{{{labels}}} 1.0" in text  # the first
        assert f"rls_bridge_identity_held{{{labels}}} 0.0" in text  # the second
    finally:
        for bridge in (second, first):
            if bridge is not None:
                bridge.close()
        for b in buffers:
            b.close()


def write_holder(buffer: SignalBuffer, host: str, pid: int, pid_ns: str, lease_ms: int) -> None:
    """What a predecessor's claim leaves: its identity key, its lease running out ``lease_ms``
    from now on the server's clock (generation 1)."""
    key = buffer.protocol.keys.rank("p0", 0).identity
    lease_until = buffer.now_ms() + lease_ms
    buffer.client.set(key, f"predecessor|{host}|{pid}|{pid_ns}|0|{lease_until}|1", px=lease_ms * 10)


def test_a_restart_takes_over_once_the_predecessors_lease_ran_out(server: RedisServer, namespace: str) -> None:
    """A predecessor on another host (so nothing proves it gone) left early signals: the new
    bridge is refused until its lease runs out, then claims, adopts them, and meets the hooks
    it served meanwhile as register would have: the task registered meanwhile recovers its
    signal late, and a newer signal of its own supersedes the predecessor's."""
    buffer = buffer_on(server, namespace)
    buffer.record("p0", 0, 0, [(5, 128), (7, 32)])  # the predecessor's early signals
    write_holder(buffer, "another-host", 4242, "", lease_ms=round(LEASE_S * 1000))
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05, lease_s=LEASE_S)
    try:
        with pytest.raises(IdentityTaken, match="another-host"):
            bridge.claimed(WAIT_S)
        assert bridge.on_cache_task(cache_info(5, "req-1")) == []  # no signal known here yet
        assert bridge.on_kv_signal(kv((7, 0, 64))) == []
        wait_until(lambda: bridge.health().identity == "held", WAIT_S, what="the takeover after the lease")
        assert bridge.claimed(0) and bridge.flush(WAIT_S)
        assert queued(bridge) == [[(5, 128)]]  # recovered late, once
        assert [s.tokens for s in buffer.pending("p0", 0, 7)] == [64]
        live = buffer.task("p0", 0, 5)
        assert live is not None and live.request_id == "req-1"
        stats = buffer.stats()
        assert (stats["buffered"], stats["recovered"], stats["superseded"], stats["registered"]) == (3, 1, 1, 1)
        assert bridge.health().identity_refusals == 1
    finally:
        bridge.close()
        buffer.close()


def test_a_restart_on_the_same_host_takes_over_at_once_from_a_dead_pid(
    server: RedisServer, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The predecessor ran on this host and its pid is gone: no waiting for its lease (a minute
    here, longer than the test waits), and its early signal reaches the new process."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    buffer = buffer_on(server, namespace)
    buffer.record("p0", 0, 0, [(5, 128)])
    write_holder(buffer, socket.gethostname(), dead.pid, pid_namespace(), lease_ms=60_000)
    with caplog.at_level(logging.WARNING, logger="redis_layer_signals.fastdeploy"):
        bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05)
        try:
            assert bridge.claimed(WAIT_S)
            assert bridge.on_cache_task(cache_info(5, "req-1")) == [(5, 128)]
            assert bridge.health().identity_refusals == 0
            assert any("took the identity over" in r.getMessage() for r in caplog.records)
            assert bridge.flush(WAIT_S)
            assert buffer.stats()["recovered"] == 1
        finally:
            bridge.close()
            buffer.close()


def test_an_identity_lost_while_running_stops_the_writes_until_it_is_claimed_again(
    server: RedisServer, namespace: str
) -> None:
    """Another process took the identity (this one's lease ran out, say in a long pause): the
    writer finds out at its next renewal, writes nothing while the other holds it, serves the
    process locally, and once it claims the identity again writes what it decided meanwhile,
    its own earlier writes counted once."""
    buffer = buffer_on(server, namespace)
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05, lease_s=LEASE_S)
    try:
        assert bridge.claimed(WAIT_S)
        assert bridge.on_cache_task(cache_info(4, "req-4")) == []
        assert bridge.on_kv_signal(kv((5, 0, 128))) == []
        assert bridge.flush(WAIT_S)
        write_holder(buffer, "another-host", 4242, "", lease_ms=round(2 * LEASE_S * 1000))
        wait_until(lambda: bridge.health().identity == "refused", WAIT_S, what="the renewal to find the other")
        assert bridge.on_kv_signal(kv((6, 0, 64))) == []
        assert bridge.on_cache_task(cache_info(7, "req-7", need=64)) == []
        assert not bridge.flush(0.1)
        assert buffer.pending("p0", 0, 6) == [] and buffer.task("p0", 0, 7) is None  # nothing written
        wait_until(lambda: bridge.health().identity == "held", WAIT_S, what="the other's lease to run out")
        assert bridge.flush(WAIT_S)
        assert [s.tokens for s in buffer.pending("p0", 0, 5)] == [128]
        assert [s.tokens for s in buffer.pending("p0", 0, 6)] == [64]
        assert [t.request_id if (t := buffer.task("p0", 0, slot)) else None for slot in (4, 7)] == ["req-4", "req-7"]
        stats = buffer.stats()
        assert (stats["buffered"], stats["superseded"], stats["registered"], stats.get("overridden", 0)) == (2, 0, 2, 0)
        assert bridge.health().identity_refusals == 1 and stats["identity_refused"] == 1
    finally:
        bridge.close()
        buffer.close()


def test_close_gives_the_identity_up_for_the_next_process(server: RedisServer, namespace: str) -> None:
    buffer = buffer_on(server, namespace)
    first = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, lease_s=60)
    assert first.claimed(WAIT_S)
    first.close()
    assert buffer.client.get(buffer.protocol.keys.rank("p0", 0).identity) is None
    second = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, lease_s=60)
    try:
        assert second.claimed(WAIT_S)  # at once: not after the first's minute-long lease
    finally:
        second.close()
        buffer.close()


# -- flush returns once Redis holds everything ---------------------------------------------------


@pytest.mark.parametrize("registers_tasks", [True, False], ids=["owned", "adder-elsewhere"])
def test_flush_returns_once_the_write_back_is_done_not_at_its_timeout(
    server: RedisServer, namespace: str, registers_tasks: bool
) -> None:
    """After an outage, flush(30) returns as soon as Redis holds every decision (before, where
    the adder runs in another process, nothing woke it: it returned after the full 30 s)."""
    buffer = buffer_on(server, namespace, retry_s=0.3)
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05, registers_tasks=registers_tasks)
    try:
        assert bridge.claimed(WAIT_S) and bridge.flush(WAIT_S)
        server.kill()
        bridge.on_kv_signal(kv((5, 0, 128)))
        bridge.on_kv_signal(kv((6, 0, 64)))
        wait_until(lambda: bridge.health().degraded, WAIT_S, what="the outage to be noticed")
        flushed: list[tuple[bool, float]] = []
        waiter = threading.Thread(target=lambda: flushed.append((bridge.flush(FLUSH_TIMEOUT_S), time.monotonic())))
        called = time.monotonic()
        waiter.start()  # flush waits while Redis is down
        server.start()
        restarted = time.monotonic()
        waiter.join(FLUSH_TIMEOUT_S + 5)
        [(done, returned)] = flushed
        layout = "owned" if registers_tasks else "adder elsewhere"
        print(f"\nflush({FLUSH_TIMEOUT_S:.0f}) after an outage, {layout}: returned {returned - called:.2f} s after")
        print(f"the call, {returned - restarted:.2f} s after Redis was back")
        assert done and returned - called < FLUSH_TIMEOUT_S / 2
        assert [s.tokens for s in buffer.pending("p0", 0, 6)] == [64]
    finally:
        bridge.close()
        buffer.close()
