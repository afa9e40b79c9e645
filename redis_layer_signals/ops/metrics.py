"""Prometheus metrics: every rank's counters (read from Redis at scrape time) and client-side
latency histograms of the calls this process makes.

Embedding process::

    metrics = BufferMetrics()
    buf = SignalBuffer.from_url(url, namespace="prod", observer=metrics.observe)
    metrics.track(buf)          # export the namespace's counters too, per instance and rank
    metrics.serve(9108)         # or metrics.render() from your own endpoint

Names follow the Prometheus naming guide: counters end in ``_total``, durations are in seconds
(``_seconds``), one counter per event with a label for its kind (``rls_dropped_total{reason}``).
The counter names are derived from the ``stats`` hash fields by ``counter_sample``, so a
counter added to the library's functions (or written by the FastDeploy bridge) is exported without a change
here.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..buffer.sync import SignalBuffer
from ..protocol.counters import COUNTERS
from ..protocol.replies import text
from ..server import durability, eviction
from ..server.checks import read_servers

METRIC_PREFIX = "rls"
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Seconds; a record on a local Redis takes well under a millisecond, a retried one seconds."""
RANK_LABELS = ("namespace", "instance", "rank")
"""The labels of every counter: an operator finds the rank that misbehaves."""
DROPPED_PREFIX = "dropped_"
"""``dropped_<reason>`` fields become one ``rls_dropped_total`` counter with a ``reason`` label."""
MILLISECONDS_SUFFIX = "_ms"
"""``<name>_ms`` fields are durations: exported as ``rls_<name>_seconds_total``, in seconds."""

HELP = {
    "recorded": "Signals accepted by record (delivered + buffered)",
    "delivered": "Signals record handed straight to a live task",
    "buffered": "Early signals record kept in Redis until their task registers",
    "superseded": "Pending signals replaced by a newer one for the same slot and layer",
    "registered": "Cache tasks registered",
    "recovered": "Buffered signals handed back by register",
    "dropped": "Buffered signals register refused, by reason",
    "finished": "Tasks removed by finish",
    "finish_dropped": "Pending signals removed by finish (aborted before register)",
    "fenced": "Late finish calls that named another request than the slot's",
    "expired": "Pending signals that outlived their TTL",
    "occupied": "Registers refused because another live request held the slot",
    "replaced": "Registers that replaced another live request (replace=True)",
    "reregistered": "Registers repeated for the live request (same recovery returned)",
    "replayed": "Resent calls answered from their idempotency token",
    "degraded_seconds": "Time the FastDeploy bridge served its process locally while Redis was unreachable",
    "served_locally": "Calls the FastDeploy bridge served in its process while degraded",
    "reconciled": "Entries the FastDeploy bridge wrote back to Redis after an outage",
    "identity_refused": "FastDeploy bridges refused their instance and rank: another live process owned it",
    "ownership_fenced": "FastDeploy bridge writes the server refused: another process claimed the rank since",
}

ENDINGS = ("recovered", "finish_dropped", "superseded", "expired")
"""Where a buffered signal ends, with every ``dropped_<reason>``: invariant 1 in numbers."""
PENDING_META_FIELDS = 2
"""Fields of a rank's pending hash that are not signals: "layers" and '~' (lua/_lib.lua)."""


@dataclass(frozen=True)
class CounterSample:
    """One sample of one counter family: ``rls_<family>_total{<extra labels>}``."""

    family: str
    extra: tuple[tuple[str, str], ...]
    value: float


def counter_sample(field: str, value: float) -> CounterSample:
    """The counter a ``stats`` hash field is exported as (any field, known or not)."""
    if field.startswith(DROPPED_PREFIX) and len(field) > len(DROPPED_PREFIX):
        return CounterSample("dropped", (("reason", field[len(DROPPED_PREFIX) :]),), value)
    if field.endswith(MILLISECONDS_SUFFIX) and len(field) > len(MILLISECONDS_SUFFIX):
        return CounterSample(field[: -len(MILLISECONDS_SUFFIX)] + "_seconds", (), value / 1000)
    return CounterSample(field, (), value)


def rank_counters(raw: dict[Any, Any]) -> dict[str, float]:
    """One rank's ``stats`` hash as counters. Every field of ``counters.COUNTERS`` is
    present (0 until it happens), so every series of the dashboard exists, the fields the
    FastDeploy bridge adds after an outage included."""
    counters: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
    for name, value in raw.items():
        counters[text(name)] = float(value)  # HINCRBYFLOAT fields too
    # record.lua counts delivered and buffered only: one counter write fewer per call.
    counters["recorded"] = counters["delivered"] + counters["buffered"]
    return counters


def unaccounted(counters: dict[str, float], pending: int) -> float:
    """Buffered signals that neither ended (recovered, dropped, superseded, expired) nor are
    still pending: 0 on a healthy rank. Positive: signals vanished (evicted, or their key's
    TTL ran out before a sweep counted them); negative: the counters themselves were lost."""
    ended = sum(value for name, value in counters.items() if name in ENDINGS or name.startswith(DROPPED_PREFIX))
    return counters["buffered"] - ended - pending


def read_rank_stats(buffer: SignalBuffer) -> dict[tuple[str, int], tuple[dict[str, float], int]]:
    """Every rank's counters and pending signal count in ``buffer``'s namespace (read only:
    no sweep, no retry). Both come from one MULTI (the keys share a hash tag), so they agree."""
    keys = buffer.protocol.keys
    ranks = {}
    for instance, rank in buffer.ranks():
        rank_keys = keys.rank(instance, rank)
        pipe = buffer.client.pipeline(transaction=True)
        pipe.hgetall(rank_keys.stats)
        pipe.hlen(rank_keys.pending)
        raw, fields = pipe.execute()
        ranks[(instance, rank)] = (rank_counters(raw), max(0, int(fields) - PENDING_META_FIELDS))
    return ranks


T = TypeVar("T")


class TrackedCollector(Collector, Generic[T]):
    """A collector over objects added while the process runs (buffers, bridges): each scrape
    works on a copy of the list, taken under a lock, so ``add`` may race with a scrape."""

    def __init__(self) -> None:
        self._tracked: list[T] = []
        self._lock = threading.Lock()

    def add(self, item: T) -> None:
        with self._lock:
            self._tracked.append(item)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            tracked = list(self._tracked)
        return self.collect_from(tracked)

    def collect_from(self, tracked: list[T]) -> Iterable[Metric]:
        raise NotImplementedError


class Exporter:
    """A registry of its own (so several can live in one process), rendered or served."""

    registry: CollectorRegistry

    def render(self) -> bytes:
        """The Prometheus text format, for an endpoint the embedding process already has."""
        return bytes(generate_latest(self.registry))

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serve ``/metrics`` on a background thread; returns the HTTP server (``shutdown()``)."""
        server, _thread = start_http_server(port, addr, registry=self.registry)
        return server


class BufferMetrics(Exporter):
    """A registry of its own (so several can live in one process) with the latency histogram
    and, for every tracked buffer, its ranks' counters."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.latency = Histogram(
            f"{METRIC_PREFIX}_call_duration_seconds",
            "Client-side duration of buffer calls, retries included",
            ["operation"],
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self._counters = _CounterCollector(self)
        self.registry.register(self._counters)

    def observe(self, operation: str, seconds: float) -> None:
        """The ``observer`` hook of [`SignalBuffer`][redis_layer_signals.SignalBuffer] and
        [`AsyncSignalBuffer`][redis_layer_signals.AsyncSignalBuffer]."""
        self.latency.labels(operation).observe(seconds)

    def track(self, buffer: SignalBuffer) -> None:
        """Export the counters of every rank of ``buffer``'s namespace on every scrape."""
        self._counters.add(buffer)


class _CounterCollector(TrackedCollector[SignalBuffer]):
    def __init__(self, metrics: BufferMetrics) -> None:
        super().__init__()
        self.metrics = metrics

    def collect_from(self, buffers: list[SignalBuffer]) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            f"{METRIC_PREFIX}_up",
            "1 when the last scrape read the namespace's counters from Redis",
            labels=["namespace"],
        )
        families: dict[str, CounterMetricFamily] = {}
        mismatch = GaugeMetricFamily(
            f"{METRIC_PREFIX}_counter_mismatch",
            "Buffered signals neither ended nor pending (0 when healthy; else lost, e.g. evicted)",
            labels=list(RANK_LABELS),
        )
        owed = GaugeMetricFamily(
            f"{METRIC_PREFIX}_owed_finishes",
            "Finishes that raised BufferUnavailable, to be sent again before the next call on their rank",
            labels=["namespace"],
        )
        refused = CounterMetricFamily(
            f"{METRIC_PREFIX}_owed_finishes_refused",
            "Finishes not kept to be sent again: their rank owed max_slots already (OwedFinishesFull)",
            labels=["namespace"],
        )
        servers: dict[str, tuple[str, float | None]] = {}
        settings: dict[str, dict[str, str]] = {}
        for buffer in buffers:
            namespace = buffer.config.namespace
            owed.add_metric([namespace], buffer.owed.count())  # this process's, read without Redis
            refused.add_metric([namespace], buffer.owed.refused)
            started = time.perf_counter()
            try:
                # No sweep: a scrape only reads. Expiries are counted by the next call on the rank.
                ranks = read_rank_stats(buffer)
            except Exception:
                up.add_metric([namespace], 0)
                continue
            self.metrics.observe("stats", time.perf_counter() - started)
            up.add_metric([namespace], 1)
            with contextlib.suppress(Exception):  # best effort: the counters are exported anyway
                servers.update(eviction.server_figures(buffer.client))
            with contextlib.suppress(Exception):
                settings.update(read_servers(buffer.client, buffer.config.wait_replicas)[1])
            for (instance, rank), (counters, pending) in ranks.items():
                mismatch.add_metric([namespace, instance, str(rank)], unaccounted(counters, pending))
                for field, value in counters.items():
                    sample = counter_sample(field, value)
                    family = families.get(sample.family)
                    if family is None:
                        family = CounterMetricFamily(
                            f"{METRIC_PREFIX}_{sample.family}",
                            HELP.get(sample.family, f"Rank counter {field}"),
                            labels=[*RANK_LABELS, *(name for name, _ in sample.extra)],
                        )
                        families[sample.family] = family
                    family.add_metric([namespace, instance, str(rank), *(v for _, v in sample.extra)], sample.value)
        yield up
        yield owed
        yield refused
        yield from families.values()
        yield mismatch
        yield from server_families(servers)
        yield durability_family(settings)


def server_families(servers: dict[str, tuple[str, float | None]]) -> Iterator[Metric]:
    """Per server: whether its maxmemory-policy may evict, and the keys it evicted."""
    evicting = GaugeMetricFamily(
        f"{METRIC_PREFIX}_server_evicting",
        "1 when the server's maxmemory-policy may evict keys (anything but noeviction)",
        labels=["server", "policy"],
    )
    evicted = CounterMetricFamily(
        f"{METRIC_PREFIX}_server_evicted_keys",
        "Keys the server evicted since it started (INFO stats evicted_keys, every tenant's keys)",
        labels=["server"],
    )
    for server, (policy, keys) in sorted(servers.items()):
        evicting.add_metric([server, policy], 1 if eviction.evicting({server: policy}) else 0)
        if keys is not None:
            evicted.add_metric([server], keys)
    yield evicting
    yield evicted


def durability_family(settings: dict[str, dict[str, str]]) -> Metric:
    """Per server and setting: 1 when acknowledged writes can be lost (``appendonly no``, a
    Sentinel primary's ``min-replicas-to-write 0``, ``wait_replicas=0`` on a Cluster primary with
    replicas), 0 when not; a setting that could not be read is left out."""
    risk = GaugeMetricFamily(
        f"{METRIC_PREFIX}_server_durability_risk",
        "1 when a server setting lets a restart or failover lose acknowledged writes (see the setting label)",
        labels=["server", "setting"],
    )
    for server, found in sorted(settings.items()):
        risky = durability.at_risk(found)
        for setting, value in sorted(found.items()):
            if value != durability.UNKNOWN:
                risk.add_metric([server, setting], 1 if setting in risky else 0)
    return risk
