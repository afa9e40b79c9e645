"""Prometheus metrics: the library API an embedding process uses, and `rls metrics` serving the
namespace's counters over HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

from redis_layer_signals import CacheTask, SignalBuffer
from redis_layer_signals.metrics import BufferMetrics
from tests.servers import RedisServer, free_port, wait_until


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
    assert sample(text, "rls_call_seconds_count", operation="record") == 2
    assert sample(text, "rls_call_seconds_count", operation="register") == 1
    assert sample(text, "rls_buffered_total", namespace="m1") == 3
    assert sample(text, "rls_recovered_total", namespace="m1") == 2
    assert sample(text, "rls_registered_total", namespace="m1") == 1
    assert sample(text, "rls_up", namespace="m1") == 1
    # The scrape itself is timed as a client-side "stats" call, visible from the next scrape on.
    assert sample(text, "rls_call_seconds_count", operation="stats") is None
    assert sample(metrics.render().decode(), "rls_call_seconds_count", operation="stats") == 1


def test_scrape_of_an_unreachable_redis_reports_down_instead_of_failing() -> None:
    metrics = BufferMetrics()
    dead = SignalBuffer.from_url(f"redis://127.0.0.1:{free_port()}/0", namespace="gone", retry_s=0.2, env={})
    metrics.track(dead)
    text = metrics.render().decode()
    assert sample(text, "rls_up", namespace="gone") == 0
    assert "rls_buffered_total" not in text


def test_rls_metrics_serves_the_namespace_counters_over_http(redis_server: RedisServer, namespace: str) -> None:
    buf = SignalBuffer.from_url(redis_server.url, namespace=namespace, env={})
    buf.record("p0", 0, 0, [(3, 10), (4, 10), (5, 10)])
    buf.register(CacheTask("p0", 0, 3, "r", need_prefill_tokens=5, num_layers=1))  # 10 > 5: over_need
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLS_")}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "redis_layer_signals",
            "metrics",
            "--redis",
            redis_server.url,
            "--namespace",
            namespace,
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--duration-s",
            "60",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        pages: list[str] = []

        def scrape() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                pages.append(response.read().decode())
            return True

        wait_until(scrape, timeout=30, what="rls metrics to answer")
        text = pages[-1]
        assert sample(text, "rls_buffered_total", namespace=namespace) == 3
        assert sample(text, "rls_dropped_over_need_total", namespace=namespace) == 1
        assert sample(text, "rls_registered_total", namespace=namespace) == 1
        assert sample(text, "rls_up", namespace=namespace) == 1
        assert "# TYPE rls_call_seconds histogram" in text
    finally:
        server.terminate()
        server.wait(timeout=10)
