"""The behaviour suite of DESIGN.md sections 2 and 3, run on fakeredis and on a real Redis."""

from __future__ import annotations

import pytest

from redis_layer_signals import CacheTask, DropReason, SignalBuffer, SlotOccupied
from redis_layer_signals.protocol.calls import ScriptCall
from tests.race import ended


def task(slot: int = 5, request_id: str = "req-1", need: int = 4096, layers: int = 61, **kw: object) -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=need, num_layers=layers, **kw)  # type: ignore[arg-type]


def test_signal_for_unregistered_slot_is_buffered_then_recovered_on_register(buf: SignalBuffer) -> None:
    res = buf.record("p0", 0, 0, [(5, 2048)])
    assert [s.slot for s in res.buffered] == [5] and res.delivered == []
    assert [(s.layer, s.tokens) for s in buf.pending("p0", 0, 5)] == [(0, 2048)]

    rec = buf.register(task())
    assert [(s.slot, s.layer, s.tokens) for s in rec.recovered] == [(5, 0, 2048)]
    assert rec.dropped == []
    assert buf.pending("p0", 0, 5) == []


def test_signal_for_live_slot_is_delivered_and_not_buffered(buf: SignalBuffer) -> None:
    buf.register(task())
    res = buf.record("p0", 0, 3, [(5, 1024)])
    assert [(s.slot, s.layer, s.tokens) for s in res.delivered] == [(5, 3, 1024)]
    assert res.buffered == [] and buf.pending("p0", 0, 5) == []


def test_batch_splits_between_delivered_and_buffered_in_entry_order(buf: SignalBuffer) -> None:
    buf.register(task(slot=7))
    res = buf.record("p0", 0, 0, [(5, 10), (7, 20), (9, 30)])
    assert [s.slot for s in res.delivered] == [7]
    assert [s.slot for s in res.buffered] == [5, 9]
    assert res.delivered[0].recorded_at_ms == res.buffered[0].recorded_at_ms > 0


def test_newer_signal_for_same_slot_and_layer_supersedes_older(buf: SignalBuffer) -> None:
    buf.record("p0", 0, 0, [(5, 2048)])
    buf.record("p0", 0, 0, [(5, 4096)])
    buf.record("p0", 0, 1, [(5, 2048)])
    assert [(s.layer, s.tokens) for s in buf.pending("p0", 0, 5)] == [(0, 4096), (1, 2048)]
    assert buf.stats()["superseded"] == 1


def test_recovered_signals_are_ordered_by_layer(buf: SignalBuffer) -> None:
    for layer in (3, 0, 2, 1):
        buf.record("p0", 0, layer, [(5, 100)])
    rec = buf.register(task())
    assert [s.layer for s in rec.recovered] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        ((5, 5000), DropReason.OVER_NEED),
        ((5, 0), DropReason.NON_POSITIVE),
        ((5, 100, "req-other"), DropReason.REQUEST_MISMATCH),
    ],
)
def test_register_drops_invalid_early_signals_with_reason(
    buf: SignalBuffer, entry: tuple[int, ...], reason: DropReason
) -> None:
    buf.record("p0", 0, 0, [entry])
    rec = buf.register(task(need=4096))
    assert rec.recovered == []
    assert [(s.tokens, r) for s, r in rec.dropped] == [(entry[1], reason)]
    assert buf.stats()[f"dropped_{reason.value}"] == 1
    assert buf.pending("p0", 0, 5) == []


def test_register_drops_layer_out_of_range(buf: SignalBuffer) -> None:
    buf.record("p0", 0, 61, [(5, 100)])
    buf.record("p0", 0, 60, [(5, 100)])
    rec = buf.register(task(layers=61))
    assert [s.layer for s in rec.recovered] == [60]
    assert [(s.layer, r) for s, r in rec.dropped] == [(61, DropReason.LAYER_OUT_OF_RANGE)]


@pytest.mark.parametrize(
    ("layer", "num_layers", "tokens", "need", "reason"),
    [
        (9, 10, 99, 100, None),
        (10, 10, 5, 100, DropReason.LAYER_OUT_OF_RANGE),
        (10, 9, 5, 100, DropReason.LAYER_OUT_OF_RANGE),
        (99, 100, 100, 100, None),
        (100, 99, 5, 100, DropReason.LAYER_OUT_OF_RANGE),
        (0, 1, 100, 99, DropReason.OVER_NEED),
        (0, 1, 999, 1000, None),
        (0, 1, 1000, 999, DropReason.OVER_NEED),
        (0, 1, 10, 9, DropReason.OVER_NEED),
        (0, 1, 9, 10, None),
        (0, 1, 1, 0, DropReason.OVER_NEED),
        (0, 1, 0, 0, DropReason.NON_POSITIVE),
    ],
)
def test_register_checks_numbers_of_different_lengths(
    buf: SignalBuffer, layer: int, num_layers: int, tokens: int, need: int, reason: DropReason | None
) -> None:
    """register compares the stored decimals by length, then bytes: "10" is above "9"."""
    buf.record("p0", 0, layer, [(5, tokens)])
    rec = buf.register(task(need=need, layers=num_layers))
    if reason is None:
        assert [(s.layer, s.tokens) for s in rec.recovered] == [(layer, tokens)] and rec.dropped == []
    else:
        assert rec.recovered == [] and [(s.layer, s.tokens, r) for s, r in rec.dropped] == [(layer, tokens, reason)]


@pytest.mark.parametrize("layers", [(10, 9, 100, 2), (2, 9, 10, 100), (100, 10, 9, 2), (9, 10)])
def test_recovered_layers_are_ordered_as_numbers(buf: SignalBuffer, layers: tuple[int, ...]) -> None:
    for layer in layers:
        buf.record("p0", 0, layer, [(5, 100)])
    assert [s.layer for s in buf.register(task(layers=101)).recovered] == sorted(layers)


@pytest.mark.parametrize(("now", "recovered"), [(9_999, True), (10_000, False), (100_000, False)])
def test_pending_deadline_is_compared_across_digit_counts(url: str, namespace: str, now: int, recovered: bool) -> None:
    """A signal recorded at 9,000 ms with a 1 s TTL is due at 10,000: recovered just before,
    expired from then on, though the two times have different lengths."""
    clock = [9_000]
    b = SignalBuffer.from_url(url, namespace=namespace, pending_ttl_s=1, clock=lambda: clock[0], env={})
    try:
        b.record("p0", 0, 0, [(5, 100)])
        clock[0] = now
        rec = b.register(task())
        stats = b.stats(sweep=False)
        assert [s.tokens for s in rec.recovered] == ([100] if recovered else [])
        expired = stats.get("expired", 0) + stats.get("dropped_expired", 0)
        assert expired == (0 if recovered else 1)
    finally:
        b.close()


def test_exactly_need_prefill_tokens_is_recovered(buf: SignalBuffer) -> None:
    buf.record("p0", 0, 0, [(5, 4096)])
    assert [s.tokens for s in buf.register(task(need=4096)).recovered] == [4096]


def test_signal_with_matching_request_id_is_recovered(buf: SignalBuffer) -> None:
    buf.record("p0", 0, 0, [(5, 100, "req-1")])
    rec = buf.register(task())
    assert [(s.tokens, s.request_id) for s in rec.recovered] == [(100, "req-1")]


def test_signal_for_another_request_is_never_delivered_to_live_task(buf: SignalBuffer) -> None:
    buf.register(task(request_id="req-1"))
    res = buf.record("p0", 0, 0, [(5, 100, "req-2"), (5, 200, "req-1")])
    assert [(s.tokens, s.request_id) for s in res.delivered] == [(200, "req-1")]
    assert [(s.tokens, s.request_id) for s in res.buffered] == [(100, "req-2")]
    # req-1 finishes; req-2's signal stays for req-2, which then recovers it.
    assert buf.finish("p0", 0, 5, "req-1").dropped == 0
    rec = buf.register(task(request_id="req-2"))
    assert [(s.tokens, s.request_id) for s in rec.recovered] == [(100, "req-2")]


def test_register_again_for_same_request_returns_first_recovery(buf: SignalBuffer) -> None:
    buf.record("p0", 0, 0, [(5, 100)])
    first = buf.register(task())
    again = buf.register(task())
    assert again.repeated and not first.repeated
    assert again.recovered == first.recovered and len(first.recovered) == 1
    assert buf.stats()["recovered"] == 1


def test_register_onto_slot_of_other_live_request_raises_slot_occupied(buf: SignalBuffer) -> None:
    buf.register(task(request_id="req-1"))
    with pytest.raises(SlotOccupied) as err:
        buf.register(task(request_id="req-2"))
    assert err.value.holder == "req-1" and err.value.slot == 5
    held = buf.task("p0", 0, 5)
    assert held is not None and held.request_id == "req-1"


def test_register_replace_takes_the_slot(buf: SignalBuffer) -> None:
    buf.register(task(request_id="req-1"))
    rec = buf.register(task(request_id="req-2"), replace=True)
    assert rec.replaced
    held = buf.task("p0", 0, 5)
    assert held is not None and held.request_id == "req-2"


def test_task_round_trips_every_field(buf: SignalBuffer) -> None:
    t = task(decode_cached_tokens=64, meta={"decode": "10.0.0.2:8000", "blocks": "1,2,3"})
    buf.register(t)
    assert buf.task("p0", 0, 5) == t
    assert buf.task("p0", 0, 6) is None


def test_finish_removes_task_and_later_signals_are_buffered_again(buf: SignalBuffer) -> None:
    buf.register(task())
    fin = buf.finish("p0", 0, 5, "req-1")
    assert (fin.removed, fin.dropped, fin.fenced) == (True, 0, False)
    assert buf.task("p0", 0, 5) is None
    assert buf.record("p0", 0, 0, [(5, 10)]).buffered


def test_late_finish_of_previous_request_is_fenced(buf: SignalBuffer) -> None:
    buf.register(task(request_id="req-1"))
    buf.finish("p0", 0, 5, "req-1")
    buf.register(task(request_id="req-2"))
    buf.record("p0", 0, 0, [(5, 50, "req-3")])
    fin = buf.finish("p0", 0, 5, "req-1")
    assert (fin.removed, fin.dropped, fin.fenced) == (False, 0, True)
    held = buf.task("p0", 0, 5)
    assert held is not None and held.request_id == "req-2"
    assert [s.request_id for s in buf.pending("p0", 0, 5)] == ["req-3"]
    assert buf.stats()["fenced"] == 1


def test_finish_without_task_drops_own_and_unknown_pending_only(buf: SignalBuffer) -> None:
    buf.record("p0", 0, 0, [(5, 10)])
    buf.record("p0", 0, 1, [(5, 10, "req-1")])
    buf.record("p0", 0, 2, [(5, 10, "req-2")])
    fin = buf.finish("p0", 0, 5, "req-1")
    assert (fin.removed, fin.dropped, fin.fenced) == (False, 2, False)
    assert [(s.layer, s.request_id) for s in buf.pending("p0", 0, 5)] == [(2, "req-2")]
    assert buf.stats()["finish_dropped"] == 2


def test_other_slots_pending_is_not_recovered_by_this_registration(buf: SignalBuffer) -> None:
    buf.record("p0", 0, 0, [(5, 10), (6, 20)])
    rec = buf.register(task(slot=5))
    assert [s.slot for s in rec.recovered] == [5]
    assert [s.tokens for s in buf.pending("p0", 0, 6)] == [20]


def test_instances_and_ranks_are_isolated(buf: SignalBuffer) -> None:
    buf.record("p0", 0, 0, [(5, 10)])
    buf.record("p0", 1, 0, [(5, 20)])
    buf.record("p1", 0, 0, [(5, 30)])
    rec = buf.register(task())
    assert [s.tokens for s in rec.recovered] == [10]
    assert [s.tokens for s in buf.pending("p0", 1, 5)] == [20]
    assert [s.tokens for s in buf.pending("p1", 0, 5)] == [30]


def test_namespaces_are_isolated(url: str, namespace: str, buf: SignalBuffer) -> None:
    other = SignalBuffer.from_url(url, namespace=namespace + "-other", env={})
    buf.record("p0", 0, 0, [(5, 10)])
    assert other.pending("p0", 0, 5) == []
    assert other.register(task()).recovered == []
    assert [s.tokens for s in buf.pending("p0", 0, 5)] == [10]
    other.close()


def test_buffers_of_one_url_share_state(url: str, namespace: str, buf: SignalBuffer) -> None:
    """Two clients (two 'processes') on one server see one buffer."""
    second = SignalBuffer.from_url(url, namespace=namespace, env={})
    buf.record("p0", 0, 0, [(5, 10)])
    assert [s.tokens for s in second.register(task()).recovered] == [10]
    assert buf.record("p0", 0, 1, [(5, 10)]).delivered
    second.close()


def test_empty_batch_needs_no_round_trip(buf: SignalBuffer) -> None:
    calls = []
    buf._run_script = calls.append  # type: ignore[method-assign,assignment]
    res = buf.record("p0", 0, 0, [])
    assert res.delivered == [] and res.buffered == [] and calls == []


def test_full_batch_of_512_is_one_script_run(buf: SignalBuffer) -> None:
    real = buf._run_script
    calls = []

    def counting(call: ScriptCall) -> object:
        calls.append(call.script)
        return real(call)

    buf._run_script = counting  # type: ignore[method-assign]
    buf.register(task(slot=0))
    buf.record("p0", 0, 1, [(0, 1)])
    calls.clear()
    res = buf.record("p0", 0, 0, [(slot, slot + 1) for slot in range(512)])
    assert len(calls) == 1
    assert [s.slot for s in res.delivered] == [0]
    assert [s.slot for s in res.buffered] == list(range(1, 512))


def test_stats_account_for_every_signal(buf: SignalBuffer) -> None:
    buf.register(task(slot=1, request_id="a"))
    buf.record("p0", 0, 0, [(1, 10), (2, 10), (3, 10), (4, 9999)])
    buf.record("p0", 0, 0, [(3, 20)])
    buf.register(task(slot=2, request_id="b"))
    buf.register(task(slot=4, request_id="d", need=100))
    buf.finish("p0", 0, 3, "c")
    s = buf.stats()
    assert s["recorded"] == 5 and s["delivered"] == 1 and s["buffered"] == 4
    assert ended(s) == s["buffered"]


def test_signal_written_back_after_its_slot_finished_ends_with_that_finish(buf: SignalBuffer) -> None:
    """A replay decides as of the time it carries (``at_ms``). A signal recorded before its
    slot's latest finish, of that request or naming none, ends as that finish ended the slot's
    signals (buffered, then finish_dropped), even when the slot holds the next request by now;
    one recorded after the finish, or naming another request, is kept as ever."""
    now = int(buf.client.time()[0]) * 1000 + 10_000  # ahead of the server: clear of its TIME
    buf.register(task(slot=3, request_id="a"), at_ms=now)
    buf.finish("p0", 0, 3, "a", at_ms=now + 100)
    buf.register(task(slot=3, request_id="b"), at_ms=now + 200)
    buf.finish("p0", 0, 4, "a", at_ms=now + 100)
    res = buf.record("p0", 0, 0, [(3, 10), (4, 20), (4, 30, "other")], at_ms=now + 50)
    assert res.delivered == [] and [s.slot for s in res.buffered] == [3, 4, 4]
    assert [(s.tokens, s.request_id) for s in buf.pending("p0", 0, 4)] == [(30, "other")]
    assert buf.pending("p0", 0, 3) == []
    later = buf.record("p0", 0, 0, [(4, 40)], at_ms=now + 150)
    assert [s.tokens for s in buf.pending("p0", 0, 4)] == [40] and later.buffered
    stats = buf.stats()
    assert (stats["buffered"], stats["finish_dropped"], stats["superseded"], stats["delivered"]) == (4, 2, 1, 0)
