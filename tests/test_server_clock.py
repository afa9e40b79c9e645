"""Property test on the server's own clock (no injected time): hypothesis interleaves record,
register, finish and real sleeps around a short pending TTL on a real Redis, so the scripts'
server-time paths (expiry markers, grouped expiry index, TTL refresh) are exercised, and checks
that every signal is accounted for exactly once and that nothing is left behind at the end."""

from __future__ import annotations

import itertools
import time
import uuid
from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from redis_layer_signals import CacheTask, SignalBuffer, SlotOccupied
from tests.race import ended
from tests.servers import RedisServer

SLOTS = st.integers(0, 19)  # spans several expiry groups
PENDING_TTL_S = 0.15
Sig = tuple[int, int, int]  # slot, layer, tokens (tokens unique per signal)


class ServerClockMachine(RuleBasedStateMachine):
    url = ""

    def __init__(self) -> None:
        super().__init__()
        self.buf = SignalBuffer.from_url(
            self.url, namespace=f"clock-{uuid.uuid4().hex[:10]}", pending_ttl_s=PENDING_TTL_S, env={}
        )
        self.serial = itertools.count(1)
        self.recorded: set[Sig] = set()
        self.buffered: set[Sig] = set()
        self.handed_out: list[Sig] = []
        self.holders: dict[int, str] = {}

    @rule(layer=st.integers(0, 3), slots=st.lists(SLOTS, min_size=1, max_size=8))
    def record(self, layer: int, slots: list[int]) -> None:
        entries = [(slot, next(self.serial)) for slot in slots]
        res = self.buf.record("p0", 0, layer, entries)
        self.recorded |= {(slot, layer, tokens) for slot, tokens in entries}
        self.handed_out += [(s.slot, s.layer, s.tokens) for s in res.delivered]
        self.buffered |= {(s.slot, s.layer, s.tokens) for s in res.buffered}
        assert len(res.delivered) + len(res.buffered) == len(entries)

    @rule(slot=SLOTS, layers=st.integers(1, 4))
    def register(self, slot: int, layers: int) -> None:
        request_id = f"r{next(self.serial)}"
        try:
            rec = self.buf.register(CacheTask("p0", 0, slot, request_id, 2**40, layers))
        except SlotOccupied as err:
            assert self.holders.get(slot) == err.holder
            return
        self.holders[slot] = request_id
        popped = [(s.slot, s.layer, s.tokens) for s in rec.recovered] + [
            (s.slot, s.layer, s.tokens) for s, _ in rec.dropped
        ]
        assert set(popped) <= self.buffered
        self.handed_out += popped

    @rule(slot=SLOTS)
    def finish(self, slot: int) -> None:
        request_id = self.holders.pop(slot, "nobody")
        fin = self.buf.finish("p0", 0, slot, request_id)
        assert not fin.fenced

    @rule(seconds=st.sampled_from([0.0, 0.05, 0.16]))
    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def pending_now(self) -> list[Sig]:
        return [(s.slot, s.layer, s.tokens) for slot in range(20) for s in self.buf.pending("p0", 0, slot)]

    @invariant()
    def every_signal_is_in_exactly_one_place(self) -> None:
        pending = self.pending_now()
        assert [s for s, n in Counter(self.handed_out + pending).items() if n > 1] == []
        assert set(pending) <= self.buffered
        stats = self.buf.stats(sweep=False)
        assert stats["buffered"] == len(self.buffered) == ended(stats) + len(pending)
        assert stats["recorded"] == len(self.recorded)

    def teardown(self) -> None:
        for slot, request_id in list(self.holders.items()):
            self.buf.finish("p0", 0, slot, request_id)
        time.sleep(PENDING_TTL_S + 0.01)
        self.buf.stats()  # sweeps what expired
        assert self.pending_now() == []
        left = {
            key.decode().rsplit(":", 1)[-1]
            for key in self.buf.client.scan_iter(match=self.buf.protocol.keys.pattern(), count=1000)
            if b":reply:" not in key
        }
        assert left <= {"stats", "ended"}, left  # the finishes' marks expire with the pending TTL
        assert self.buf.client.pttl(self.buf.protocol.keys.rank("p0", 0).ended) != -1
        self.buf.close()


@pytest.fixture(autouse=True, scope="module")
def _server(redis_server: RedisServer) -> None:
    ServerClockMachine.url = redis_server.url


ServerClockMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestServerClock = ServerClockMachine.TestCase
