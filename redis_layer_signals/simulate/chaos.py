"""``rls simulate --chaos``: break the buffer's Redis at random moments during a run, then let
the simulation's own checks say what was lost.

The fault depends on the topology the URL names:

- ``memory://`` (the default): the run gets its own ``redis-server`` (free port, temp dir) with
  AOF at ``--chaos-fsync`` (``always`` by default), SIGKILLed and restarted on its data.
  With ``always`` the checks must find nothing lost; ``everysec`` or ``off`` show what a
  weaker setting loses.
- ``redis+sentinel://``: ``SENTINEL FAILOVER``.
- ``redis+cluster://``: ``CLUSTER FAILOVER`` on a random replica (the cluster needs replicas).
- ``redis://``, ``rediss://``, ``unix://``: a server this command does not own and cannot
  restart, so it gets ``FUNCTION FLUSH`` and ``CLIENT KILL TYPE normal`` (every connection
  reset mid-call) in turn.

The simulation's messages (the GPU side, the registrar, the senders) go through a separate
Redis that this command starts and never breaks: they stand in for FastDeploy's own paths,
which are not what is under test. Faults come while the run is in full swing, between 10 % and
75 % of the requests done: the ranks' set-up reads and final checks read Redis directly,
without the buffer's retries, and are left alone.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..bench.server import LocalRedis
from ..connection import CLUSTER, MEMORY, SENTINEL, parse_multi_host, scheme_of, sync_client
from ..errors import InvalidConfig
from .config import SimConfig
from .report import Summary

FSYNC_CHOICES = ("always", "everysec", "off")
ACTIVE_FROM = 0.10
ACTIVE_UNTIL = 0.75
"""Share of the requests done between which faults are injected."""
FAULT_TIMEOUT_S = 5.0


def _server(fsync: str) -> LocalRedis:
    """A redis-server of this run (free port, temp dir), with AOF at ``fsync`` unless "off"."""
    return LocalRedis([] if fsync == "off" else ["--appendonly", "yes", "--appendfsync", fsync])


@dataclass
class ChaosReport:
    """The faults applied during a run, in order, and the ones that could not be applied."""

    target: str
    faults: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def foreign_faults(url: str) -> str | None:
    """What ``--chaos`` does to the server ``url`` names when the run did not start it (None for
    ``memory://``, where it starts its own): said before the run, which needs ``--yes`` for it."""
    scheme = scheme_of(url)
    if scheme == MEMORY:
        return None
    if scheme == SENTINEL:
        return "SENTINEL FAILOVER of its primary, again and again (clients of that primary reconnect)"
    if scheme == CLUSTER:
        return "CLUSTER FAILOVER on random replicas, again and again (their primaries are demoted)"
    return (
        "FUNCTION FLUSH (every function library on the server, not only this package's) and "
        "CLIENT KILL TYPE normal (every client connection), in turn"
    )


def _fault_for(url: str, own: LocalRedis | None) -> Callable[[int], str]:
    """The fault to apply for ``url``: called with a counter, returns what it did."""
    if own is not None:

        def restart(_n: int) -> str:
            own.kill()
            own.start()
            return "SIGKILL + restart"

        return restart
    scheme = scheme_of(url)
    if scheme == SENTINEL:
        parsed = parse_multi_host(url)

        def failover(_n: int) -> str:
            import redis

            host, port = parsed.hosts[0]
            sentinel: Any = redis.Redis(host=host, port=port, socket_timeout=FAULT_TIMEOUT_S)
            try:
                sentinel.execute_command("SENTINEL", "FAILOVER", parsed.path.split("/")[0])
            finally:
                sentinel.close()
            return "SENTINEL FAILOVER"

        return failover
    if scheme == CLUSTER:
        client: Any = sync_client(url, FAULT_TIMEOUT_S)
        rng = random.Random(0)

        def cluster_failover(_n: int) -> str:
            client.nodes_manager.initialize()
            replicas = client.get_replicas()
            if not replicas:
                raise InvalidConfig("chaos", url, "CLUSTER FAILOVER needs a cluster with replicas")
            replica = rng.choice(replicas)
            replica.redis_connection.execute_command("CLUSTER", "FAILOVER")
            return f"CLUSTER FAILOVER on {replica.name}"

        return cluster_failover
    direct: Any = sync_client(url, FAULT_TIMEOUT_S)

    def reset(n: int) -> str:
        if n % 2:
            direct.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            return "CLIENT KILL TYPE normal"
        direct.function_flush()
        return "FUNCTION FLUSH"

    return reset


class _Injector:
    """Applies a fault every ``interval_s`` on average while the run is in its active window."""

    def __init__(self, fault: Callable[[int], str], interval_s: float, seed: int, total: int) -> None:
        self.fault = fault
        self.interval_s = interval_s
        self.rng = random.Random(seed)
        self.total = total
        self.done = 0
        self.active = threading.Event()
        self.stop = threading.Event()
        self.busy = threading.Lock()
        self.report_faults: list[str] = []
        self.report_failed: list[str] = []
        self.thread = threading.Thread(target=self._loop, name="chaos", daemon=True)

    def tick(self, n: int) -> None:
        """Progress of the run (requests done): opens and closes the window."""
        self.done += n
        if self.done >= ACTIVE_UNTIL * self.total and not self.stop.is_set():
            self.stop.set()
            self.active.set()
            with self.busy:  # a fault under way ends (the server is back) before checks start
                pass
        elif self.done >= ACTIVE_FROM * self.total:
            self.active.set()

    def _loop(self) -> None:
        """The first fault as soon as the window opens (a short run still gets one), then one
        every ``interval_s`` on average."""
        self.active.wait()
        count = 0
        wait = 0.0
        while not self.stop.wait(wait):
            wait = self.rng.uniform(0.5, 1.5) * self.interval_s
            with self.busy:
                if self.stop.is_set():
                    return
                count += 1
                try:
                    self.report_faults.append(self.fault(count))
                except Exception as exc:  # reported, not raised: the run's checks still decide
                    self.report_failed.append(f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def _servers(config: SimConfig, fsync: str) -> Iterator[tuple[SimConfig, LocalRedis | None]]:
    """The buffer's server (ours when the URL is memory://) and the message server."""
    if fsync not in FSYNC_CHOICES:
        raise InvalidConfig("chaos_fsync", fsync, f"must be one of {', '.join(FSYNC_CHOICES)}")
    started: list[LocalRedis] = []
    try:
        own = None
        url = config.url
        if scheme_of(url) == MEMORY:
            own = _server(fsync)
            started.append(own)
            url = own.start().url
        messages = _server("off")
        started.append(messages)
        yield config.with_(url=url, channel_url=messages.start().url), own
    finally:
        for server in started:
            server.cleanup()


Progress = Callable[[int], None]


def run_with_chaos(
    config: SimConfig, interval_s: float, fsync: str, run: Callable[[SimConfig, Progress], Summary]
) -> tuple[Summary, ChaosReport]:
    """Run the simulation through ``run(config, on_progress)`` while faults hit the buffer's
    Redis every ``interval_s`` seconds on average (seeded by the run's seed)."""
    if not interval_s > 0:
        raise InvalidConfig("chaos_interval_s", interval_s, "must be positive")
    with _servers(config, fsync) as (chaos_config, own):
        target = "own redis-server, appendfsync " + fsync if own is not None else config.url
        total = config.instances * config.ranks * config.requests
        injector = _Injector(_fault_for(chaos_config.url, own), interval_s, config.seed, total)
        injector.thread.start()
        try:
            summary = run(chaos_config, injector.tick)
        finally:
            injector.stop.set()
            injector.active.set()
            injector.thread.join(FAULT_TIMEOUT_S * 4)
        return summary, ChaosReport(target, injector.report_faults, injector.report_failed)
