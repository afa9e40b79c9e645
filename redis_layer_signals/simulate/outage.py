"""A Redis outage in the middle of the reference pipeline, and the checks that nothing was lost.

``run_outage`` starts its own ``redis-server`` (AOF, ``appendfsync always``), drives the
mixed workload of ``workload`` through the reference messager, SIGKILLs the server once the
run is under way, keeps it down for ``down_s`` while GPU signals, cache infos and finishes keep
arriving (the driver paces itself so the outage spans that time), then restarts it ``empty``
(a node with a fresh disk), from its ``aof``, or ``never``. ``OutageReport.problems`` says
what went wrong: a request that did not finish, a block written twice, early or never, a
missing "task added" acknowledgement, a thread that stopped serving, or a signal the counters
do not account for exactly once.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from ..bench.server import LocalRedis
from ..buffer.sync import SignalBuffer
from ..errors import InvalidConfig
from ..fastdeploy.demo.reference import ReferenceMessager
from ..fastdeploy.demo.workload import INSTANCE, RANK, Outcome, make_plans, run

RESTARTS = ("empty", "aof", "never")
AOF_ALWAYS = ("--appendonly", "yes", "--appendfsync", "always")
PACE_S = 0.05
"""While Redis is down, the driver waits this long between steps: traffic spread over the outage."""
IDLE_TIMEOUT_S = 30.0
"""Bound on waiting for the messager to go idle before the kill, and for the write-back."""


@dataclass(frozen=True)
class OutageReport:
    """What one outage run did and saw."""

    restart: str
    killed_at_step: int
    down_s: float
    """Seconds from the kill to the restart (to the end of the run for ``never``)."""
    before: dict[str, int]
    """The namespace's counters just before the kill."""
    pending_before: int
    """Early signals pending in Redis just before the kill."""
    outcome: Outcome

    def problems(self) -> list[str]:
        """Everything that went wrong, in words; empty when the outage cost nothing."""
        out = list(self.outcome.problems())
        if not self.outcome.health.episodes:
            out.append("the bridge never noticed the outage: it proved nothing")
        out += self._accounting()
        return out

    def _accounting(self) -> list[str]:
        """Every layer-0 signal the GPU emitted ends in exactly one place, across Redis's
        counters (before the kill, and after a restart that lost them) and the bridge's."""
        emitted = self.outcome.layer0_signals()
        before = self.before
        out = _balance("before the kill", before, self.pending_before)
        local, after = self.outcome.local_counts, self.outcome.stats
        if self.restart == "never":
            recorded = before["recorded"] + local.get("recorded", 0)
            out += _balance("decided locally", local, self.outcome.local_pending)
            if local.get("shared_taken", 0) != self.pending_before:
                out.append(
                    f"{self.pending_before} signals were pending at the kill, "
                    f"{local.get('shared_taken', 0)} taken locally"
                )
        elif after is None:
            return [*out, "Redis could not be read after the restart"]
        else:
            if local:
                out.append(f"decisions never written back: {dict(local)}")
            out += _balance("after the restart", after, 0)
            recorded = after["recorded"] + (before["recorded"] if self.restart == "empty" else 0)
        if recorded != emitted:
            out.append(f"{emitted} layer-0 signals emitted, {recorded} recorded")
        return out


def _balance(where: str, counts: Mapping[str, int], pending: int) -> list[str]:
    """``recorded = delivered + buffered`` and ``buffered`` = its fates + still pending."""
    get = counts.get
    recorded = get("recorded", 0)
    delivered, buffered = get("delivered", 0), get("buffered", 0)
    ended = sum(get(name, 0) for name in ("recovered", "superseded", "finish_dropped", "expired"))
    ended += sum(value for name, value in counts.items() if name.startswith("dropped_"))
    out = []
    if recorded != delivered + buffered:
        out.append(f"{where}: recorded {recorded} != delivered {delivered} + buffered {buffered}")
    if buffered != ended + pending:
        out.append(f"{where}: buffered {buffered} != ended {ended} + pending {pending}")
    return out


class _Outage:
    """The fault, driven by the workload's steps: kill at ``kill_at``, pace while down, restart."""

    def __init__(
        self, server: LocalRedis, namespace: str, kill_at: int, down_s: float, restart: str, pace_s: float
    ) -> None:
        self.server = server
        self.namespace = namespace
        self.kill_at = kill_at
        self.down_s = down_s
        self.restart = restart
        self.killed: float | None = None
        self.down_for = 0.0
        self.before: dict[str, int] = {}
        self.pending_before = 0
        self.pace_s = pace_s

    def __call__(self, step: int, messager: ReferenceMessager) -> None:
        if step == self.kill_at:
            self._kill(messager)
        elif self.killed is not None and not self.down_for:
            if time.monotonic() - self.killed < self.down_s:
                time.sleep(self.pace_s)  # traffic goes on, spread over the outage
            elif self.restart != "never":
                self._restart(self.killed)

    def _restart(self, killed: float) -> None:
        if self.restart == "empty":
            self.server.wipe()
        self.server.start()
        self.down_for = time.monotonic() - killed

    def _kill(self, messager: ReferenceMessager) -> None:
        """Between two calls, so the counters read now are the ones Redis dies with."""
        if not messager.wait_idle(IDLE_TIMEOUT_S):
            raise TimeoutError(f"the messager did not go idle within {IDLE_TIMEOUT_S}s")
        if not messager.bridge.flush(IDLE_TIMEOUT_S):
            raise TimeoutError(f"the bridge's writer did not catch up within {IDLE_TIMEOUT_S}s")
        with SignalBuffer.from_url(self.server.url, namespace=self.namespace, env={}) as reader:
            self.before = reader.stats(sweep=False)
            self.pending_before = sum(
                len(reader.pending(INSTANCE, RANK, slot)) for slot in range(reader.config.max_slots)
            )
        self.server.kill()
        self.killed = time.monotonic()

    def settle(self, messager: ReferenceMessager) -> None:
        """Once every request finished: wait for the write-back (unless Redis stays down)."""
        if self.killed is None:
            raise RuntimeError(f"the run ended before step {self.kill_at}: no outage happened")
        # The workload may end before down_s: the outage still lasts that long.
        time.sleep(max(0.0, self.down_s - (time.monotonic() - self.killed)))
        if self.restart == "never":
            self.down_for = time.monotonic() - self.killed
            return
        if not self.down_for:
            self._restart(self.killed)
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while messager.bridge.health().degraded and time.monotonic() < deadline:
            time.sleep(0.02)


def run_outage(
    restart: str,
    *,
    requests: int = 32,
    seed: int = 1,
    layers: int = 4,
    retry_s: float = 0.5,
    down_s: float = 2.0,
    kill_at: int | None = None,
    timeout_s: float = 60.0,
) -> OutageReport:
    """One run of the workload through an outage of its own redis-server (see module doc).
    ``kill_at`` is the driver step of the kill (default: a third of the way in; for ``never``,
    three fifths, and the driver paces its remaining steps over ``down_s`` or more, so the run
    ends with Redis still down)."""
    if restart not in RESTARTS:
        raise InvalidConfig("restart", restart, f"must be one of {', '.join(RESTARTS)}")
    if not 0 < retry_s < down_s:
        raise InvalidConfig(
            "down_s", down_s, "must exceed retry_s: an outage shorter than one call's budget is a retry"
        )
    steps = _steps(requests, seed)
    if kill_at is None:
        kill_at = steps * 3 // 5 if restart == "never" else steps // 3
    pace_s = max(PACE_S, down_s / max(1, steps - kill_at)) if restart == "never" else PACE_S
    server = LocalRedis(AOF_ALWAYS)
    namespace = f"outage-{uuid.uuid4().hex[:8]}"
    try:
        server.start()
        outage = _Outage(server, namespace, kill_at, down_s, restart, pace_s)
        outcome = run(
            server.url,
            namespace,
            requests=requests,
            seed=seed,
            layers=layers,
            timeout_s=timeout_s,
            retry_s=retry_s,
            on_step=outage,
            before_end=outage.settle,
        )
        return OutageReport(restart, kill_at, outage.down_for, outage.before, outage.pending_before, outcome)
    finally:
        server.cleanup()


def _steps(requests: int, seed: int) -> int:
    """Roughly how many driver steps a run takes: every chunk in a step of ~2, plus each task."""
    plans = make_plans(seed, requests)
    return sum(len(p.chunks) for p in plans) // 2 + requests
