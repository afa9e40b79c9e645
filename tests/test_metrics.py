"""Prometheus metrics: the library API an embedding process uses, and `rls metrics` serving every
rank's counters over HTTP, named as the Prometheus naming guide asks."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from redis_layer_signals import CacheTask, DropReason, SignalBuffer
from redis_layer_signals.ops.metrics import BufferMetrics, CounterSample, counter_sample
from tests.servers import RedisServer, free_port, wait_until
from tests.topology import ClusterTopology


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample line of the text format, or None when absent."""
    rendered = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    prefix = f"{name}{{{rendered}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return None


def test_observer_feeds_latency_histograms_and_track_exports_counters() -> None:
    metrics = BufferMetrics()
    buf = SignalBuffer.from_url("memory://metrics-lib", namespace="m1", observer=metrics.observe, env={})
    metrics.track(buf)
    buf.record("p0", 0, 0, [(1, 100), (2, 100)])
    buf.record("p0", 0, 1, [(1, 100)])
    buf.register(CacheTask("p0", 0, 1, "r1", need_prefill_tokens=100, num_layers=2))

    text = metrics.render().decode()
    rank0 = {"namespace": "m1", "instance": "p0", "rank": "0"}
    assert sample(text, "rls_call_duration_seconds_count", operation="record") == 2
    assert sample(text, "rls_call_duration_seconds_count", operation="register") == 1
    assert sample(text, "rls_buffered_total", **rank0) == 3
    assert sample(text, "rls_recovered_total", **rank0) == 2
    assert sample(text, "rls_registered_total", **rank0) == 1
    assert sample(text, "rls_recorded_total", **rank0) == 3
    assert sample(text, "rls_up", namespace="m1") == 1
    # The scrape itself is timed as a client-side "stats" call, visible from the next scrape on.
    assert sample(text, "rls_call_duration_seconds_count", operation="stats") is None
    assert sample(metrics.render().decode(), "rls_call_duration_seconds_count", operation="stats") == 1


def test_every_rank_is_its_own_series_and_drops_are_one_counter_by_reason() -> None:
    metrics = BufferMetrics()
    buf = SignalBuffer.from_url("memory://metrics-ranks", namespace="m2", env={})
    metrics.track(buf)
    buf.record("p0", 0, 0, [(1, 100)])
    buf.record("p0", 1, 0, [(1, 100), (2, 100)])
    buf.record("p1", 0, 0, [(1, 500)])
    buf.register(CacheTask("p1", 0, 1, "r1", need_prefill_tokens=100, num_layers=2))  # 500 > 100: over_need

    text = metrics.render().decode()
    assert sample(text, "rls_buffered_total", namespace="m2", instance="p0", rank="0") == 1
    assert sample(text, "rls_buffered_total", namespace="m2", instance="p0", rank="1") == 2
    assert sample(text, "rls_buffered_total", namespace="m2", instance="p1", rank="0") == 1
    over_need = {"namespace": "m2", "instance": "p1", "rank": "0", "reason": "over_need"}
    assert sample(text, "rls_dropped_total", **over_need) == 1
    # Every reason is a series of its own from the start, so a rate over it is never empty.
    for reason in DropReason:
        assert sample(text, "rls_dropped_total", namespace="m2", instance="p0", rank="0", reason=reason.value) == 0
    assert "rls_dropped_over_need_total" not in text
    assert "# TYPE rls_dropped_total counter" in text


def test_bridge_fields_and_unknown_fields_of_a_stats_hash_are_exported() -> None:
    metrics = BufferMetrics()
    buf = SignalBuffer.from_url("memory://metrics-bridge", namespace="m3", env={})
    metrics.track(buf)
    buf.record("p0", 0, 0, [(1, 100)])
    stats_key = buf.protocol.keys.rank("p0", 0).stats
    # What the FastDeploy bridge writes when it reconciles after an outage, and a future counter.
    buf.client.hset(stats_key, mapping={"degraded_ms": 2500, "served_locally": 7, "reconciled": 3, "resized": 4})
    text = metrics.render().decode()
    rank0 = {"namespace": "m3", "instance": "p0", "rank": "0"}
    assert sample(text, "rls_degraded_seconds_total", **rank0) == 2.5
    assert sample(text, "rls_served_locally_total", **rank0) == 7
    assert sample(text, "rls_reconciled_total", **rank0) == 3
    assert sample(text, "rls_resized_total", **rank0) == 4
    assert "rls_degraded_ms_total" not in text


@pytest.mark.parametrize(
    ("field", "family", "extra", "value"),
    [
        ("buffered", "buffered", (), 5.0),
        ("dropped_expired", "dropped", (("reason", "expired"),), 5.0),
        ("dropped_some_new_reason", "dropped", (("reason", "some_new_reason"),), 5.0),
        ("degraded_ms", "degraded_seconds", (), 0.005),
        ("finish_dropped", "finish_dropped", (), 5.0),
    ],
)
def test_counter_sample_names_follow_the_naming_guide(
    field: str, family: str, extra: tuple[tuple[str, str], ...], value: float
) -> None:
    assert counter_sample(field, 5) == CounterSample(family, extra, value)


def test_scrape_of_an_unreachable_redis_reports_down_instead_of_failing() -> None:
    metrics = BufferMetrics()
    dead = SignalBuffer.from_url(f"redis://127.0.0.1:{free_port()}/0", namespace="gone", retry_s=0.2, env={})
    metrics.track(dead)
    text = metrics.render().decode()
    assert sample(text, "rls_up", namespace="gone") == 0
    assert "rls_buffered_total{" not in text


class Exporter:
    """``rls metrics`` in a process of its own, on a free port of loopback."""

    def __init__(self, process: subprocess.Popen[bytes], port: int) -> None:
        self.process = process
        self.port = port
        self.pages: list[str] = []

    def scrape(self) -> bool:
        """Read the page once (kept in ``pages``); raises while nothing answers."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as response:
            self.pages.append(response.read().decode())
        return True

    def wait_for(self, check: Callable[[str], bool], what: str) -> str:
        """Scrape until a page passes ``check``; that page."""
        wait_until(lambda: self.scrape() and check(self.pages[-1]), timeout=30, what=what)
        return self.pages[-1]


@contextlib.contextmanager
def rls_metrics(url: str, namespace: str, duration_s: int) -> Iterator[Exporter]:
    """Start ``rls metrics`` on ``url`` (no ``RLS_*`` variable reaches it); stop it after."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLS_")}
    command = [sys.executable, "-m", "redis_layer_signals", "metrics", "--redis", url, "--namespace", namespace]
    command += ["--port", str(port), "--host", "127.0.0.1", "--duration-s", str(duration_s)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        yield Exporter(process, port)
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_rls_metrics_serves_the_namespace_counters_over_http(redis_server: RedisServer, namespace: str) -> None:
    buf = SignalBuffer.from_url(redis_server.url, namespace=namespace, env={})
    buf.record("p0", 0, 0, [(3, 10), (4, 10), (5, 10)])
    buf.register(CacheTask("p0", 0, 3, "r", need_prefill_tokens=5, num_layers=1))  # 10 > 5: over_need
    with rls_metrics(redis_server.url, namespace, 60) as exporter:
        text = exporter.wait_for(lambda page: True, "rls metrics to answer")
        rank0 = {"namespace": namespace, "instance": "p0", "rank": "0"}
        assert sample(text, "rls_buffered_total", **rank0) == 3
        assert sample(text, "rls_dropped_total", **rank0, reason="over_need") == 1
        assert sample(text, "rls_registered_total", **rank0) == 1
        assert sample(text, "rls_up", namespace=namespace) == 1
        assert "# TYPE rls_call_duration_seconds histogram" in text


def test_every_rank_of_a_cluster_is_read_from_the_node_that_holds_it(cluster: ClusterTopology, namespace: str) -> None:
    """The ranks' stats hashes live on different primaries; the exporter finds every one."""
    metrics = BufferMetrics()
    with SignalBuffer.from_url(cluster.url, namespace=namespace, env={}) as buf:
        metrics.track(buf)
        pairs = [(f"p{i}", rank) for i in range(4) for rank in range(2)]
        for n, (instance, rank) in enumerate(pairs, start=1):
            buf.record(instance, rank, 0, [(slot, 10) for slot in range(n)])
        holders = {cluster.node_for_key(buf.protocol.keys.rank(i, r).stats).port for i, r in pairs}
        assert len(holders) >= 2  # otherwise this test would not cover more than one node

        text = metrics.render().decode()
        assert sample(text, "rls_up", namespace=namespace) == 1
        for n, (instance, rank) in enumerate(pairs, start=1):
            assert sample(text, "rls_buffered_total", namespace=namespace, instance=instance, rank=str(rank)) == n


def test_counter_mismatch_is_zero_while_signals_are_accounted_for(redis_server: RedisServer, namespace: str) -> None:
    """buffered = recovered + dropped + finish_dropped + superseded + expired + pending."""
    metrics = BufferMetrics()
    with SignalBuffer.from_url(redis_server.url, namespace=namespace, env={}, pending_ttl_s=0.05) as buf:
        metrics.track(buf)
        buf.record("p0", 0, 0, [(1, 10), (2, 10), (3, 10), (4, 10_000)])
        buf.record("p0", 0, 0, [(1, 11)])  # supersedes
        buf.record("p0", 0, 1, [(5, 10)])
        buf.register(CacheTask("p0", 0, 1, "r1", need_prefill_tokens=100, num_layers=2))  # recovers
        buf.register(CacheTask("p0", 0, 4, "r4", need_prefill_tokens=100, num_layers=2))  # drops over need
        buf.finish("p0", 0, 2, "gone")  # aborted: finish_dropped
        rank0 = {"namespace": namespace, "instance": "p0", "rank": "0"}
        assert sample(metrics.render().decode(), "rls_counter_mismatch", **rank0) == 0  # slots 3 and 5 pending
        wait_until(lambda: buf.sweep() == 0 and buf.pending("p0", 0, 3) == [], what="expiry")
        text = metrics.render().decode()
        assert sample(text, "rls_counter_mismatch", **rank0) == 0
        assert sample(text, "rls_server_evicting", server=f"127.0.0.1:{redis_server.port}", policy="noeviction") == 0
        assert sample(text, "rls_server_evicted_keys_total", server=f"127.0.0.1:{redis_server.port}") == 0


def test_keys_lost_behind_the_library_show_as_a_mismatch(redis_server: RedisServer, namespace: str) -> None:
    metrics = BufferMetrics()
    with SignalBuffer.from_url(redis_server.url, namespace=namespace, env={}) as buf:
        metrics.track(buf)
        buf.record("p0", 0, 0, [(1, 10), (2, 10), (3, 10)])
        buf.client.delete(buf.protocol.keys.rank("p0", 0).pending)  # as an eviction would
        text = metrics.render().decode()
        assert sample(text, "rls_counter_mismatch", namespace=namespace, instance="p0", rank="0") == 3


def test_fake_server_reports_no_eviction() -> None:
    metrics = BufferMetrics()
    buf = SignalBuffer.from_url("memory://metrics-evict", namespace="m9", env={})
    metrics.track(buf)
    buf.record("p0", 0, 0, [(1, 10)])
    text = metrics.render().decode()
    assert sample(text, "rls_server_evicting", server="memory", policy="noeviction") == 0
    assert sample(text, "rls_counter_mismatch", namespace="m9", instance="p0", rank="0") == 0
    buf.close()


def test_rls_metrics_started_before_its_redis_reports_down_then_up(namespace: str) -> None:
    """The exporter outlives Redis: started while nothing listens, it serves rls_up 0, then the
    real figures once Redis answers."""
    redis_port = free_port()
    late: RedisServer | None = None
    try:
        with rls_metrics(f"redis://127.0.0.1:{redis_port}/0", namespace, 90) as exporter:
            page = exporter.wait_for(lambda page: True, "rls metrics to answer while Redis is down")
            assert exporter.process.poll() is None
            assert sample(page, "rls_up", namespace=namespace) == 0
            late = RedisServer(port=redis_port).start()
            with SignalBuffer.from_url(late.url, namespace=namespace, env={}) as buf:
                buf.record("p0", 0, 0, [(1, 10)])
            page = exporter.wait_for(lambda page: sample(page, "rls_up", namespace=namespace) == 1, "rls_up 1")
            assert sample(page, "rls_buffered_total", namespace=namespace, instance="p0", rank="0") == 1
    finally:
        if late is not None:
            late.cleanup()
