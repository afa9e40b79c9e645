"""What a tensor-parallel group is fed: cache tasks, GPU forward steps, pauses, in one script.

Every rank of a group gets the same script, as every GPU of an instance runs the same forward
steps and every messager of it reads the same cache_infos; only each rank's own timing differs.
A ``Workload`` is a list of events the driver (``tp.run_group``) plays in order:

- ``Tasks``: the cache_infos of some requests, the prefill halves in one batch, then the decode
  halves in another (the adder registers a task when its second half comes);
- ``Step``: one forward step, one GPU message per layer, ``[(slot, offset, length), ...]``;
- ``Pause``: the driver waits, so what came before is usually handled first on every rank;
- ``AwaitFinished``: the driver waits until every rank reported these requests finished (the
  engine reuses a slot only then).

The seven named workloads cover what makes ranks race: a task registered before or after its
first signal, chunked prefill, several slots per message, an aborted request whose task never
comes, and a slot reused by the next request. ``random_workload`` makes longer ones for
``rls simulate --tp``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

BLOCK_SIZE = 64
"""Tokens per KV block in the cache_infos (FastDeploy's default)."""
MAX_SLOTS = 512
"""Engine slots of an instance: aborted requests stop taking spare slots there."""
PAUSE_S = 0.2
"""A pause long enough that every rank, jitter included, handled what came before."""
RACE_S = 0.02
"""A pause after a task's halves that lets the GPU's next message race the registration: the
adders take two barrier rounds of up to 20 ms jitter each to register it."""


@dataclass(frozen=True)
class Request:
    """One request on an engine slot; ``aborted`` ones never get a cache task."""

    request_id: str
    slot: int
    need: int
    chunk: int = 0
    """Chunk size of its prefill in tokens; 0: one chunk."""
    aborted: bool = False

    def chunks(self) -> list[tuple[int, int]]:
        """``(offset, length)`` of each chunk."""
        size = self.chunk or self.need
        return [(offset, min(size, self.need - offset)) for offset in range(0, self.need, size)]

    def prefill_half(self) -> dict[str, Any]:
        blocks = -(-self.need // BLOCK_SIZE)
        base = self.slot * 1000
        return {
            "request_id": self.request_id,
            "current_id": self.slot,
            "need_prefill_tokens": self.need,
            "src_block_ids": [base + i for i in range(blocks)],
        }

    def decode_half(self) -> dict[str, Any]:
        blocks = -(-self.need // BLOCK_SIZE)
        base = 100_000 + self.slot * 1000
        return {
            "request_id": self.request_id,
            "dest_block_ids": [base + i for i in range(blocks)],
            "transfer_protocol": "ipc",
            "ip": "0.0.0.0",
        }


@dataclass(frozen=True)
class Tasks:
    requests: tuple[Request, ...]


@dataclass(frozen=True)
class Step:
    entries: tuple[tuple[Request, int, int], ...]
    """``(request, offset, length)``: the chunk each slot of the step computes."""


@dataclass(frozen=True)
class Pause:
    seconds: float = PAUSE_S


@dataclass(frozen=True)
class AwaitFinished:
    requests: tuple[Request, ...]


Event = Tasks | Step | Pause | AwaitFinished


@dataclass(frozen=True)
class Workload:
    name: str
    events: tuple[Event, ...]
    requests: tuple[Request, ...] = field(default=())

    @property
    def expected(self) -> frozenset[str]:
        """The requests every rank must send: all but the aborted ones."""
        return frozenset(r.request_id for r in self.requests if not r.aborted)


def _workload(name: str, events: Sequence[Event]) -> Workload:
    seen: dict[str, Request] = {}
    for event in events:
        if isinstance(event, Tasks):
            seen.update((r.request_id, r) for r in event.requests)
        elif isinstance(event, Step):
            seen.update((r.request_id, r) for r, _o, _n in event.entries)
    return Workload(name, tuple(events), tuple(seen.values()))


def _step(*parts: tuple[Request, int]) -> Step:
    """A step over ``(request, chunk index)`` parts."""
    return Step(tuple((r, *r.chunks()[i]) for r, i in parts))


def early_registration() -> Workload:
    """Every task is registered well before the GPU's first signal: the easy case."""
    a, b, c = Request("a", 0, 128), Request("b", 1, 128), Request("c", 2, 256, chunk=128)
    return _workload("early_registration", [Tasks((a, b, c)), Pause(), _step((a, 0), (b, 0), (c, 0)), _step((c, 1))])


def late_registration() -> Workload:
    """Every signal is read well before its task: every layer-0 entry waits for its task."""
    a, b = Request("a", 0, 128), Request("b", 1, 192)
    return _workload("late_registration", [_step((a, 0), (b, 0)), Pause(), Tasks((a, b))])


def mixed_message() -> Workload:
    """One message for slots 5 and 6; slot 6 registered long before, slot 5's task races it."""
    r5, r6 = Request("r5", 5, 128), Request("r6", 6, 128)
    return _workload("mixed_message", [Tasks((r6,)), Pause(), Tasks((r5,)), Pause(RACE_S), _step((r5, 0), (r6, 0))])


def chunked_prefill() -> Workload:
    """A request prefilled in three chunks whose task races its first; a short one joins."""
    a, b = Request("a", 0, 384, chunk=128), Request("b", 1, 128)
    return _workload("chunked_prefill", [_step((a, 0)), Tasks((a,)), _step((a, 1), (b, 0)), Tasks((b,)), _step((a, 2))])


def several_slots() -> Workload:
    """Six slots in one message, half of them registering while it comes, half just after."""
    reqs = [Request(f"s{i}", i, 128 + 64 * (i % 2)) for i in range(6)]
    return _workload(
        "several_slots",
        [Tasks(tuple(reqs[:3])), Pause(RACE_S), _step(*((r, 0) for r in reqs)), Tasks(tuple(reqs[3:]))],
    )


def aborted_request() -> Workload:
    """An aborted request shares a message with two live ones; its task never comes."""
    live, gone, long = Request("live", 1, 128), Request("gone", 0, 128, aborted=True), Request("long", 2, 256, 128)
    return _workload(
        "aborted_request", [Tasks((long,)), _step((live, 0), (gone, 0), (long, 0)), Tasks((live,)), _step((long, 1))]
    )


def slot_reuse() -> Workload:
    """Slot 3 serves one request, then the next one, whose task races its first chunk."""
    first, second, other = Request("first", 3, 128), Request("second", 3, 256, 128), Request("other", 4, 128)
    return _workload(
        "slot_reuse",
        [
            Tasks((first,)),
            Pause(),
            _step((first, 0)),
            AwaitFinished((first,)),
            _step((second, 0), (other, 0)),
            Tasks((second, other)),
            _step((second, 1)),
        ],
    )


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "early_registration": early_registration,
    "late_registration": late_registration,
    "mixed_message": mixed_message,
    "chunked_prefill": chunked_prefill,
    "several_slots": several_slots,
    "aborted_request": aborted_request,
    "slot_reuse": slot_reuse,
}
"""The seven workloads, by name."""


def random_workload(
    seed: int,
    requests: int,
    slots: int,
    chunk_tokens: int,
    max_prompt_tokens: int,
    early_share: float,
    abort_share: float,
    prefix: str = "req",
) -> Workload:
    """``requests`` requests in waves of ``slots``: each wave's tasks, its steps (one per chunk
    index, every request of the wave that still has a chunk in it), the tasks of the wave's
    ``early_share`` right after its first step (their signals come first), then a wait until
    the wave finished, so the next wave reuses the slots. Aborted requests (``abort_share``)
    take a slot of their own that is never reused and never get a task."""
    rng = random.Random(seed)
    events: list[Event] = []
    spare = slots
    for start in range(0, requests, slots):
        wave: list[Request] = []
        for index in range(start, min(start + slots, requests)):
            aborted = rng.random() < abort_share and spare < MAX_SLOTS
            slot = index - start
            if aborted:
                slot, spare = spare, spare + 1
            need = rng.randint(1, max_prompt_tokens)
            wave.append(Request(f"{prefix}-{index}", slot, need, chunk_tokens, aborted))
        live = [r for r in wave if not r.aborted]
        early = [r for r in live if rng.random() < early_share]
        if ahead := tuple(r for r in live if r not in early):
            events.append(Tasks(ahead))
        for chunk in range(max(len(r.chunks()) for r in wave)):
            events.append(Step(tuple((r, *r.chunks()[chunk]) for r in wave if chunk < len(r.chunks()))))
            if chunk == 0 and early:
                events.append(Tasks(tuple(early)))
        if live:
            events.append(AwaitFinished(tuple(live)))
    return _workload(f"random-{seed}", events)
