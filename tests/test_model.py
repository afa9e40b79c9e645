"""Model-based test: hypothesis drives random sequences of record, register, finish, resends
and clock advances against the real scripts (on fakeredis, with an injected clock) and checks
every reply and the stored state against the reference model in tests/model.py."""

from __future__ import annotations

import uuid
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from redis_layer_signals import CacheTask, SignalBuffer, SlotOccupied
from redis_layer_signals.protocol.calls import ScriptCall
from tests.model import Model
from tests.race import ended
from tests.servers import RedisServer

SLOTS = st.integers(0, 3)
LAYERS = st.integers(0, 4)
TOKENS = st.sampled_from([0, 1, 64, 100, 4096])
REQUESTS = st.sampled_from(["r0", "r1", "r2"])
MAYBE_REQUEST = st.one_of(st.none(), REQUESTS)
ENTRIES = st.lists(st.tuples(SLOTS, TOKENS, MAYBE_REQUEST), min_size=1, max_size=6)
PENDING_TTL_MS = 1000
TASK_TTL_MS = 5000


class BufferMachine(RuleBasedStateMachine):
    url: str | None = None  # None: a fresh fakeredis server per run; else a real Redis

    def __init__(self) -> None:
        super().__init__()
        self.model = Model(PENDING_TTL_MS, TASK_TTL_MS)
        self.buf = SignalBuffer.from_url(
            self.url or f"memory://model-{uuid.uuid4().hex}",
            namespace=f"model-{uuid.uuid4().hex[:12]}",
            pending_ttl_s=PENDING_TTL_MS / 1000,
            task_ttl_s=TASK_TTL_MS / 1000,
            clock=lambda: self.model.now,
            env={},
        )
        self._original_run = self.buf._run_script
        self.resend_next = False

    def _run(self, call: ScriptCall) -> Any:
        """When asked, run the call twice with one token, as a resend after a lost reply does."""
        if self.resend_next:
            self.resend_next = False
            self._original_run(call)
            self.model.count("replayed")
        return self._original_run(call)

    @rule()
    def lose_next_reply(self) -> None:
        self.buf._run_script = self._run  # type: ignore[method-assign]
        self.resend_next = True

    @rule(ms=st.sampled_from([1, 200, 999, 1000, 2500, 6000]))
    def advance_clock(self, ms: int) -> None:
        self.model.now += ms

    @rule(layer=LAYERS, entries=ENTRIES)
    def record(self, layer: int, entries: list[tuple[int, int, str | None]]) -> None:
        flags = self.model.record(layer, entries)
        res = self.buf.record("p0", 0, layer, entries)
        got = {(s.slot, s.tokens, s.request_id) for s in res.delivered}
        want = {e for e, f in zip(entries, flags, strict=True) if f == "D"}
        assert got == want
        assert len(res.delivered) == flags.count("D") and len(res.buffered) == flags.count("B")
        assert all(s.recorded_at_ms == self.model.now and s.layer == layer for s in res.delivered + res.buffered)

    @rule(
        slot=SLOTS,
        rid=REQUESTS,
        need=st.sampled_from([64, 100, 4096]),
        layers=st.integers(1, 5),
        replace=st.booleans(),
    )
    def register(self, slot: int, rid: str, need: int, layers: int, replace: bool) -> None:
        status, expected = self.model.register(slot, rid, need, layers, replace)
        task = CacheTask("p0", 0, slot, rid, need_prefill_tokens=need, num_layers=layers)
        if status == "occupied":
            try:
                self.buf.register(task, replace=replace)
            except SlotOccupied as err:
                assert err.holder == expected
                return
            raise AssertionError("register onto an occupied slot did not raise SlotOccupied")
        rec = self.buf.register(task, replace=replace)
        assert rec.repeated == (status == "again") and rec.replaced == (status == "replaced")
        assert isinstance(expected, list)
        got = [((s.layer, s.tokens, s.request_id, s.recorded_at_ms), "") for s in rec.recovered]
        got += [((s.layer, s.tokens, s.request_id, s.recorded_at_ms), r.value) for s, r in rec.dropped]
        assert sorted(got, key=str) == sorted(expected, key=str)
        assert [s.layer for s in rec.recovered] == sorted(s.layer for s in rec.recovered)

    @rule(slot=SLOTS, rid=REQUESTS)
    def finish(self, slot: int, rid: str) -> None:
        removed, dropped, fenced = self.model.finish(slot, rid)
        fin = self.buf.finish("p0", 0, slot, rid)
        assert (fin.removed, fin.dropped, fin.fenced) == (removed, dropped, fenced)

    @rule(
        layer=LAYERS,
        entries=ENTRIES,
        slot=SLOTS,
        rid=REQUESTS,
        finish_instead=st.booleans(),
    )
    def record_reply_lost_while_another_client_acts(
        self, layer: int, entries: list[tuple[int, int, str | None]], slot: int, rid: str, finish_instead: bool
    ) -> None:
        """Record runs, its reply is lost, another client registers (or finishes) a slot, and
        only then does the resend arrive: it must replay the first outcome, not run again."""
        flags = self.model.record(layer, entries)
        prepared = self.buf.protocol.record("p0", 0, layer, entries)
        assert prepared.call is not None
        first = prepared.parse(self._original_run(prepared.call))
        if finish_instead:
            self.finish(slot, rid)
        else:
            self.register(slot, rid, need=4096, layers=5, replace=False)
        resent = prepared.parse(self._original_run(prepared.call))
        assert resent == first
        assert [s.slot for s in resent.buffered] == [e[0] for e, f in zip(entries, flags, strict=True) if f == "B"]
        self.model.count("replayed")

    @invariant()
    def stored_state_matches_model(self) -> None:
        for slot in range(4):
            stored = [(s.layer, s.tokens, s.request_id, s.recorded_at_ms) for s in self.buf.pending("p0", 0, slot)]
            modelled = [
                (layer, p.tokens, p.request_id, p.at) for layer, p in sorted(self.model.pending.get(slot, {}).items())
            ]
            assert stored == modelled, slot
            live = self.buf.task("p0", 0, slot)
            holder = self.model.alive(slot)
            assert (live.request_id if live else None) == (holder.request_id if holder else None)

    @invariant()
    def counters_match_model_and_account_for_every_signal(self) -> None:
        stats = self.buf.stats(sweep=False)
        for name, value in self.model.stats.items():
            assert stats[name] == value, name
        still_pending = sum(len(layers) for layers in self.model.pending.values())
        assert stats["buffered"] == ended(stats) + still_pending
        assert stats["recorded"] == stats["delivered"] + stats["buffered"]

    def teardown(self) -> None:
        self.buf.close()


class RealRedisBufferMachine(BufferMachine):
    """The same machine on the real redis-server of this test session."""


@pytest.fixture(autouse=True, scope="module")
def _real_server(redis_server: RedisServer) -> None:
    RealRedisBufferMachine.url = redis_server.url


BufferMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
RealRedisBufferMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBufferModelOnFakeredis = BufferMachine.TestCase
TestBufferModelOnRedis = RealRedisBufferMachine.TestCase
