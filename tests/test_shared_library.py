"""The library on a shared server: a buffer calls only the rls_v2 code it ships. Another
tenant who may load functions replaces rls_v2 with other code; the next call of a tenant who
may not raises LibraryMismatch naming both digests, runs none of that code and writes nothing,
and the other library is left in place. ``rls library load`` / ``status``, the operator's side.
Each test starts its own server, as it replaces the library that every other test uses."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
import redis

from redis_layer_signals import AsyncSignalBuffer, CacheTask, LibraryMismatch, SignalBuffer
from redis_layer_signals.ops import acl
from redis_layer_signals.server.library import FILES, _lua_dir, build, library
from tests.servers import VALKEY, RedisServer, library_functions, rls

PASSWORD = "s3cret-pw"


def task(slot: int, request_id: str) -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=4096, num_layers=61)


@pytest.fixture(params=["redis", VALKEY])
def server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    started = RedisServer(binary="redis-server" if request.param == "redis" else VALKEY).start()
    yield started
    started.cleanup()


def add_user(admin: redis.Redis, server: RedisServer, rules: list[str]) -> str:
    user = f"rls-{uuid.uuid4().hex[:6]}"
    admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}", *rules)
    return f"redis://{user}:{PASSWORD}@127.0.0.1:{server.port}/0"


def keyspace(admin: redis.Redis, namespace: str) -> dict[bytes, bytes | None]:
    return {key: admin.dump(key) for key in sorted(admin.scan_iter(match=f"rls:{{{namespace}/*"))}


def modified_build() -> str:
    """Another build of rls_v2: record delivers every signal, live task or not (the loss the
    shared server showed). Built as a release is, so it carries its own digest."""
    source = "\n".join((_lua_dir() / name).read_text() for name in FILES)
    changed = source.replace("local delivered = value and value > next16", "local delivered = true")
    assert changed != source
    return build(changed).code


def test_a_tenant_replacing_the_library_makes_the_next_call_of_another_fail_and_write_nothing(
    server: RedisServer,
) -> None:
    admin = server.client()
    ns_a, ns_b = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    loaded = rls("library", "load", "--redis", add_user(admin, server, acl.rules(role="operator")))
    assert loaded.returncode == 0, loaded.stderr
    assert f"digest {library().digest}" in loaded.stdout
    tenant_a = add_user(admin, server, acl.rules(ns_a, role="owner"))  # may load functions
    tenant_b = add_user(admin, server, acl.rules(ns_b, role="tenant"))  # may not
    b = SignalBuffer.from_url(tenant_b, namespace=ns_b, env={}, retry_s=1)
    b.register(task(5, "live-5"))
    b.record("p0", 0, 0, [(6, 100)])  # buffered: no task on slot 6

    a = redis.Redis.from_url(tenant_a)
    other = modified_build()
    a.function_load(other, replace=True)
    a.close()
    before = keyspace(admin, ns_b)
    with pytest.raises(LibraryMismatch) as refused:
        b.record("p0", 0, 0, [(7, 100)])  # the modified record would "deliver" it
    served = build_digest(other)
    assert refused.value.ours == library().digest and refused.value.served == served
    assert library().digest in str(refused.value) and served in str(refused.value)
    for call in (lambda: b.register(task(6, "req-6")), lambda: b.finish("p0", 0, 5, "live-5"), b.sweep):
        with pytest.raises(LibraryMismatch):
            call()
    assert keyspace(admin, ns_b) == before  # nothing written
    assert admin.function_list(library="rls_v2", withcode=True)[0][-1].decode() == other  # not replaced

    status = rls("library", "status", "--redis", server.url)
    assert status.returncode == 1 and "OTHER code" in status.stdout and served in status.stdout
    refused_load = rls("library", "load", "--redis", server.url)
    assert refused_load.returncode == 1 and served in refused_load.stderr
    replaced = rls("library", "load", "--replace", "--redis", server.url)
    assert replaced.returncode == 0, replaced.stderr
    assert rls("library", "status", "--redis", server.url).returncode == 0
    assert [s.tokens for s in b.register(task(6, "req-6")).recovered] == [100]  # served again
    b.close()
    admin.close()


def build_digest(code: str) -> str:
    """The digest a built library carries (its rls_v2_digest answer)."""
    marker = "local DIGEST = '"
    start = code.index(marker) + len(marker)
    return code[start : start + 64]


def test_an_rls_v2_that_reports_no_digest_is_refused_and_left_in_place(server: RedisServer) -> None:
    admin = server.client()
    foreign = "#!lua name=rls_v2\nredis.register_function('rls_v2_record', function(keys, args) return 'ok' end)\n"
    admin.function_load(foreign)
    namespace = f"n-{uuid.uuid4().hex[:6]}"
    buf = SignalBuffer.from_url(server.url, namespace=namespace, env={}, retry_s=1)
    with pytest.raises(LibraryMismatch) as refused:
        buf.record("p0", 0, 0, [(5, 100)])
    assert refused.value.served is None and "none" in str(refused.value)
    assert library_functions(admin, "rls_v2") == {"rls_v2_record"}
    assert keyspace(admin, namespace) == {}

    async def async_call() -> None:
        abuf = AsyncSignalBuffer.from_url(server.url, namespace=namespace, env={}, retry_s=1)
        try:
            with pytest.raises(LibraryMismatch):
                await abuf.register(task(5, "req-5"))
        finally:
            await abuf.close()

    asyncio.run(async_call())
    assert keyspace(admin, namespace) == {}
    buf.close()
    admin.close()


def test_status_sees_code_edited_by_hand_that_still_claims_the_digest(server: RedisServer) -> None:
    """The digest is what a library says of itself: the buffers can be fooled by an edit that
    keeps it, `rls library status` (which compares the code) is not."""
    admin = server.client()
    assert rls("library", "load", "--redis", server.url).returncode == 0
    again = rls("library", "load", "--redis", server.url)
    assert again.returncode == 0 and "already loaded" in again.stdout
    assert rls("library", "status", "--redis", server.url).returncode == 0
    edited = library().code.replace("local delivered = value and value > next16", "local delivered = true")
    admin.function_load(edited, replace=True)
    status = rls("library", "status", "--redis", server.url)
    assert status.returncode == 1 and f"reports digest {library().digest}" in status.stdout
    admin.close()
