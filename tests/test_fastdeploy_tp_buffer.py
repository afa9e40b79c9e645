"""At every TP size Redis holds each early signal: a tensor-parallel rank's early layer-0 signal
sits in its rank's pending hash, with its TTL, until its task takes it, as a rank of its own's
does, and the counters balance (on fakeredis, Redis 7.0, Valkey 8.1 and a 3-primary Cluster)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import pytest

from redis_layer_signals import SignalBuffer
from redis_layer_signals.fastdeploy import Layer0Bridge
from redis_layer_signals.fastdeploy.signals import encode_kv_signal
from tests.servers import wait_until

NRANKS = 2


def cache_info(slot: int, request_id: str, need: int) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "current_id": slot,
        "need_prefill_tokens": need,
        "status": "init",
        "src_block_ids": [1],
        "dest_block_ids": [1],
        "transfer_protocol": "rdma",
    }


@pytest.fixture
def group(
    url: str, namespace: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[list[Layer0Bridge], list[queue.Queue[Any]]]]:
    monkeypatch.setenv("RLS_GROUP_DIR", str(tmp_path))
    readies: list[queue.Queue[Any]] = [queue.Queue() for _ in range(NRANKS)]
    bridges = [
        Layer0Bridge(
            SignalBuffer.from_url(url, namespace=namespace, env={}),
            "p0",
            rank,
            num_layers=4,
            ready=readies[rank],
            nranks=NRANKS,
            probe_s=0.05,
        )
        for rank in range(NRANKS)
    ]
    yield bridges, readies
    for bridge in bridges:
        bridge.close()
        bridge.buffer.close()


def test_a_tp_ranks_early_signal_is_in_its_pending_hash_until_its_task_takes_it(
    group: tuple[list[Layer0Bridge], list[queue.Queue[Any]]],
) -> None:
    bridges, readies = group
    for bridge in bridges:
        assert bridge.on_kv_signal(encode_kv_signal(0, [(3, 0, 96)])) == []  # no task yet: early
        assert bridge.flush(10)
    for rank, bridge in enumerate(bridges):
        held = bridge.buffer.pending("p0", rank, 3)
        assert [(s.layer, s.tokens) for s in held] == [(0, 96)], f"rank {rank}"
        keys = bridge.buffer.protocol.keys.rank("p0", rank)
        assert 0 < bridge.buffer.client.pttl(keys.pending) <= bridge.buffer.protocol.task_ttl_ms + 60_000

    for bridge in bridges:
        bridge.on_cache_task(cache_info(3, "req-a", 128))
    for rank, ready in enumerate(readies):
        assert ready.get(timeout=10) == [(3, 96)], f"rank {rank}"
    for rank, bridge in enumerate(bridges):
        assert bridge.flush(10)
        assert bridge.buffer.pending("p0", rank, 3) == []  # taken by its task

    stats = bridges[0].buffer.stats()
    assert stats["buffered"] == NRANKS
    assert stats["recovered"] == NRANKS
    assert stats["recorded"] == stats["delivered"] + stats["buffered"]
    assert stats["registered"] == NRANKS


def test_an_aborted_requests_signal_stays_in_redis_and_holds_back_no_other_request(
    group: tuple[list[Layer0Bridge], list[queue.Queue[Any]]],
) -> None:
    bridges, readies = group
    for bridge in bridges:
        bridge.on_kv_signal(encode_kv_signal(0, [(9, 0, 64), (4, 0, 32)]))  # 9 never registers
        bridge.on_cache_task(cache_info(4, "req-b", 32))
    for rank, ready in enumerate(readies):
        assert ready.get(timeout=10) == [(4, 32)], f"rank {rank}"
    for rank, bridge in enumerate(bridges):
        assert bridge.flush(10)
        assert [(s.layer, s.tokens) for s in bridge.buffer.pending("p0", rank, 9)] == [(0, 64)]
        health = bridge.health()
        assert health.group_waiting == 1  # slot 9, for a task that never comes
        assert health.group_outcomes.get("released") == 1
    wait_until(lambda: all(b.health().group_wait[1] == 1 for b in bridges), timeout=5, what="the wait observed")
