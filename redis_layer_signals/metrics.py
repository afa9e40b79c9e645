"""Prometheus metrics: the namespace's counters (read from Redis at scrape time) and
client-side latency histograms of the calls this process makes.

Embedding process::

    metrics = BufferMetrics()
    buf = SignalBuffer.from_url(url, namespace="prod", observer=metrics.observe)
    metrics.track(buf)          # export the namespace's counters too
    metrics.serve(9108)         # or metrics.render() from your own endpoint
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .buffer import SignalBuffer

METRIC_PREFIX = "rls"
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Seconds; a record on a local Redis takes well under a millisecond, a retried one seconds."""


class BufferMetrics:
    """A registry of its own (so several can live in one process) with the latency histogram
    and, for every tracked buffer, its namespace's counters."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.latency = Histogram(
            f"{METRIC_PREFIX}_call_seconds",
            "Client-side duration of buffer calls, retries included",
            ["operation"],
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self._counters = _CounterCollector(self)
        self.registry.register(self._counters)

    def observe(self, operation: str, seconds: float) -> None:
        """The ``observer`` hook of :class:`SignalBuffer` and :class:`AsyncSignalBuffer`."""
        self.latency.labels(operation).observe(seconds)

    def track(self, buffer: SignalBuffer) -> None:
        """Export ``buffer``'s namespace counters on every scrape."""
        self._counters.add(buffer)

    def render(self) -> bytes:
        """The Prometheus text format, for an endpoint the embedding process already has."""
        return bytes(generate_latest(self.registry))

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serve ``/metrics`` on a background thread; returns the HTTP server (``shutdown()``)."""
        server, _thread = start_http_server(port, addr, registry=self.registry)
        return server


class _CounterCollector(Collector):
    def __init__(self, metrics: BufferMetrics) -> None:
        self.metrics = metrics
        self.buffers: list[SignalBuffer] = []
        self.lock = threading.Lock()

    def add(self, buffer: SignalBuffer) -> None:
        with self.lock:
            self.buffers.append(buffer)

    def collect(self) -> Iterable[Metric]:
        with self.lock:
            buffers = list(self.buffers)
        return self._collect(buffers)

    def _collect(self, buffers: list[SignalBuffer]) -> Iterator[Metric]:
        up = GaugeMetricFamily(f"{METRIC_PREFIX}_up", "1 when the last scrape read the counters", labels=["namespace"])
        families: dict[str, CounterMetricFamily] = {}
        for buffer in buffers:
            namespace = buffer.config.namespace
            started = time.perf_counter()
            try:
                # No sweep: a scrape only reads. Expiries are counted by the next call on the rank.
                counters = buffer.stats(sweep=False)
            except Exception:
                up.add_metric([namespace], 0)
                continue
            self.metrics.observe("stats", time.perf_counter() - started)
            up.add_metric([namespace], 1)
            for name, value in counters.items():
                family = families.get(name)
                if family is None:
                    family = CounterMetricFamily(
                        f"{METRIC_PREFIX}_{name}", f"Namespace counter {name} (summed over ranks)", labels=["namespace"]
                    )
                    families[name] = family
                family.add_metric([namespace], value)
        yield up
        yield from families.values()
