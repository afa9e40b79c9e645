"""The hosts and the nemesis themselves: a cut host's packets vanish (a connect times out, no
reset), a cut link spares the others, a split keeps each side whole, heal restores all, and
nothing of a run is left behind."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.netns import Hosts, namespaces

pytestmark = pytest.mark.netns  # make check deselects it: network namespaces need root

PORT = 7000


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    made = Hosts(["h1", "h2", "h3", "h4"])
    yield made
    made.cleanup()


def listen(hosts: Hosts, name: str, stop: threading.Event) -> None:
    """Accept and close connections on ``name``'s address until ``stop``."""
    ready = threading.Event()

    def serve() -> None:
        server = socket.create_server((hosts.address(name), PORT))
        server.settimeout(0.1)
        ready.set()
        while not stop.is_set():
            try:
                server.accept()[0].close()
            except OSError:
                continue
        server.close()

    hosts.thread(name, serve)
    assert ready.wait(5)


def connects(hosts: Hosts, src: str, dst: str, timeout: float = 0.5) -> str:
    """``ok``, ``timeout`` (packets vanished) or the error, for a TCP connect from ``src``."""

    def attempt() -> str:
        try:
            socket.create_connection((hosts.address(dst), PORT), timeout=timeout).close()
        except TimeoutError:
            return "timeout"
        except OSError as exc:
            return repr(exc)
        return "ok"

    return hosts.run(src, attempt)


@pytest.mark.timeout(60)
def test_nemesis_cuts_splits_and_heals_without_a_reset(hosts: Hosts) -> None:
    stop = threading.Event()
    for name in hosts.names:
        listen(hosts, name, stop)
    try:
        assert connects(hosts, "h1", "h2") == "ok"
        hosts.isolate("h2")
        started = time.monotonic()
        assert connects(hosts, "h1", "h2") == "timeout"  # nothing answers: no reset, no unreachable
        assert time.monotonic() - started >= 0.4
        assert connects(hosts, "h2", "h3") == "timeout" and connects(hosts, "h1", "h3") == "ok"
        hosts.heal()
        assert connects(hosts, "h1", "h2") == "ok"

        hosts.cut("h1", "h2")
        assert connects(hosts, "h1", "h2") == "timeout" and connects(hosts, "h2", "h1") == "timeout"
        assert connects(hosts, "h1", "h3") == "ok" and connects(hosts, "h2", "h3") == "ok"
        hosts.heal()

        hosts.split(["h1", "h2"], ["h3", "h4"])
        assert connects(hosts, "h1", "h2") == "ok" and connects(hosts, "h3", "h4") == "ok"
        assert connects(hosts, "h1", "h3") == "timeout" and connects(hosts, "h4", "h2") == "timeout"
        hosts.heal()
        assert hosts.rules == [] and connects(hosts, "h4", "h1") == "ok"

        hosts.lose("h3", 99)  # the SYN and its SYN-ACK each get through 1 time in 100
        assert connects(hosts, "h1", "h3") == "timeout"
        hosts.heal()
        assert connects(hosts, "h1", "h3") == "ok"
    finally:
        stop.set()


@pytest.mark.timeout(30)
def test_cleanup_removes_every_namespace_of_the_run() -> None:
    made = Hosts(["h1", "h2"])
    mine = [n for n in namespaces() if n.startswith(made.run_id + "-")]
    assert len(mine) == 3  # the switch and two hosts
    made.cleanup()
    assert [n for n in namespaces() if n.startswith(made.run_id + "-")] == []


@pytest.mark.timeout(60)
def test_delay_holds_each_chunk_both_ways_until_healed(hosts: Hosts) -> None:
    ready = threading.Event()

    def greet() -> None:
        server = socket.create_server((hosts.address("h2"), PORT + 1))
        ready.set()
        while True:
            conn = server.accept()[0]
            conn.sendall(conn.recv(16))  # an echo: one chunk each way
            conn.close()

    hosts.thread("h2", greet)
    assert ready.wait(5)

    def round_trip() -> float:
        started = time.monotonic()
        with socket.create_connection((hosts.address("h2"), PORT + 1), timeout=5) as conn:
            conn.sendall(b"ping")
            assert conn.recv(16) == b"ping"
        return time.monotonic() - started

    assert hosts.run("h1", round_trip) < 0.3
    hosts.delay("h2", "h1", PORT + 1, 300)
    assert hosts.run("h1", round_trip) >= 0.6  # 300 ms there and 300 ms back
    assert hosts.run("h3", round_trip) < 0.3  # only h1's link is slow
    hosts.heal()
    assert hosts.run("h1", round_trip) < 0.3
