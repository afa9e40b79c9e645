"""The seed fix's scenarios on the reference cache messager: a scripted GPU fills paddle signal
tensors, the consumer / adder / sender threads run around Layer0Bridge, and a recording
transport shows which blocks of which layers went out. Every wait is bounded."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

from redis_layer_signals import SignalBuffer
from redis_layer_signals.fastdeploy import Layer0Bridge
from redis_layer_signals.fastdeploy.demo.reference import ReferenceMessager, UnbufferedBridge
from redis_layer_signals.fastdeploy.demo.scripted import (
    DEST_BLOCK_BASE,
    PrefillRequest,
    RecordingTransport,
    ScriptedGpu,
)
from tests.servers import wait_until

LAYERS = 4
WAIT_S = 10.0
"""Upper bound for anything that should happen; a pass never waits for it."""
UNSENT_WAIT_S = 1.0
"""How long the pre-fix case is given to send a request it has lost (it never does)."""


@pytest.fixture(params=["fake", "real"])
def backend(request: pytest.FixtureRequest) -> str:
    """Fakeredis and one real redis-server: the pipeline's scenarios are about ordering, not
    topology, which the behaviour suite covers."""
    return str(request.param)


@dataclass
class Rig:
    buffer: SignalBuffer
    messager: ReferenceMessager
    gpu: ScriptedGpu

    @property
    def transport(self) -> RecordingTransport:
        return self.messager.transport

    def add_task(self, request: PrefillRequest) -> None:
        """Both halves of the cache_info, then wait until the adder has registered it."""
        self.messager.cache_infos.put(request.prefill_half())
        self.messager.cache_infos.put(request.decode_half())
        assert self.messager.wait_drained(WAIT_S), "adder did not take the cache_info"

    def prefill(self, request: PrefillRequest, chunk_tokens: int | None = None) -> None:
        """Run the request's chunks and wait until the consumer has read every signal."""
        self.gpu.prefill(request, chunk_tokens)
        assert self.messager.wait_drained(WAIT_S), "consumer did not read the signals"

    def stats(self) -> dict[str, int]:
        assert self.messager.bridge.flush(WAIT_S), "the bridge's writer did not catch up"
        return self.buffer.stats()

    def pending_layer0(self, slot: int) -> list[int]:
        assert self.messager.bridge.flush(WAIT_S), "the bridge's writer did not catch up"
        return [s.tokens for s in self.buffer.pending("p0", 0, slot) if s.layer == 0]

    def assert_clean(self) -> None:
        assert self.messager.errors == []
        assert self.transport.premature == [], "a block was written before the GPU finished it"
        for write in self.transport.writes:
            assert [d - DEST_BLOCK_BASE for d in write.dest_blocks] == list(write.src_blocks)


def make_rig(
    url: str, namespace: str, bridge_type: type[Layer0Bridge] = Layer0Bridge, gpu: ScriptedGpu | None = None
) -> Iterator[Rig]:
    """A messager on its own client; ``gpu`` keeps an engine that outlives an earlier one."""
    buffer = SignalBuffer.from_url(url, namespace=namespace, env={})
    messager = ReferenceMessager(bridge_type(buffer, "p0", 0, num_layers=LAYERS), RecordingTransport())
    if gpu is None:
        gpu = ScriptedGpu(messager.signals, LAYERS)
    gpu.signals = messager.signals
    messager.transport.gpu = gpu
    with messager:
        yield Rig(buffer, messager, gpu)
    buffer.close()


@pytest.fixture
def rig(url: str, namespace: str) -> Iterator[Rig]:
    yield from make_rig(url, namespace)


def expected_writes(requests: Sequence[PrefillRequest]) -> dict[tuple[int, int, int], int]:
    """Every block the decode node lacks, of every layer, exactly once."""
    return {
        (r.slot, layer, block): 1
        for r in requests
        for layer in range(LAYERS)
        for block in r.src_block_ids[r.decode_cached_blocks :]
    }


def ranges_per_layer(transport: RecordingTransport, request: PrefillRequest) -> list[list[list[int]]]:
    """For each layer, the block-index ranges written for ``request``, in send order."""
    base = request.src_block_ids[0]
    out: list[list[list[int]]] = [[] for _ in range(LAYERS)]
    for write in transport.for_slot(request.slot):
        out[write.layer].append([b - base for b in write.src_blocks])
    return out


# --- the seed's scenarios ---------------------------------------------------------------------


@pytest.mark.parametrize(("bridge_type", "sends"), [(Layer0Bridge, True), (UnbufferedBridge, False)])
def test_layer0_signal_before_cache_task_no_longer_hangs_the_request(
    url: str, namespace: str, bridge_type: type[Layer0Bridge], sends: bool
) -> None:
    """The seed bug: the GPU's only layer-0 signal comes before the cache task. With the bridge
    the registration recovers it and every block of every layer goes out once; with the
    pre-fix behaviour the signal is dropped and the request is never sent."""
    for rig in make_rig(url, namespace, bridge_type):
        request = PrefillRequest("req-1", 5, 300)
        rig.prefill(request)
        rig.add_task(request)
        finished = rig.messager.wait_finished([request.request_id], WAIT_S if sends else UNSENT_WAIT_S)
        rig.assert_clean()
        if sends:
            assert finished == {"req-1"}
            assert rig.transport.block_writes() == expected_writes([request])
            assert rig.stats()["recovered"] == 1
            assert rig.messager.bridge.flush(WAIT_S) and rig.buffer.task("p0", 0, 5) is None  # finished, slot released
        else:
            assert finished == set()
            assert rig.transport.writes == []
            assert rig.buffer.task("p0", 0, 5) is not None  # the request hangs on its slot


def test_signal_after_registration_is_delivered_by_either_bridge(url: str, namespace: str) -> None:
    """The order that always worked still works, so the difference above is the early case."""
    for bridge_type in (Layer0Bridge, UnbufferedBridge):
        for rig in make_rig(url, f"{namespace}-{bridge_type.__name__}", bridge_type):
            request = PrefillRequest("req-1", 5, 300)
            rig.add_task(request)
            rig.prefill(request)
            assert rig.messager.wait_finished(["req-1"], WAIT_S) == {"req-1"}
            assert rig.transport.block_writes() == expected_writes([request])
            rig.assert_clean()


def test_early_signal_over_need_is_dropped_not_sent(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """A stale layer-0 signal (5000 tokens, left by an aborted request) waits on slot 5 when a
    request needing 256 tokens registers there: it is dropped with its reason, and the new
    request is sent from its own signals only."""
    rig.messager.signals.put(rig.gpu.signal_tensor(0, [(5, 0, 5000)]))
    assert rig.messager.wait_drained(WAIT_S)
    assert rig.pending_layer0(5) == [5000]
    request = PrefillRequest("req-1", 5, 256)
    with caplog.at_level(logging.WARNING, logger="redis_layer_signals.fastdeploy"):
        rig.add_task(request)
    assert "over_need" in caplog.text
    assert rig.pending_layer0(5) == []
    rig.prefill(request, chunk_tokens=128)
    assert rig.messager.wait_finished(["req-1"], WAIT_S) == {"req-1"}
    assert rig.transport.block_writes() == expected_writes([request])
    assert ranges_per_layer(rig.transport, request) == [[[0, 1], [2, 3]]] * LAYERS
    stats = rig.stats()
    assert (stats["dropped_over_need"], stats["recovered"]) == (1, 0)
    rig.assert_clean()


def test_finished_task_pending_signal_is_gone(rig: Rig) -> None:
    """Request A is aborted after its early signal: finishing it drops that signal, so request
    B on the same slot recovers nothing of A's and only B's blocks are written."""
    first = PrefillRequest("req-a", 5, 256)
    rig.prefill(first)
    assert rig.pending_layer0(5) == [256]
    assert rig.messager.bridge.on_task_finished(5, "req-a").dropped == 1
    assert rig.pending_layer0(5) == []

    second = PrefillRequest("req-b", 5, 128, block_base=5500)
    rig.add_task(second)
    rig.prefill(second)
    assert rig.messager.wait_finished(["req-b"], WAIT_S) == {"req-b"}
    assert rig.transport.block_writes() == expected_writes([second])
    assert rig.stats()["recovered"] == 0
    rig.assert_clean()


def test_registration_does_not_recover_another_slots_pending_signal(rig: Rig) -> None:
    """One forward step carries slots 5 and 7, both early. Registering slot 5 recovers slot 5
    only; slot 7's signal stays pending until its own task registers."""
    five, seven = PrefillRequest("req-5", 5, 192), PrefillRequest("req-7", 7, 320)
    rig.gpu.forward([(five, 0, 192), (seven, 0, 320)])
    assert rig.messager.wait_drained(WAIT_S)

    rig.add_task(five)
    assert rig.messager.wait_finished(["req-5"], WAIT_S) == {"req-5"}
    assert rig.pending_layer0(7) == [320]
    assert rig.transport.for_slot(7) == []

    rig.add_task(seven)
    assert rig.messager.wait_finished(["req-7"], WAIT_S) == {"req-7"}
    assert rig.transport.block_writes() == expected_writes([five, seven])
    assert rig.stats()["recovered"] == 2
    rig.assert_clean()


@pytest.mark.parametrize(
    ("early_chunks", "cached_blocks", "ranges"),
    [
        (0, 0, [[0, 1], [2, 3], [4]]),
        (1, 0, [[0, 1], [2, 3], [4]]),
        (2, 0, [[0, 1, 2, 3], [4]]),  # chunk 2's signal superseded chunk 1's while waiting
        (3, 0, [[0, 1, 2, 3, 4]]),
        (1, 3, [[3], [4]]),  # the decode node holds blocks 0-2 already
    ],
    ids=["none-early", "first-early", "two-early", "all-early", "first-early-decode-cached"],
)
def test_chunked_prefill_sends_the_right_block_ranges(
    rig: Rig, early_chunks: int, cached_blocks: int, ranges: list[list[int]]
) -> None:
    """300 tokens in chunks of 128 (layer-0 signals at 128, 256, 300; blocks of 64): the first
    ``early_chunks`` chunks run before the task registers. Each layer gets the same ranges,
    each block once, none before the GPU wrote it."""
    request = PrefillRequest("req-1", 5, 300, decode_cached_blocks=cached_blocks)
    chunks = request.chunks(128)
    assert chunks == [(0, 128), (128, 128), (256, 44)]
    for offset, length in chunks[:early_chunks]:
        rig.gpu.forward([(request, offset, length)])
    assert rig.messager.wait_drained(WAIT_S)
    rig.add_task(request)
    for offset, length in chunks[early_chunks:]:
        rig.gpu.forward([(request, offset, length)])
    assert rig.messager.wait_finished(["req-1"], WAIT_S) == {"req-1"}
    assert ranges_per_layer(rig.transport, request) == [ranges] * LAYERS
    assert rig.transport.block_writes() == expected_writes([request])
    rig.assert_clean()


def test_sender_writes_a_layer_only_after_the_gpu_signalled_it(rig: Rig) -> None:
    """The GPU stops after layer 0: the sender writes layer 0 and then waits for layer 1's
    signal instead of sending blocks the GPU has not written yet."""
    request = PrefillRequest("req-1", 5, 300)
    rig.add_task(request)
    rig.gpu.forward([(request, 0, 300)], layers=[0])
    progress = rig.messager.progress
    wait_until(
        lambda: progress.waiting_for == (5, 300, 1) or len(rig.transport.writes) == LAYERS,
        WAIT_S,
        interval=0.002,
        what="the sender to block on layer 1",
    )
    assert [w.layer for w in rig.transport.writes] == [0]
    rig.gpu.forward([(request, 0, 300)], layers=range(1, LAYERS))
    assert rig.messager.wait_finished(["req-1"], WAIT_S) == {"req-1"}
    assert [w.layer for w in rig.transport.writes] == list(range(LAYERS))
    rig.assert_clean()


def test_early_signal_survives_a_restart_of_the_messager(url: str, namespace: str) -> None:
    """The early signal lives in Redis, not in the messager: a messager that stops after
    buffering it and a new one (new client, new threads) still send the request in full.
    FastDeploy's in-process dict loses it here."""
    request = PrefillRequest("req-1", 5, 300)
    for first in make_rig(url, namespace):
        first.gpu.forward([(request, 0, 300)], layers=[0])
        assert first.messager.wait_drained(WAIT_S)
        assert first.pending_layer0(5) == [300]
        first.messager.bridge.close()  # its process exits: the identity is free for the next
    for second in make_rig(url, namespace, gpu=first.gpu):  # the engine keeps running
        second.gpu.forward([(request, 0, 300)], layers=range(1, LAYERS))
        assert second.messager.wait_drained(WAIT_S)
        second.add_task(request)
        assert second.messager.wait_finished(["req-1"], WAIT_S) == {"req-1"}
        assert second.transport.block_writes() == expected_writes([request])
        second.assert_clean()
