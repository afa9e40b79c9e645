"""Security: TLS with a CA and client certificates made here with openssl; the least-privilege
ACL of :mod:`redis_layer_signals.ops.acl` (the library works under it, one namespace's user cannot
touch another's keys, on a single server and on the Cluster); hostile identifiers rejected
before they could leave their hash tag."""

from __future__ import annotations

import asyncio
import re
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import key_slot

from redis_layer_signals import (
    AsyncSignalBuffer,
    BufferUnavailable,
    CacheTask,
    InvalidConfig,
    InvalidSignal,
    InvalidTask,
    NoPermissionError,
    SignalBuffer,
)
from redis_layer_signals.ops import acl
from redis_layer_signals.protocol.keys import KeySpace
from tests.servers import RedisServer
from tests.topology import ClusterTopology, TlsRedisServer, make_certificates

LUA_DIR = Path(__file__).resolve().parent.parent / "lua"
PASSWORD = "s3cret-pw"


def task(slot: int = 5, request_id: str = "req-1", instance: str = "p0") -> CacheTask:
    return CacheTask(instance, 0, slot, request_id, need_prefill_tokens=4096, num_layers=61)


def roundtrip(buf: SignalBuffer) -> list[int]:
    buf.record("p0", 0, 0, [(5, 100)])
    buf.stats()
    return [s.tokens for s in buf.register(task()).recovered]


# -- TLS -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server() -> Iterator[TlsRedisServer]:
    directory = Path(tempfile.mkdtemp(prefix="rls-tls-"))
    server = TlsRedisServer(make_certificates(directory)).start()
    yield server
    server.cleanup()


def test_rediss_url_with_ca_and_client_certificate_works_sync_and_async(
    tls_server: TlsRedisServer, namespace: str
) -> None:
    buf = SignalBuffer.from_url(tls_server.url, namespace=namespace, env={})
    assert roundtrip(buf) == [100]
    buf.close()

    async def async_roundtrip() -> list[int]:
        abuf = AsyncSignalBuffer.from_url(tls_server.url, namespace=namespace, env={})
        try:
            await abuf.record("p0", 0, 0, [(6, 200)])
            return [s.tokens for s in (await abuf.register(task(slot=6))).recovered]
        finally:
            await abuf.close()

    assert asyncio.run(async_roundtrip()) == [200]


def test_rediss_without_client_certificate_is_refused(tls_server: TlsRedisServer, namespace: str) -> None:
    url = f"rediss://127.0.0.1:{tls_server.port}/0?{tls_server.tls_query(client_cert=False)}"
    buf = SignalBuffer.from_url(url, namespace=namespace, env={}, retry_s=0.3)
    with pytest.raises(BufferUnavailable):
        buf.record("p0", 0, 0, [(5, 100)])
    buf.close()
    assert tls_server.client().exists(KeySpace(namespace).rank("p0", 0).stats) == 0


def test_plain_redis_url_to_a_tls_port_is_refused(tls_server: TlsRedisServer, namespace: str) -> None:
    buf = SignalBuffer.from_url(f"redis://127.0.0.1:{tls_server.port}/0", namespace=namespace, env={}, retry_s=0.3)
    with pytest.raises(BufferUnavailable):
        buf.record("p0", 0, 0, [(5, 100)])
    buf.close()


# -- ACL -----------------------------------------------------------------------------------------


def set_user(client: Any, user: str, rules: list[str]) -> None:
    client.execute_command("ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}", *rules)


def user_url(server: RedisServer, user: str) -> str:
    return f"redis://{user}:{PASSWORD}@127.0.0.1:{server.port}/0"


def test_acl_lists_exactly_the_commands_the_lua_functions_call() -> None:
    called = set()
    for path in LUA_DIR.glob("*.lua"):
        called |= {c.lower() for c in re.findall(r"redis\.p?call\(\s*'([A-Za-z]+)'", path.read_text())}
    listed = set(acl.SCRIPT_COMMANDS)
    assert called == listed, f"update redis_layer_signals/acl.py: missing {called - listed}, unused {listed - called}"


def test_docs_show_the_acl_rules_the_library_defines() -> None:
    """Every page that shows the least-privilege user shows the rules acl.py defines."""
    pages = [LUA_DIR.parent / "README.md", *sorted((LUA_DIR.parent / "docs").rglob("*.md"))]
    text = "\n".join(page.read_text() for page in pages)
    shown = [line for line in text.splitlines() if line.startswith("ACL SETUSER rls-prod on >PASSWORD ")]
    assert shown and set(shown) == {"ACL SETUSER rls-prod on >PASSWORD " + " ".join(acl.rules("prod"))}


def test_library_works_under_the_least_privilege_acl(redis_server: RedisServer, namespace: str) -> None:
    admin = redis_server.client()
    user = f"rls-{uuid.uuid4().hex[:6]}"
    set_user(admin, user, acl.rules())
    buf = SignalBuffer.from_url(user_url(redis_server, user), namespace=namespace, env={}, retry_s=1)
    admin.function_flush()  # so the restricted user must load the library itself ("Function not found")
    assert roundtrip(buf) == [100]
    assert buf.finish("p0", 0, 5, "req-1").removed
    assert buf.stats()["recorded"] == 1
    # ...and nothing more: no FLUSHALL, no CONFIG, no keys outside rls:*.
    direct = redis.Redis(host="127.0.0.1", port=redis_server.port, username=user, password=PASSWORD)
    for forbidden in (("FLUSHALL",), ("CONFIG", "GET", "*"), ("GET", "other:key"), ("KEYS", "*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            direct.execute_command(*forbidden)
    direct.close()
    buf.close()
    admin.close()


def test_user_limited_to_namespace_a_cannot_read_or_write_namespace_b(redis_server: RedisServer) -> None:
    admin = redis_server.client()
    ns_a, ns_b = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    user = f"rls-{ns_a}"
    set_user(admin, user, acl.rules(ns_a))
    owner_b = SignalBuffer.from_url(redis_server.url, namespace=ns_b, env={})
    owner_b.record("p0", 0, 0, [(5, 100)])
    keys_b = sorted(admin.scan_iter(match=f"rls:{{{ns_b}/*"))
    before = {k: admin.dump(k) for k in keys_b}

    as_a = SignalBuffer.from_url(user_url(redis_server, user), namespace=ns_a, env={}, retry_s=1)
    assert roundtrip(as_a) == [100]  # its own namespace works
    intruder = SignalBuffer.from_url(user_url(redis_server, user), namespace=ns_b, env={}, retry_s=1)
    with pytest.raises(NoPermissionError):
        intruder.record("p0", 0, 1, [(5, 1)])
    with pytest.raises(NoPermissionError):
        intruder.register(task())
    with pytest.raises(NoPermissionError):
        intruder.finish("p0", 0, 5, "req-1")
    with pytest.raises(NoPermissionError):
        intruder.pending("p0", 0, 5)
    assert {k: admin.dump(k) for k in keys_b} == before  # B untouched
    assert [s.tokens for s in owner_b.pending("p0", 0, 5)] == [100]
    for buf in (owner_b, as_a, intruder):
        buf.close()
    admin.close()


def test_cluster_url_with_user_and_password_under_namespace_acl(cluster: ClusterTopology) -> None:
    ns_a, ns_b = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    user = f"rls-{ns_a}"
    for node in cluster.nodes:  # ACL users are per node
        client = node.client()
        set_user(client, user, acl.rules(ns_a, cluster=True))
        client.close()
    hosts = ",".join(f"127.0.0.1:{n.port}" for n in cluster.nodes)
    url = f"redis+cluster://{user}:{PASSWORD}@{hosts}"
    as_a = SignalBuffer.from_url(url, namespace=ns_a, env={}, retry_s=1)
    assert roundtrip(as_a) == [100]
    intruder = SignalBuffer.from_url(url, namespace=ns_b, env={}, retry_s=1)
    with pytest.raises(NoPermissionError):
        intruder.record("p0", 0, 0, [(5, 1)])
    as_a.close()
    intruder.close()


# -- hostile identifiers -------------------------------------------------------------------------

HOSTILE = ["a{b", "a}b", "{x}", "a/b", "a*", "a?", "a[b]", "a:b", "a\nb", "a\rb", "a b", "", "é", "a\x00b", "x" * 129]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_identifiers_are_rejected_before_anything_reaches_the_cluster(
    cluster: ClusterTopology, name: str
) -> None:
    admin = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    before = set(admin.scan_iter(count=1000))  # a key set: other tests' reply keys may expire meanwhile
    with pytest.raises(InvalidConfig) as as_namespace:
        SignalBuffer.from_url(cluster.url, namespace=name, env={})
    assert as_namespace.value.field == "namespace" and as_namespace.value.value == name
    buf = SignalBuffer.from_url(cluster.url, namespace="hostile-check", env={})
    with pytest.raises(InvalidSignal) as as_instance:
        buf.record(name, 0, 0, [(5, 100)])
    assert as_instance.value.field == "instance"
    with pytest.raises(InvalidSignal) as as_request:
        buf.record("p0", 0, 0, [(5, 100, name)])
    assert "request_id" in str(as_request.value)
    with pytest.raises(InvalidTask) as in_task:
        buf.register(task(request_id=name))
    assert in_task.value.field == "request_id"
    with pytest.raises(InvalidTask):
        buf.finish("p0", 0, 5, name)
    assert set(admin.scan_iter(count=1000)) <= before  # nothing written anywhere
    buf.close()
    admin.close()


def test_every_key_of_a_rank_carries_exactly_its_own_hash_tag(namespace: str) -> None:
    """Valid identifiers that look alike still give distinct tags, and the slot is the tag's."""
    space = KeySpace(namespace)
    seen: dict[str, tuple[str, int]] = {}
    for instance in ("p0", "p0.0", "p0-0", "p0_0", "P0", "0"):
        for rank in (0, 1, 10, 65535):
            keys = space.rank(instance, rank)
            tag = f"{namespace}/{instance}/{rank}"
            for key in (keys.live, keys.pending, keys.expiry, keys.stats, keys.reply("t")):
                assert key.startswith(f"rls:{{{tag}}}:") and key.count("{") == 1 and key.count("}") == 1
                assert key_slot(key.encode()) == key_slot(tag.encode())
                assert space.owner(key) == (instance, rank)
            assert tag not in seen
            seen[tag] = (instance, rank)


def test_docs_show_the_tenant_and_operator_rules_the_library_defines() -> None:
    text = (LUA_DIR.parent / "docs" / "operations" / "topologies.md").read_text()
    assert "ACL SETUSER rls-tenant-a on >PASSWORD " + " ".join(acl.rules("tenant-a", role="tenant")) in text
    assert "ACL SETUSER rls-operator on >PASSWORD " + " ".join(acl.rules(role="operator")) in text
    assert "+function|load" not in " ".join(acl.rules("tenant-a", role="tenant"))


def test_acl_roles_are_checked() -> None:
    with pytest.raises(InvalidConfig) as bad:
        acl.rules(role="admin")
    assert bad.value.field == "role"
