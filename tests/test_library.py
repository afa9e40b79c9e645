"""The Functions library: what it is made of, that Redis 7.0 and Valkey 8.1 load it as it is,
and how a server without it (FUNCTION FLUSH, a restart without persistence, a new Cluster
node) gets it back in the middle of a run without a call running twice or not at all."""

from __future__ import annotations

import hashlib
import re

import pytest
import redis

from redis_layer_signals import CacheTask, SignalBuffer
from redis_layer_signals.server.library import (
    DIGEST_FUNCTION,
    DIGEST_PLACEHOLDER,
    FILES,
    FUNCTIONS,
    LIBRARY_NAME,
    OPERATIONS,
    _lua_dir,
    library,
    load_library,
)
from tests.servers import RedisServer, library_functions
from tests.topology import ClusterTopology


def task(slot: int = 5, request_id: str = "req-1") -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=4096, num_layers=61)


def functions_on(client: redis.Redis) -> set[str]:
    return library_functions(client, LIBRARY_NAME)


def test_the_library_is_the_lua_files_joined_and_named_with_its_version_and_digest() -> None:
    built = library()
    assert built.code.startswith(f"#!lua name={LIBRARY_NAME}\n")
    source = "\n".join((_lua_dir() / name).read_text() for name in FILES)
    assert built.digest == hashlib.sha256(source.encode()).hexdigest()
    assert built.code == source.replace(DIGEST_PLACEHOLDER, built.digest)
    plain = r"\('(\w+)' \.\. DIGEST, \w+\)"
    flagged = r"\{function_name = '(\w+)' \.\. DIGEST, callback = \w+, flags = \{'allow-oom'\}\}"  # finish, sweep
    found = re.findall(rf"^redis\.register_function(?:{plain}|{flagged})$", source, re.MULTILINE)
    registered = [a or b for a, b in found]
    assert [f"{name}{built.digest}" for name in registered] == [FUNCTIONS[operation] for operation in OPERATIONS]
    assert all(name.startswith(LIBRARY_NAME + "_") for name in FUNCTIONS.values())
    assert "@helpers" not in built.code


@pytest.mark.parametrize("name", FILES[1:])
def test_each_function_file_documents_its_keys_args_reply_and_guarantees(name: str) -> None:
    header = (_lua_dir() / name).read_text().split("\nlocal function", 1)[0]
    for part in ("keys[1]", "args[1]", "Reply:", "Guarantees:"):
        assert part in header, (name, part)


def test_no_lua_file_builds_a_key_name() -> None:
    """Keys come from the call's keys only: no key prefix or hash tag appears in the Lua."""
    for name in FILES:
        text = (_lua_dir() / name).read_text()
        assert "rls:" not in text and "'{" not in text and '"{' not in text, name


@pytest.mark.parametrize("server", ["redis_server", "valkey_8"])
def test_redis_7_0_and_valkey_8_1_load_the_library_as_it_is(server: str, request: pytest.FixtureRequest) -> None:
    """Redis 7.0 refuses globals while a library loads: this is where using one would fail."""
    started: RedisServer = request.getfixturevalue(server)
    client = started.client()
    try:
        load_library(client, replace=True)
        load_library(client, replace=True)  # the operator's REPLACE of the same code
        assert functions_on(client) == set(FUNCTIONS.values())
    finally:
        client.close()


def test_a_call_resent_after_function_flush_replays_its_first_reply(buf: SignalBuffer) -> None:
    """The reply of a call was lost, and the library flushed before the resend (on the Cluster,
    from every primary): the resend loads the library and gets the first reply, so the signal
    is not buffered twice."""
    prepared = buf.protocol.record("p0", 0, 0, [(5, 100)])
    assert prepared.call is not None
    first = buf._run_script(prepared.call)
    buf.client.function_flush()
    assert buf._run_script(prepared.call) == first
    stats = buf.stats()
    assert (stats["buffered"], stats["replayed"]) == (1, 1)
    buf.client.function_flush()
    rec = buf.register(task())
    assert [(s.layer, s.tokens) for s in rec.recovered] == [(0, 100)]
    buf.client.function_flush()
    assert buf.finish("p0", 0, 5, "req-1").removed


def test_a_cluster_primary_without_the_library_gets_it_back_and_the_others_keep_it(
    cluster: ClusterTopology, namespace: str
) -> None:
    """A node that lost the library (as a new node or a promoted replica would) answers
    "Function not found" for the ranks it serves; the call loads it and goes through."""
    buf = SignalBuffer.from_url(cluster.url, namespace=namespace, env={})
    buf.record("p0", 0, 0, [(5, 100)])  # the rank's primary has the library now
    owner = cluster.node_for_key(buf.protocol.keys.rank("p0", 0).pending)
    others = [node for node in cluster.primary_nodes() if node.port != owner.port]
    had = {}
    for node in others:
        with node.client() as client:
            had[node.port] = functions_on(client)
    with owner.client() as client:
        client.function_flush()
        assert functions_on(client) == set()
    rec = buf.register(task())
    assert [(s.layer, s.tokens) for s in rec.recovered] == [(0, 100)]
    with owner.client() as client:
        assert functions_on(client) == set(FUNCTIONS.values())
    for node in others:  # loaded on the node that answered only; the others keep what they had
        with node.client() as client:
            assert functions_on(client) == had[node.port], node.port
    buf.close()


def test_only_the_functions_that_free_memory_run_when_the_server_is_full(redis_server: RedisServer) -> None:
    """finish and sweep carry allow-oom (a full server drains through them); record and register
    do not, so Redis refuses them before they run when it is at maxmemory."""
    client = redis_server.client()
    try:
        load_library(client, replace=True)  # the same code: the server may have it already
        flags = {}
        for entry in client.function_list(library=LIBRARY_NAME):
            fields = dict(zip(entry[::2], entry[1::2], strict=True))
            for function in fields[b"functions"]:
                described = dict(zip(function[::2], function[1::2], strict=True))
                flags[described[b"name"].decode()] = sorted(flag.decode() for flag in described[b"flags"])
        assert flags == {
            FUNCTIONS["record"]: [],
            FUNCTIONS["register"]: [],
            FUNCTIONS["finish"]: ["allow-oom"],
            FUNCTIONS["sweep"]: ["allow-oom"],
            FUNCTIONS["apply"]: [],
            FUNCTIONS["claim"]: [],
            FUNCTIONS["permissions"]: ["no-writes"],
            DIGEST_FUNCTION: ["no-writes"],
        }
    finally:
        client.close()
