"""How the server's cost grows: per record entry as batches grow, per record call as the rank
buffers more signals elsewhere, per register as its slot holds more pending layers."""

from __future__ import annotations

import contextlib
from typing import Any

from ..buffer.sync import SignalBuffer
from ..models import CacheTask
from . import names
from .commandstats import server_time

INSTANCE = "scale"
RANK = 0
NUM_LAYERS = 61
CALLS = 50


def _buffer(url: str) -> contextlib.AbstractContextManager[SignalBuffer]:
    return names.scratch_buffer(url, names.namespace("scale"), INSTANCE, RANK)


def record_vs_elsewhere(
    url: str, elsewhere_layers: tuple[int, ...] = (0, 61), calls: int = CALLS
) -> list[dict[str, Any]]:
    """Server time of a 1-entry record on slot 0 while slots 1..511 hold ``layers`` signals each."""
    rows = []
    for layers in elsewhere_layers:
        with _buffer(url) as buf:
            for layer in range(layers):
                buf.record(INSTANCE, RANK, layer, [(slot, 1000) for slot in range(1, 512)])

            def run(buf: SignalBuffer = buf) -> None:
                for i in range(calls):
                    buf.record(INSTANCE, RANK, i % NUM_LAYERS, [(0, 1000)])

            usec = server_time(buf.client, run)
            rows.append({"buffered_elsewhere": 511 * layers, "server_us_per_call": usec})
    return rows


def record_into_full_slot(url: str, layers: int = NUM_LAYERS, calls: int = CALLS) -> dict[str, Any]:
    """Server time of a 1-entry record that supersedes a layer of a slot holding ``layers``.

    Each pending signal is its own field, written blind: the slot's other layers are not read
    or copied, so this should cost what a record onto a slot holding one layer costs.
    """
    with _buffer(url) as buf:
        for layer in range(layers):
            buf.record(INSTANCE, RANK, layer, [(0, 1000)])

        def run() -> None:
            for i in range(calls):
                buf.record(INSTANCE, RANK, i % layers, [(0, 1000)])

        usec = server_time(buf.client, run)
        return {"slot_layers": layers, "server_us_per_call": usec}


def record_per_entry(url: str, sizes: tuple[int, ...], calls: int = CALLS) -> list[dict[str, Any]]:
    """Server time per call and per entry of a buffering record, by batch size."""
    rows = []
    for size in sizes:
        with _buffer(url) as buf:
            entries = [(slot, 1000 + slot) for slot in range(size)]

            def run(buf: SignalBuffer = buf, entries: list[tuple[int, int]] = entries) -> None:
                for _ in range(calls):
                    buf.record(INSTANCE, RANK, 0, entries)

            usec = server_time(buf.client, run)
            rows.append({"entries": size, "server_us_per_call": usec, "server_us_per_entry": usec / size})
    return rows


def register_vs_pending(url: str, pending: tuple[int, ...], calls: int = CALLS) -> list[dict[str, Any]]:
    """Server time of register on slots that each hold ``n`` pending layers."""
    rows = []
    for layers in pending:
        with _buffer(url) as buf:
            for layer in range(layers):
                buf.record(INSTANCE, RANK, layer, [(slot, 1000) for slot in range(calls)])

            def run(buf: SignalBuffer = buf) -> None:
                for slot in range(calls):
                    buf.register(
                        CacheTask(INSTANCE, RANK, slot, f"r{slot}", need_prefill_tokens=4096, num_layers=NUM_LAYERS)
                    )

            usec = server_time(buf.client, run)
            rows.append({"pending_layers": layers, "server_us_per_call": usec})
    return rows
