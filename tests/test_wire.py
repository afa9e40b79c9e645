"""The sync buffer's direct transport (:mod:`redis_layer_signals.transport.wire`): it sends exactly what
redis-py would, keeps one connection per concurrent caller, never reads another call's reply
(threads, forks, interrupted calls) and replaces a dead connection, with the call still run
exactly once. Each test that counts connections runs on its own redis-server."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
import redis
from hypothesis import given
from redis.connection import Encoder, PythonRespSerializer

from redis_layer_signals import CacheTask, SignalBuffer
from redis_layer_signals.transport import wire
from tests.servers import RedisServer, running

pytestmark = pytest.mark.real

TEXT = st.text(max_size=40)


def task(slot: int, request_id: str = "req") -> CacheTask:
    return CacheTask("p0", 0, slot, request_id, need_prefill_tokens=1 << 20, num_layers=61)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with running() as private:
        yield private


@pytest.fixture
def direct_buf(server: RedisServer) -> Iterator[SignalBuffer]:
    buffer = SignalBuffer.from_url(server.url, namespace="w", env={}, retry_s=5)
    yield buffer
    buffer.close()


def our_connections(server: RedisServer) -> int:
    """Client connections on the private server other than the one asking."""
    with redis.Redis(port=server.port) as admin:
        return len(admin.client_list()) - 1


def delivered_count(buffer: SignalBuffer) -> int:
    return buffer.stats(sweep=False)["delivered"]


@given(name=st.text(min_size=1, max_size=40), keys=st.lists(TEXT, max_size=6), args=st.lists(TEXT, max_size=14))
def test_packed_call_is_byte_for_byte_what_redis_py_sends(name: str, keys: list[str], args: list[str]) -> None:
    packer = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
    expected = b"".join(packer.pack("FCALL", name, len(keys), *keys, *args))
    assert wire.fcall(name, keys, args) == expected
    floor = b"".join(packer.pack("EVALSHA", name, len(keys), *keys, *args))
    assert wire.evalsha(name, keys, args) == floor


def test_plain_clients_go_direct_and_the_others_keep_redis_py(server: RedisServer, cluster: Any) -> None:
    assert wire.supports(redis.Redis(port=server.port))
    assert not wire.supports(redis.Redis(port=server.port, protocol=3))
    assert not wire.supports(redis.Redis(port=server.port, single_connection_client=True))
    memory = SignalBuffer.from_url("memory://wire-test", env={})
    clustered = SignalBuffer.from_url(cluster.url, env={})
    assert memory.sender.direct is None and clustered.sender.direct is None
    memory.close()
    clustered.close()


def test_sequential_calls_keep_one_connection(direct_buf: SignalBuffer, server: RedisServer) -> None:
    """One kept for the scripts, besides the pool's own for reads and script loads."""
    direct_buf.register(task(1))
    assert direct_buf.record("p0", 0, 0, [(1, 1)]).delivered
    before = our_connections(server)
    for tokens in range(2, 102):
        assert direct_buf.record("p0", 0, 0, [(1, tokens)]).delivered
    assert our_connections(server) == before <= 2
    assert delivered_count(direct_buf) == 101


def test_threads_never_read_each_others_replies(direct_buf: SignalBuffer, server: RedisServer) -> None:
    """Sixteen threads share one buffer; odd slots are live, even ones are not, so a reply that
    reached the wrong caller would flip delivered and buffered."""
    threads, calls = 16, 60
    for slot in range(1, threads, 2):
        direct_buf.register(task(slot, f"req-{slot}"))
    # Load the library first: sixteen first calls racing into "Function not found" would each load it
    # on a connection of the client's own pool, which the bound below does not count.
    assert direct_buf.record("p0", 0, 0, [(1, 0)]).delivered
    wrong: list[tuple[int, int]] = []

    def work(slot: int) -> None:
        for tokens in range(1, calls + 1):
            result = direct_buf.record("p0", 0, 0, [(slot, tokens)])
            signals = result.delivered if slot % 2 else result.buffered
            if [(s.slot, s.tokens) for s in signals] != [(slot, tokens)]:
                wrong.append((slot, tokens))

    workers = [threading.Thread(target=work, args=(slot,)) for slot in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert wrong == []
    assert 1 <= our_connections(server) <= threads + 1  # at most one per thread, and the pool's
    assert delivered_count(direct_buf) == threads // 2 * calls + 1


def _record_many(buffer: SignalBuffer, slot: int, live: bool) -> int:
    """How many of 300 calls came back with their own entry on the expected side."""
    good = 0
    for tokens in range(1, 301):
        result = buffer.record("p0", 0, 0, [(slot, tokens)])
        signals = result.delivered if live else result.buffered
        good += [(s.slot, s.tokens) for s in signals] == [(slot, tokens)]
    return good


def test_forked_child_never_sends_on_the_parents_connection(direct_buf: SignalBuffer, server: RedisServer) -> None:
    """The parent has a kept connection when it forks; parent and child then call at the same
    time. Sharing the socket would cross their replies."""
    direct_buf.register(task(1))
    assert direct_buf.record("p0", 0, 0, [(1, 1)]).delivered
    context = multiprocessing.get_context("fork")
    results = context.Queue()

    def child() -> None:
        results.put(_record_many(direct_buf, slot=2, live=False))

    process = context.Process(target=child)
    process.start()
    parent_good = _record_many(direct_buf, slot=1, live=True)
    child_good = results.get(timeout=60)
    process.join(timeout=60)
    assert process.exitcode == 0
    assert (parent_good, child_good) == (300, 300)
    assert delivered_count(direct_buf) == 301


def test_interrupted_call_leaves_no_reply_for_the_next(direct_buf: SignalBuffer, server: RedisServer) -> None:
    """An interrupt after the send leaves the reply unread on the socket; the next call must
    not read it as its own."""
    direct_buf.register(task(1))
    assert direct_buf.record("p0", 0, 0, [(1, 1)]).delivered
    before = our_connections(server)
    (connection,) = direct_buf.sender.direct._idle  # type: ignore[union-attr]
    real_read = connection.read_response

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        connection.read_response = real_read
        raise KeyboardInterrupt

    connection.read_response = interrupted
    with pytest.raises(KeyboardInterrupt):
        direct_buf.record("p0", 0, 0, [(1, 2)])
    result = direct_buf.record("p0", 0, 0, [(2, 7), (3, 8)])
    assert [(s.slot, s.tokens) for s in result.buffered] == [(2, 7), (3, 8)]
    assert result.delivered == []
    assert our_connections(server) == before


def test_killed_connection_is_replaced_and_the_call_runs_once(direct_buf: SignalBuffer, server: RedisServer) -> None:
    direct_buf.register(task(1))
    assert direct_buf.record("p0", 0, 0, [(1, 1)]).delivered
    with redis.Redis(port=server.port) as admin:
        assert admin.client_kill_filter(_type="normal", skipme=True) == 2  # ours and the pool's
    assert [(s.slot, s.tokens) for s in direct_buf.record("p0", 0, 0, [(1, 2)]).delivered] == [(1, 2)]
    assert delivered_count(direct_buf) == 2
    assert our_connections(server) == 2  # the replacement and the pool's


def test_function_flush_is_reloaded_on_the_direct_path(direct_buf: SignalBuffer, server: RedisServer) -> None:
    direct_buf.register(task(1))
    with redis.Redis(port=server.port) as admin:
        admin.function_flush()
    assert direct_buf.record("p0", 0, 0, [(1, 5)]).delivered
    assert delivered_count(direct_buf) == 1


def test_close_hands_the_kept_connections_back(server: RedisServer) -> None:
    buffer = SignalBuffer.from_url(server.url, namespace="w", env={})
    buffer.record("p0", 0, 0, [(1, 1)])
    assert our_connections(server) >= 1
    buffer.close()
    assert our_connections(server) == 0


def test_close_during_a_call_leaves_no_connection_checked_out(server: RedisServer) -> None:
    """A call in flight when close() runs puts its connection back after close() has handed
    the kept ones back; on a pool the client does not own (so not disconnected by close), a
    connection kept then would stay checked out for good."""
    pool = redis.ConnectionPool(port=server.port, max_connections=2)
    buffer = SignalBuffer(redis.Redis(connection_pool=pool), namespace="w", env={})
    buffer.record("p0", 0, 0, [(1, 1)])  # one connection kept, one used by SCRIPT LOAD
    (connection,) = buffer.sender.direct._idle  # type: ignore[union-attr]
    real_read = connection.read_response

    def close_meanwhile(*args: Any, **kwargs: Any) -> Any:
        connection.read_response = real_read
        buffer.close()
        return real_read(*args, **kwargs)

    connection.read_response = close_meanwhile
    assert [(s.slot, s.tokens) for s in buffer.record("p0", 0, 0, [(1, 2)]).buffered] == [(1, 2)]
    both = [pool.get_connection(), pool.get_connection()]  # MaxConnectionsError if one leaked
    for each in both:
        pool.release(each)
    pool.disconnect()
