"""How a bridge is doing: whether it serves from Redis or locally, and what that cost.

``BridgeHealth`` is a snapshot (``Layer0Bridge.health()``); ``BridgeMetrics`` exports
the snapshots of the bridges it tracks to Prometheus, labelled by namespace, instance and rank,
from the process that runs them (the ``rls metrics`` exporter reads Redis, which cannot say
that Redis is unreachable)::

    metrics = BridgeMetrics()
    metrics.track(bridge)
    metrics.serve(9109)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ..ops.metrics import RANK_LABELS, Exporter, TrackedCollector

if TYPE_CHECKING:
    from ..buffer.sync import SignalBuffer

OPERATIONS = ("on_kv_signal", "on_cache_task", "on_task_finished")
"""The three hooks, as the ``operation`` label spells them."""
WAIT_BUCKETS_S = (0.001, 0.005, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
"""Bounds of the wait histograms, in seconds: a task's usual lag (ms) up to the pending TTL."""
GROUP_EVENTS = ("generation", "restart", "reset", "refused", "duplicate", "nranks", "absent", "bug")
"""The group's recoveries and refusals every bridge exports from its first scrape on, 0 until
they happen: ``increase`` over a series that appears at 1 is 0, so an alert would miss the first."""
GROUP_OUTCOMES = ("released", "lost", "abandoned", "expired")
"""The group's outcomes every bridge exports from its first scrape on (see ``GROUP_EVENTS``)."""


class WaitHistogram:
    """Counts of waits per bucket, kept by the bridge under its lock (no lock of its own),
    exported as a Prometheus histogram: cheaper on the hooks' path than a client ``Histogram``."""

    __slots__ = ("buckets", "count", "total_s")

    def __init__(self) -> None:
        self.buckets = [0] * len(WAIT_BUCKETS_S)
        self.count = 0
        self.total_s = 0.0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        for index, bound in enumerate(WAIT_BUCKETS_S):
            if seconds <= bound:
                self.buckets[index] += 1
                return

    def snapshot(self) -> tuple[tuple[int, ...], int, float]:
        """(per-bucket counts, not cumulative; count; sum in seconds)."""
        return tuple(self.buckets), self.count, self.total_s


@dataclass(frozen=True)
class BridgeHealth:
    """One bridge's state and counters since it was built."""

    degraded: bool
    """True while Redis is unreachable and the bridge serves this process on its own."""
    episodes: int
    """Times Redis became unreachable."""
    degraded_seconds: float
    """Time spent degraded, the current episode included."""
    local_calls: Mapping[str, int]
    """Hook calls served locally, per hook."""
    reconciled_entries: int
    """Entries written back to Redis after an episode (a record's entries, a task, a finish)."""
    journal: int
    """Operations served locally and not yet written back."""
    errors: Mapping[str, int]
    """Hook calls that failed on the way (Redis errors, invalid input, bugs), per hook: each one
    was logged (once per episode) and served locally or skipped, never raised."""
    suppressed: int
    """Layer-0 signals not queued because the sender already had one as far along."""
    unwritten: int = 0
    """Hook decisions Redis does not hold yet: the writer's lag (``registers_tasks``), or the
    journal (an adder in another process)."""
    lag_seconds: float = 0.0
    """Age of the oldest decision Redis does not hold yet (0 when caught up): how far behind
    what ``rls inspect`` and the exporter read from Redis is."""
    group_waiting: int = 0
    """A tensor-parallel rank (``nranks > 1``): layer-0 entries waiting for their task on this
    rank (0 for a rank of its own)."""
    group_reported: int = 0
    """Entries this rank reported ready that the group has not released yet (another rank's
    task is not registered yet)."""
    group_generation: int = 0
    """The group's sequencer generation this rank joined (0: none yet): it grows when the
    sequencer's process is gone and another rank's takes over."""
    group_sequencer: bool = False
    """This process sequences its group."""
    group_connected: bool = False
    """This rank is connected to its group's sequencer."""
    group_problem: str = ""
    """Why the group cannot agree, while it cannot: another process holds the rank, the ranks
    disagree on ``nranks``, a live rank did not join (also logged at ERROR)."""
    group_events: Mapping[str, int] = field(default_factory=dict)
    """Recoveries and refusals seen: ``generation`` (a new sequencer), ``restart`` (a rank
    restarted), ``reset``, ``refused``, ``duplicate``, ``nranks``, ``absent``, ``bug``."""
    early_wait: tuple[tuple[int, ...], int, float] = ((0,) * len(WAIT_BUCKETS_S), 0, 0.0)
    """How long the early signals handed to their task had waited for it (``WaitHistogram``)."""
    group_wait: tuple[tuple[int, ...], int, float] = ((0,) * len(WAIT_BUCKETS_S), 0, 0.0)
    """A tensor-parallel rank: how long each entry the group released waited, once ready here,
    for the other ranks (their tasks)."""
    group_outcomes: Mapping[str, int] = field(default_factory=dict)
    """Entries the group queued (``released``) or dropped here, by why (``lost``, ``abandoned``,
    ``expired`` or a drop reason)."""
    evicting: Mapping[str, str] = field(default_factory=dict)
    """The servers the buffer found with a ``maxmemory-policy`` that may evict (server: policy):
    empty on a ``noeviction`` server. Eviction deletes what the bridge wrote without an error."""
    identity: str = "none"
    """The claim on (instance, rank) where the process owns its rank: "claiming" until Redis
    answers the first claim, then "held", or "refused" while another live process holds it
    (``IdentityTaken``: nothing is written, the process is served locally); "none" where
    Redis judges (no process owns the rank)."""
    identity_holder: str = ""
    """While refused: the process that holds the identity (host, pid)."""
    identity_refusals: int = 0
    """Times the bridge found another live process holding its identity."""


class Tracked(Protocol):
    """What the exporter reads of a bridge (``Layer0Bridge``): its rank and its health."""

    buffer: SignalBuffer
    instance: str
    rank: int

    def health(self) -> BridgeHealth: ...


class BridgeMetrics(Exporter):
    """A registry of its own with one collector over every tracked bridge."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._collector = _BridgeCollector()
        self.registry.register(self._collector)

    def track(self, bridge: Tracked) -> None:
        self._collector.add(bridge)


LABELS = list(RANK_LABELS)


class _BridgeCollector(TrackedCollector[Tracked]):
    def collect_from(self, bridges: list[Tracked]) -> Iterator[Metric]:
        degraded = GaugeMetricFamily("rls_bridge_degraded", "1 while the bridge serves locally", labels=LABELS)
        seconds = CounterMetricFamily("rls_bridge_degraded_seconds", "Seconds the bridge served locally", labels=LABELS)
        episodes = CounterMetricFamily("rls_bridge_episodes", "Times Redis became unreachable", labels=LABELS)
        local = CounterMetricFamily(
            "rls_bridge_local_calls", "Hook calls served without Redis", labels=[*LABELS, "operation"]
        )
        reconciled = CounterMetricFamily(
            "rls_bridge_reconciled_entries", "Entries written back to Redis after an outage", labels=LABELS
        )
        journal = GaugeMetricFamily(
            "rls_bridge_journal", "Operations served locally, not yet written back", labels=LABELS
        )
        unwritten = GaugeMetricFamily(
            "rls_bridge_unwritten", "Hook decisions Redis does not hold yet (the writer's lag)", labels=LABELS
        )
        lag = GaugeMetricFamily(
            "rls_bridge_lag_seconds", "Age of the oldest decision Redis does not hold yet", labels=LABELS
        )
        waiting = GaugeMetricFamily(
            "rls_bridge_group_waiting", "Tensor-parallel rank: layer-0 entries not released yet", labels=LABELS
        )
        reported = GaugeMetricFamily(
            "rls_bridge_group_reported",
            "Tensor-parallel rank: entries reported ready, awaiting the other ranks",
            labels=LABELS,
        )
        generation = GaugeMetricFamily(
            "rls_bridge_group_generation", "Tensor-parallel rank: the sequencer generation joined", labels=LABELS
        )
        problem = GaugeMetricFamily(
            "rls_bridge_group_problem", "Tensor-parallel rank: 1 while its group cannot agree (logged)", labels=LABELS
        )
        events = CounterMetricFamily(
            "rls_bridge_group_events",
            "Tensor-parallel rank: recoveries and refusals (new sequencer, rank restart, nranks mismatch, ...)",
            labels=[*LABELS, "event"],
        )
        outcomes = CounterMetricFamily(
            "rls_bridge_group_entries",
            "Tensor-parallel rank: layer-0 entries the group released or dropped, by outcome",
            labels=[*LABELS, "outcome"],
        )
        errors = CounterMetricFamily(
            "rls_bridge_errors", "Hook calls that failed on the way (never raised)", labels=[*LABELS, "operation"]
        )
        identity = GaugeMetricFamily(
            "rls_bridge_identity_held", "1 while this process owns its instance and rank in Redis", labels=LABELS
        )
        refusals = CounterMetricFamily(
            "rls_bridge_identity_refused",
            "Times another live process held this bridge's instance and rank (IdentityTaken)",
            labels=LABELS,
        )
        early = HistogramMetricFamily(
            "rls_bridge_early_signal_wait_seconds",
            "How long an early layer-0 signal waited for its task, handed to it",
            labels=LABELS,
        )
        group_wait = HistogramMetricFamily(
            "rls_bridge_group_wait_seconds",
            "Tensor-parallel rank: how long an entry, ready here, waited for the other ranks",
            labels=LABELS,
        )
        for bridge in bridges:
            health = bridge.health()
            labels = [bridge.buffer.config.namespace, bridge.instance, str(bridge.rank)]
            degraded.add_metric(labels, int(health.degraded))
            seconds.add_metric(labels, health.degraded_seconds)
            episodes.add_metric(labels, health.episodes)
            reconciled.add_metric(labels, health.reconciled_entries)
            journal.add_metric(labels, health.journal)
            unwritten.add_metric(labels, health.unwritten)
            lag.add_metric(labels, health.lag_seconds)
            waiting.add_metric(labels, health.group_waiting)
            reported.add_metric(labels, health.group_reported)
            generation.add_metric(labels, health.group_generation)
            problem.add_metric(labels, int(bool(health.group_problem)))
            for event, n in {**dict.fromkeys(GROUP_EVENTS, 0), **health.group_events}.items():
                events.add_metric([*labels, event], n)
            for outcome, n in {**dict.fromkeys(GROUP_OUTCOMES, 0), **health.group_outcomes}.items():
                outcomes.add_metric([*labels, outcome], n)
            for family, (counts, count, total) in ((early, health.early_wait), (group_wait, health.group_wait)):
                cumulative, buckets = 0, []
                for bound, n in zip(WAIT_BUCKETS_S, counts, strict=True):
                    cumulative += n
                    buckets.append((str(bound), cumulative))
                buckets.append(("+Inf", count))
                family.add_metric(labels, buckets, total)
            identity.add_metric(labels, int(health.identity == "held"))
            refusals.add_metric(labels, health.identity_refusals)
            for operation in OPERATIONS:
                local.add_metric([*labels, operation], health.local_calls.get(operation, 0))
                errors.add_metric([*labels, operation], health.errors.get(operation, 0))
        yield from (
            degraded,
            seconds,
            episodes,
            local,
            reconciled,
            journal,
            unwritten,
            lag,
            waiting,
            reported,
            generation,
            problem,
            events,
            outcomes,
            early,
            group_wait,
            errors,
            identity,
            refusals,
        )
