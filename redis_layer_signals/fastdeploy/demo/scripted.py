"""The stand-ins around the reference messager: requests, a scripted GPU and a recording transport.

The GPU fills a real paddle ``int32`` tensor per layer and per forward step, exactly as the
engine's signal op fills ``kv_signal_data``, and remembers which KV blocks it has written, so the
transport can tell a write of a block that was not computed yet from a correct one.
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidSignal
from ...extras import install_hint
from ..bridge import DEFAULT_BLOCK_SIZE
from ..signals import KV_SIGNAL_MAX_TASKS, encode_kv_signal

DEST_BLOCK_BASE = 100_000
"""Decode-side block ids start here, so a write's source and destination never look alike."""


def load_paddle() -> Any:
    """Import paddle on first use (about a second), so numpy-only users never pay for it."""
    with warnings.catch_warnings():
        # The CPU wheel warns about a missing C++ compiler cache it never uses here.
        warnings.filterwarnings("ignore", message=".*ccache.*")
        try:
            import paddle
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(
                f"the scripted GPU (simulate --chaos-outage) needs paddle: {install_hint('paddle')}",
                name="paddle",
            ) from error

    return paddle


@dataclass(frozen=True)
class PrefillRequest:
    """One request as the prefill and decode halves of FastDeploy's ``cache_info`` describe it."""

    request_id: str
    slot: int
    need_prefill_tokens: int
    block_size: int = DEFAULT_BLOCK_SIZE
    decode_cached_blocks: int = 0
    """Blocks the decode node already holds (prefix cache hit): never sent."""
    block_base: int | None = None
    """First source block id; defaults to ``slot * 1000``. Give two requests that share a
    slot different bases so each block id names one request's block."""

    @property
    def num_blocks(self) -> int:
        return -(-self.need_prefill_tokens // self.block_size)

    @property
    def src_block_ids(self) -> list[int]:
        base = self.slot * 1000 if self.block_base is None else self.block_base
        return [base + i for i in range(self.num_blocks)]

    @property
    def dest_block_ids(self) -> list[int]:
        """Blocks the decode node allocated, all but its cached prefix: source id plus
        ``DEST_BLOCK_BASE``, so a write's pairs can be checked."""
        return [DEST_BLOCK_BASE + block for block in self.src_block_ids[self.decode_cached_blocks :]]

    def prefill_half(self) -> dict[str, Any]:
        """What the prefill engine sends to its cache messager."""
        return {
            "request_id": self.request_id,
            "current_id": self.slot,
            "need_prefill_tokens": self.need_prefill_tokens,
            "src_block_ids": self.src_block_ids,
        }

    def decode_half(self) -> dict[str, Any]:
        """What the decode instance sends back: where to write."""
        return {
            "request_id": self.request_id,
            "dest_block_ids": self.dest_block_ids,
            "transfer_protocol": "ipc",
            "ip": "0.0.0.0",
        }

    def chunks(self, chunk_tokens: int) -> list[tuple[int, int]]:
        """``(chunk_token_offset, current_seq_len)`` of each chunk of a chunked prefill."""
        return [
            (offset, min(chunk_tokens, self.need_prefill_tokens - offset))
            for offset in range(0, self.need_prefill_tokens, chunk_tokens)
        ]


@dataclass(frozen=True)
class Write:
    """One ``write_cache`` call as the transport saw it."""

    slot: int
    layer: int
    src_blocks: tuple[int, ...]
    dest_blocks: tuple[int, ...]


class ScriptedGpu:
    """Runs forward steps on demand and emits one signal tensor per layer into ``signals``."""

    def __init__(self, signals: queue.Queue[Any], num_layers: int) -> None:
        self.signals = signals
        self.num_layers = num_layers
        self._lock = threading.Lock()
        self._filled: dict[tuple[int, int], int] = {}  # (layer, src block) -> tokens written
        self._capacity: dict[int, int] = {}  # src block -> tokens it holds when complete
        self.paddle = load_paddle()

    def forward(self, step: Sequence[tuple[PrefillRequest, int, int]], layers: Iterable[int] | None = None) -> None:
        """One forward step over ``(request, chunk_token_offset, current_seq_len)`` entries.

        ``layers`` runs only part of the step (the rest in a later call), to hold the GPU
        between two layers.
        """
        if not 0 < len(step) <= KV_SIGNAL_MAX_TASKS:
            raise InvalidSignal("step", len(step), f"a forward step carries 1..{KV_SIGNAL_MAX_TASKS} entries")
        for layer in range(self.num_layers) if layers is None else layers:
            with self._lock:
                for request, offset, length in step:
                    self._compute(request, layer, offset, length)
            self.signals.put(self.signal_tensor(layer, [(r.slot, o, n) for r, o, n in step]))

    def prefill(self, request: PrefillRequest, chunk_tokens: int | None = None) -> None:
        """Every chunk of one request, one forward step each."""
        for offset, length in request.chunks(chunk_tokens or request.need_prefill_tokens):
            self.forward([(request, offset, length)])

    def signal_tensor(self, layer: int, entries: Sequence[tuple[int, int, int]]) -> Any:
        """A CPU paddle tensor laid out like ``kv_signal_data`` (unused tail left at -1)."""
        values = encode_kv_signal(layer, entries)
        return self.paddle.to_tensor(values, dtype="int32", place=self.paddle.CPUPlace())

    def complete(self, layer: int, src_block: int) -> bool:
        """Is every token of this block written at this layer?"""
        with self._lock:
            capacity = self._capacity.get(src_block)
            return capacity is not None and self._filled.get((layer, src_block), 0) == capacity

    def _compute(self, request: PrefillRequest, layer: int, offset: int, length: int) -> None:
        size = request.block_size
        blocks = request.src_block_ids
        for index, block in enumerate(blocks):
            self._capacity[block] = min(size, request.need_prefill_tokens - index * size)
        for position in range(offset // size, -(-(offset + length) // size)):
            start, stop = max(offset, position * size), min(offset + length, (position + 1) * size)
            key = (layer, blocks[position])
            self._filled[key] = self._filled.get(key, 0) + stop - start


class RecordingTransport:
    """A fake RDMA/IPC transport: records every ``write_cache`` call and checks it against the
    GPU, so a block sent before the GPU finished it shows up in ``premature``."""

    def __init__(self, gpu: ScriptedGpu | None = None) -> None:
        self.gpu = gpu
        self._lock = threading.Lock()
        self.writes: list[Write] = []
        self.premature: list[tuple[int, int]] = []  # (layer, src block)

    def write_cache(self, slot: int, layer: int, src_blocks: Sequence[int], dest_blocks: Sequence[int]) -> int:
        """Returns 0 like FastDeploy's messagers do on success."""
        write = Write(slot, layer, tuple(src_blocks), tuple(dest_blocks))
        with self._lock:
            self.writes.append(write)
            if self.gpu is not None:
                self.premature.extend((layer, b) for b in write.src_blocks if not self.gpu.complete(layer, b))
        return 0

    def for_slot(self, slot: int) -> list[Write]:
        with self._lock:
            return [w for w in self.writes if w.slot == slot]

    def block_writes(self) -> dict[tuple[int, int, int], int]:
        """How many times each ``(slot, layer, src block)`` was written."""
        counts: dict[tuple[int, int, int], int] = {}
        with self._lock:
            for write in self.writes:
                for block in write.src_blocks:
                    key = (write.slot, write.layer, block)
                    counts[key] = counts.get(key, 0) + 1
        return counts
