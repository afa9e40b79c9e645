"""The pre-8034 rule as FastDeploy's structure runs it: ``CacheMessagerV1`` of the fixture
(tests/fixtures/fastdeploy/cache_messager.py, release/2.6 with PR 7872) executed with stub
imports, one instance per rank, its three methods run unchanged on the harness's threads.

The stubs put FastDeploy's barriers where its sender has them and the fixture leaves them out:
``begin_send_cache_barrier`` right after the sender takes a batch (the stub queue's ``get``),
``finish_send_cache_barrier`` right before each finished task is reported (the stub worker
queue's ``put_finished_req``, which the fixture calls under the lock, as FastDeploy waits there).

With ``adders="free"`` (``tp.run_group``) the stub worker queue's ``finish_add_cache_task_barrier``
is the harness's no-op, so the fixture's adders run out of lockstep as develop's do (PR 7724);
the fixture's sender is its own, so it runs with ``sender="one"`` only. ``PatchedFixtureRule``
runs the fixture as ``rls fastdeploy patch`` leaves it, its ``Layer0Bridge`` on the harness's
Redis: FastDeploy's structure with the bridge.
"""

from __future__ import annotations

import logging
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from redis_layer_signals.buffer.sync import SignalBuffer
from redis_layer_signals.fastdeploy.bridge import Layer0Bridge
from redis_layer_signals.fastdeploy.demo.tp import RankIO
from redis_layer_signals.fastdeploy.patch import patch_source

FIXTURE = Path(__file__).parent / "fixtures" / "fastdeploy" / "cache_messager.py"
_EXEC_LOCK = threading.Lock()
"""The stub modules are in ``sys.modules`` only while a copy of the fixture is executed."""


class StubWorkerQueue:
    """``EngineWorkerQueue`` of one rank, served by its ``RankIO``."""

    def __init__(self, io: RankIO) -> None:
        self.io = io
        self.messager: Any = None
        self.finish_add_cache_task_barrier = io.finish_add_cache_task_barrier

    def get_cache_info(self) -> list[dict[str, Any]]:
        return self.io.get_cache_info()

    def put_finished_add_cache_task_req(self, request_ids: list[str]) -> None:
        if self.io.adders == "lockstep":  # develop has no acknowledgement (PR 7724)
            self.io.put_finished_add_cache_task_req(request_ids)

    def write_cache(self, slot: int, tokens: int) -> None:
        self.io.write_cache(self.messager.idx_cache_task_dict[slot]["request_id"], slot, tokens)

    def put_finished_req(self, reqs: list[list[str]]) -> None:
        self.io.finish_send_cache_barrier.wait()
        for request_id, status in reqs:
            self.io.put_finished_req(request_id, status)


class BarrierQueue:
    """The sender's queue: the rank's recording queue, with FastDeploy's begin-send barrier."""

    def __init__(self, io: RankIO) -> None:
        self.io = io

    def put(self, batch: list[tuple[int, int]]) -> None:
        self.io.ready.put(batch)

    def get(self) -> list[tuple[int, int]]:
        batch = self.io.ready.get()
        self.io.begin_send_cache_barrier.wait()
        return batch


class FixtureMessager:
    def __init__(self, io: RankIO, bridge: Callable[..., Layer0Bridge] | None = None) -> None:
        """``bridge``: run the patched fixture, its ``bridge_for_messager`` replaced by this."""
        if io.sender != "one":
            raise ValueError(f"sender={io.sender!r}: the fixture's sender is its own, run it with sender='one'")
        namespace = _execute_fixture(patched=bridge is not None)
        if bridge is not None:
            namespace["bridge_for_messager"] = bridge
        worker_queue = StubWorkerQueue(io)
        namespace["EngineWorkerQueue"] = lambda **_kwargs: worker_queue
        namespace["get_output_kv_signal"] = lambda buffer, _rank_id, _wait: io.get_output_kv_signal(buffer)
        # "mixed": the constructor starts no thread; the harness runs the three loops.
        self.messager = namespace["CacheMessagerV1"]("mixed", "10.0.0.7", 9923, 0, io.rank, io.nranks, io.layers)
        worker_queue.messager = self.messager
        self.messager.cache_prefilled_engine_ids_queue = BarrierQueue(io)

    def loops(self) -> list[Callable[[], None]]:
        m = self.messager
        return [m.consume_signals, m._add_cache_task_thread, m.prefill_layerwise_send_cache_thread]

    def close(self) -> None:
        bridge = getattr(self.messager, "layer0", None)
        if bridge is not None:
            bridge.close()
            bridge.buffer.close()


class FixtureRule:
    """The pre-8034 rule: FastDeploy's structure, the fixture's code."""

    name = "pre-8034 (FastDeploy's structure)"

    def messager(self, io: RankIO, group: str) -> FixtureMessager:
        return FixtureMessager(io)


class PatchedFixtureRule:
    """The fixture as ``rls fastdeploy patch`` leaves it: FastDeploy's structure with the
    bridge, each rank's ``Layer0Bridge`` on ``url`` with a client of its own, told the group's
    size, built as ``bridge_for_messager`` builds it (the short ``pending_ttl_s`` of the
    harness's ``bridge_rule``, so a group gives up an aborted request's signal within a test)."""

    name = "bridge in FastDeploy's structure (patched fixture)"

    def __init__(self, url: str, namespace: str, pending_ttl_s: float = 1.0) -> None:
        self.url, self.namespace, self.pending_ttl_s = url, namespace, pending_ttl_s

    def messager(self, io: RankIO, group: str) -> FixtureMessager:
        def bridge_for_messager(
            *, rank: int, nranks: int, block_size: int, num_layers: int, ready: Any, logger: Any, **_where: Any
        ) -> Layer0Bridge:
            buffer = SignalBuffer.from_url(self.url, namespace=self.namespace, pending_ttl_s=self.pending_ttl_s)
            try:
                return Layer0Bridge(
                    buffer,
                    group,
                    rank,
                    block_size,
                    num_layers=num_layers,
                    ready=ready,
                    registers_tasks=True,
                    nranks=nranks,
                    logger=logger,
                )
            except BaseException:
                buffer.close()
                raise

        return FixtureMessager(io, bridge_for_messager)


def _execute_fixture(patched: bool = False) -> dict[str, Any]:
    paddle = types.ModuleType("paddle")
    paddle.full = lambda shape, fill_value, dtype: np.full(shape, fill_value, dtype=dtype)  # type: ignore[attr-defined]
    stubs: dict[str, Any] = {
        "paddle": paddle,
        "fastdeploy": types.ModuleType("fastdeploy"),
        "fastdeploy.cache_manager": types.ModuleType("fastdeploy.cache_manager"),
        "fastdeploy.cache_manager.ops": types.SimpleNamespace(get_output_kv_signal=None),
        "fastdeploy.inter_communicator": types.SimpleNamespace(EngineWorkerQueue=None),
        "fastdeploy.utils": types.SimpleNamespace(get_logger=lambda *_a: logging.getLogger("tp.fixture")),
    }
    namespace: dict[str, Any] = {"__name__": "fixture_cache_messager"}
    source = patch_source(FIXTURE.read_bytes()).patched if patched else FIXTURE.read_bytes()
    code = compile(source, str(FIXTURE), "exec")
    with _EXEC_LOCK:
        saved = {name: sys.modules.get(name) for name in stubs}
        sys.modules.update(stubs)
        try:
            exec(code, namespace)
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
    return namespace
