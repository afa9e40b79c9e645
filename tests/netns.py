"""Hosts of our own for the tests: :mod:`redis_layer_signals.simulate.hosts` (namespaces joined
by a bridge, the nemesis), and a redis-server started on one of them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import redis

from redis_layer_signals.simulate.hosts import (
    DelayRelay,
    Hosts,
    NamespacesUnavailable,
    namespaces,
    remove_stale,
    require_namespaces,
)
from tests.servers import RedisServer

__all__ = [
    "DelayRelay",
    "HostedRedis",
    "Hosts",
    "NamespacesUnavailable",
    "namespaces",
    "remove_stale",
    "require_namespaces",
]

T = TypeVar("T")


class HostedRedis(RedisServer):
    """A redis-server on host ``host``: started with ``ip netns exec``, bound to the host's
    address on ``port`` (every host has its own ports). :meth:`admin` reads or configures it
    from inside its host, which a cut never reaches."""

    def __init__(self, hosts: Hosts, host: str, args: Sequence[str] = (), port: int = 6379) -> None:
        super().__init__(args, port=port)
        self.hosts = hosts
        self.host = host
        self.address = hosts.address(host)

    @property
    def url(self) -> str:
        return f"redis://{self.address}:{self.port}/0"

    def command(self) -> list[str]:
        command = super().command()
        command[command.index("--bind") + 1] = self.address
        # reachable only inside the test's namespaces, so protected mode would only refuse our hosts
        return [*self.hosts.exec_prefix(self.host), *command, "--protected-mode", "no"]

    def client(self, **kwargs: object) -> redis.Redis:
        """A client for this server; use it on the server's host (:meth:`admin`, :meth:`Hosts.run`)."""
        return redis.Redis(host=self.address, port=self.port, socket_timeout=5, **kwargs)  # type: ignore[arg-type]

    def start(self) -> HostedRedis:
        return self.hosts.run(self.host, RedisServer.start, self)

    def admin(self, function: Callable[[redis.Redis], T]) -> T:
        """``function(client)`` on a fresh client made on the server's own host."""

        def call() -> T:
            with self.client() as client:
                return function(client)

        return self.hosts.run(self.host, call)
