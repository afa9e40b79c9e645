"""What asynchronous replication may lose at a failover, bounded from both sides.

Redis promises no more than this: the primary acknowledges a write without waiting for a
replica to apply it (``wait_replicas=0``), and the promoted replica keeps exactly the prefix
of the replication stream it had applied, up to its offset ``kept`` (``second_repl_offset - 1``
once promoted; a transaction counts only once its ``EXEC`` is applied). Whatever the primary had run when its
own ``master_repl_offset`` was still at most ``kept`` survives; whatever it ran once its offset
was past ``kept`` is gone. So, with the old primary's offset sampled on its own host (which no
cut reaches), each reading stamped before it was asked and after it answered:

- at most: the calls acknowledged after the last reading still within ``kept`` was asked
  (each ran after that reading, and a call is acknowledged after it ran);
- at least: the calls first sent after the first reading past ``kept`` answered, acknowledged
  while the old primary was the only one serving them (a resend of them replays or reruns
  there, past ``kept`` too).

Neither bound is a guess about the replication lag: the lag is whatever it was, and the
offsets place it. The stamps are monotonic seconds, which every host of the tests shares.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.netns import HostedRedis

SAMPLE_S = 0.02
"""Between two readings of the primary's offset: the bounds are this much looser than the lag."""


@dataclass(frozen=True)
class Reading:
    asked: float
    answered: float
    offset: int


@dataclass
class OffsetSampler:
    """A primary's ``master_repl_offset`` read every ``SAMPLE_S`` on a thread on its own host."""

    node: HostedRedis
    readings: list[Reading] = field(default_factory=list)
    error: BaseException | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> OffsetSampler:
        self._thread = self.node.hosts.thread(self.node.host, self._run)
        return self

    def _run(self) -> None:
        try:
            with self.node.client() as client:
                while not self._stop.is_set():
                    asked = time.monotonic()
                    offset = int(client.info("replication")["master_repl_offset"])
                    self.readings.append(Reading(asked, time.monotonic(), offset))
                    self._stop.wait(SAMPLE_S)
        except BaseException as exc:  # said by stop(): a sampler that stopped early is a failed test
            self.error = exc

    def halt(self) -> None:
        """Stop reading (again), raising nothing: for a ``finally`` that must go on."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def stop(self) -> list[Reading]:
        """Stop reading; the readings, or what made them fail."""
        self.halt()
        if self.error is not None:
            raise AssertionError(f"reading the primary's offset failed: {self.error!r}") from self.error
        return self.readings


def kept_offset(promoted: HostedRedis) -> int:
    """The last offset of the old primary's stream the promoted replica applied."""
    info = promoted.admin(lambda c: c.info("replication"))
    return int(info["second_repl_offset"]) - 1


Ack = Sequence[float]
"""``[first attempt's start, acknowledged, signals recorded, registrations, signals handed out]``
(tests/partition_worker.py)."""
Acked = tuple[int, Ack]
"""An acknowledged call and the client process (its index in the test's client hosts) it came from."""


def acks_of(result: dict[str, Any], ns: str) -> list[Acked]:
    """One namespace's acknowledged calls, from every client process."""
    return [(process, ack) for process, timing in enumerate(result["timings"][ns]) for ack in timing["acks"]]


def _sums(acks: list[Acked]) -> dict[str, int]:
    return {
        "signals": int(sum(a[2] for _, a in acks)),
        "registrations": int(sum(a[3] for _, a in acks)),
        "handed_out": int(sum(a[4] for _, a in acks)),
    }


def loss_window(
    readings: list[Reading],
    kept: int,
    acks: list[Acked],
    old_primary_only: Callable[[int, float], bool],
    old_primary_may_have: Callable[[int, float], bool],
) -> dict[str, Any]:
    """The bounds on what the failover lost of ``acks`` (see the module docstring).

    ``old_primary_only(process, acknowledged)``: the old primary certainly acknowledged the
    call (before the cut, or to a host that reached no other). ``old_primary_may_have(process,
    acknowledged)``: it may have (any looseness here only widens the upper bound)."""
    within = [r for r in readings if r.offset <= kept]
    past = [r for r in readings if r.offset > kept]
    kept_until = max((r.asked for r in within), default=float("-inf"))
    lost_from = min((r.answered for r in past), default=float("inf"))
    at_most = [(p, a) for p, a in acks if a[1] >= kept_until and old_primary_may_have(p, a[1])]
    at_least = [(p, a) for p, a in acks if a[0] >= lost_from and old_primary_only(p, a[1])]
    last = readings[-1].offset if readings else None
    return {
        "kept_offset": kept,
        "old_primary_offset": last,
        "lag_bytes": None if last is None else last - kept,
        "kept_until": round(kept_until, 3),
        "lost_from": round(lost_from, 3),
        "at_most": _sums(at_most),
        "at_least": _sums(at_least),
    }


def assert_loss_within(accounting: dict[str, int], window: dict[str, Any], figures: object) -> None:
    """What the failover lost lies within the window; what was handed out twice was handed out
    by a call it undid (at most the window's hand-outs)."""
    lost = {"signals": accounting["signals_lost"], "registrations": accounting["registrations_lost"]}
    for kind, count in lost.items():
        assert window["at_least"][kind] <= count <= window["at_most"][kind], (kind, figures)
    assert accounting["twice"] <= window["at_most"]["handed_out"], figures
