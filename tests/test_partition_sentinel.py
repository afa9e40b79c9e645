"""Sentinel split, not killed: a primary and two replicas, a sentinel beside each, on three hosts,
and client processes on two more. The split leaves the old primary with one sentinel (no
majority) and one client host; the two replicas, two sentinels and the other client host elect
a new primary. Then it heals, and the old primary rejoins as a replica, dropping what it took
alone.

With ``min-replicas-to-write 1`` (``min-replicas-max-lag 2``) and ``wait_replicas=1``, nothing
acknowledged is lost: the old primary's writes after the split are never confirmed by a replica,
so never acknowledged. Without either, what the old primary acknowledged after the split is
lost: the test counts it, and it must lie within the window the replication offsets place
(tests/replication_window.py)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.hosted import HostedSentinelGroup
from tests.netns import Hosts
from tests.partition_clients import call_bound_s, check_on, collect, figures_of, start_workers
from tests.replication_window import OffsetSampler, acks_of, assert_loss_within, kept_offset, loss_window
from tests.servers import wait_until

pytestmark = pytest.mark.netns  # make check deselects it: network namespaces need root

RETRY_S = 2.0
SERVER_HOSTS = ["h1", "h2", "h3"]  # h1: the first primary; a sentinel beside each server
OLD_SIDE = ["h1", "h4"]
NEW_SIDE = ["h2", "h3", "h5"]
CLIENT_HOSTS = ["h4", "h5"]
MIN_REPLICAS = ("--min-replicas-to-write", "1", "--min-replicas-max-lag", "2")
CALL_BOUND_S = call_bound_s(RETRY_S)
"""Every attempt on either side, the old side's asking the unreachable sentinels included."""
OLD_SIDE_WRITES_S = 3.0
"""How long the old primary's side keeps calling after the new primary is elected."""


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    made = Hosts(sorted({*SERVER_HOSTS, *CLIENT_HOSTS}))
    yield made
    made.cleanup()


def split_and_heal(hosts: Hosts, group: HostedSentinelGroup, tmp: Path, wait: int) -> tuple[dict[str, Any], Any]:
    namespace = f"split-{uuid.uuid4().hex[:8]}"
    sampler = OffsetSampler(group.servers["h1"]).start()
    workers = start_workers(hosts, group.url, CLIENT_HOSTS, tmp, [namespace], wait, RETRY_S)
    phases: dict[str, float] = {}
    try:
        time.sleep(1.5)  # calls under way from both client hosts
        split = time.monotonic()
        hosts.split(OLD_SIDE, NEW_SIDE)
        wait_until(
            lambda: (
                group.sentinels["h2"].primary_address() != group.servers["h1"].address
                and group.role(group.host_of(group.sentinels["h2"].primary_address()))[0] == "master"
            ),
            timeout=30,
            what="the majority side electing a new primary",
        )
        phases["split_to_new_primary_s"] = time.monotonic() - split
        new = group.host_of(group.sentinels["h2"].primary_address())
        readings = sampler.stop()
        kept = kept_offset(group.servers[new])
        time.sleep(OLD_SIDE_WRITES_S)  # the old primary's side keeps calling it
        healing = time.monotonic()  # before: a client may reach the new primary before heal() returns
        hosts.heal()
        healed = time.monotonic()
        wait_until(lambda: group.role("h1") == ("slave", new), timeout=60, what="the old primary rejoined")
        rejoined = time.monotonic()
        phases["heal_to_rejoined_s"] = rejoined - healed
        time.sleep(1.0)
    finally:
        sampler.halt()
        hosts.heal()  # also after a failure: the clients only stop once their calls get through
        result = collect(tmp, workers)
    # Before the split every client called the old primary, and the old side's client (h4,
    # process 0) reached no other until the heal began; none acknowledges a write once it rejoined
    # as a replica (the test saw that last: looser, never wrong).
    window = loss_window(
        readings,
        kept,
        acks_of(result, namespace),
        old_primary_only=lambda process, acked: acked < split or (process == 0 and acked < healing),
        old_primary_may_have=lambda _process, acked: acked <= rejoined,
    )
    return {"result": result, "phases": phases, "namespace": namespace, "loss_window": window}, new


@pytest.mark.timeout(180)
@pytest.mark.parametrize("safe", [True, False], ids=["min-replicas-and-wait1", "neither"])
def test_sentinel_split_old_primary_without_majority(
    hosts: Hosts, tmp_path: Path, safe: bool, record_property: Any
) -> None:
    group = HostedSentinelGroup(hosts, SERVER_HOSTS, SERVER_HOSTS, MIN_REPLICAS if safe else ())
    try:
        group.start()
        run, new = split_and_heal(hosts, group, tmp_path, wait=1 if safe else 0)
        namespace, result = run["namespace"], run["result"]
        accounting = check_on(hosts, "h5", group.url, namespace, result["logs"][namespace], exact=safe)
    finally:
        group.cleanup()
    old_side, new_side = figures_of(result, namespace, 0), figures_of(result, namespace, 1)  # h4, h5
    figures = {
        "phases": run["phases"],
        "new_primary": new,
        "old_side": old_side,
        "new_side": new_side,
        **accounting,
        "loss_window": run["loss_window"],
    }
    record_property("figures", figures)
    print(f"\nfigures sentinel safe={safe}: {json.dumps(figures)}")
    for side in (old_side, new_side):
        assert side["max_attempt_s"] <= CALL_BOUND_S + side["max_lag_s"], figures
    if safe:
        # Exact: a call is acknowledged once a replica applied it (WAIT 1), the old primary
        # refuses writes once no replica acknowledged within 2 s (min-replicas-max-lag), and the
        # sentinels promote the replica with the largest offset, which holds all either applied.
        assert accounting["twice"] == 0, figures
        assert accounting["signals_lost"] == accounting["registrations_lost"] == 0, figures
    else:
        # The old primary acknowledged the old side's calls for the whole split; its rejoin
        # as a replica discarded them. Two primaries also hand out signals on their own, so a
        # signal may be handed out on both sides (by a call the rejoin undid: bounded too).
        assert_loss_within(accounting, run["loss_window"], figures)
        assert run["loss_window"]["at_least"]["signals"] > 0, f"nothing was surely lost: was it split? {figures}"
