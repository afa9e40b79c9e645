"""The senders of one rank: each delivered or recovered signal sends that layer's new blocks
to the decode side; a request whose every layer of every chunk went out is finished.

A delivered signal reports one chunk, ``[chunk start, tokens)``. A recovered signal is the
newest of the signals that waited, and nothing of its request was sent before it registered,
so it sends ``[0, tokens)``. A signal handed over twice therefore sends a chunk twice, and
one that vanished leaves a chunk unsent: the checks count both.
"""

from __future__ import annotations

import time

from ..models import CacheTask, LayerSignal
from .channels import Message
from .config import Mode
from .rank import RankContext, cache_task
from .workload import Request

POLL_S = 0.02


class Sender:
    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.requests: dict[str, Request] = {r.request_id: r for r in ctx.requests}
        self.chunk_tokens = ctx.config.chunk_tokens
        self.chunks = {r.request_id: r.chunks(self.chunk_tokens) for r in ctx.requests}
        self.tasks: dict[int, CacheTask] = {}
        self.parked: dict[int, list[LayerSignal]] = {}
        self.sent: dict[tuple[str, int, int], int] = {}  # (request, layer, chunk) -> times sent
        self.remaining = {rid: ctx.config.layers * len(chunks) for rid, chunks in self.chunks.items()}
        self.prefilled: dict[str, float] = {}
        self.resolved: dict[str, str] = {}  # request -> completed | hung | aborted

    def run(self) -> None:
        ctx = self.ctx
        while len(self.resolved) < len(self.requests) and not ctx.expired():
            message = ctx.inbox.get(POLL_S)
            if message is not None:
                self.handle(message)
            self.check_hangs()

    def handle(self, message: Message) -> None:
        kind = message["kind"]
        if kind == "delivered":
            for signal in message["signals"]:
                self.delivered(signal)
        elif kind == "registered":
            self.registered(message)
        elif kind == "prefill_done":
            self.prefill_done(message["request_id"], float(message["at"]))

    # -- signals ----------------------------------------------------------------------------

    def delivered(self, signal: LayerSignal) -> None:
        task = self.tasks.get(signal.slot)
        if task is None:
            # Redis said the slot is live, but the registration notice is still on its way.
            self.parked.setdefault(signal.slot, []).append(signal)
            return
        request = self.requests[task.request_id]
        if not self.ends_a_chunk(request, signal.tokens):
            self.ctx.violation(
                f"signal slot {signal.slot} layer {signal.layer} tokens {signal.tokens} "
                f"sent for {task.request_id}, which has no chunk ending there"
            )
            return
        start = ((signal.tokens - 1) // self.chunk_tokens) * self.chunk_tokens
        self.send(request, signal.layer, start, signal.tokens)

    def registered(self, message: Message) -> None:
        ctx = self.ctx
        task = cache_task(message["task"])
        if message.get("error"):
            ctx.violation(f"register {task.request_id}: {message['error']}")
        request = self.requests.get(task.request_id)
        if request is None:
            ctx.violation(f"registration of {task.request_id}, a request this rank never had")
            return
        if task.request_id in self.resolved:
            ctx.violation(f"registration of {task.request_id} arrived after it was {self.resolved[task.request_id]}")
            return
        ctx.handoff.learn(task)
        self.tasks[task.slot] = task
        with ctx.lock:
            ctx.registered.add(task.request_id)
        ctx.wakeup.set()
        ctx.count("recovered", len(message["recovered"]))
        for layer, tokens in message["recovered"]:
            if not self.ends_a_chunk(request, tokens):
                ctx.violation(f"recovered layer {layer} tokens {tokens} does not belong to {task.request_id}")
                continue
            self.send(request, int(layer), 0, int(tokens))
        for _layer, _tokens, reason in message["dropped"]:
            ctx.count(f"dropped_{reason}")
        for signal in self.parked.pop(task.slot, []):
            self.delivered(signal)

    def ends_a_chunk(self, request: Request, tokens: int) -> bool:
        return any(end == tokens for _start, end in self.chunks[request.request_id])

    def send(self, request: Request, layer: int, start: int, end: int) -> None:
        """'Send' the layer's blocks for tokens [start, end): count each chunk it carries."""
        rid = request.request_id
        if rid in self.resolved:
            self.ctx.violation(f"{rid} layer {layer} sent after the request was {self.resolved[rid]}")
        for index, (chunk_start, chunk_end) in enumerate(self.chunks[rid]):
            if start <= chunk_start and chunk_end <= end:
                key = (rid, layer, index)
                self.sent[key] = self.sent.get(key, 0) + 1
                if self.sent[key] == 1:
                    self.remaining[rid] -= 1
        if self.remaining[rid] == 0 and rid not in self.resolved:
            self.complete(request)

    # -- ends of a request ------------------------------------------------------------------

    def complete(self, request: Request) -> None:
        slot = self.ctx.slots[request.request_id]
        result = self.ctx.handoff.finish(self.ctx.instance, self.ctx.rank, slot, request.request_id)
        if not result.removed or result.fenced or result.dropped:
            self.ctx.violation(f"finish {request.request_id}: {result}")
        self.resolve(request.request_id, "completed", slot)

    def prefill_done(self, rid: str, at: float) -> None:
        request = self.requests[rid]
        if rid in self.resolved:
            return
        self.prefilled[rid] = at
        if request.abort:
            slot = self.ctx.slots[rid]
            result = self.ctx.handoff.finish(self.ctx.instance, self.ctx.rank, slot, rid)
            # Every layer of an aborted request waited (newest per layer): all must go now.
            want = 0 if self.ctx.config.mode is Mode.DROP else self.ctx.config.layers
            if result.removed or result.fenced or result.dropped != want:
                self.ctx.violation(f"abort of {rid}: {result}, expected {want} pending signals dropped")
            self.ctx.count("finish_dropped", result.dropped)
            self.resolve(rid, "aborted", slot)

    def check_hangs(self) -> None:
        now = time.monotonic()
        for rid, at in list(self.prefilled.items()):
            if rid in self.resolved or now - at < self.ctx.config.hang_timeout_s:
                continue
            # The decode side gives up: clean the slot so the rank goes on, and count the hang.
            slot = self.ctx.slots[rid]
            result = self.ctx.handoff.finish(self.ctx.instance, self.ctx.rank, slot, rid)
            self.ctx.count("finish_dropped", result.dropped)
            self.resolve(rid, "hung", slot)

    def resolve(self, rid: str, how: str, slot: int) -> None:
        self.resolved[rid] = how
        self.ctx.count(how)
        if self.tasks.get(slot) is not None and self.tasks[slot].request_id == rid:
            del self.tasks[slot]
        self.ctx.free.put(slot)
        self.ctx.wakeup.set()
        self.ctx.progress(1)

    # -- what the checks read ---------------------------------------------------------------

    def lost_and_duplicates(self) -> tuple[int, int, list[str]]:
        lost = duplicates = 0
        notes = []
        for request in self.requests.values():
            if request.abort:
                continue
            missing = self.remaining[request.request_id]
            if missing:
                lost += missing
                notes.append(f"{request.request_id}: {missing} layer-chunks never sent")
        for (rid, layer, index), times in self.sent.items():
            if times > 1:
                duplicates += times - 1
                notes.append(f"{rid} layer {layer} chunk {index} sent {times} times")
        return lost, duplicates, notes
