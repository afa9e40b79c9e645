"""URL schemes that reach a single server: redis://, unix:// and the embedded memory://."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from redis_layer_signals import AsyncSignalBuffer, BufferUnavailable, CacheTask, InvalidConfig, SignalBuffer
from redis_layer_signals.transport.deadline import MARGIN_S
from tests.servers import RedisServer, free_port


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


# -- URL mistakes said as such ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("tail", "database"),
    [("/abc", "abc"), ("/-1", "-1"), ("/1/2", "1/2"), ("/0?db=abc", "abc"), ("?db=-3", "-3")],
)
def test_database_that_is_not_a_number_is_refused_not_read_as_zero(
    redis_server: RedisServer, tail: str, database: str
) -> None:
    """redis-py reads ``redis://host:port/abc`` as database 0 and says nothing: a typo in the
    database would then share database 0 with whatever else uses it."""
    url = f"redis://127.0.0.1:{redis_server.port}{tail}"
    with pytest.raises(InvalidConfig) as err:
        SignalBuffer.from_url(url, namespace="db-typo", env={})
    assert (err.value.field, err.value.value) == ("url", url)
    assert f"database {database!r}" in str(err.value) and "must be a number, 0 or more" in str(err.value)


@pytest.mark.parametrize(
    "url",
    [
        "unix:///tmp/rls-no-such.sock?db=abc",
        "redis+sentinel://127.0.0.1:{port}/mymaster?db=abc",
        "rediss://127.0.0.1:{port}/abc",
    ],
)
def test_database_typo_is_refused_on_every_scheme_before_connecting(url: str) -> None:
    url = url.format(port=free_port())  # nothing listens there: only a check before connecting answers
    for make in (SignalBuffer.from_url, AsyncSignalBuffer.from_url):
        with pytest.raises(InvalidConfig, match=r"database 'abc' \(.+\) must be a number, 0 or more"):
            make(url, namespace="db-typo", env={})


@pytest.mark.parametrize("tail", ["/3", "?db=1"])
def test_cluster_url_with_a_database_other_than_zero_is_refused(tail: str) -> None:
    url = f"redis+cluster://127.0.0.1:{free_port()}{tail}"
    with pytest.raises(InvalidConfig, match=r"a Redis Cluster has database 0 only") as err:
        SignalBuffer.from_url(url, env={})
    assert err.value.field == "url"


def test_url_error_hides_the_password() -> None:
    with pytest.raises(InvalidConfig) as err:
        SignalBuffer.from_url(f"redis://rls:s3cret@127.0.0.1:{free_port()}/abc", env={})
    assert "s3cret" not in str(err.value) and "rls:***@" in str(err.value)


def test_port_redis_py_cannot_read_is_invalid_config() -> None:
    with pytest.raises(InvalidConfig, match="Port could not be cast") as err:
        SignalBuffer.from_url("redis://127.0.0.1:abc/0", env={})
    assert err.value.field == "url"


RETRY_S = 0.5


def test_rediss_against_a_plain_server_says_it_may_not_speak_tls(redis_server: RedisServer) -> None:
    """A plain server reads the ClientHello as the start of a command and waits: redis-py
    said only ``Timeout connecting to server``, which sends the reader to the network."""
    url = redis_server.url.replace("redis://", "rediss://", 1)
    buf = SignalBuffer.from_url(url, namespace="tls-typo", retry_s=RETRY_S, env={})
    with pytest.raises(BufferUnavailable, match="did not complete"):  # builds redis-py's SSL context
        buf.record("p0", 0, 0, [(1, 10)])
    started = time.monotonic()
    with pytest.raises(BufferUnavailable) as err:
        buf.record("p0", 0, 0, [(1, 10)])
    elapsed = time.monotonic() - started
    message = str(err.value)
    assert f"TLS handshake with 127.0.0.1:{redis_server.port} did not complete" in message
    assert "is the server started with TLS (tls-port)? use redis:// for a plain server" in message
    assert isinstance(err.value.__cause__, RedisConnectionError)
    assert err.value.__cause__.__cause__ is not None  # the SSL error or timeout itself, kept
    assert elapsed < RETRY_S + MARGIN_S
    assert list(redis_server.client().scan_iter(match="rls:{tls-typo/*")) == []
    buf.close()


def test_async_rediss_against_a_plain_server_says_it_may_not_speak_tls(redis_server: RedisServer) -> None:
    url = redis_server.url.replace("redis://", "rediss://", 1)

    async def record() -> tuple[BufferUnavailable, float]:
        buf = AsyncSignalBuffer.from_url(url, namespace="tls-typo", retry_s=RETRY_S, env={})
        started = time.monotonic()
        try:
            with pytest.raises(BufferUnavailable) as err:
                await buf.record("p0", 0, 0, [(1, 10)])
            return err.value, time.monotonic() - started
        finally:
            await buf.close()

    error, elapsed = asyncio.run(record())
    assert f"connecting to 127.0.0.1:{redis_server.port} over TLS did not complete" in str(error)
    assert "is the server started with TLS (tls-port)? use redis:// for a plain server" in str(error)
    assert isinstance(error.__cause__, RedisConnectionError)
    assert elapsed < RETRY_S + MARGIN_S
