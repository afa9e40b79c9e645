"""What the buffer is measured against.

(a) ``LocalDictBuffer``: FastDeploy's own fix, a process-local dict behind a lock: the cost
    of buffering when nothing is shared. (b) ``NaiveRedisBuffer``: the obvious redis-py
    version without Lua, optimistic WATCH/MULTI/EXEC retried on conflict. (c) ``Floor``:
    EVALSHA of a script that only returns, one key, the entries as ARGV (two integers each): the
    least any Redis design must send. (d) ``redis-benchmark`` lives in ``external``.
(c') ``FloorDirect``: the same call sent the way the sync buffer sends its own scripts
    (``.wire``), a reference for what our Lua costs once redis-py's per-command path is gone.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import WatchError

from ..transport import wire

FLOOR_SCRIPT = "return 1"
"""Does nothing: what is left is the round trip, redis-py and the Lua call itself."""

NAIVE_TTL_S = 60
MAX_NAIVE_ATTEMPTS = 10_000
"""Bounds the optimistic retry loop; a run that needs more conflicts than this is broken."""


class LocalDictBuffer:
    """FastDeploy's fix: early signals in a dict keyed by slot (newest wins), under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, dict[int, int]] = {}
        self._tasks: dict[int, str] = {}

    def record(self, layer: int, entries: Sequence[tuple[int, int]]) -> int:
        delivered = 0
        with self._lock:
            for slot, tokens in entries:
                if slot in self._tasks:
                    delivered += 1
                else:
                    self._pending.setdefault(slot, {})[layer] = tokens
        return delivered

    def register(self, slot: int, request_id: str, need: int) -> list[tuple[int, int]]:
        with self._lock:
            self._tasks[slot] = request_id
            early = self._pending.pop(slot, {})
        return [(layer, tokens) for layer, tokens in sorted(early.items()) if 0 < tokens <= need]

    def finish(self, slot: int, request_id: str) -> bool:
        with self._lock:
            if self._tasks.get(slot) != request_id:
                return False
            del self._tasks[slot]
            self._pending.pop(slot, None)
        return True


class NaiveRedisBuffer:
    """The buffer as redis-py calls without Lua: read under WATCH, write in MULTI, retry."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.live = f"{prefix}:live"
        self.pending = f"{prefix}:pending"
        self.conflicts = 0

    def _transaction(self, keys: Sequence[str], body: Any) -> Any:
        for _ in range(MAX_NAIVE_ATTEMPTS):
            pipe: Any
            with self.client.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(*keys)
                    result = body(pipe)
                    pipe.execute()
                    return result
                except WatchError:
                    self.conflicts += 1
        raise RuntimeError(f"naive transaction gave up after {MAX_NAIVE_ATTEMPTS} conflicts")

    def record(self, layer: int, entries: Sequence[tuple[int, int]]) -> int:
        slots = [str(slot) for slot, _ in entries]

        def body(pipe: Any) -> int:
            holders = pipe.hmget(self.live, slots)
            stored = pipe.hmget(self.pending, slots)
            updates: dict[str, str] = {}
            delivered = 0
            for (_slot, tokens), name, holder, packed in zip(entries, slots, holders, stored, strict=True):
                if holder is not None:
                    delivered += 1
                    continue
                records = dict(_split(updates.get(name) or (packed.decode() if packed else "")))
                records[str(layer)] = str(tokens)
                updates[name] = ";".join(f"{k}:{v}" for k, v in records.items())
            pipe.multi()
            if updates:
                pipe.hset(self.pending, mapping=updates)
                pipe.expire(self.pending, NAIVE_TTL_S)
            return delivered

        return int(self._transaction([self.live, self.pending], body))

    def register(self, slot: int, request_id: str, need: int) -> list[tuple[int, int]]:
        field = str(slot)

        def body(pipe: Any) -> list[tuple[int, int]]:
            packed = pipe.hget(self.pending, field)
            pipe.multi()
            pipe.hset(self.live, field, request_id)
            pipe.expire(self.live, NAIVE_TTL_S)
            if packed is not None:
                pipe.hdel(self.pending, field)
            pairs = [(int(k), int(v)) for k, v in _split(packed.decode() if packed else "")]
            return [(layer, tokens) for layer, tokens in sorted(pairs) if 0 < tokens <= need]

        result: list[tuple[int, int]] = self._transaction([self.live, self.pending], body)
        return result

    def finish(self, slot: int, request_id: str) -> bool:
        field = str(slot)

        def body(pipe: Any) -> bool:
            holder = pipe.hget(self.live, field)
            pipe.multi()
            if holder is None or holder.decode() != request_id:
                return False
            pipe.hdel(self.live, field)
            pipe.hdel(self.pending, field)
            return True

        return bool(self._transaction([self.live, self.pending], body))


def _split(packed: str) -> list[tuple[str, str]]:
    return [tuple(item.split(":", 1)) for item in packed.split(";") if item]  # type: ignore[misc]


class Floor:
    """EVALSHA of a script that only returns: one key, the entries flattened into ARGV."""

    def __init__(self, client: Any, key: str) -> None:
        self.client = client
        self.key = key
        self.sha = client.script_load(FLOOR_SCRIPT)

    @staticmethod
    def flat(entries: Sequence[tuple[int, int]]) -> list[int]:
        return [number for entry in entries for number in entry]

    def call(self, args: Sequence[int]) -> Any:
        return self.client.evalsha(self.sha, 1, self.key, *args)


class FloorDirect(Floor):
    """``Floor`` sent as the sync buffer sends its scripts: a hiredis-packed EVALSHA on a
    kept pool connection. The floor of the issue goes through redis-py's ``execute_command``,
    which ours now skips; this one skips it too, so ours/floor_direct is what our scripts cost."""

    def __init__(self, client: Any, key: str) -> None:
        if not wire.supports(client):
            raise TypeError(f"{type(client).__name__} with these options is not sent directly; no direct floor")
        super().__init__(client, key)
        self._direct = wire.DirectCalls(client)

    def call(self, args: Sequence[int]) -> Any:
        return self._direct.run(wire.evalsha(self.sha, [self.key], [str(arg) for arg in args]))

    def close(self) -> None:
        """Hand the kept connections back to the client's pool."""
        self._direct.close()


class AsyncFloor:
    """``Floor`` on redis.asyncio; ``await AsyncFloor.create(client, key)``."""

    def __init__(self, client: Any, key: str, sha: str) -> None:
        self.client = client
        self.key = key
        self.sha = sha

    @classmethod
    async def create(cls, client: Any, key: str) -> AsyncFloor:
        return cls(client, key, await client.script_load(FLOOR_SCRIPT))

    async def call(self, args: Sequence[int]) -> Any:
        return await self.client.evalsha(self.sha, 1, self.key, *args)
