"""The bridge logs through whatever logger FastDeploy hands the messager, one string per call.

FastDeploy's own unit tests for the cache messager give it a stand-in logger whose methods take
exactly one argument. The patched prefill ``CacheMessagerV1`` (the fixture's, patched by the
codemod) must build and serve with such a logger, and with one that raises, and an outage must
reach it as one line naming its cause."""

from __future__ import annotations

import queue
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import redis_layer_signals.fastdeploy
from redis_layer_signals import SignalBuffer
from redis_layer_signals.fastdeploy import bridge_for_messager
from redis_layer_signals.fastdeploy.patch import patch_source
from redis_layer_signals.fastdeploy.signals import encode_kv_signal
from tests.servers import RedisServer, free_port, wait_until
from tests.test_fastdeploy_patch import BOTH, Stop

WAIT_S = 20.0
LAYERS = 2
INSTANCE = "10.0.0.7-9923"
"""The bridge's instance: the messager's pod IP and engine worker queue port."""


class OneArgumentLogger:
    """The shape of the logger FastDeploy's tests pass: each method takes one message."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def _keep(self, level: str, message: str) -> None:
        with self._lock:
            self.lines.append((level, message))

    def debug(self, message: str) -> None:
        self._keep("debug", message)

    def info(self, message: str) -> None:
        self._keep("info", message)

    def warning(self, message: str) -> None:
        self._keep("warning", message)

    def error(self, message: str) -> None:
        self._keep("error", message)

    def at(self, level: str) -> list[str]:
        with self._lock:
            return [message for kept, message in self.lines if kept == level]


class RaisingLogger:
    """A logger that fails on every line."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"logger.{name} is broken")

        return fail


class Engine:
    """FastDeploy's side of a prefill messager, stubbed: the GPU's signal op, the worker queue
    with its cache infos, and what the messager reports. Each loop of the messager blocks on it
    until ``stop``, which ends the loops (``Stop`` is not an ``Exception``)."""

    def __init__(self) -> None:
        self.signals: queue.Queue[list[int] | None] = queue.Queue()
        self.cache_infos: queue.Queue[list[dict[str, Any]] | None] = queue.Queue()
        self.writes: list[tuple[int, int]] = []
        self.finished: queue.Queue[str] = queue.Queue()
        self.added: list[str] = []

    def get_output_kv_signal(self, buffer: np.ndarray, rank_id: int, wait_flag: int) -> None:
        message = self.signals.get()
        if message is None:
            self.signals.put(None)
            raise Stop
        buffer[:] = message

    def worker_queue(self, **kwargs: Any) -> Any:
        engine = self

        class WorkerQueue:
            finish_add_cache_task_barrier = types.SimpleNamespace(wait=lambda: None)

            def get_cache_info(self) -> list[dict[str, Any]]:
                infos = engine.cache_infos.get()
                if infos is None:
                    engine.cache_infos.put(None)
                    raise Stop
                return infos

            def put_finished_add_cache_task_req(self, ids: list[str]) -> None:
                engine.added.extend(ids)

            def write_cache(self, slot: int, tokens: int) -> None:
                engine.writes.append((slot, tokens))

            def put_finished_req(self, reqs: list[list[str]]) -> None:
                engine.finished.put(reqs[0][0])

        return WorkerQueue()

    def stop(self) -> None:
        self.signals.put(None)
        self.cache_infos.put(None)


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    """The modules the fixture imports, stubbed; the real ``bridge_for_messager``."""
    engine = Engine()
    paddle = types.ModuleType("paddle")
    paddle.full = lambda shape, fill_value, dtype: np.full(shape, fill_value, dtype=dtype)  # type: ignore[attr-defined]
    paddle.Tensor = type("Tensor", (), {})  # type: ignore[attr-defined]  # the buffers here are numpy arrays
    modules = {
        "paddle": paddle,
        "fastdeploy": types.ModuleType("fastdeploy"),
        "fastdeploy.cache_manager": types.ModuleType("fastdeploy.cache_manager"),
        "fastdeploy.cache_manager.ops": types.SimpleNamespace(get_output_kv_signal=engine.get_output_kv_signal),
        "fastdeploy.inter_communicator": types.SimpleNamespace(EngineWorkerQueue=engine.worker_queue),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(redis_layer_signals.fastdeploy, "bridge_for_messager", bridge_for_messager)
    hook = threading.excepthook
    # A messager loop ended by Stop is how these tests end it; anything else is reported.
    monkeypatch.setattr(
        threading, "excepthook", lambda args: None if args.exc_type is Stop else hook(args), raising=True
    )
    yield engine
    engine.stop()


def patched_messager_class(original: bytes, logger: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setitem(sys.modules, "fastdeploy.utils", types.SimpleNamespace(get_logger=lambda *a: logger))
    namespace: dict[str, Any] = {"__name__": "patched_messager"}
    exec(compile(patch_source(original).patched, "cache_messager.py", "exec"), namespace)
    return namespace["CacheMessagerV1"]


@pytest.fixture(params=["fake", "real"])
def redis_url(request: pytest.FixtureRequest) -> str:
    if request.param == "fake":
        return "memory://logger-test"
    server: RedisServer = request.getfixturevalue("redis_server")
    return str(server.url)


@BOTH
def test_the_patched_prefill_messager_builds_and_serves_with_a_one_argument_logger(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, redis_url: str, namespace: str, original: bytes
) -> None:
    """The logger FastDeploy's tests pass: building a prefill messager used to raise TypeError
    (the bridge called ``logger.info(fmt, *args)``). Now every line the bridge logs is one
    finished string, and an early layer-0 signal reaches the sender through the buffer."""
    monkeypatch.setenv("RLS_REDIS_URL", redis_url)
    monkeypatch.setenv("RLS_NAMESPACE", namespace)
    logger = OneArgumentLogger()
    messager = patched_messager_class(original, logger, monkeypatch)("prefill", "10.0.0.7", 9923, 0, 0, 1, LAYERS)
    bridge = messager.layer0
    reader = SignalBuffer.from_url(redis_url, namespace=namespace)
    try:
        assert bridge is not None
        started = [line for line in logger.at("info") if line.startswith("rls: layer-0 signals of")]
        assert started == [f"rls: layer-0 signals of {INSTANCE} rank 0 buffered in Redis namespace {namespace}"]

        engine.signals.put(list(encode_kv_signal(0, [(5, 0, 128)])))  # before its task: it waits in Redis
        engine.signals.put(list(encode_kv_signal(1, [(5, 0, 128)])))
        wait_until(
            lambda: bridge.flush(0.1) and reader.pending(INSTANCE, 0, 5),
            WAIT_S,
            what=f"the early signal {logger.lines}",
        )
        first_half = {"request_id": "r1", "current_id": 5, "need_prefill_tokens": 128, "src_block_ids": [0, 1]}
        engine.cache_infos.put([first_half])
        engine.cache_infos.put([{"request_id": "r1", "dest_block_ids": [7, 8]}])
        sender = threading.Thread(target=messager.prefill_layerwise_send_cache_thread, daemon=True)
        sender.start()
        assert engine.finished.get(timeout=WAIT_S) == "r1"
        assert engine.writes == [(5, 128)] and engine.added == ["r1"]
        assert bridge.flush(WAIT_S), "the writer did not catch up"
        stats = reader.stats()
        assert (stats["recorded"], stats["buffered"], stats["recovered"], stats["finished"]) == (1, 1, 1, 1)
        assert all(type(message) is str for _level, message in logger.lines)
        assert bridge.health().errors == {}
    finally:
        engine.stop()
        reader.close()
        if bridge is not None:
            bridge.close()


def prefill_bridge(ready: queue.Queue[list[tuple[int, int]]], logger: Any) -> Any:
    """The bridge a prefill messager of rank 0 builds (RLS_REDIS_URL and RLS_NAMESPACE set by
    the test), with ``logger`` as FastDeploy's."""
    return bridge_for_messager(
        splitwise_role="prefill",
        pod_ip="10.0.0.7",
        engine_worker_queue_port=9923,
        rank=0,
        nranks=1,
        block_size=64,
        num_layers=LAYERS,
        ready=ready,
        logger=logger,
    )


def test_a_logger_that_raises_never_reaches_the_messager(monkeypatch: pytest.MonkeyPatch, namespace: str) -> None:
    """Building the bridge logs (the namespace it buffers in), and so do its hooks: a logger
    that fails on every line changes nothing of what the messager sees."""
    monkeypatch.setenv("RLS_REDIS_URL", "memory://raising-logger")
    monkeypatch.setenv("RLS_NAMESPACE", namespace)
    ready: queue.Queue[list[tuple[int, int]]] = queue.Queue()
    bridge = prefill_bridge(ready, RaisingLogger())
    assert bridge is not None
    try:
        info = {"request_id": "r1", "current_id": 5, "need_prefill_tokens": 64, "src_block_ids": [0]}
        bridge.on_cache_task({**info, "dest_block_ids": [7], "decode_cached_tokens": 0})
        assert bridge.on_cache_task({**info, "request_id": "r2", "dest_block_ids": [7]}) == []  # a takeover: logged
        assert bridge.on_kv_signal(encode_kv_signal(0, [(5, 0, 64)])) == [(5, 64)]
        assert bridge.on_kv_signal(np.zeros(3, dtype=np.int64)) == []  # bad input: logged
        assert ready.get_nowait() == [(5, 64)]
        assert bridge.health().errors == {"on_kv_signal": 1}
    finally:
        bridge.close()


def test_an_outage_reaches_a_one_argument_logger_as_one_line_naming_its_cause(
    monkeypatch: pytest.MonkeyPatch, namespace: str
) -> None:
    """A Redis that never answers: the writer's outage is logged once, as one line with the
    connection's error and no traceback (it used to pass ``exc_info``, which such a logger
    refuses, and the writer thread died on it)."""
    monkeypatch.setenv("RLS_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    monkeypatch.setenv("RLS_NAMESPACE", namespace)
    monkeypatch.setenv("RLS_RETRY_S", "0.2")
    logger = OneArgumentLogger()
    ready: queue.Queue[list[tuple[int, int]]] = queue.Queue()
    bridge = prefill_bridge(ready, logger)
    assert bridge is not None
    try:
        bridge.on_cache_task(
            {
                "request_id": "r1",
                "current_id": 5,
                "need_prefill_tokens": 64,
                "src_block_ids": [0],
                "dest_block_ids": [7],
            }
        )
        wait_until(lambda: logger.at("warning"), WAIT_S, what="the outage's warning")
        assert bridge.on_kv_signal(encode_kv_signal(0, [(5, 0, 64)])) == [(5, 64)], "served locally meanwhile"
        [warning] = logger.at("warning")
        assert "\n" not in warning and "Traceback" not in warning
        assert "serving this process locally" in warning and "Connection refused" in warning
        assert bridge.health().degraded
    finally:
        bridge.close()
