"""Layer0Bridge's three hooks on the buffer, on fakeredis and on a real redis-server: what each
returns to CacheMessagerV1, what it leaves in the buffer, and that bad input writes nothing."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from redis_layer_signals import InvalidConfig, InvalidTask, SignalBuffer
from redis_layer_signals.fastdeploy import KV_SIGNAL_LENGTH, KvSignal, Layer0Bridge
from redis_layer_signals.fastdeploy.bridge import block_ids
from redis_layer_signals.fastdeploy.signals import encode_kv_signal
from tests.servers import running, wait_until

LAYERS = 4


def kv(layer: int, *entries: tuple[int, int, int]) -> Any:
    return encode_kv_signal(layer, entries)


def cache_info(slot: Any = 5, request_id: str = "req-1", need: int = 300, **extra: Any) -> dict[str, Any]:
    blocks = -(-need // 64)
    info: dict[str, Any] = {
        "request_id": request_id,
        "current_id": slot,
        "need_prefill_tokens": need,
        "src_block_ids": list(range(blocks)),
        "dest_block_ids": [100 + b for b in range(blocks)],
        "decode_cached_tokens": 0,
        "transfer_protocol": "rdma",
        "ip": "10.0.0.7",
        "rdma_ports": [7000, 7001],
        "status": "init",
    }
    info.update(extra)
    return info


def synced(bridge: Layer0Bridge, buf: SignalBuffer) -> SignalBuffer:
    """``buf``, once Redis holds everything the bridge decided (its writer runs behind)."""
    assert bridge.flush(5.0), "the writer did not catch up"
    return buf


@pytest.fixture
def bridge(buf: SignalBuffer) -> Iterator[Layer0Bridge]:
    made = Layer0Bridge(buf, "p0", 0, num_layers=LAYERS)
    yield made
    made.close()


def test_layer0_signal_without_task_is_buffered_not_returned(bridge: Layer0Bridge, buf: SignalBuffer) -> None:
    assert bridge.on_kv_signal(kv(0, (5, 0, 128), (7, 0, 64))) == []
    assert [(s.layer, s.tokens) for s in synced(bridge, buf).pending("p0", 0, 5)] == [(0, 128)]
    assert [(s.layer, s.tokens) for s in synced(bridge, buf).pending("p0", 0, 7)] == [(0, 64)]


def test_layer0_signal_for_registered_slot_is_returned_for_the_queue(bridge: Layer0Bridge, buf: SignalBuffer) -> None:
    assert bridge.on_cache_task(cache_info(slot=5)) == []
    assert bridge.on_kv_signal(kv(0, (7, 0, 64), (5, 128, 64))) == [(5, 192)]
    assert synced(bridge, buf).pending("p0", 0, 5) == []
    assert [s.tokens for s in synced(bridge, buf).pending("p0", 0, 7)] == [64]


def test_later_layers_and_empty_reads_pass_through_without_touching_redis(
    bridge: Layer0Bridge, buf: SignalBuffer
) -> None:
    assert bridge.on_kv_signal(kv(1, (5, 0, 128))) == []
    assert bridge.on_kv_signal(kv(LAYERS - 1, (5, 0, 128))) == []
    assert bridge.on_kv_signal(np.full(KV_SIGNAL_LENGTH, -1, dtype=np.int32)) == []
    assert bridge.on_kv_signal(KvSignal(0, ())) == []
    assert synced(bridge, buf).pending("p0", 0, 5) == []
    assert synced(bridge, buf).stats()["recorded"] == 0


def test_already_decoded_signal_is_accepted(bridge: Layer0Bridge, buf: SignalBuffer) -> None:
    bridge.on_cache_task(cache_info(slot=5))
    assert bridge.on_kv_signal(KvSignal(0, ((5, 256),))) == [(5, 256)]


def test_cache_task_registration_returns_the_early_batch_once(bridge: Layer0Bridge, buf: SignalBuffer) -> None:
    bridge.on_kv_signal(kv(0, (5, 0, 128)))
    bridge.on_kv_signal(kv(0, (5, 128, 128)))  # the second chunk supersedes the first
    assert bridge.on_cache_task(cache_info(slot=5)) == [(5, 256)]
    assert synced(bridge, buf).pending("p0", 0, 5) == []
    assert bridge.on_kv_signal(kv(0, (5, 256, 44))) == [(5, 300)]
    assert synced(bridge, buf).stats()["superseded"] == 1


def test_cache_info_maps_to_a_task_with_block_ids_readable_from_redis(bridge: Layer0Bridge, buf: SignalBuffer) -> None:
    info = cache_info(slot=np.int32(9), need=200, decode_cached_tokens=np.int64(64))
    bridge.on_cache_task(info)
    task = synced(bridge, buf).task("p0", 0, 9)
    assert task is not None
    assert (task.request_id, task.need_prefill_tokens, task.num_layers, task.decode_cached_tokens) == (
        "req-1",
        200,
        LAYERS,
        64,
    )
    assert block_ids(task, "src_block_ids") == [0, 1, 2, 3]
    assert block_ids(task, "dest_block_ids") == [100, 101, 102, 103]
    assert task.meta["transfer_protocol"] == "rdma" and task.meta["ip"] == "10.0.0.7"
    assert "rdma_ports" not in task.meta and "status" not in task.meta


def test_early_signal_over_need_is_dropped_and_logged_with_reason(
    bridge: Layer0Bridge, buf: SignalBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    bridge.on_kv_signal(kv(0, (5, 0, 5000)))
    with caplog.at_level(logging.WARNING, logger="redis_layer_signals.fastdeploy"):
        assert bridge.on_cache_task(cache_info(slot=5, need=300)) == []
    assert "over_need" in caplog.text and "slot 5" in caplog.text and "req-1" in caplog.text
    assert synced(bridge, buf).stats()["dropped_over_need"] == 1
    assert synced(bridge, buf).pending("p0", 0, 5) == []


def test_finish_releases_the_slot_and_a_late_finish_is_fenced(bridge: Layer0Bridge, buf: SignalBuffer) -> None:
    bridge.on_cache_task(cache_info(slot=5, request_id="req-a"))
    assert bridge.on_task_finished(5, "req-a").removed
    bridge.on_cache_task(cache_info(slot=5, request_id="req-b"))
    late = bridge.on_task_finished(5, "req-a")
    assert late.fenced and not late.removed
    task = synced(bridge, buf).task("p0", 0, 5)
    assert task is not None and task.request_id == "req-b"


def test_finish_of_an_aborted_request_drops_its_early_signal(bridge: Layer0Bridge, buf: SignalBuffer) -> None:
    bridge.on_kv_signal(kv(0, (5, 0, 128)))
    assert bridge.on_task_finished(5, "req-1").dropped == 1
    assert synced(bridge, buf).pending("p0", 0, 5) == []
    assert bridge.on_cache_task(cache_info(slot=5, request_id="req-2")) == []


BAD_CACHE_INFOS = [
    ({"request_id": None}, "request_id"),
    ({"request_id": "bad id"}, "request_id"),
    ({"current_id": "5"}, "current_id"),
    ({"current_id": True}, "current_id"),
    ({"current_id": 512}, "slot"),
    ({"need_prefill_tokens": 1.5}, "need_prefill_tokens"),
    ({"need_prefill_tokens": -1}, "need_prefill_tokens"),
    ({"decode_cached_tokens": "0"}, "decode_cached_tokens"),
    ({"src_block_ids": "0,1"}, "src_block_ids"),
    ({"dest_block_ids": [100, "x"]}, "dest_block_ids[1]"),
]


@pytest.mark.parametrize(("change", "field"), BAD_CACHE_INFOS)
def test_bad_cache_info_is_named_logged_and_writes_nothing(
    bridge: Layer0Bridge, buf: SignalBuffer, change: dict[str, Any], field: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The mapping raises InvalidTask naming the field; the hook, which must never raise into
    FastDeploy's loop, logs it, counts it and leaves Redis and the local state untouched."""
    info = cache_info(slot=5)
    for key, value in change.items():
        if value is None:
            del info[key]
        else:
            info[key] = value
    with pytest.raises(InvalidTask) as caught:
        bridge.cache_task(info)
    assert caught.value.field == field and isinstance(caught.value, ValueError)
    with caplog.at_level(logging.ERROR, logger="redis_layer_signals.fastdeploy"):
        assert bridge.on_cache_task(info) == []
    assert field in caplog.text
    assert bridge.health().errors == {"on_cache_task": 1}
    assert synced(bridge, buf).task("p0", 0, 5) is None and bridge.local.tasks == {}
    assert synced(bridge, buf).stats()["registered"] == 0


def test_cache_info_that_is_not_a_mapping_is_refused(bridge: Layer0Bridge) -> None:
    with pytest.raises(InvalidTask) as caught:
        bridge.cache_task([("request_id", "req-1")])  # type: ignore[arg-type]
    assert caught.value.field == "cache_info"
    assert bridge.on_cache_task([("request_id", "req-1")]) == []  # type: ignore[arg-type]


def test_malformed_signal_is_logged_once_and_records_nothing(
    bridge: Layer0Bridge, buf: SignalBuffer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="redis_layer_signals.fastdeploy"):
        assert bridge.on_kv_signal(kv(0, (5, 0, 128)).astype(np.int64)) == []
        assert bridge.on_kv_signal(kv(0, (5, 0, 128), (600, 0, 1))) == []
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1, "once per run of bad input"
    assert bridge.health().errors == {"on_kv_signal": 2}
    assert synced(bridge, buf).pending("p0", 0, 5) == []
    assert synced(bridge, buf).stats()["recorded"] == 0
    bridge.on_cache_task(cache_info(slot=5))
    assert bridge.on_kv_signal(kv(0, (5, 0, 128))) == [(5, 128)]  # the hook goes on working


@pytest.mark.parametrize(("option", "value"), [("block_size", 0), ("block_size", True), ("num_layers", 0)])
def test_bad_bridge_option_raises_invalid_config(buf: SignalBuffer, option: str, value: Any) -> None:
    options: dict[str, Any] = {"block_size": 64, "num_layers": LAYERS, option: value}
    with pytest.raises(InvalidConfig) as caught:
        Layer0Bridge(buf, "p0", 0, **options)
    assert caught.value.field == option


def test_ranks_and_instances_do_not_share_slots(bridge: Layer0Bridge, buf: SignalBuffer) -> None:
    """Slot 5 of rank 0 and slot 5 of rank 1 (or of another instance) are different slots."""
    rank1 = Layer0Bridge(buf, "p0", 1, num_layers=LAYERS)
    other = Layer0Bridge(buf, "p1", 0, num_layers=LAYERS)
    bridge.on_kv_signal(kv(0, (5, 0, 128)))
    assert rank1.on_cache_task(cache_info(slot=5, request_id="req-r1")) == []
    assert other.on_cache_task(cache_info(slot=5, request_id="req-p1")) == []
    assert bridge.on_cache_task(cache_info(slot=5)) == [(5, 128)]
    rank1.close()
    other.close()


def test_hooks_serve_locally_when_redis_is_gone(caplog: pytest.LogCaptureFixture) -> None:
    """With Redis down no hook waits for it or raises: the early signal waits in the process,
    the task's registration hands it to the sender at once; the writer, which notices the
    outage, logs it once with its cause and keeps the three decisions until Redis answers."""
    with running() as server:
        buffer = SignalBuffer.from_url(server.url, namespace="gone", retry_s=0.3, env={})
        bridge = Layer0Bridge(buffer, "p0", 0, num_layers=LAYERS, probe_s=60)
        server.kill()
        with caplog.at_level(logging.WARNING, logger="redis_layer_signals.fastdeploy"):
            started = time.monotonic()
            assert bridge.on_kv_signal(kv(0, (6, 0, 128))) == []
            assert bridge.on_cache_task(cache_info(slot=6, need=128)) == [(6, 128)]
            finished = bridge.on_task_finished(6, "req-1")
            assert time.monotonic() - started < 0.3, "a hook waited for Redis"
            wait_until(lambda: bridge.health().degraded, 5.0, what="the writer to notice the outage")
            # The writer logs the episode once it released the lock the hooks take.
            wait_until(lambda: any(r.levelno == logging.WARNING for r in caplog.records), 5.0, what="the warning")
        assert (finished.removed, finished.fenced) == (True, False)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "Connection refused" in warnings[0].getMessage()
        health = bridge.health()
        assert health.degraded and health.unwritten == 3 and health.lag_seconds > 0
        assert not bridge.flush(0.1)
        assert bridge.ready.get_nowait() == [(6, 128)]
        bridge.close()
        buffer.close()


def test_bridge_follows_the_messagers_queue_attribute_when_it_is_replaced(buf: SignalBuffer) -> None:
    """``ready`` as a callable is looked up at each put: code that replaces the messager's
    ``cache_prefilled_engine_ids_queue`` (FastDeploy's own unit test does) keeps the bridge
    queueing on the current queue, not on the one it was built with."""

    class Messager:
        def __init__(self) -> None:
            self.cache_prefilled_engine_ids_queue: queue.Queue[Any] = queue.Queue()

    messager = Messager()
    bridge = Layer0Bridge(buf, "p0", 0, num_layers=LAYERS, ready=lambda: messager.cache_prefilled_engine_ids_queue)
    try:
        first = messager.cache_prefilled_engine_ids_queue
        bridge.on_cache_task(cache_info(slot=5))
        assert bridge.on_kv_signal(kv(0, (5, 0, 128))) == [(5, 128)]
        assert first.get_nowait() == [(5, 128)]
        messager.cache_prefilled_engine_ids_queue = replaced = queue.Queue()
        assert bridge.on_kv_signal(kv(0, (5, 128, 64))) == [(5, 192)]
        assert replaced.get_nowait() == [(5, 192)]
        assert first.empty()
        assert bridge.ready is replaced
    finally:
        bridge.close()  # its writer renews the identity's lease until then


def test_ready_that_is_neither_a_queue_nor_callable_is_refused(buf: SignalBuffer) -> None:
    with pytest.raises(InvalidConfig) as caught:
        Layer0Bridge(buf, "p0", 0, num_layers=LAYERS, ready=42)  # type: ignore[arg-type]
    assert caught.value.field == "ready"


def test_a_bridge_on_the_implicit_memory_url_is_refused_naming_the_variable() -> None:
    """No URL and no RLS_REDIS_URL: the default memory:// would be this process's alone."""
    implicit = SignalBuffer.from_url(env={})
    with pytest.raises(InvalidConfig) as refused:
        Layer0Bridge(implicit, "p0", 0, num_layers=4)
    assert refused.value.field == "RLS_REDIS_URL" and "memory://" in str(refused.value)
    explicit = SignalBuffer.from_url("memory://", env={})
    Layer0Bridge(explicit, "p0", 0, num_layers=4, registers_tasks=False).close()
    from_env = SignalBuffer.from_url(env={"RLS_REDIS_URL": "memory://"})
    assert not from_env.config.url_implicit
