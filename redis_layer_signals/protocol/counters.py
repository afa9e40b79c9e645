"""The counters each rank keeps in its ``stats`` hash, and their sum over a namespace."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..models import DropReason
from .replies import text


def sum_stats(hashes: Sequence[dict[Any, Any]]) -> dict[str, int]:
    """Add up the per-rank counter hashes into one namespace view, every known counter present."""
    totals = dict.fromkeys(COUNTERS, 0)
    for counters in hashes:
        for name, value in counters.items():
            key = text(name)
            totals[key] = totals.get(key, 0) + int(value)
    # record.lua counts delivered and buffered only: one counter write fewer per call.
    totals["recorded"] = totals["delivered"] + totals["buffered"]
    return totals


COUNTERS = (
    "recorded",
    "delivered",
    "buffered",
    "superseded",
    "registered",
    "recovered",
    *(f"dropped_{reason.value}" for reason in DropReason),
    "finished",
    "finish_dropped",
    "fenced",
    "expired",
    "occupied",
    "replaced",
    "reregistered",
    "replayed",
    # Added by the FastDeploy bridge when an outage ends (fastdeploy/bridge.py).
    "degraded_ms",
    "served_locally",
    "reconciled",
    # Added by a FastDeploy bridge refused its identity (fastdeploy/identity.py, lua/claim.lua).
    "identity_refused",
    # Added by the ownership fence (lua/_lib.lua owner_fence): a write or claim of a process that
    # no longer owns the rank, refused.
    "ownership_fenced",
)
"""Counters a namespace reports. ``buffered`` signals end as recovered, dropped_*,
finish_dropped, superseded or expired (or are still pending): invariant 1 in numbers.
``degraded_ms``, ``served_locally`` and ``reconciled`` count the FastDeploy bridge's outages:
milliseconds served without Redis, hook calls served so, entries written back after.
``identity_refused`` counts bridges refused because another live process owned the rank,
``ownership_fenced`` writes refused because their process had lost the rank to another."""
