"""The asyncio buffer: the same protocol and scripts as ``SignalBuffer``, on redis.asyncio."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from functools import partial, wraps
from typing import Any, TypeVar

from ..errors import ASYNC_FAILURES, BufferUnavailable, raise_ours
from ..models import CacheTask, FinishResult, LayerSignal, RecordResult, RegisterResult
from ..protocol.calls import Prepared, ScriptCall
from ..protocol.counters import sum_stats
from ..protocol.keys import PENDING_LAYERS
from ..protocol.replies import decode_task, parse_pending, pending_layers, slot_signal_fields, task_fields
from ..server import checks
from ..server.checks import ServerChecks
from ..server.durability import ServerPolicies
from ..transport import connection, senders
from ..transport.deadline import BACKSTOP_S, async_timeout, call_deadline, within_call
from ..transport.retry import RETRYABLE, Attempts
from .base import BufferBase
from .owed import OwedFinish

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def whole_call(method: F) -> F:
    """Bound a read of several round trips by one timeout, ``retry_s`` (see ``deadline``)."""

    @wraps(method)
    async def bounded(self: AsyncSignalBuffer, *args: Any, **kwargs: Any) -> Any:
        try:
            async with async_timeout(self.config.retry_s):
                return await method(self, *args, **kwargs)
        except asyncio.TimeoutError as exc:
            raise BufferUnavailable(method.__name__, self.config.retry_s, exc) from exc

    return bounded  # type: ignore[return-value]


class AsyncSignalBuffer(BufferBase):
    """[`SignalBuffer`][redis_layer_signals.SignalBuffer] with coroutine methods, on ``redis.asyncio``;
    see it for what each call guarantees."""

    @staticmethod
    def make_client(url: str, retry_s: float) -> Any:
        return connection.async_client(url, retry_s)

    @staticmethod
    def sender_for(client: Any, checks: ServerChecks, wait_replicas: int, wait_timeout_ms: int) -> senders.AsyncSender:
        return senders.async_sender_for(client, checks, wait_replicas, wait_timeout_ms)

    async def record(self, instance: str, rank: int, layer: int, entries: Iterable[Any]) -> RecordResult:
        return await self._execute(self.protocol.record(instance, rank, layer, entries))

    async def register(self, task: CacheTask, replace: bool = False) -> RegisterResult:
        return await self._execute(self.protocol.register(task, replace))

    async def finish(self, instance: str, rank: int, slot: int, request_id: str) -> FinishResult:
        prepared = self.protocol.finish(instance, rank, slot, request_id)
        try:
            return await self._execute(prepared)
        except BufferUnavailable as exc:
            # Sent again before the next call on the rank; OwedFinishesFull instead when full.
            self.owed.owe(OwedFinish(prepared, slot, request_id), exc)
            raise

    @whole_call
    async def pending(self, instance: str, rank: int, slot: int) -> list[LayerSignal]:
        keys = self.protocol.slot_keys(instance, rank, slot)
        stored = await self._retrying("pending", lambda: self.client.hget(keys.pending, PENDING_LAYERS), "hget")
        layers = pending_layers(stored)
        if not layers:
            return []
        fields = slot_signal_fields(slot, layers)
        values = await self._retrying("pending", lambda: self.client.hmget(keys.pending, fields), "hmget")
        return parse_pending(instance, rank, slot, layers, values)

    @whole_call
    async def task(self, instance: str, rank: int, slot: int) -> CacheTask | None:
        keys = self.protocol.slot_keys(instance, rank, slot)
        fields = task_fields(slot)
        holder, document = await self._retrying("task", lambda: self.client.hmget(keys.live, fields), "hmget")
        return decode_task(instance, rank, slot, holder, document, await self.now_ms())

    async def now_ms(self) -> int:
        if self.protocol.clock is not None:
            return int(self.protocol.clock())
        seconds, micros = await self._retrying("time", self.client.time, "time")
        return int(seconds) * 1000 + int(micros) // 1000

    async def ranks(self, kind: str = "stats") -> list[tuple[str, int]]:
        found = set()
        for key in await self._retrying("scan", partial(self._scan, self.protocol.keys.pattern(kind)), "scan"):
            owner = self.protocol.keys.owner(key)
            if owner is not None:
                found.add(owner)
        return sorted(found)

    async def _scan(self, pattern: str) -> list[Any]:
        """One whole SCAN walk; a walk cut short by a fault is started again by the caller."""
        return [key async for key in self.client.scan_iter(match=pattern, count=1000)]

    async def sweep(self) -> int:
        total = 0
        for instance, rank in await self.ranks("expiry"):
            call = self.protocol.sweep(self.protocol.keys.rank(instance, rank))
            while True:
                expired = int(await self._retrying("sweep", partial(self._run_script, call)))
                total += expired
                if expired == 0:
                    break
        return total

    async def stats(self, sweep: bool = True) -> dict[str, int]:
        if sweep:
            await self.sweep()
        keys = await self._retrying("stats", partial(self._scan, self.protocol.keys.pattern("stats")), "scan")
        return sum_stats([await self._retrying("stats", partial(self.client.hgetall, key), "hgetall") for key in keys])

    async def server_policies(self) -> ServerPolicies:
        """Each server's ``maxmemory-policy`` and durability settings, read now (see
        SignalBuffer.server_policies)."""
        read = partial(checks.async_read_servers, self.client, self.config.wait_replicas)
        return self.checks.report(*await self._retrying("policy", read))

    async def close(self) -> None:
        await self.sender.close()
        await self.client.aclose()

    async def __aenter__(self) -> AsyncSignalBuffer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run_script(self, call: ScriptCall) -> Any:
        """Every call's way to the server: the sender runs the checks that are due, then sends
        (tests wrap this to lose replies)."""
        return await self.sender.send(call)

    async def _retrying(self, operation: str, action: Callable[[], Awaitable[T]], sent: str = "fcall") -> T:
        """``await action()``, resent after retryable errors until ``retry_s`` (from now) runs out;
        ``sent`` names the command for a refused key (see SignalBuffer._retrying)."""
        started = time.monotonic()
        try:
            async with async_timeout(self.config.retry_s + BACKSTOP_S):
                try:
                    return await action()
                except RETRYABLE as exc:
                    return await self._resend(operation, action, started, exc)
        except ASYNC_FAILURES as exc:  # a timeout: the bound on the whole call (see deadline.py)
            raise_ours(operation, exc, self.config.retry_s, False, sent)

    async def _resend(
        self, operation: str, action: Callable[[], Awaitable[T]], started: float, error: BaseException
    ) -> T:
        """The retry loop, entered only after a first attempt failed (see SignalBuffer._resend).

        It stops itself at ``retry_s``, before the timeouts around the call (``BACKSTOP_S``
        later), so that ``BufferUnavailable`` carries the last error it met (a refused
        connection, a TLS handshake that did not complete), not a timeout that says nothing."""
        attempts = Attempts(operation, self.config.retry_s, started)
        try:
            async with async_timeout(max(0.0, attempts.deadline - time.monotonic())):
                while True:
                    self.checks.forget()  # the resend may reach another node, or a new connection
                    await asyncio.sleep(attempts.next_delay(error))
                    try:
                        return await action()
                    except RETRYABLE as exc:
                        error = attempts.keep(error, exc)
        except asyncio.TimeoutError:
            raise BufferUnavailable(operation, self.config.retry_s, error) from error

    async def _execute(self, prepared: Prepared[T]) -> T:
        """Send once inline, resend only after a retryable error (see SignalBuffer._execute)."""
        call = prepared.call
        if call is None:
            return prepared.parse(None)
        observer = self.observer
        started = time.monotonic()
        timer = time.perf_counter() if observer is not None else 0.0
        operation = prepared.operation
        # The call's deadline: a plain client reads each reply within it; the others get one
        # timeout over the whole call, resends included (see deadline.py).
        token = call_deadline.set(started + self.config.retry_s + BACKSTOP_S)
        try:
            if self.owed:  # within this call's time: a call's bound holds with finishes owed
                async with async_timeout(self.config.retry_s):
                    await self._settle(call.keys[0])
            if self.sender.direct is not None:
                reply = await self._attempts(operation, call, started)
            else:
                async with async_timeout(started + self.config.retry_s + BACKSTOP_S - time.monotonic()):
                    reply = await self._attempts(operation, call, started)
        except ASYNC_FAILURES as exc:
            raise_ours(operation, exc, self.config.retry_s, False)
        finally:
            call_deadline.reset(token)
        result = prepared.parse(reply)
        if observer is not None:
            observer(operation, time.perf_counter() - timer)
        return result

    async def _settle(self, key: str) -> None:
        """Send the finishes owed on ``key``'s rank first (see SignalBuffer._settle)."""
        owed = self.owed.take(key)
        for index, finish in enumerate(owed):
            try:
                await self._execute(finish.prepared)
            except BaseException:  # unsent (a timeout cancels it too): owed still
                self.owed.give_back(key, owed[index:])
                raise

    async def _attempts(self, operation: str, call: ScriptCall, started: float) -> Any:
        """Send once inline; resend only after a retryable error, the same call (same token)."""
        try:
            return await self._run_script(call)
        except RETRYABLE as exc:
            resend = self._resend(operation, partial(self._run_script, call), started, exc)
            return await within_call(resend)
