"""Durability settings said at run time: a server without AOF, a Sentinel primary with
min-replicas-to-write 0 and a Cluster with replicas used with wait_replicas=0 are each warned
about once per process, server and setting, named in ``server_policies().durability`` and
exported as ``rls_server_durability_risk``; where CONFIG is refused they are read from INFO,
and where INFO is refused too they are "unknown", and the calls still run. Each on real
servers started here (tests/servers.py, tests/topology.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Iterator

import pytest
import redis

from redis_layer_signals import AsyncSignalBuffer, SignalBuffer
from redis_layer_signals.ops import acl
from redis_layer_signals.ops.metrics import BufferMetrics
from redis_layer_signals.server import said
from redis_layer_signals.server.durability import (
    APPENDONLY,
    AT_LEAST_ONE,
    MIN_REPLICAS,
    UNKNOWN,
    WAIT_REPLICAS,
    ServerPolicies,
    conclude,
    warning,
)
from tests.servers import REDIS_SERVER, VALKEY, RedisServer
from tests.test_metrics import sample
from tests.topology import ClusterTopology, SentinelTopology

LOGGER = "redis_layer_signals"


def namespace() -> str:
    return f"du-{uuid.uuid4().hex[:8]}"


def warnings_naming(caplog: pytest.LogCaptureFixture, server: str, setting: str) -> list[str]:
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    return [m for m in messages if server in m and setting in m]


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test counts its warnings as a new process would: "once per process" would otherwise
    hide a warning that another test, on the same session-wide Sentinel or Cluster, gave first."""
    monkeypatch.setattr(said, "_said", set())


@pytest.fixture
def no_aof(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    server = RedisServer(["--appendonly", "no"], binary=getattr(request, "param", REDIS_SERVER)).start()
    yield server
    server.cleanup()


@pytest.mark.parametrize("no_aof", [REDIS_SERVER, VALKEY], indirect=True)
def test_a_server_without_aof_is_warned_once_named_and_exported(
    no_aof: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    label = f"127.0.0.1:{no_aof.port}"
    metrics = BufferMetrics()
    first = SignalBuffer.from_url(no_aof.url, namespace=namespace(), env={})
    second = SignalBuffer.from_url(no_aof.url, namespace=namespace(), env={})
    try:
        for buffer in (first, second, first):
            assert buffer.record("p0", 0, 0, [(1, 10)]).buffered  # the check never fails a call
        assert first.durability == {label: {APPENDONLY: "no"}}
        policies = second.server_policies()
        assert isinstance(policies, ServerPolicies) and policies == {label: "noeviction"}  # as it always was
        assert policies.durability == {label: {APPENDONLY: "no"}}
        assert policies.durability_risks() == {label: {APPENDONLY: "no"}}
        found = warnings_naming(caplog, label, "appendonly no")
        assert len(found) == 1, found  # one per process and server, however many buffers and reads
        assert "restart" in found[0] and "appendonly yes" in found[0]
        metrics.track(first)
        text = metrics.render().decode()
        assert sample(text, "rls_server_durability_risk", server=label, setting="appendonly") == 1
    finally:
        first.close()
        second.close()


def test_a_server_with_aof_is_not_warned_and_exports_0(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    server = RedisServer(["--appendonly", "yes", "--appendfsync", "always"]).start()
    label = f"127.0.0.1:{server.port}"
    metrics = BufferMetrics()
    try:
        with SignalBuffer.from_url(server.url, namespace=namespace(), env={}) as buffer:
            buffer.record("p0", 0, 0, [(1, 10)])
            assert buffer.durability == {label: {APPENDONLY: "yes"}}
            assert buffer.server_policies().durability_risks() == {}
            metrics.track(buffer)
            text = metrics.render().decode()
            assert sample(text, "rls_server_durability_risk", server=label, setting="appendonly") == 0
        assert warnings_naming(caplog, label, "") == []
    finally:
        server.cleanup()


def test_memory_is_not_judged() -> None:
    with SignalBuffer.from_url(f"memory://{uuid.uuid4().hex}", namespace=namespace(), env={}) as buffer:
        buffer.record("p0", 0, 0, [(1, 10)])
        assert buffer.durability == {}
        assert buffer.server_policies().durability == {}


def test_where_config_is_denied_settings_come_from_info(no_aof: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """The tenant rule grants INFO, not CONFIG (CONFIG GET shows passwords): INFO persistence says it."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    admin = no_aof.client()
    label = f"127.0.0.1:{no_aof.port}"
    try:
        ns = namespace()
        admin.execute_command("ACL", "SETUSER", "tenant", "on", ">pw", *acl.rules(ns))
        url = f"redis://tenant:pw@127.0.0.1:{no_aof.port}/0"
        with SignalBuffer.from_url(url, namespace=ns, env={}) as buffer:
            with pytest.raises(redis.exceptions.NoPermissionError):
                buffer.client.config_get("appendonly")  # CONFIG is indeed refused to this user
            assert buffer.record("p0", 0, 0, [(1, 10)]).buffered
            assert buffer.durability == {label: {APPENDONLY: "no"}}
        assert len(warnings_naming(caplog, label, "appendonly no")) == 1
    finally:
        admin.close()


def test_where_config_and_info_are_denied_the_setting_is_unknown_and_calls_run(
    no_aof: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    admin = no_aof.client()
    label = f"127.0.0.1:{no_aof.port}"
    metrics = BufferMetrics()
    try:
        ns = namespace()
        rules = [rule for rule in acl.rules(ns) if rule != "+info"]
        admin.execute_command("ACL", "SETUSER", "blind", "on", ">pw", *rules)
        url = f"redis://blind:pw@127.0.0.1:{no_aof.port}/0"
        with SignalBuffer.from_url(url, namespace=ns, env={}) as buffer:
            assert buffer.record("p0", 0, 0, [(1, 10)]).buffered
            assert buffer.durability == {label: {APPENDONLY: UNKNOWN}}
            assert buffer.server_policies().durability_risks() == {}  # unknown is no risk found
            metrics.track(buffer)
            assert "rls_server_durability_risk{" not in metrics.render().decode()  # left out, not 0
        found = warnings_naming(caplog, label, "cannot read appendonly")
        assert len(found) == 1 and "+info" in found[0], found
    finally:
        admin.close()


def test_async_buffer_reads_and_warns(no_aof: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    label = f"127.0.0.1:{no_aof.port}"

    async def scenario() -> ServerPolicies:
        buffer = AsyncSignalBuffer.from_url(no_aof.url, namespace=namespace(), env={})
        try:
            await buffer.record("p0", 0, 0, [(1, 10)])
            assert buffer.durability == {label: {APPENDONLY: "no"}}
            return await buffer.server_policies()
        finally:
            await buffer.close()

    policies = asyncio.run(scenario())
    assert policies.durability == {label: {APPENDONLY: "no"}}
    assert len(warnings_naming(caplog, label, "appendonly no")) == 1


def test_a_reconnect_reads_the_settings_again(no_aof: RedisServer) -> None:
    """A reconnect may reach another node (failover, restart): the next call reads again."""
    admin = no_aof.client()
    label = f"127.0.0.1:{no_aof.port}"
    try:
        with SignalBuffer.from_url(no_aof.url, namespace=namespace(), env={}) as buffer:
            buffer.record("p0", 0, 0, [(1, 10)])
            assert buffer.durability[label][APPENDONLY] == "no"
            admin.config_set("appendonly", "yes")
            admin.client_kill_filter(_type="normal", skipme=True)
            buffer.record("p0", 0, 0, [(1, 11)])
            assert buffer.durability[label][APPENDONLY] == "yes"
    finally:
        admin.close()


# -- Sentinel: min-replicas-to-write ---------------------------------------------------------------


def test_sentinel_primary_without_min_replicas_to_write_is_warned(
    sentinel_group: SentinelTopology, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    label = "sentinel:" + sentinel_group.url.rsplit("/", 1)[1]
    primary = sentinel_group.current_primary()
    admin = primary.client()
    metrics = BufferMetrics()
    try:
        admin.config_set("min-replicas-to-write", 0)
        with SignalBuffer.from_url(sentinel_group.url, namespace=namespace(), env={}) as buffer:
            assert buffer.record("p0", 0, 0, [(1, 10)]).buffered
            assert buffer.durability == {label: {APPENDONLY: "yes", MIN_REPLICAS: "0"}}  # the fixture runs AOF
            assert buffer.server_policies().durability_risks() == {label: {MIN_REPLICAS: "0"}}
            metrics.track(buffer)
            text = metrics.render().decode()
            assert sample(text, "rls_server_durability_risk", server=label, setting=MIN_REPLICAS) == 1
            assert sample(text, "rls_server_durability_risk", server=label, setting=APPENDONLY) == 0
        found = warnings_naming(caplog, label, "min-replicas-to-write 0")
        assert len(found) == 1 and "failover" in found[0] and "min-replicas-to-write 1" in found[0], found

        admin.config_set("min-replicas-to-write", 1)
        with SignalBuffer.from_url(sentinel_group.url, namespace=namespace(), env={}) as buffer:
            assert buffer.record("p0", 0, 0, [(1, 10)]).buffered
            assert buffer.durability == {label: {APPENDONLY: "yes", MIN_REPLICAS: "1"}}
            assert buffer.server_policies().durability_risks() == {}
    finally:
        admin.config_set("min-replicas-to-write", 0)  # as the fixture's other tests expect it
        admin.close()


def test_min_replicas_to_write_is_read_from_info_where_config_is_refused() -> None:
    """INFO replication lists min_slaves_good_slaves only while min-replicas-to-write is on."""
    sentinel = "sentinel"
    off = {"role": "master", "connected_slaves": 1}
    on = {**off, "min_slaves_good_slaves": 1}
    assert conclude(sentinel, 0, {}, off) == {APPENDONLY: UNKNOWN, MIN_REPLICAS: "0"}
    assert conclude(sentinel, 0, {}, {**on, "aof_enabled": 1}) == {APPENDONLY: "yes", MIN_REPLICAS: AT_LEAST_ONE}
    assert conclude(sentinel, 0, {}, None) == {APPENDONLY: UNKNOWN, MIN_REPLICAS: UNKNOWN}
    lag_off = {APPENDONLY: "yes", MIN_REPLICAS: "1", "min-replicas-max-lag": "0"}  # max-lag 0 turns it off
    assert conclude(sentinel, 0, lag_off, None)[MIN_REPLICAS] == "0"


# -- Cluster: wait_replicas ------------------------------------------------------------------


def test_cluster_with_replicas_and_wait_replicas_0_is_warned_per_primary(
    cluster_with_replicas: ClusterTopology, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    primaries = {f"127.0.0.1:{node.port}" for node in cluster_with_replicas.primary_nodes()}
    with SignalBuffer.from_url(cluster_with_replicas.url, namespace=namespace(), env={}) as buffer:
        assert buffer.record("p0", 0, 0, [(1, 10)]).buffered
        assert set(buffer.durability) == primaries
        assert all(found == {APPENDONLY: "yes", WAIT_REPLICAS: "0"} for found in buffer.durability.values())
    for server in primaries:
        found = warnings_naming(caplog, server, "wait_replicas=0")
        assert len(found) == 1 and "failover" in found[0] and "wait_replicas=1" in found[0], found

    caplog.clear()
    with SignalBuffer.from_url(cluster_with_replicas.url, namespace=namespace(), env={}, wait_replicas=1) as buffer:
        assert buffer.record("p0", 0, 0, [(1, 10)]).buffered
        policies = buffer.server_policies()
        assert all(found[WAIT_REPLICAS] == "1" for found in policies.durability.values())
        assert policies.durability_risks() == {}
    assert [r for r in caplog.records if "wait_replicas" in r.getMessage()] == []


def test_cluster_without_replicas_has_no_failover_to_lose_writes_in(cluster: ClusterTopology) -> None:
    with SignalBuffer.from_url(cluster.url, namespace=namespace(), env={}) as buffer:
        buffer.record("p0", 0, 0, [(1, 10)])
        primaries = {f"127.0.0.1:{node.port}" for node in cluster.primary_nodes()}
        assert buffer.durability == {server: {APPENDONLY: "no"} for server in primaries}  # the fixture runs no AOF


def test_each_warning_names_what_is_lost_and_the_setting_that_prevents_it() -> None:
    for setting, value, fix in (
        (APPENDONLY, "no", "appendonly yes"),
        (MIN_REPLICAS, "0", "min-replicas-to-write 1"),
        (WAIT_REPLICAS, "0", "wait_replicas=1"),
    ):
        text = warning("10.0.0.5:6379", setting, value)
        assert text.startswith("Redis 10.0.0.5:6379 ") and fix in text
        assert "loses" in text or "lack" in text


def test_rls_says_a_risky_setting_once_as_a_warning_line(no_aof: RedisServer) -> None:
    from tests.servers import rls

    ns = namespace()
    with SignalBuffer.from_url(no_aof.url, namespace=ns, env={}) as buffer:
        buffer.record("p0", 0, 0, [(1, 10)])
    done = rls("stats", "--redis", no_aof.url, "--namespace", ns)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [line for line in lines if line.startswith("rls: warning: ")], done.stderr
    assert len([line for line in lines if "appendonly no" in line]) == 1, done.stderr


def warning_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` that say a server keeps no AOF, whatever their voice."""
    return [line for line in stderr.splitlines() if "has appendonly no" in line]


def test_rls_simulate_on_a_server_without_aof_says_it_once_not_once_per_process(no_aof: RedisServer) -> None:
    """`rls simulate --requests 4` started five processes and each said the warning, bare."""
    from tests.servers import rls

    done = rls("simulate", "--requests", "4", "--layers", "4", "--redis", no_aof.url, "--namespace", namespace())
    assert done.returncode == 0, done.stderr
    found = warning_lines(done.stderr)
    assert len(found) == 1, done.stderr
    assert found[0].startswith(f"rls: warning: Redis 127.0.0.1:{no_aof.port} has appendonly no: ")


@pytest.mark.parametrize(
    ("command", "code"),
    [
        (("inspect",), 0),
        (("stats",), 0),
        (("purge",), 1),  # refused without --yes, after the warning
        (("metrics", "--port", "0", "--host", "127.0.0.1", "--duration-s", "0.2"), 0),
        (("registrar", "--idle-exit-s", "0.2"), 0),
    ],
    ids=lambda c: c[0] if isinstance(c, tuple) else str(c),
)
def test_every_command_that_talks_to_a_server_says_its_risky_settings_in_one_voice(
    no_aof: RedisServer, command: tuple[str, ...], code: int
) -> None:
    """`rls inspect` and `rls metrics` said nothing of a server that keeps no AOF."""
    from tests.servers import rls

    ns = namespace()
    with SignalBuffer.from_url(no_aof.url, namespace=ns, env={}) as buffer:
        buffer.record("p0", 0, 0, [(1, 10)])
    done = rls(*command, "--redis", no_aof.url, "--namespace", ns)
    assert done.returncode == code, done.stderr
    found = warning_lines(done.stderr)
    assert len(found) == 1 and found[0].startswith(f"rls: warning: Redis 127.0.0.1:{no_aof.port} "), done.stderr


def test_a_child_process_leaves_unsaid_what_its_command_said(no_aof: RedisServer) -> None:
    """The library alone still warns once per process; a process started by a command that said
    the warning (RLS_SAID_WARNINGS in its environment) does not repeat it, and says other news."""
    import subprocess
    import sys

    from redis_layer_signals.server.said import SAID_VARIABLE

    code = (
        "import sys; from redis_layer_signals import SignalBuffer\n"
        "with SignalBuffer.from_url(sys.argv[1], namespace='child', env={}) as b: b.server_policies()\n"
    )
    said = warning(f"127.0.0.1:{no_aof.port}", APPENDONLY, "no")
    other = warning("10.0.0.5:6379", APPENDONLY, "no")
    for parent_said, repeated in (("", 1), (f"{other}", 1), (f"{other}\n{said}", 0)):
        environment = {k: v for k, v in os.environ.items() if not k.startswith("RLS_")}
        done = subprocess.run(
            [sys.executable, "-c", code, no_aof.url],
            capture_output=True,
            text=True,
            timeout=60,
            env={**environment, SAID_VARIABLE: parent_said},
        )
        assert done.returncode == 0, done.stderr
        assert len(warning_lines(done.stderr)) == repeated, (parent_said, done.stderr)


def test_a_reply_not_understood_is_unknown_never_an_error() -> None:
    assert conclude("cluster", 0, {}, {"aof_enabled": "?", "connected_slaves": None}) == {
        APPENDONLY: UNKNOWN,
        WAIT_REPLICAS: UNKNOWN,
    }
    assert conclude("single", 0, {}, "not a mapping") == {APPENDONLY: UNKNOWN}
