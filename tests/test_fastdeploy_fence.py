"""One identity, one owner, fenced by the server: once another process claimed a rank, nothing
the previous owner writes lands (``apply``), no early signal is handed out by both, and both
sides log the clash naming the other. The Lua fence (lua/_lib.lua ``owner_fence``) on fakeredis
and a real redis-server, every interleaving of a small two-process history, and two bridges on
a real redis-server."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from redis_layer_signals import CacheTask, OwnershipLost, SignalBuffer
from redis_layer_signals.fastdeploy import Layer0Bridge
from redis_layer_signals.fastdeploy.identity import CLAIMED, LAPSED, RENEWED, TAKEN, IdentityClaim
from redis_layer_signals.fastdeploy.signals import encode_kv_signal
from redis_layer_signals.protocol.calls import Claim
from redis_layer_signals.protocol.keys import RankKeys
from tests.proxy import BLACK_HOLE, PASS, Proxy
from tests.servers import RedisServer, wait_until

LAYERS = 4
WAIT_S = 15.0
LEASE_S = 1.5
SHORT_LEASE_S = 0.2


def kv(*entries: tuple[int, int, int]) -> Any:
    return encode_kv_signal(0, entries)


def cache_info(slot: int, request_id: str, need: int = 300) -> dict[str, Any]:
    return {"request_id": request_id, "current_id": slot, "need_prefill_tokens": need}


def drain(bridge: Layer0Bridge) -> list[Any]:
    out = []
    while True:
        try:
            out.extend(bridge.ready.get_nowait())
        except queue.Empty:
            return out


@pytest.fixture(params=["fake", "real", "cluster"])
def fence_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """fakeredis, a redis-server, and a 3-primary Cluster (every key the fence reads and writes
    comes in the call's keys, under the rank's hash tag)."""
    if request.param == "fake":
        yield f"memory://{uuid.uuid4().hex}"
        return
    if request.param == "cluster":
        yield request.getfixturevalue("cluster").url
        return
    server = RedisServer().start()
    yield server.url
    server.cleanup()


def rank_state(buffer: SignalBuffer, keys: RankKeys) -> dict[str, Any]:
    """What the rank's keys hold that an owner writes: tasks, signals, their index, counters
    (the claim, the clash note and the writers' batch keys left out)."""
    client = buffer.client
    stats = {k.decode(): v.decode() for k, v in client.hgetall(keys.stats).items()}
    return {
        "live": client.hgetall(keys.live),
        "pending": client.hgetall(keys.pending),
        "expiry": client.zrange(keys.expiry, 0, -1, withscores=True),
        "stats": stats,
    }


def slot_state(slot: int, tokens: int, writer: str) -> tuple[str, str, str, str, str, str, str, str]:
    """One slot for ``apply``: a pending signal whose request id names its writer."""
    far = 1 << 50
    return (str(slot), "?", "", "", "", f"{tokens},{writer},1000,{far}", "", "")


def apply(buffer: SignalBuffer, writer: str, batch: int, claim: Claim, slot: int) -> str | None:
    """One owner's write of one pending signal; returns the fencing claim, None when it landed."""
    keys = buffer.protocol.keys.rank("p0", 0)
    prepared = buffer.protocol.apply(
        keys, 0, {"buffered": 1}, [slot_state(slot, 64 + batch, writer)], writer, batch, claim
    )
    return buffer.apply(prepared).fenced_by


# -- the Lua fence -------------------------------------------------------------------------------


def test_a_stale_owners_apply_lands_nothing_after_a_new_claim(fence_url: str) -> None:
    """The old owner writes while it owns the rank; its lease runs out, a second process claims
    (``lapsed``, naming the first); the old owner's next write is refused: the rank's keys and
    counters stay as they were but for ``ownership_fenced``, and the new owner's renewal reads
    who was refused."""
    buffer = SignalBuffer.from_url(fence_url, namespace=f"f-{uuid.uuid4().hex[:8]}", env={})
    keys = buffer.protocol.keys.rank("p0", 0)
    old = IdentityClaim(buffer, "p0", 0, "old-writer", SHORT_LEASE_S)
    new = IdentityClaim(buffer, "p0", 0, "new-writer", SHORT_LEASE_S)
    assert old.claim().outcome == CLAIMED
    old_claim = old.held()
    assert old_claim is not None
    assert apply(buffer, "old-writer", 1, old_claim, 5) is None, "the owner's write lands"
    assert new.claim().outcome == TAKEN, "the old owner's lease still runs"
    time.sleep(SHORT_LEASE_S + 0.1)
    took = new.claim()
    assert took.outcome == LAPSED and took.holder is not None and took.holder.token == "old-writer"
    new_claim = new.held()
    assert new_claim is not None and new_claim.generation > old_claim.generation
    before = rank_state(buffer, keys)

    fenced_by = apply(buffer, "old-writer", 2, old_claim, 6)

    assert fenced_by is not None and fenced_by.startswith("new-writer|")
    after = rank_state(buffer, keys)
    assert after["stats"].pop("ownership_fenced") == "1"
    assert after == before, "a write of the stale owner changed the rank's keys"
    with pytest.raises(OwnershipLost, match="writer new-writ"):
        old.check_applied(fenced_by)
    assert old.held() is None and not old.valid_for(0)
    renewed = new.claim()
    assert renewed.outcome == RENEWED and renewed.clash is not None
    assert (renewed.clash.owner.token, renewed.clash.refused) == ("old-writer", "write")
    assert new.claim().clash is None, "a clash is reported once"
    assert apply(buffer, "new-writer", 1, new_claim, 6) is None, "the new owner writes"


# -- every interleaving of a two-process history ---------------------------------------------------

OLD_STEPS = ("claim", "write", "renew", "write")
NEW_STEPS = ("claim", "write")


def interleavings() -> Iterator[tuple[str, ...]]:
    """Every order of the old owner's steps, the new one's and the lease running out, each
    process's steps in their own order."""
    steps = ["old"] * len(OLD_STEPS) + ["new"] * len(NEW_STEPS) + ["lapse"]
    yield from sorted(set(itertools.permutations(steps)))


def test_no_write_of_a_non_owner_lands_in_any_interleaving() -> None:
    """Two processes, one identity: the old one claims, writes, renews and writes again; the new
    one claims and writes; the old one's lease runs out at any point. Run on the Lua functions
    (fakeredis) in every order, and held to the rule: a claim succeeds when the identity is
    free, the caller's, or its holder's lease ran out; a write lands exactly when its process
    holds the identity then. So no write of a process that does not own the rank lands, and
    what the pending hash holds was written by the owner of the moment."""
    explored = 0
    server = f"memory://{uuid.uuid4().hex}"  # one server (the library loads once), a namespace per run
    for order in interleavings():
        buffer = SignalBuffer.from_url(server, namespace=f"x{explored}", env={})
        keys = buffer.protocol.keys.rank("p0", 0)
        processes = {name: IdentityClaim(buffer, "p0", 0, f"{name}-writer", 60.0) for name in ("old", "new")}
        progress = {"old": 0, "new": 0}
        holder: str | None = None
        lease_runs = False
        claims: dict[str, Claim | None] = {"old": None, "new": None}
        batches = {"old": 0, "new": 0}
        landed: list[tuple[str, str | None]] = []
        """Each write that landed: its process, and the last process whose claim succeeded."""
        last_claimed: str | None = None
        for actor in order:
            if actor == "lapse":
                value = buffer.client.get(keys.identity)
                if value is not None:  # the lease runs out on the server's clock
                    fields = value.decode().split("|")
                    fields[-2] = "0"
                    buffer.client.set(keys.identity, "|".join(fields))
                lease_runs = False
                continue
            step = (OLD_STEPS if actor == "old" else NEW_STEPS)[progress[actor]]
            progress[actor] += 1
            if step in ("claim", "renew"):
                may = holder in (None, actor) or not lease_runs
                outcome = processes[actor].claim().outcome
                assert (outcome != TAKEN) == may, (order, actor, step, outcome)
                if may:
                    holder, lease_runs, claims[actor] = actor, True, processes[actor].held()
                    last_claimed = actor
                continue
            claim = claims[actor]
            if claim is None:
                continue  # never claimed: a process writes nothing without a claim
            batches[actor] += 1
            fenced = apply(buffer, f"{actor}-writer", batches[actor], claim, 10 * (actor == "new") + batches[actor])
            assert (fenced is None) == (holder == actor), (order, actor, fenced)
            if fenced is None:
                landed.append((actor, last_claimed))
        pending = buffer.client.hgetall(keys.pending)
        stored = {value.decode().split(",")[1] for field, value in pending.items() if b":" in field}
        assert stored == {f"{actor}-writer" for actor, _ in landed}, order
        stale = [actor for actor, owner in landed if actor != owner]
        assert stale == [], f"{order}: writes of {stale} landed after another process claimed the rank"
        explored += 1
    assert explored == 105
    print(f"\n{explored} interleavings of the two-process history explored")


# -- two bridges on one identity (a real redis-server) ---------------------------------------------


@pytest.fixture
def server() -> Iterator[RedisServer]:
    started = RedisServer().start()
    yield started
    started.cleanup()


class PausedWrites:
    """Holds the writer's ``apply`` calls while armed, as a process frozen (a pause, a swapped
    VM) after it checked its lease: the call reaches Redis only once released."""

    def __init__(self, buffer: SignalBuffer) -> None:
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.released = threading.Event()
        self._apply = buffer.apply
        buffer.apply = self  # type: ignore[method-assign]

    def __call__(self, prepared: Any) -> Any:
        if self.armed.is_set():
            self.entered.set()
            self.released.wait(WAIT_S)
        return self._apply(prepared)


def lease_ran_out(buffer: SignalBuffer) -> bool:
    """The identity's lease, as the key holds it, ended on the server's clock."""
    value = buffer.client.get(buffer.protocol.keys.rank("p0", 0).identity)
    return value is None or int(value.decode().split("|")[-2]) < buffer.now_ms()


def test_an_owner_paused_past_its_lease_lands_nothing_and_both_sides_name_the_other(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The old owner wrote an early signal to Redis, then its writer stalls past the lease with a
    batch in hand; a second process claims the rank, adopts the signal and hands it to its task.
    The old owner, whose task for that slot registers meanwhile, hands out nothing (its lease
    no longer surely holds); when its writer goes on, the batch is refused by Redis: the rank's
    keys and counters stay as the new owner left them. The old side raises ``OwnershipLost``
    and logs one ERROR naming the new owner; the new one logs the refused write, naming the old."""
    namespace = f"p-{uuid.uuid4().hex[:8]}"
    old_buffer = SignalBuffer.from_url(server.url, namespace=namespace, retry_s=0.5, env={})
    new_buffer = SignalBuffer.from_url(server.url, namespace=namespace, retry_s=0.5, env={})
    keys = new_buffer.protocol.keys.rank("p0", 0)
    paused = PausedWrites(old_buffer)
    old = Layer0Bridge(old_buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05, lease_s=LEASE_S)
    new: Layer0Bridge | None = None
    try:
        with caplog.at_level(logging.INFO, logger="redis_layer_signals.fastdeploy"):
            assert old.on_kv_signal(kv((5, 0, 128))) == []
            assert old.flush(WAIT_S) and new_buffer.pending("p0", 0, 5) != []
            paused.armed.set()
            assert old.on_kv_signal(kv((6, 0, 64))) == []  # a batch for the writer, held
            assert paused.entered.wait(WAIT_S)
            assert old.identity is not None
            wait_until(lambda: not old.identity.valid_for(0), WAIT_S, what="the old owner's lease to end")
            wait_until(lambda: lease_ran_out(new_buffer), WAIT_S, what="the lease to end on the server")

            new = Layer0Bridge(new_buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05, lease_s=LEASE_S)
            assert new.claimed(WAIT_S)
            assert new.on_cache_task(cache_info(5, "req-new")) == [(5, 128)], "the new owner recovers it"
            assert old.on_cache_task(cache_info(5, "req-old")) == [], "handed out by both"
            assert new.flush(WAIT_S)
            before = rank_state(new_buffer, keys)

            paused.released.set()  # the old owner's writer goes on with its batch
            wait_until(lambda: old.health().identity == "refused", WAIT_S, what="the old owner to be refused")
            assert new.identity is not None
            wait_until(
                lambda: f"Redis refused a write of {old.identity.me.describe()}" in caplog.text,
                WAIT_S,
                what="the new owner to log the refused write",
            )

        after = rank_state(new_buffer, keys)
        assert after["stats"].pop("ownership_fenced") == "1"
        assert after == before, "a write of the old owner landed after the new claim"
        with pytest.raises(OwnershipLost, match=r"lost its identity to host") as lost:
            old.claimed(0)
        assert new.identity.me.describe() in str(lost.value)
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert [m for m in errors if "lost its identity" in m] == [str(lost.value)], "one ERROR on the old side"
        assert drain(old) == [], "the old owner handed out the signal the new one recovered"
        assert old.on_cache_task(cache_info(5, "req-old-2")) == [], "the old owner still holds it"
        # A lapsed takeover names the predecessor too.
        assert f"claimed the identity {old.identity.me.describe()} held" in caplog.text
    finally:
        paused.released.set()
        old.close()
        if new is not None:
            new.close()
        old_buffer.close()
        new_buffer.close()


# -- no host wall clock in a decision --------------------------------------------------------------


@pytest.mark.parametrize("skew_s", [-120.0, 120.0], ids=["host-clock-behind", "host-clock-ahead"])
def test_a_wrong_host_clock_with_redis_unreachable_at_start_expires_nothing_and_loses_nothing(
    skew_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host's wall clock is 120 s off the server's, and Redis does not answer when the
    bridge starts: an early signal recorded then is dated on the monotonic clock, so when Redis
    answers it is neither expired at once (clock behind) nor kept 120 s too long (ahead): Redis
    stores the time it was recorded on the server's clock, its task, registering within
    ``pending_ttl_s``, recovers it, and the counters balance."""
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + skew_s)
    server = RedisServer()  # its port is chosen; nothing listens on it yet
    buffer = SignalBuffer.from_url(server.url, namespace=f"c-{uuid.uuid4().hex[:8]}", retry_s=0.3, env={})
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05, lease_s=LEASE_S)
    try:
        recorded_ms = real_time() * 1000
        assert bridge.on_kv_signal(kv((5, 0, 128))) == []
        wait_until(lambda: bridge.health().degraded, WAIT_S, what="the writer to find Redis unreachable")
        time.sleep(1.0)  # the signal is a second old when Redis answers
        server.start()
        assert bridge.flush(WAIT_S)
        (signal,) = buffer.pending("p0", 0, 5)
        assert abs(signal.recorded_at_ms - recorded_ms) < 5000, "dated by the host's wall clock"
        assert bridge.on_cache_task(cache_info(5, "req-1")) == [(5, 128)]
        assert bridge.flush(WAIT_S)
        stats = buffer.stats()
        assert stats.get("expired", 0) == 0
        assert (stats["buffered"], stats["recovered"], stats["registered"]) == (1, 1, 1)
        assert buffer.pending("p0", 0, 5) == []
    finally:
        bridge.close()
        buffer.close()
        server.cleanup()


def test_a_task_registered_while_the_lease_may_have_ended_gets_its_signal_once_renewed(
    server: RedisServer,
) -> None:
    """The price of the fence in an outage longer than the lease, when nobody else claims the
    rank: a task that registers then does not get the early signal Redis holds at once (another
    owner might have adopted it); the owner's next renewal proves it still owns the rank, and the
    task gets it, once, and the counters balance."""
    proxy = Proxy(server.port)
    buffer = SignalBuffer.from_url(proxy.url, namespace=f"h-{uuid.uuid4().hex[:8]}", retry_s=0.3, env={})
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05, lease_s=LEASE_S)
    try:
        assert bridge.on_kv_signal(kv((5, 0, 128))) == []
        assert bridge.flush(WAIT_S)
        proxy.mode = BLACK_HOLE  # the replies vanish: the owner cannot tell whether it still owns
        assert bridge.identity is not None
        wait_until(lambda: not bridge.identity.holds(), WAIT_S, what="the lease to end by the owner's clock")
        assert bridge.on_cache_task(cache_info(5, "req-1")) == []
        proxy.mode = PASS
        assert bridge.ready.get(timeout=WAIT_S) == [(5, 128)]
        assert bridge.flush(WAIT_S)
        assert drain(bridge) == []
        stats = buffer.stats()
        assert (stats["buffered"], stats["recovered"], stats.get("expired", 0)) == (1, 1, 0)
        assert buffer.pending("p0", 0, 5) == []
    finally:
        bridge.close()
        buffer.close()
        proxy.close()


@pytest.mark.parametrize("skew_s", [-120.0, 120.0], ids=["host-clock-behind", "host-clock-ahead"])
def test_a_journaled_record_is_replayed_at_its_time_on_the_servers_clock_whatever_the_host_clock(
    skew_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where Redis judges (another process registers the tasks), a record served locally while
    Redis was unreachable from the start is journaled with its time on the monotonic clock and
    replayed at that time on the server's: with the host clock 120 s off, the signal is stored as
    recorded a second ago, and a task registered elsewhere within ``pending_ttl_s`` recovers it."""
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + skew_s)
    server = RedisServer()
    namespace = f"j-{uuid.uuid4().hex[:8]}"
    buffer = SignalBuffer.from_url(server.url, namespace=namespace, retry_s=0.3, env={})
    bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=0.05, registers_tasks=False)
    registrar: SignalBuffer | None = None
    try:
        recorded_ms = real_time() * 1000
        assert bridge.on_kv_signal(kv((5, 0, 128))) == []
        assert bridge.health().degraded
        time.sleep(1.0)
        server.start()
        assert bridge.flush(WAIT_S)
        (signal,) = buffer.pending("p0", 0, 5)
        assert abs(signal.recorded_at_ms - recorded_ms) < 5000, "replayed at the host's wall-clock time"
        registrar = SignalBuffer.from_url(server.url, namespace=namespace, env={})
        task = CacheTask(instance="p0", rank=0, slot=5, request_id="req-1", need_prefill_tokens=300, num_layers=LAYERS)
        assert [(s.slot, s.tokens) for s in registrar.register(task).recovered] == [(5, 128)]
        assert buffer.stats().get("expired", 0) == 0
    finally:
        bridge.close()
        buffer.close()
        if registrar is not None:
            registrar.close()
        server.cleanup()
