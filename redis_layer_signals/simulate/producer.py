"""The simulated GPU of one rank: chunked prefill of a batch of slots, one batched signal per
layer per forward step, as FastDeploy's kernels emit ``[(slot, chunk_offset + seq_len), ...]``."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from .rank import RankContext
from .workload import Request


@dataclass
class Running:
    request: Request
    slot: int
    chunks: list[tuple[int, int]]
    next_chunk: int = 0
    announced: bool = False  # its task was handed to the registrar


def produce(ctx: RankContext) -> None:
    config = ctx.config
    waiting = deque(ctx.requests)
    running: dict[int, Running] = {}
    while (waiting or running) and not ctx.expired():
        while waiting and not ctx.free.empty():
            request = waiting.popleft()
            slot = ctx.free.get_nowait()
            with ctx.lock:
                ctx.slots[request.request_id] = slot
            item = Running(request, slot, request.chunks(config.chunk_tokens))
            running[slot] = item
            if not request.early and not request.abort:
                # The usual order: the task is known before the GPU starts on the request.
                ctx.registrar.put(ctx.task_message(request, slot, 0.0))
                item.announced = True
        with ctx.lock:
            ready = [
                r
                for r in running.values()
                if r.request.early or r.request.abort or r.request.request_id in ctx.registered
            ]
        if not ready:
            ctx.wakeup.wait(0.05)
            ctx.wakeup.clear()
            continue
        step(ctx, ready)
        for item in ready:
            item.next_chunk += 1
            if item.next_chunk == len(item.chunks):
                del running[item.slot]
                ctx.inbox.put({"kind": "prefill_done", "request_id": item.request.request_id, "at": time.monotonic()})


def step(ctx: RankContext, batch: list[Running]) -> None:
    """One forward step: every layer of the batch's current chunks, one record call per layer."""
    entries = [(item.slot, item.chunks[item.next_chunk][1]) for item in batch]
    for layer in range(ctx.config.layers):
        started = time.perf_counter()
        result = ctx.handoff.record(ctx.instance, ctx.rank, layer, entries)
        ctx.record_ms.append((time.perf_counter() - started) * 1000)
        ctx.count("signals", len(entries))
        ctx.count("delivered", len(result.delivered))
        ctx.count("buffered", len(result.buffered))
        if result.delivered:
            ctx.inbox.put({"kind": "delivered", "signals": result.delivered})
        if layer == 0:
            for item in batch:
                if item.request.early and not item.announced:
                    # The race of the seed: the task reaches the registrar after this signal.
                    ctx.registrar.put(ctx.task_message(item.request, item.slot, item.request.delay_ms))
                    item.announced = True
                    ctx.count("late_tasks")
