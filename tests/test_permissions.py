"""A missing ACL permission writes nothing: for each command of the rule ``acl.rules()``
recommends, removed in turn, every call either succeeds or raises ``NoPermissionError`` naming
that command, and the namespace's keys (their DUMP and TTL) are then exactly as before. On
Redis 7.0 and on Valkey 8.1."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from redis_layer_signals import CacheTask, NoPermissionError, SignalBuffer
from redis_layer_signals.ops import acl
from tests.servers import RedisServer

PASSWORD = "s3cret-pw"
GRANTED = [rule[1:] for rule in acl.rules() if rule.startswith("+")]


def task(slot: int, request_id: str) -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=4096, num_layers=61)


@pytest.fixture(params=["redis_server", "valkey_8"])
def server(request: pytest.FixtureRequest) -> RedisServer:
    started: RedisServer = request.getfixturevalue(request.param)
    return started


@pytest.fixture
def admin(server: RedisServer) -> Iterator[redis.Redis]:
    client = server.client()
    yield client
    client.close()


def keyspace(admin: redis.Redis, namespace: str) -> dict[bytes, tuple[bytes | None, bool]]:
    """Every key of the namespace: its DUMP and whether it has a TTL. The TTLs themselves are
    compared apart (they run down between two snapshots)."""
    return {
        key: (admin.dump(key), admin.pttl(key) >= 0) for key in sorted(admin.scan_iter(match=f"rls:{{{namespace}/*"))
    }


def ttls(admin: redis.Redis, namespace: str) -> dict[bytes, int]:
    return {key: admin.pttl(key) for key in admin.scan_iter(match=f"rls:{{{namespace}/*")}


def prepare(url: str, namespace: str) -> None:
    """Every path a function can write on: a live task (slot 5), pending signals of another
    slot (6) and of a slot about to register (7)."""
    owner = SignalBuffer.from_url(url, namespace=namespace, env={})
    owner.register(task(5, "live-5"))
    owner.record("p0", 0, 0, [(6, 100), (7, 200)])
    owner.record("p0", 0, 1, [(6, 100)])
    owner.close()


def calls(buf: SignalBuffer) -> dict[str, Callable[[], Any]]:
    return {
        "record": lambda: buf.record("p0", 0, 0, [(5, 10), (6, 20), (8, 30)]),
        "register": lambda: buf.register(task(7, "req-7")),
        "finish": lambda: buf.finish("p0", 0, 5, "live-5"),
        "finish_unknown": lambda: buf.finish("p0", 0, 6, "gone-6"),
        "sweep": buf.sweep,
        "stats": buf.stats,
        "pending": lambda: buf.pending("p0", 0, 6),
        "task": lambda: buf.task("p0", 0, 5),
    }


@pytest.mark.parametrize("removed", GRANTED)
def test_a_call_refused_for_a_missing_permission_changes_nothing_and_names_the_command(
    server: RedisServer, admin: redis.Redis, removed: str
) -> None:
    namespace = f"acl-{uuid.uuid4().hex[:8]}"
    prepare(server.url, namespace)  # also loads the library, as an operator would
    user = f"rls-{uuid.uuid4().hex[:6]}"
    rules = [rule for rule in acl.rules(namespace) if rule != f"+{removed}"]
    admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}", *rules)
    url = f"redis://{user}:{PASSWORD}@127.0.0.1:{server.port}/0"
    buf = SignalBuffer.from_url(url, namespace=namespace, env={}, retry_s=1)
    refused = []
    try:
        for name, call in calls(buf).items():
            before, before_ttls = keyspace(admin, namespace), ttls(admin, namespace)
            try:
                call()
            except NoPermissionError as exc:
                refused.append(name)
                assert exc.command == removed, (name, str(exc))
                assert removed in str(exc)
                assert keyspace(admin, namespace) == before, name
                after_ttls = ttls(admin, namespace)
                # No TTL refreshed or removed: each only ran down.
                assert all(after_ttls[k] <= before_ttls[k] for k in before_ttls), name
    finally:
        buf.close()
        admin.execute_command("ACL", "DELUSER", user)
    # The commands every call needs are refused to every call; the client's own reads to theirs.
    needed_by_all_functions = set(acl.SCRIPT_COMMANDS) | {"fcall"}
    if removed in needed_by_all_functions:
        assert {"record", "register", "finish", "finish_unknown", "sweep", "stats"} <= set(refused)
    expected_reads = {"hget": {"pending"}, "hmget": {"pending", "task"}, "time": {"task"}, "scan": {"sweep", "stats"}}
    assert expected_reads.get(removed, set()) <= set(refused), refused
    if removed in ("ping", "wait", "function|load"):  # not needed here: the library is loaded
        assert refused == []


def test_a_key_left_out_of_the_users_patterns_is_found_before_anything_is_written(
    server: RedisServer, admin: redis.Redis
) -> None:
    """Key patterns narrower than the rule's, leaving out the rank's finish marks (``ended``):
    the check runs on all the rank's keys, not only those of the first call, so the rank's
    first call is refused already (the server refuses the check's own FCALL on that key), and
    nothing is written."""
    namespace = f"acl-{uuid.uuid4().hex[:8]}"
    prepare(server.url, namespace)
    user = f"rls-{uuid.uuid4().hex[:6]}"
    base = f"rls:{{{namespace}/*}}:"
    patterns = [f"~{base}{kind}" for kind in ("live", "pending", "expiry", "stats", "reply:*", "writer:*")]
    commands = [rule for rule in acl.rules(namespace) if not rule.startswith(("~", "resetkeys"))]
    rules = ["resetkeys", *patterns, *commands]
    admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}", *rules)
    url = f"redis://{user}:{PASSWORD}@127.0.0.1:{server.port}/0"
    buf = SignalBuffer.from_url(url, namespace=namespace, env={}, retry_s=1)
    try:
        before = keyspace(admin, namespace)
        for call in (lambda: buf.register(task(7, "req-7")), lambda: buf.finish("p0", 0, 5, "live-5")):
            with pytest.raises(NoPermissionError) as refused:
                call()
            assert refused.value.command in ("fcall", "hset"), str(refused.value)
        assert keyspace(admin, namespace) == before
    finally:
        buf.close()
        admin.execute_command("ACL", "DELUSER", user)


def test_without_function_load_a_missing_library_is_refused_and_nothing_written(
    server: RedisServer, admin: redis.Redis
) -> None:
    namespace = f"acl-{uuid.uuid4().hex[:8]}"
    prepare(server.url, namespace)
    admin.function_flush()
    user = f"rls-{uuid.uuid4().hex[:6]}"
    rules = [rule for rule in acl.rules(namespace) if rule != "+function|load"]
    admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}", *rules)
    buf = SignalBuffer.from_url(f"redis://{user}:{PASSWORD}@127.0.0.1:{server.port}/0", namespace=namespace, env={})
    before = keyspace(admin, namespace)
    try:
        with pytest.raises(NoPermissionError) as refused:
            buf.record("p0", 0, 0, [(6, 1)])
        assert refused.value.command == "function|load"
        assert isinstance(refused.value.__cause__, redis.exceptions.NoPermissionError)
        assert keyspace(admin, namespace) == before
    finally:
        buf.close()
        admin.execute_command("ACL", "DELUSER", user)
        SignalBuffer.from_url(server.url, namespace=namespace, env={}).record("p0", 0, 0, [])


@pytest.mark.parametrize("removed", ["hset", "pexpire", "fcall"])
def test_the_async_buffer_refuses_the_same_way(server: RedisServer, admin: redis.Redis, removed: str) -> None:
    import asyncio

    from redis_layer_signals import AsyncSignalBuffer

    namespace = f"acl-{uuid.uuid4().hex[:8]}"
    prepare(server.url, namespace)
    user = f"rls-{uuid.uuid4().hex[:6]}"
    rules = [rule for rule in acl.rules(namespace) if rule != f"+{removed}"]
    admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}", *rules)
    url = f"redis://{user}:{PASSWORD}@127.0.0.1:{server.port}/0"
    before = keyspace(admin, namespace)

    async def refused() -> list[str]:
        buf = AsyncSignalBuffer.from_url(url, namespace=namespace, env={}, retry_s=1)
        commands = []
        try:
            for call in (
                lambda: buf.record("p0", 0, 0, [(5, 10), (6, 20)]),
                lambda: buf.register(task(7, "req-7")),
                lambda: buf.finish("p0", 0, 5, "live-5"),
                buf.sweep,
            ):
                with pytest.raises(NoPermissionError) as error:
                    await call()
                commands.append(error.value.command)
        finally:
            await buf.close()
        return commands

    try:
        assert asyncio.run(refused()) == [removed] * 4
        assert keyspace(admin, namespace) == before
    finally:
        admin.execute_command("ACL", "DELUSER", user)
