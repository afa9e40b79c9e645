"""The synchronous buffer: validation and packing come from ``protocol``, this module only
runs the calls on a redis-py client, with bounded retries and reloading of the Functions library."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from functools import partial, wraps
from typing import Any, TypeVar

from ..errors import FAILURES, BufferUnavailable, raise_ours
from ..models import CacheTask, FinishResult, LayerSignal, RecordResult, RegisterResult
from ..protocol.calls import Applied, Prepared, ScriptCall
from ..protocol.counters import sum_stats
from ..protocol.keys import PENDING_LAYERS
from ..protocol.replies import decode_task, parse_pending, pending_layers, slot_signal_fields, task_fields
from ..server import checks
from ..server.checks import ServerChecks
from ..server.durability import ServerPolicies
from ..transport import connection, deadline, senders
from ..transport.retry import RETRYABLE, Attempts, cut_by_deadline
from .base import BufferBase
from .owed import OwedFinish

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def whole_call(method: F) -> F:
    """Bound a read of a few round trips (``pending``, ``task``) by one deadline, ``retry_s``
    from its start, like a single call (see ``deadline``). Reads whose round trips grow
    with the namespace (``ranks``, ``sweep``, ``stats``) bound each round trip instead."""

    @wraps(method)
    def bounded(self: SignalBuffer, *args: Any, **kwargs: Any) -> Any:
        previous = deadline.bounded(time.monotonic() + self.config.retry_s)
        try:
            return method(self, *args, **kwargs)
        finally:
            deadline.release(previous)

    return bounded  # type: ignore[return-value]


class SignalBuffer(BufferBase):
    """Early layer signals in Redis, shared by every process that uses the same namespace.

    ``record`` delivers a signal whose slot has a live task and buffers the others;
    ``register`` makes a task live and pops its slot's early signals; ``finish`` releases the
    slot, fenced by request id. Each is one Lua function call, atomic on the server.
    """

    @staticmethod
    def make_client(url: str, retry_s: float) -> Any:
        return connection.sync_client(url, retry_s)

    @staticmethod
    def sender_for(client: Any, checks: ServerChecks, wait_replicas: int, wait_timeout_ms: int) -> senders.Sender:
        return senders.sender_for(client, checks, wait_replicas, wait_timeout_ms)

    # -- the three operations --------------------------------------------------------------

    def record(
        self, instance: str, rank: int, layer: int, entries: Iterable[Any], at_ms: int | None = None
    ) -> RecordResult:
        """Deliver or buffer one layer's batch of ``(slot, tokens[, request_id])`` entries.

        Raises ``InvalidSignal`` naming the field and value, with nothing sent, unless ``layer``
        is below ``max_layers``, each slot below ``max_slots`` and each ``tokens`` in
        ``[0, 2**53)``. A 0-token entry is kept, as FastDeploy's own fix keeps it: ``register``
        drops it as ``non_positive`` (counted), and one such entry never costs its batch.

        ``at_ms`` (all three operations): decide as of that time, on the server's clock, instead
        of now: a replay keeps the time of the decision it replays (a signal keeps the time it
        was first recorded, so one that expired stays expired)."""
        return self._execute(self.protocol.record(instance, rank, layer, entries, at_ms))

    def register(self, task: CacheTask, replace: bool = False, at_ms: int | None = None) -> RegisterResult:
        """Make ``task`` the holder of its slot and return the slot's early signals."""
        return self._execute(self.protocol.register(task, replace, at_ms))

    def finish(self, instance: str, rank: int, slot: int, request_id: str, at_ms: int | None = None) -> FinishResult:
        """Release the slot of ``request_id``; a no-op (``fenced``) if another request holds it.

        One that raises ``BufferUnavailable`` is owed: sent again before the next call on the
        rank (see ``owed``), unless its rank owes ``max_slots`` finishes already: then it
        raises ``OwedFinishesFull``, and sending it again is the caller's."""
        prepared = self.protocol.finish(instance, rank, slot, request_id, at_ms)
        try:
            return self._execute(prepared)
        except BufferUnavailable as exc:
            # Sent again before the next call on the rank; OwedFinishesFull instead when full.
            self.owed.owe(OwedFinish(prepared, slot, request_id), exc)
            raise

    def apply(self, prepared: Prepared[Applied]) -> Applied:
        """Run a prepared ``apply`` (the FastDeploy bridge's writer); resent with the same
        token within ``retry_s``."""
        return self._execute(prepared)

    def execute(self, prepared: Prepared[T]) -> T:
        """Run a call the FastDeploy bridge prepared (its identity claim), with the retries,
        library loading and checks of every call; each is idempotent, so a resend within
        ``retry_s`` is safe."""
        return self._execute(prepared)

    # -- reads -----------------------------------------------------------------------------

    @whole_call
    def pending(self, instance: str, rank: int, slot: int) -> list[LayerSignal]:
        """The slot's buffered signals, ordered by layer (read-only)."""
        keys = self.protocol.slot_keys(instance, rank, slot)
        # Two reads: the rank's layers, then the slot's field for each (a view, not a snapshot).
        stored = self._retrying("pending", lambda: self.client.hget(keys.pending, PENDING_LAYERS), "hget")
        layers = pending_layers(stored)
        if not layers:
            return []
        fields = slot_signal_fields(slot, layers)
        values = self._retrying("pending", lambda: self.client.hmget(keys.pending, fields), "hmget")
        return parse_pending(instance, rank, slot, layers, values)

    @whole_call
    def task(self, instance: str, rank: int, slot: int) -> CacheTask | None:
        """The slot's live task, or None (read-only)."""
        keys = self.protocol.slot_keys(instance, rank, slot)
        # One read of the lease and the document; decode_task checks that they agree.
        fields = task_fields(slot)
        holder, document = self._retrying("task", lambda: self.client.hmget(keys.live, fields), "hmget")
        return decode_task(instance, rank, slot, holder, document, self.now_ms())

    def now_ms(self) -> int:
        """The time the scripts use: the injected clock, else the server's."""
        if self.protocol.clock is not None:
            return int(self.protocol.clock())
        seconds, micros = self._retrying("time", self.client.time, "time")
        return int(seconds) * 1000 + int(micros) // 1000

    def ranks(self, kind: str = "stats") -> list[tuple[str, int]]:
        """Every (instance, rank) with a ``kind`` key in this namespace (SCAN, never KEYS).

        Every rank that ever recorded has a ``stats`` key, so the default finds them all without
        walking the short-lived reply keys; ``kind="*"`` walks every key of the namespace.
        """
        found = set()
        pattern = self.protocol.keys.pattern(kind)
        for key in self._retrying("scan", lambda: list(self.client.scan_iter(match=pattern, count=1000)), "scan"):
            owner = self.protocol.keys.owner(key)
            if owner is not None:
                found.add(owner)
        return sorted(found)

    def sweep(self) -> int:
        """Count and remove expired pending signals on every rank of the namespace."""
        total = 0
        for instance, rank in self.ranks("expiry"):
            call = self.protocol.sweep(self.protocol.keys.rank(instance, rank))
            while True:
                expired = int(self._retrying("sweep", partial(self._run_script, call)))
                total += expired
                if expired == 0:
                    break
        return total

    def stats(self, sweep: bool = True) -> dict[str, int]:
        """The namespace's counters, summed over its ranks; sweeps expiries first by default."""
        if sweep:
            self.sweep()
        pattern = self.protocol.keys.pattern("stats")
        keys = self._retrying("stats", lambda: list(self.client.scan_iter(match=pattern, count=1000)), "scan")
        return sum_stats([self._retrying("stats", partial(self.client.hgetall, key), "hgetall") for key in keys])

    def server_policies(self) -> ServerPolicies:
        """Each server's ``maxmemory-policy`` (every primary of a Cluster), read now; anything
        but ``noeviction`` is warned about once per process and server (see ``eviction``).
        Its ``durability`` holds each server's settings that decide what a restart or a
        failover loses, warned about the same way (see ``durability``)."""
        read = partial(checks.read_servers, self.client, self.config.wait_replicas)
        return self.checks.report(*self._retrying("policy", read))

    def close(self) -> None:
        self.sender.close()
        self.client.close()

    def __enter__(self) -> SignalBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport -------------------------------------------------------------------------

    def _run_script(self, call: ScriptCall) -> Any:
        """Every call's way to the server: the sender runs the checks that are due, then sends
        (tests wrap this to lose replies)."""
        return self.sender.send(call)

    def _retrying(self, operation: str, action: Callable[[], T], sent: str = "fcall") -> T:
        """``action()``, resent after retryable errors until ``retry_s`` (from now) runs out.
        A refusal by the ACL is ours (``NoPermissionError``); ``sent`` names the command when
        the server does not (a refused key)."""
        started = time.monotonic()
        previous = deadline.bounded(started + self.config.retry_s)
        try:
            try:
                return action()
            except RETRYABLE as exc:
                return self._resend(operation, action, started, exc)
        except FAILURES as exc:
            raise_ours(operation, exc, self.config.retry_s, cut_by_deadline(), sent)
        finally:
            deadline.release(previous)

    def _resend(self, operation: str, action: Callable[[], T], started: float, error: BaseException) -> T:
        """The retry loop, entered only after a first attempt failed with ``error``: the common
        call pays for no ``Attempts``. The budget counts from ``started``, the call's start."""
        attempts = Attempts(operation, self.config.retry_s, started)
        while True:
            self.checks.forget()  # the resend may reach another node, or a new connection
            time.sleep(attempts.next_delay(error))
            try:
                return action()
            except RETRYABLE as exc:
                error = attempts.keep(error, exc)

    def _execute(self, prepared: Prepared[T]) -> T:
        """Send a prepared call and parse its reply. The first send is made inline (no closure,
        no retry state; ``perf_counter`` only for an observer); a resend reuses the same call,
        hence the same idempotency token."""
        call = prepared.call
        if call is None:
            return prepared.parse(None)
        observer = self.observer
        started = time.monotonic()
        timer = time.perf_counter() if observer is not None else 0.0
        operation = prepared.operation
        # Every socket operation of the call waits at most until its deadline (see deadline.py).
        previous = deadline.bounded(started + self.config.retry_s)
        try:
            try:
                if self.owed:  # within this call's deadline: a call's bound holds with finishes owed
                    self._settle(call.keys[0])
                reply = self._run_script(call)
            except RETRYABLE as exc:
                reply = self._resend(operation, partial(self._run_script, call), started, exc)
        except FAILURES as exc:
            raise_ours(operation, exc, self.config.retry_s, cut_by_deadline())
        finally:
            deadline.release(previous)
        result = prepared.parse(reply)
        if observer is not None:
            observer(operation, time.perf_counter() - timer)
        return result

    def _settle(self, key: str) -> None:
        """Send the finishes owed on ``key``'s rank, in order, before the call that needs them."""
        owed = self.owed.take(key)
        for index, finish in enumerate(owed):
            try:
                self._execute(finish.prepared)
            except BaseException:  # unsent: owed still, whatever stopped it
                self.owed.give_back(key, owed[index:])
                raise
