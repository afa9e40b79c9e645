"""Tensor-parallel groups for the tests: the ranks of one instance as bridges of this process
(``Group``, threads) or as processes of their own (``RankProcess``, see ``tests/tp_rank.py``),
and the GPU stream they share (``workload``).

A group's ranks queue what the group released from a thread of the bridge's, after the hook
returned: a sender thread per rank collects each rank's queue here, in order."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis_layer_signals import SignalBuffer
from redis_layer_signals.fastdeploy import Layer0Bridge
from redis_layer_signals.fastdeploy.health import BridgeHealth
from redis_layer_signals.fastdeploy.signals import encode_kv_signal
from tests.servers import wait_until

Entry = tuple[int, int]
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Workload:
    """The GPU's layer-0 messages (every rank reads them, in order) and the tasks the adders
    register; ``aborted`` slots never register."""

    messages: list[list[Entry]]
    tasks: list[tuple[int, str, int]]  # (slot, request id, need_prefill_tokens)
    aborted: set[int]

    @property
    def stream(self) -> list[Entry]:
        return [entry for message in self.messages for entry in message]

    @property
    def need(self) -> dict[int, tuple[str, int]]:
        """slot -> (request id, its last chunk's tokens)."""
        return {slot: (request_id, tokens) for slot, request_id, tokens in self.tasks}


def workload(seed: int, requests: int = 12, aborted: int = 0) -> Workload:
    """``requests`` requests of 1 to 3 chunks each on slots of their own, interleaved at random,
    cut into messages of 1 to 4 entries; ``aborted`` more whose tasks never come."""
    rng = random.Random(seed)
    chunks = {slot: [rng.randint(1, 300) for _ in range(rng.randint(1, 3))] for slot in range(requests + aborted)}
    order = [slot for slot, sizes in chunks.items() for _ in sizes]
    rng.shuffle(order)
    emitted = dict.fromkeys(chunks, 0)
    prefilled = dict.fromkeys(chunks, 0)
    stream = []
    for slot in order:
        prefilled[slot] += chunks[slot][emitted[slot]]
        emitted[slot] += 1
        stream.append((slot, prefilled[slot]))
    messages = []
    while stream:
        size = rng.randint(1, 4)
        messages.append(stream[:size])
        stream = stream[size:]
    tasks = [(slot, f"req-{seed}-{slot}", prefilled[slot]) for slot in range(requests)]
    rng.shuffle(tasks)
    return Workload(messages, tasks, set(range(requests, requests + aborted)))


def cache_info(slot: int, request_id: str, need: int) -> dict[str, Any]:
    return {"request_id": request_id, "current_id": slot, "need_prefill_tokens": need}


def signal(entries: Sequence[Entry]) -> Any:
    """A layer-0 message as FastDeploy's GPU sends it."""
    return encode_kv_signal(0, [(slot, 0, tokens) for slot, tokens in entries])


def check_agreement(queued: Sequence[Sequence[list[Entry]]], stream: Sequence[Entry]) -> None:
    """What every group must hold, whatever happened: every rank queued the same batches in the
    same order (one entry each), none of them twice, and each slot's chunks in the GPU's order."""
    first = [list(batch) for batch in queued[0]]
    for rank, batches in enumerate(queued):
        assert [list(batch) for batch in batches] == first, f"rank {rank} queued another sequence than rank 0"
    entries = [batch[0] for batch in first]
    assert all(len(batch) == 1 for batch in first), first
    assert len(set(entries)) == len(entries), f"queued twice: {entries}"
    position = {entry: i for i, entry in enumerate(stream)}
    assert all(entry in position for entry in entries), f"queued what the GPU never sent: {entries}"
    by_slot: dict[int, list[int]] = {}
    for entry in entries:
        by_slot.setdefault(entry[0], []).append(position[entry])
    for slot, positions in by_slot.items():
        assert positions == sorted(positions), f"slot {slot}: chunks queued out of the GPU's order"


class Group:
    """``nranks`` bridges of one instance, one buffer each, as one process per GPU has, each with
    a sender thread that takes its queue's batches (and finishes a request once its last chunk
    is taken, when told the requests with ``finishing``). ``nranks_of`` gives ranks another
    ``nranks`` than the group's (a misconfigured rank); ``ranks`` builds only those ranks (in
    that order: ``bridges[i]`` is ``ranks[i]``)."""

    def __init__(
        self,
        url: str,
        namespace: str,
        nranks: int,
        *,
        instance: str = "p0",
        nranks_of: Mapping[int, int] | None = None,
        urls: Mapping[int, str] | None = None,
        ranks: Sequence[int] | None = None,
        **options: Any,
    ) -> None:
        self.ranks = list(range(nranks) if ranks is None else ranks)
        self.buffers = [
            SignalBuffer.from_url((urls or {}).get(rank, url), namespace=namespace, env={}, **options)
            for rank in self.ranks
        ]
        self.ready: list[queue.Queue[list[Entry]]] = [queue.Queue() for _ in self.ranks]
        self.bridges = [
            Layer0Bridge(
                buffer,
                instance,
                rank,
                num_layers=4,
                ready=ready,
                nranks=(nranks_of or {}).get(rank, nranks),
                probe_s=0.05,
            )
            for rank, buffer, ready in zip(self.ranks, self.buffers, self.ready, strict=True)
        ]
        self.queued: list[list[list[Entry]]] = [[] for _ in self.ranks]
        self.finishing: dict[int, tuple[str, int]] = {}
        """slot -> (request id, last chunk's tokens): the sender finishes the request once taken."""
        self._stop = threading.Event()
        self._senders = [threading.Thread(target=self._send, args=(i,), daemon=True) for i in range(len(self.ranks))]
        for thread in self._senders:
            thread.start()

    def _send(self, i: int) -> None:
        while not self._stop.is_set():
            try:
                batch = self.ready[i].get(timeout=0.05)
            except queue.Empty:
                continue
            self.queued[i].append(batch)
            for slot, tokens in batch:
                request_id, last = self.finishing.get(slot, ("", -1))
                if tokens == last:
                    self.bridges[i].on_task_finished(slot, request_id)

    def health(self) -> list[BridgeHealth]:
        return [bridge.health() for bridge in self.bridges]

    def wait(self, predicate: Callable[[], object], what: str, timeout: float = 30.0) -> None:
        wait_until(predicate, timeout, what=what)

    def wait_joined(self, timeout: float = 30.0) -> None:
        """Every rank joined a generation of its group's sequencer."""
        self.wait(lambda: all(h.group_generation > 0 for h in self.health()), "every rank to join", timeout)

    def wait_queued(self, count: int, timeout: float = 30.0) -> None:
        self.wait(lambda: all(len(q) >= count for q in self.queued), f"every rank to queue {count} batches", timeout)

    def run(self, work: Workload, timeout_s: float = 60.0, seed: int = 0) -> None:
        """Each rank's consumer reads the GPU's messages and its adder registers the tasks, each
        in an order and at a pace of its own (no lockstep between the ranks' adders); returns
        once both are done on every rank. The senders go on."""
        self.finishing.update(work.need)
        failures: list[BaseException] = []

        def consumer(rank: int) -> None:
            rng = random.Random(seed * 100 + rank)
            for message in work.messages:
                time.sleep(rng.random() * 0.003)
                self.bridges[rank].on_kv_signal(signal(message))

        def adder(rank: int) -> None:
            rng = random.Random(seed * 100 + 50 + rank)
            tasks = list(work.tasks)
            rng.shuffle(tasks)
            for slot, request_id, tokens in tasks:
                time.sleep(rng.random() * 0.005)
                self.bridges[rank].on_cache_task(cache_info(slot, request_id, tokens))

        def guarded(target: Callable[[int], None], rank: int) -> None:
            try:
                target(rank)
            except BaseException as exc:
                failures.append(exc)

        threads = [
            threading.Thread(target=guarded, args=(target, rank))
            for rank in range(len(self.bridges))
            for target in (consumer, adder)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s)
        assert not failures, failures

    def close(self) -> None:
        """Close every bridge, each from a thread of its own: one whose lock is held for good (a
        test found a bug) is left behind rather than hanging the test run."""
        self._stop.set()
        for thread in self._senders:
            thread.join(5)
        closing = [threading.Thread(target=bridge.close, daemon=True) for bridge in self.bridges]
        for thread in closing:
            thread.start()
        for thread in closing:
            thread.join(20)
        if not any(thread.is_alive() for thread in closing):
            for buffer in self.buffers:
                buffer.close()


class RankProcess:
    """One rank in a process of its own (``tests/tp_rank.py``): commands go to its stdin, what
    its queue got is collected in ``queued``; it logs to ``log_path``."""

    def __init__(
        self,
        url: str,
        namespace: str,
        rank: int,
        nranks: int,
        log_path: Path,
        *,
        pending_ttl_s: float = 60.0,
        instance: str = "p0",
    ) -> None:
        self.rank = rank
        self.log_path = log_path
        environment = {k: v for k, v in os.environ.items() if k != "RLS_REDIS_URL"}
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH", "")]))
        command = [sys.executable, "-m", "tests.tp_rank", "--url", url, "--namespace", namespace]
        command += ["--instance", instance, "--rank", str(rank), "--nranks", str(nranks)]
        command += ["--pending-ttl-s", str(pending_ttl_s)]
        with open(log_path, "a") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=ROOT, env=environment, text=True
            )
        self.pid = self.process.pid
        self.queued: list[list[Entry]] = []
        self._replies: dict[int, dict[str, Any]] = {}
        self._started = threading.Event()
        self._asked = 0
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            with self._changed:
                if message["ev"] == "queued":
                    self.queued.append([(slot, tokens) for slot, tokens in message["batch"]])
                elif message["ev"] == "health":
                    self._replies[message["id"]] = message
                elif message["ev"] == "started":
                    self._started.set()
                self._changed.notify_all()

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def signal(self, entries: Sequence[Entry]) -> None:
        self.send(op="signal", entries=[list(entry) for entry in entries])

    def task(self, slot: int, request_id: str, need: int) -> None:
        self.send(op="task", slot=slot, request_id=request_id, need=need)

    def finish(self, slot: int, request_id: str) -> None:
        self.send(op="finish", slot=slot, request_id=request_id)

    def health(self, timeout: float = 20.0) -> dict[str, Any]:
        """The bridge's health, asked after every command sent before (they ran by then)."""
        with self._changed:
            self._asked += 1
            asked = self._asked
        self.send(op="health", id=asked)
        deadline = time.monotonic() + timeout
        with self._changed:
            while asked not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    raise TimeoutError(f"rank {self.rank} (pid {self.pid}) did not answer: {self.log()[-2000:]}")
                self._changed.wait(left)
            return self._replies.pop(asked)

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        """SIGKILL: no close, no cleanup; the kernel frees its locks and closes its sockets."""
        self.process.kill()
        self.process.wait(10)
        self._reader.join(5)

    def close(self) -> None:
        """End of stdin: the bridge closes; killed if it does not exit in time."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                assert self.process.stdin is not None
                self.process.stdin.close()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._reader.join(5)
