"""URL schemes that reach a single server: redis://, unix:// and the embedded memory://."""

from __future__ import annotations

from pathlib import Path

import pytest

from redis_layer_signals import CacheTask, InvalidConfig, SignalBuffer
from tests.servers import RedisServer


def roundtrip(buf: SignalBuffer) -> list[int]:
    buf.record("p0", 0, 0, [(1, 10)])
    return [s.tokens for s in buf.register(CacheTask("p0", 0, 1, "r", 10, 1)).recovered]


def test_unix_socket_url(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    server = RedisServer(["--unixsocket", str(sock), "--unixsocketperm", "700"]).start()
    try:
        buf = SignalBuffer.from_url(f"unix://{sock}?db=0", namespace="unix", env={})
        assert roundtrip(buf) == [10]
        assert server.client().exists("rls:{unix/p0/0}:stats") == 1
        buf.close()
    finally:
        server.cleanup()


def test_memory_urls_share_one_server_per_name() -> None:
    a = SignalBuffer.from_url("memory://shared-name", namespace="m", env={})
    b = SignalBuffer.from_url("memory://shared-name", namespace="m", env={})
    c = SignalBuffer.from_url("memory://other-name", namespace="m", env={})
    a.record("p0", 0, 0, [(1, 10)])
    assert [s.tokens for s in b.pending("p0", 0, 1)] == [10]
    assert c.pending("p0", 0, 1) == []


def test_bring_your_own_client(redis_server: RedisServer, namespace: str) -> None:
    buf = SignalBuffer(redis_server.client(), namespace=namespace, env={})
    assert roundtrip(buf) == [10]


def test_decoded_client_works_too(redis_server: RedisServer, namespace: str) -> None:
    buf = SignalBuffer(redis_server.client(decode_responses=True), namespace=namespace, env={})
    assert roundtrip(buf) == [10]
    assert buf.task("p0", 0, 1) is not None and buf.stats()["recovered"] == 1


@pytest.mark.parametrize("url", ["ftp://x", "localhost:6379", "redis+cluster://", "redis+sentinel://h:1"])
def test_bad_urls_raise_invalid_config(url: str) -> None:
    with pytest.raises(InvalidConfig) as err:
        SignalBuffer.from_url(url, env={})
    assert err.value.field == "url"
