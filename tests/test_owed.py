"""Owed finishes (``owed``): one per (rank, slot, request id), every request of a slot in order,
at most ``max_slots`` per rank, and one more refused loudly (``OwedFinishesFull``, a warning, a
metric), never silently. The real-network case is ``tests/test_partition_finish.py``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from redis.exceptions import ConnectionError

from redis_layer_signals import BufferUnavailable, CacheTask, OwedFinishesFull, SignalBuffer
from redis_layer_signals.buffer.owed import OwedFinish, OwedFinishes
from redis_layer_signals.ops.metrics import BufferMetrics

LIMIT = 2


@pytest.fixture
def buf(namespace: str) -> Iterator[SignalBuffer]:
    made = SignalBuffer.from_url(f"memory://{namespace}", namespace=namespace, env={}, retry_s=0.05, max_slots=LIMIT)
    yield made
    made.close()


def owed_finish(buf: SignalBuffer, slot: int, request_id: str, rank: int = 0) -> OwedFinish:
    return OwedFinish(buf.protocol.finish("p0", rank, slot, request_id), slot, request_id)


def unavailable() -> BufferUnavailable:
    cause = ConnectionError("cut off")
    try:
        raise BufferUnavailable("finish", 0.05, cause) from cause
    except BufferUnavailable as exc:
        return exc


def test_a_finish_owed_again_is_kept_once_the_first_with_its_token(buf: SignalBuffer) -> None:
    owed = OwedFinishes(LIMIT)
    first, again = owed_finish(buf, 0, "req-a"), owed_finish(buf, 0, "req-a")
    owed.owe(first, unavailable())
    owed.owe(again, unavailable())
    assert owed.take(first.prepared.call.keys[0]) == [first]  # type: ignore[union-attr]


def test_finishes_of_other_requests_on_one_slot_are_all_kept_in_order(buf: SignalBuffer) -> None:
    owed = OwedFinishes(LIMIT)
    a, b = owed_finish(buf, 0, "req-a"), owed_finish(buf, 0, "req-b")
    owed.owe(a, unavailable())
    owed.owe(b, unavailable())
    assert owed.take(a.prepared.call.keys[0]) == [a, b]  # type: ignore[union-attr]


def test_one_finish_over_the_limit_is_refused_loudly_and_the_owed_stay(
    buf: SignalBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    owed = OwedFinishes(LIMIT)
    kept = [owed_finish(buf, 0, "req-a"), owed_finish(buf, 1, "req-b")]
    for finish in kept:
        owed.owe(finish, unavailable())
    error = unavailable()
    with caplog.at_level(logging.WARNING, logger="redis_layer_signals"), pytest.raises(OwedFinishesFull) as refused:
        owed.owe(owed_finish(buf, 0, "req-c"), error)
    assert isinstance(refused.value, BufferUnavailable) and refused.value.__cause__ is error.__cause__
    assert (refused.value.slot, refused.value.request_id, refused.value.limit) == (0, "req-c", LIMIT)
    assert "req-c" in str(refused.value) and "not kept" in caplog.text
    assert owed.refused == 1 and owed.count() == LIMIT
    other_rank = owed_finish(buf, 0, "req-d", rank=1)
    owed.owe(other_rank, unavailable())  # the limit is per rank
    assert owed.take(kept[0].prepared.call.keys[0]) == kept  # type: ignore[union-attr]


def test_given_back_finishes_go_first_and_are_not_owed_twice(buf: SignalBuffer) -> None:
    owed = OwedFinishes(LIMIT)
    a, b = owed_finish(buf, 0, "req-a"), owed_finish(buf, 1, "req-b")
    key = a.prepared.call.keys[0]  # type: ignore[union-attr]
    owed.owe(a, unavailable())
    taken = owed.take(key)
    owed.owe(b, unavailable())  # owed while ``a`` was being resent
    owed.owe(owed_finish(buf, 0, "req-a"), unavailable())  # and ``a`` again: a new token
    owed.give_back(key, taken)
    assert owed.take(key) == [a, b]


def cut_finishes(buf: SignalBuffer) -> None:
    """Every function call raises ConnectionError: Redis unreachable."""

    def cut(call: Any) -> Any:
        raise ConnectionError("cut off")

    buf._run_script = cut  # type: ignore[method-assign,assignment]


def test_the_buffer_refuses_one_finish_over_max_slots_and_exports_the_counts(buf: SignalBuffer) -> None:
    for slot in range(LIMIT):
        buf.register(CacheTask("p0", 0, slot, f"req-{slot}", 10, 1))
    real = buf._run_script
    cut_finishes(buf)
    for slot in range(LIMIT):
        with pytest.raises(BufferUnavailable) as raised:
            buf.finish("p0", 0, slot, f"req-{slot}")
        assert not isinstance(raised.value, OwedFinishesFull)
    with pytest.raises(BufferUnavailable):
        buf.finish("p0", 0, 0, "req-0")  # the same finish again: owed once
    with pytest.raises(OwedFinishesFull):
        buf.finish("p0", 0, 1, "req-late")
    assert buf.owed.count() == LIMIT and buf.owed.refused == 1
    metrics = BufferMetrics()
    metrics.track(buf)
    text = metrics.render().decode()
    assert f'rls_owed_finishes{{namespace="{buf.config.namespace}"}} {float(LIMIT)}' in text
    assert f'rls_owed_finishes_refused_total{{namespace="{buf.config.namespace}"}} 1.0' in text

    buf._run_script = real  # type: ignore[method-assign]
    buf.record("p0", 0, 0, [(0, 10)])  # Redis back: the owed finishes go first
    assert buf.owed.count() == 0
    assert buf.task("p0", 0, 0) is None and buf.task("p0", 0, 1) is None
    assert buf.stats()["finished"] == LIMIT
