"""The Redis users run: an evicting maxmemory-policy is said loudly (one warning per process and
server, the policies the buffer read, an option that refuses); a server at maxmemory under
noeviction refuses writes with ServerOutOfMemory and changes nothing, while finish and the
sweep still run and drain it. Each on its own redis-server (and Valkey 8.1), started here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterator

import pytest
import redis

from redis_layer_signals import (
    AsyncSignalBuffer,
    CacheTask,
    EvictingServer,
    InvalidConfig,
    InvalidSignal,
    InvalidTask,
    ServerOutOfMemory,
    SignalBuffer,
    SignalBufferError,
)
from redis_layer_signals.ops import acl
from tests.servers import REDIS_SERVER, VALKEY, RedisServer
from tests.topology import ClusterTopology, SentinelTopology

EVICTING = ("allkeys-lru", "volatile-lru", "allkeys-random")
LOGGER = "redis_layer_signals"


def task(slot: int, request_id: str) -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=4096, num_layers=61)


def namespace() -> str:
    return f"ev-{uuid.uuid4().hex[:8]}"


def our_keys(client: redis.Redis, ns: str | None = None) -> dict[bytes, object]:
    """Every rls key (of namespace ``ns`` only, on a server other tests share) with its content,
    to compare the keyspace before and after a call."""
    dump: dict[bytes, object] = {}
    for key in sorted(client.scan_iter(match="rls:*" if ns is None else f"rls:{{{ns}/*")):
        kind = client.type(key)
        if kind == b"hash":
            dump[key] = client.hgetall(key)
        elif kind == b"zset":
            dump[key] = client.zrange(key, 0, -1, withscores=True)
        else:
            dump[key] = client.get(key)
    return dump


def warnings_about(caplog: pytest.LogCaptureFixture, server: str) -> list[str]:
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    return [m for m in messages if "maxmemory-policy" in m and server in m]


@contextlib.contextmanager
def policy_server(policy: str, *options: str, binary: str = REDIS_SERVER) -> Iterator[RedisServer]:
    """A redis-server of its own with ``maxmemory-policy`` (and ``options``) set, removed after."""
    server = RedisServer(["--maxmemory-policy", policy, *options], binary=binary).start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(params=[REDIS_SERVER, VALKEY])
def binary(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# -- eviction policy -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", EVICTING)
def test_evicting_policy_is_warned_once_per_server_and_reported(
    binary: str, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    with policy_server(policy, binary=binary) as server:
        caplog.set_level(logging.WARNING, logger=LOGGER)
        label = f"127.0.0.1:{server.port}"
        first = SignalBuffer.from_url(server.url, namespace=namespace(), env={})
        second = SignalBuffer.from_url(server.url, namespace=namespace(), env={})
        try:
            for buffer in (first, second, first):
                buffer.record("p0", 0, 0, [(1, 10)])
                buffer.register(task(1, "r1"))
                buffer.finish("p0", 0, 1, "r1")
            assert first.policies == {label: policy}
            assert second.server_policies() == {label: policy}
            found = warnings_about(caplog, label)
            assert len(found) == 1, found  # one per process and server, however many buffers
            assert policy in found[0] and "maxmemory-policy noeviction" in found[0]
        finally:
            first.close()
            second.close()


@pytest.mark.parametrize("policy", EVICTING)
def test_refuse_mode_raises_evicting_server_and_writes_nothing(binary: str, policy: str) -> None:
    with (
        policy_server(policy, binary=binary) as server,
        server.client() as client,
        SignalBuffer.from_url(server.url, namespace=namespace(), env={"RLS_EVICTION": "refuse"}) as buffer,
    ):
        for call in (
            lambda: buffer.record("p0", 0, 0, [(1, 10)]),
            lambda: buffer.register(task(1, "r1")),
            lambda: buffer.finish("p0", 0, 1, "r1"),
        ):
            with pytest.raises(EvictingServer) as refused:
                call()
            assert isinstance(refused.value, SignalBufferError)
            assert refused.value.policy == policy and policy in str(refused.value)
        assert our_keys(client) == {}
        # Fixing the server's setting is enough: the next call reads the policy again.
        client.config_set("maxmemory-policy", "noeviction")
        assert buffer.record("p0", 0, 0, [(1, 10)]).buffered


def test_noeviction_and_memory_are_not_warned(binary: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with policy_server("noeviction", binary=binary) as server:
        for url in (server.url, f"memory://{uuid.uuid4().hex}"):
            with SignalBuffer.from_url(url, namespace=namespace(), env={"RLS_EVICTION": "refuse"}) as buffer:
                buffer.record("p0", 0, 0, [(1, 10)])
                assert set(buffer.policies.values()) == {"noeviction"}
        assert [r for r in caplog.records if "maxmemory-policy" in r.getMessage()] == []


def test_eviction_option_is_validated() -> None:
    with pytest.raises(InvalidConfig, match="eviction"):
        SignalBuffer.from_url("memory://", env={}, eviction="sometimes")
    with pytest.raises(InvalidConfig, match="never"):
        SignalBuffer.from_url("memory://", env={"RLS_EVICTION": "never"})


def test_policy_read_from_info_where_config_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """The recommended ACL rule grants INFO, not CONFIG (CONFIG GET shows passwords)."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with policy_server("volatile-lru") as server, server.client() as admin:
        ns = namespace()
        admin.execute_command("ACL", "SETUSER", "tenant", "on", ">pw", *acl.rules(ns))
        url = f"redis://tenant:pw@127.0.0.1:{server.port}/0"
        with SignalBuffer.from_url(url, namespace=ns, env={}) as buffer:
            assert buffer.record("p0", 0, 0, [(1, 10)]).buffered
            assert buffer.policies == {f"127.0.0.1:{server.port}": "volatile-lru"}
        refusing = SignalBuffer.from_url(url, namespace=ns, env={}, eviction="refuse")
        with refusing, pytest.raises(EvictingServer):
            refusing.record("p0", 0, 0, [(2, 10)])
        assert len(warnings_about(caplog, str(server.port))) == 1


def test_policy_read_again_after_a_reconnect() -> None:
    """A reconnect may reach another node (failover, restart): the next call reads again."""
    with (
        policy_server("noeviction") as server,
        server.client() as admin,
        SignalBuffer.from_url(server.url, namespace=namespace(), env={}, eviction="refuse") as buffer,
    ):
        buffer.record("p0", 0, 0, [(1, 10)])
        admin.config_set("maxmemory-policy", "allkeys-lru")
        buffer.record("p0", 0, 0, [(1, 11)])  # same connection: not read again (off the hot path)
        admin.client_kill_filter(_type="normal", skipme=True)
        with pytest.raises(EvictingServer):
            buffer.record("p0", 0, 0, [(1, 12)])


def test_async_buffer_warns_and_refuses(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with policy_server("allkeys-random") as server:

        async def scenario() -> None:
            warn = AsyncSignalBuffer.from_url(server.url, namespace=namespace(), env={})
            refuse = AsyncSignalBuffer.from_url(server.url, namespace=namespace(), env={}, eviction="refuse")
            try:
                await warn.record("p0", 0, 0, [(1, 10)])
                assert warn.policies == {f"127.0.0.1:{server.port}": "allkeys-random"}
                with pytest.raises(EvictingServer):
                    await refuse.record("p0", 0, 0, [(1, 10)])
            finally:
                await warn.close()
                await refuse.close()

        asyncio.run(scenario())
        assert len(warnings_about(caplog, str(server.port))) == 1


def test_cluster_reads_every_primary(cluster: ClusterTopology, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    odd = cluster.primary_nodes()[1]
    admin = odd.client()
    admin.config_set("maxmemory-policy", "volatile-lru")
    try:
        with SignalBuffer.from_url(cluster.url, namespace=namespace(), env={}) as buffer:
            buffer.record("p0", 0, 0, [(1, 10)])
            policies = buffer.policies
        assert len(policies) == len(cluster.primary_nodes())
        assert [server for server, policy in policies.items() if policy != "noeviction"] == [f"127.0.0.1:{odd.port}"]
        assert len(warnings_about(caplog, f"127.0.0.1:{odd.port}")) == 1
        with SignalBuffer.from_url(cluster.url, namespace=namespace(), env={}, eviction="refuse") as buffer:
            with pytest.raises(EvictingServer) as refused:
                buffer.record("p0", 0, 0, [(1, 10)])
            assert refused.value.server == f"127.0.0.1:{odd.port}"
    finally:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.close()


# -- memory full -----------------------------------------------------------------------------


@pytest.fixture(params=[REDIS_SERVER, VALKEY])
def full_server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    with policy_server("noeviction", binary=str(request.param)) as server:
        yield server


def fill(client: redis.Redis) -> None:
    """Another tenant fills the server to its maxmemory (a few MB above what it used), which is
    then set a little below what it uses, so it stays full while a few keys are freed."""
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used + 2 * 1024 * 1024)
    value = b"x" * 16384
    for n in range(10_000):
        try:
            client.set(f"other:{n}", value)
        except redis.exceptions.OutOfMemoryError:
            client.config_set("maxmemory", int(client.info("memory")["used_memory"]) - 256 * 1024)
            return
    raise AssertionError("the server never reached maxmemory")


def test_memory_full_refuses_writes_typed_and_finish_drains(full_server: RedisServer) -> None:
    client = full_server.client()
    try:
        with SignalBuffer.from_url(full_server.url, namespace=namespace(), env={}) as buffer:
            for slot in range(8):
                buffer.register(task(slot, f"live-{slot}"))
                buffer.record("p0", 0, 0, [(slot + 100, 10)])  # early signals of aborted requests
            fill(client)
            before = our_keys(client)
            for call in (
                lambda: buffer.record("p0", 0, 0, [(1, 10), (200, 5)]),
                lambda: buffer.register(task(300, "new")),
                lambda: buffer.register(task(3, "live-3")),
            ):
                with pytest.raises(ServerOutOfMemory, match="out of memory") as refused:
                    call()
                assert isinstance(refused.value.__cause__, redis.exceptions.OutOfMemoryError)
                assert our_keys(client) == before  # nothing changed
            # finish only frees memory: it runs, and what it removes is gone.
            for slot in range(8):
                assert buffer.finish("p0", 0, slot, f"live-{slot}").removed
                assert buffer.finish("p0", 0, slot + 100, "aborted").dropped == 1
            assert buffer.sweep() == 0  # the sweep runs too
            assert buffer.task("p0", 0, 3) is None
            assert buffer.pending("p0", 0, 100) == []
            counters = buffer.stats()
            assert counters["finished"] == 8 and counters["finish_dropped"] == 8
    finally:
        client.close()


def test_memory_full_async_raises_the_typed_error(full_server: RedisServer) -> None:
    client = full_server.client()

    async def scenario() -> None:
        buffer = AsyncSignalBuffer.from_url(full_server.url, namespace=namespace(), env={})
        try:
            await buffer.register(task(1, "r1"))
            fill(client)
            with pytest.raises(ServerOutOfMemory):
                await buffer.record("p0", 0, 0, [(2, 10)])
            assert (await buffer.finish("p0", 0, 1, "r1")).removed
        finally:
            await buffer.close()

    try:
        asyncio.run(scenario())
    finally:
        client.close()


# -- max_layers ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["fake", "real"])
def test_stray_layers_are_refused_and_write_nothing(where: str, redis_server: RedisServer) -> None:
    url = redis_server.url if where == "real" else f"memory://{uuid.uuid4().hex}"
    ns = namespace()
    with SignalBuffer.from_url(url, namespace=ns, env={"RLS_MAX_LAYERS": "64"}) as buffer:
        assert buffer.config.max_layers == 64
        assert buffer.record("p0", 0, 63, [(1, 10)]).buffered
        before = our_keys(buffer.client, ns)
        for layer in (64, 3061, 2**40):
            with pytest.raises(InvalidSignal, match=r"must be in \[0, 64\) \(max_layers\)") as refused:
                buffer.record("p0", 0, layer, [(1, 10)])
            assert refused.value.field == "layer" and refused.value.value == layer
        with pytest.raises(InvalidTask, match=r"must be in \[1, 64\] \(max_layers\)") as refused_task:
            buffer.register(CacheTask("p0", 0, 1, "r1", need_prefill_tokens=10, num_layers=65))
        assert refused_task.value.field == "num_layers"
        assert our_keys(buffer.client, ns) == before
        assert buffer.register(CacheTask("p0", 0, 1, "r1", need_prefill_tokens=10, num_layers=64)).recovered


def test_max_layers_default_and_validation() -> None:
    assert SignalBuffer.from_url("memory://", env={}).config.max_layers == 1024
    for bad in (0, -1, "many"):
        with pytest.raises(InvalidConfig, match="max_layers"):
            SignalBuffer.from_url("memory://", env={}, max_layers=bad)


# -- evidence of loss ------------------------------------------------------------------------


def test_eviction_is_evidenced_by_the_exporter(binary: str) -> None:
    """volatile-lru (several managed services' default) evicts our keys, which all carry a
    TTL, but not the counters: only their mismatch, and the server's evicted_keys, show it."""
    from redis_layer_signals.ops.metrics import BufferMetrics
    from tests.test_metrics import sample

    with policy_server("volatile-lru", "--maxmemory-samples", "10", binary=binary) as server, server.client() as client:
        metrics = BufferMetrics()
        with SignalBuffer.from_url(server.url, namespace=namespace(), env={}, pending_ttl_s=3600) as buffer:
            metrics.track(buffer)
            for rank in range(20):
                buffer.record("p0", rank, 0, [(slot, 10) for slot in range(50)])
            client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 1024 * 1024)
            value = b"x" * 8192
            n = 0
            while sum(client.exists(buffer.protocol.keys.rank("p0", r).pending) for r in range(20)) == 20:
                client.set(f"other:{n}", value, ex=3600)  # another tenant's cache, with TTLs
                n += 1
                assert n < 20_000, "nothing of ours was evicted"
            text = metrics.render().decode()
            label = f"127.0.0.1:{server.port}"
            assert sample(text, "rls_server_evicting", server=label, policy="volatile-lru") == 1
            assert (sample(text, "rls_server_evicted_keys_total", server=label) or 0) > 0
            lost = [
                sample(text, "rls_counter_mismatch", namespace=buffer.config.namespace, instance="p0", rank=str(r))
                for r in range(20)
            ]
            assert any(value and value > 0 for value in lost), lost
            assert buffer.stats(sweep=False)["buffered"] == 1000  # the counters survived


def test_exporter_works_under_its_read_only_acl_rules() -> None:
    from redis_layer_signals.ops.metrics import BufferMetrics
    from tests.test_metrics import sample

    with policy_server("allkeys-lru") as server, server.client() as admin:
        ns = namespace()
        with SignalBuffer.from_url(server.url, namespace=ns, env={}) as writer:
            writer.record("p0", 0, 0, [(1, 10), (2, 10)])
        admin.execute_command("ACL", "SETUSER", "exporter", "on", ">pw", *acl.exporter_rules(ns))
        metrics = BufferMetrics()
        with SignalBuffer.from_url(f"redis://exporter:pw@127.0.0.1:{server.port}/0", namespace=ns, env={}) as reader:
            metrics.track(reader)
            text = metrics.render().decode()
            assert sample(text, "rls_up", namespace=ns) == 1
            assert sample(text, "rls_buffered_total", namespace=ns, instance="p0", rank="0") == 2
            assert sample(text, "rls_counter_mismatch", namespace=ns, instance="p0", rank="0") == 0
            assert sample(text, "rls_server_evicting", server=f"127.0.0.1:{server.port}", policy="allkeys-lru") == 1
            with pytest.raises(redis.exceptions.NoPermissionError):
                reader.client.hset(reader.protocol.keys.rank("p0", 0).stats, "buffered", 0)


def test_a_policy_that_cannot_be_read_is_warned_about_not_refused(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with policy_server("allkeys-lru") as server, server.client() as admin:
        ns = namespace()
        rules = [rule for rule in acl.rules(ns) if rule != "+info"]
        admin.execute_command("ACL", "SETUSER", "blind", "on", ">pw", *rules)
        url = f"redis://blind:pw@127.0.0.1:{server.port}/0"
        with SignalBuffer.from_url(url, namespace=ns, env={}, eviction="refuse") as buffer:
            assert buffer.record("p0", 0, 0, [(1, 10)]).buffered
            assert buffer.policies == {f"127.0.0.1:{server.port}": "unknown"}
        found = [r.getMessage() for r in caplog.records if "cannot read the maxmemory-policy" in r.getMessage()]
        assert len(found) == 1 and str(server.port) in found[0]


def test_sentinel_primary_is_checked(sentinel_group: SentinelTopology) -> None:
    primary = sentinel_group.current_primary()
    with SignalBuffer.from_url(sentinel_group.url, namespace=namespace(), env={}, eviction="refuse") as buffer:
        assert buffer.record("p0", 0, 0, [(1, 10)]).buffered
        assert buffer.policies == {"sentinel:" + sentinel_group.url.rsplit("/", 1)[1]: "noeviction"}
    admin = primary.client()
    try:
        admin.config_set("maxmemory-policy", "allkeys-lru")
        refusing = SignalBuffer.from_url(sentinel_group.url, namespace=namespace(), env={}, eviction="refuse")
        with refusing, pytest.raises(EvictingServer):
            refusing.record("p0", 0, 0, [(1, 10)])
    finally:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.close()


def test_async_cluster_reads_every_primary(cluster: ClusterTopology) -> None:
    async def scenario() -> dict[str, str]:
        buffer = AsyncSignalBuffer.from_url(cluster.url, namespace=namespace(), env={})
        try:
            await buffer.record("p0", 0, 0, [(1, 10)])
            return buffer.policies
        finally:
            await buffer.close()

    policies = asyncio.run(scenario())
    assert sorted(policies) == sorted(f"127.0.0.1:{node.port}" for node in cluster.primary_nodes())
    assert set(policies.values()) == {"noeviction"}


def test_bridge_health_and_rls_stats_name_an_evicting_server() -> None:
    """The policy is reported where operators look: the FastDeploy bridge's health() and the
    caption of `rls stats`; a noeviction server shows there as such, with no warning."""
    from redis_layer_signals.fastdeploy import Layer0Bridge
    from tests.test_cli import rls

    for policy in ("allkeys-lru", "noeviction"):
        with policy_server(policy) as server:
            ns = namespace()
            buffer = SignalBuffer.from_url(server.url, namespace=ns, env={})
            bridge = Layer0Bridge(buffer, "p0", 0, num_layers=4)
            try:
                buffer.record("p0", 0, 0, [(1, 10)])  # the buffer's first call reads the policy
                label = f"127.0.0.1:{server.port}"
                expected = {label: policy} if policy != "noeviction" else {}
                assert bridge.health().evicting == expected
                done = rls("stats", "--redis", server.url, "--namespace", ns)
                assert done.returncode == 0, done.stderr
                caption = " ".join(done.stdout.split())
                assert f"maxmemory-policy: {label} {policy}" in caption
                assert ("set noeviction" in caption) == (policy != "noeviction")
            finally:
                bridge.close()
                buffer.close()
