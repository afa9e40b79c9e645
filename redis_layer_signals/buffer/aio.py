"""The asyncio buffer: the same protocol and scripts as ``SignalBuffer``, on redis.asyncio."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from functools import partial, wraps
from typing import Any, TypeVar

from redis.exceptions import OutOfMemoryError, ResponseError, SlotNotCoveredError

from ..constants import WARN
from ..errors import BufferUnavailable, ServerOutOfMemory
from ..models import CacheTask, FinishResult, LayerSignal, RecordResult, RegisterResult
from ..protocol.calls import Prepared, ScriptCall
from ..protocol.counters import sum_stats
from ..protocol.keys import PENDING_LAYERS
from ..protocol.replies import decode_task, parse_pending, pending_layers, slot_signal_fields, task_fields
from ..server import durability, eviction
from ..server.durability import ServerPolicies
from ..server.library import FUNCTIONS, LibraryMissing, async_ensure_library, function_missing
from ..server.permissions import ServerRefused, from_server, refused
from ..transport import connection, replication, wire
from ..transport.deadline import async_timeout, call_deadline
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
    def direct_calls(client: Any) -> wire.AsyncDirectCalls | None:
        return wire.AsyncDirectCalls(client) if wire.supports_async(client) else None

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
                expired = int(await self._retrying("sweep", partial(self._send, "sweep", call)))
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
        self.policies = await self._retrying("policy", partial(eviction.async_server_policies, self.client))
        eviction.judge(self.policies, WARN)
        read = partial(durability.async_server_settings, self.client, self.config.wait_replicas)
        self.durability = await self._retrying("durability", read)
        durability.judge(self.durability)
        return ServerPolicies(self.policies, self.durability)

    async def _check_server(self, key: str) -> None:
        """Read the eviction policy and durability settings before the first write (see
        SignalBuffer._check_server)."""
        found = await eviction.async_server_policies(self.client, key if self.policies else None)
        self.policies = {**self.policies, **found}
        eviction.judge(found, self.config.eviction)
        wait_replicas = self.config.wait_replicas
        settings = await durability.async_server_settings(self.client, wait_replicas, key if self.durability else None)
        self.durability = {**self.durability, **settings}
        durability.judge(settings)
        self._server_unchecked = False

    async def close(self) -> None:
        if self._direct is not None:
            await self._direct.close()
        await self.client.aclose()

    async def __aenter__(self) -> AsyncSignalBuffer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call_function(self, call: ScriptCall) -> Any:
        """One FCALL; on "Function not found" load the library and resend (see SignalBuffer)."""
        function = FUNCTIONS[call.script]
        direct = self._direct
        send: Callable[[], Awaitable[Any]]
        if direct is not None:
            send = partial(direct.run, wire.fcall(function, call.keys, call.args))
        elif self._cluster:
            send = partial(self._fcall_on_key_node, function, call)
        else:
            send = partial(self.client.fcall, function, len(call.keys), *call.keys, *call.args)
        try:
            return await send()
        except ResponseError as exc:
            if not function_missing(exc):
                raise
        await _by_deadline(async_ensure_library(self.client, call.keys[0]))
        try:
            return await send()
        except ResponseError as exc:
            if function_missing(exc):
                raise LibraryMissing(f"{function}: the library went missing again after loading it") from exc
            raise

    async def _fcall_on_key_node(self, function: str, call: ScriptCall) -> Any:
        """FCALL on the node of the call's slot, named to redis.asyncio's Cluster client: its
        own ``fcall`` first asks a node ``COMMAND GETKEYS`` on every call (see ``routing``).
        Redirections stay redis-py's; before its first slot table, its own routing."""
        client = self.client
        command = ("FCALL", function, len(call.keys), *call.keys, *call.args)
        try:
            node = client.get_node_from_key(call.keys[0])
        except SlotNotCoveredError:
            return await client.execute_command(*command)
        return await client.execute_command(*command, target_nodes=node)

    _run_script = _call_function
    """The operations' path (tests wrap it to lose replies); the permission check calls
    ``_call_function`` itself."""

    async def _retrying(self, operation: str, action: Callable[[], Awaitable[T]], sent: str = "fcall") -> T:
        """``await action()``, resent after retryable errors until ``retry_s`` (from now) runs out;
        ``sent`` names the command for a refused key (see SignalBuffer._retrying)."""
        started = time.monotonic()
        try:
            async with async_timeout(self.config.retry_s):
                try:
                    return await action()
                except RETRYABLE as exc:
                    return await self._resend(operation, action, started, exc)
        except ServerRefused as exc:
            raise from_server(operation, exc, sent) from exc
        except asyncio.TimeoutError as exc:  # the bound on the whole call (see deadline.py)
            raise BufferUnavailable(operation, self.config.retry_s, exc) from exc

    async def _resend(
        self, operation: str, action: Callable[[], Awaitable[T]], started: float, error: BaseException
    ) -> T:
        """The retry loop, entered only after a first attempt failed (see SignalBuffer._resend)."""
        attempts = Attempts(operation, self.config.retry_s, started)
        while True:
            self._allowed.clear()  # the resend may reach another node, or a new connection
            await asyncio.sleep(attempts.next_delay(error))
            try:
                return await action()
            except RETRYABLE as exc:
                error = attempts.keep(error, exc)
                self._server_unchecked = True  # a reconnect may reach another node

    async def _execute(self, prepared: Prepared[T]) -> T:
        """Send once inline, resend only after a retryable error (see SignalBuffer._execute)."""
        call = prepared.call
        if call is None:
            return prepared.parse(None)
        observer = self.observer
        started = time.monotonic()
        timer = time.perf_counter() if observer is not None else 0.0
        operation = prepared.operation
        if self.owed:  # within this call's time: a call's bound holds with finishes owed
            try:
                async with async_timeout(self.config.retry_s):
                    await self._settle(call.keys[0])
            except asyncio.TimeoutError as exc:
                raise BufferUnavailable(operation, self.config.retry_s, exc) from exc
        # The call's deadline: a plain client reads each reply within it; the others get one
        # timeout over the whole call, resends included (see deadline.py).
        token = call_deadline.set(started + self.config.retry_s)
        try:
            if self._direct is not None:
                reply = await self._attempts(operation, call, started)
            else:
                async with async_timeout(started + self.config.retry_s - time.monotonic()):
                    reply = await self._attempts(operation, call, started)
        except OutOfMemoryError as exc:
            raise ServerOutOfMemory(operation, exc) from exc
        except ServerRefused as exc:
            raise from_server(operation, exc, "fcall") from exc
        except asyncio.TimeoutError as exc:
            raise BufferUnavailable(operation, self.config.retry_s, exc) from exc
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
            return await self._send(operation, call)
        except RETRYABLE as exc:
            self._server_unchecked = True  # a reconnect may reach another node
            resend = self._resend(operation, partial(self._send, operation, call), started, exc)
            return await _by_deadline(resend)

    # -- replication option (wait_replicas): see replication.py --------------------------------

    async def _send(self, operation: str, call: ScriptCall) -> Any:
        # The steps before the call, and the WAIT path, use the client's own commands, which
        # the direct path's per-read deadline does not reach: each is bounded by the call's.
        if self._server_unchecked:
            await _by_deadline(self._check_server(call.keys[0]))
        if call.keys[0] not in self._allowed:
            await _by_deadline(self._allow(operation, call))
        if self.config.wait_replicas and operation in replication.WAITED_OPERATIONS:
            wanted, timeout_ms = self.config.wait_replicas, self.config.wait_timeout_ms
            return await _by_deadline(replication.async_run_and_wait(self.client, call, operation, wanted, timeout_ms))
        return await self._run_script(call)

    async def _allow(self, operation: str, call: ScriptCall) -> None:
        """Check the rank's permissions before its first call (see ``permissions``)."""
        failure = refused(operation, await self._call_function(self.protocol.permissions(call)))
        if failure is not None:
            raise failure
        self._allowed.add(call.keys[0])


async def _by_deadline(step: Awaitable[T]) -> T:
    """``step`` within the call's deadline (``call_deadline``), when one is set: the direct
    path times its own reads, not what a call sends through the client itself (a server check,
    loading the library, the permission check, WAIT, a resend's reconnect)."""
    ends = call_deadline.get()
    if ends is None:
        return await step
    async with async_timeout(ends - time.monotonic()):
        return await step
