"""The client's fast paths for record batches build exactly what the general paths build."""

from __future__ import annotations

from dataclasses import FrozenInstanceError

import pytest

from redis_layer_signals import DropReason, InvalidSignal, LayerSignal, SignalBuffer
from redis_layer_signals.protocol.calls import plain_batch
from redis_layer_signals.protocol.replies import recovery, split_signals


def test_split_signals_builds_equal_frozen_hashable_signals() -> None:
    batch = [(5, 2048), (7, 512, "req-1")]
    delivered, buffered = split_signals("p0", 3, 2, 1_000, batch, "DB")
    assert delivered == [LayerSignal("p0", 3, 5, 2, 2048, None, 1_000)]
    assert buffered == [LayerSignal("p0", 3, 7, 2, 512, "req-1", 1_000)]
    assert hash(delivered[0]) == hash(LayerSignal("p0", 3, 5, 2, 2048, None, 1_000))
    with pytest.raises(FrozenInstanceError):
        delivered[0].tokens = 1  # type: ignore[misc]


def test_split_signals_refuses_a_reply_with_the_wrong_number_of_flags() -> None:
    with pytest.raises(ValueError, match="2 flags for 1 entries"):
        split_signals("p0", 0, 0, 1, [(5, 10)], "DD")


@pytest.mark.parametrize(
    "raw",
    [
        [(1, True)],  # bools are ints to isinstance, not to the fast path
        [[1, 2]],  # lists go through the full check
        [(1, 2, "req")],  # request ids too
        [(512, 2)],  # slot out of range
        [(1, 2**53)],  # tokens out of range
        ((1, 2),),  # a tuple of entries
    ],
)
def test_plain_batch_leaves_anything_unusual_to_the_full_validation(raw: object) -> None:
    assert plain_batch(raw, 512) is None


def test_plain_and_general_batches_record_the_same_signals() -> None:
    buf = SignalBuffer.from_url("memory://packing-same", namespace="packing", env={})
    clock = [1_000_000]
    buf.protocol.clock = lambda: clock[0]
    plain = buf.record("p0", 0, 1, [(1, 10), (2, 20)])
    general = buf.record("p0", 1, 1, [[1, 10], [2, 20]])
    assert [(s.slot, s.tokens, s.request_id) for s in plain.buffered] == [(1, 10, None), (2, 20, None)]
    assert [(s.slot, s.tokens, s.request_id) for s in general.buffered] == [(1, 10, None), (2, 20, None)]
    assert buf.pending("p0", 0, 1) == [LayerSignal("p0", 0, 1, 1, 10, None, 1_000_000)]
    assert buf.pending("p0", 1, 1) == [LayerSignal("p0", 1, 1, 1, 10, None, 1_000_000)]
    buf.close()


def test_a_bool_token_is_still_refused_and_names_the_field() -> None:
    buf = SignalBuffer.from_url("memory://packing-bool", namespace="packing", env={})
    with pytest.raises(InvalidSignal, match=r"entries\[0\]\.tokens"):
        buf.record("p0", 0, 0, [(1, True)])
    buf.close()


def test_recovery_payload_becomes_equal_signals_and_reasons() -> None:
    recovered, dropped = recovery("p0", 1, 5, "0,100,,7,;1,9000,req-2,8,over_need;")
    assert recovered == [LayerSignal("p0", 1, 5, 0, 100, None, 7)]
    assert dropped == [(LayerSignal("p0", 1, 5, 1, 9000, "req-2", 8), DropReason.OVER_NEED)]
    assert recovery("p0", 1, 5, "") == ([], [])
