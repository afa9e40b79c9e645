"""``rls simulate --chaos``: break the buffer's Redis at random moments during a run, then let
the simulation's own checks say what was lost.

The fault depends on the topology the URL names:

- ``memory://`` (the default): the run gets its own ``redis-server`` (free port, temp dir) with
  AOF at ``--chaos-fsync`` (``always`` by default), SIGKILLed and restarted on its data.
  With ``always`` the checks must find nothing lost; ``everysec`` or ``off`` show what a
  weaker setting loses.
- ``--chaos-fault partition`` (``memory://`` only, as root, on Linux): the run owns its hosts
  too (``hosts``). Its Redis runs on one network namespace, the ranks, the registrar and
  the message server on another, and each fault cuts the Redis host off for ``PARTITION_S``
  (its packets vanish, nothing answers), then heals. The cut is shorter than the buffer's
  ``retry_s``: the calls block and then succeed, and the checks must find nothing lost.
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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..bench.server import LocalRedis
from ..errors import InvalidConfig
from ..transport.connection import CLUSTER, MEMORY, SENTINEL, parse_multi_host, scheme_of, sync_client
from ..transport.routing import refresher_of
from .config import SimConfig
from .hosts import Hosts
from .report import Summary

FSYNC_CHOICES = ("always", "everysec", "off")
ACTIVE_FROM = 0.10
ACTIVE_UNTIL = 0.75
"""Share of the requests done between which faults are injected."""
FAULT_TIMEOUT_S = 5.0
FAULTS = ("auto", "partition")
"""``auto``: the fault the URL's topology gets (above); ``partition``: cut off the run's own Redis host."""
PARTITION_S = 1.0
"""How long one partition fault cuts the Redis host off: below the default retry_s (3 s)."""
REDIS_HOST, RANKS_HOST = "h1", "h2"


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


def _partition(hosts: Hosts) -> Callable[[int], str]:
    def cut(_n: int) -> str:
        hosts.isolate(REDIS_HOST)
        try:
            time.sleep(PARTITION_S)
        finally:
            hosts.heal()
        return f"partition of the Redis host for {PARTITION_S:g} s"

    return cut


def _fault_for(url: str, own: LocalRedis | None, hosts: Hosts | None) -> Callable[[int], str]:
    """The fault to apply for ``url``: called with a counter, returns what it did."""
    if hosts is not None:
        return _partition(hosts)
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
            refresher_of(client).now()  # the replicas as they are now
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
def _servers(config: SimConfig, fsync: str, fault: str) -> Iterator[tuple[SimConfig, LocalRedis | None, Hosts | None]]:
    """The buffer's server (ours when the URL is memory://), the message server, and the hosts
    they run on when the fault is a partition."""
    if fsync not in FSYNC_CHOICES:
        raise InvalidConfig("chaos_fsync", fsync, f"must be one of {', '.join(FSYNC_CHOICES)}")
    if fault not in FAULTS:
        raise InvalidConfig("chaos_fault", fault, f"must be one of {', '.join(FAULTS)}")
    if fault == "partition" and scheme_of(config.url) != MEMORY:
        raise InvalidConfig("chaos_fault", fault, "needs the run's own Redis (memory://): it owns the hosts then")
    started: list[LocalRedis] = []
    hosts = Hosts([REDIS_HOST, RANKS_HOST]) if fault == "partition" else None
    try:
        own = None
        url = config.url
        if scheme_of(url) == MEMORY:
            own = _server(fsync)
            started.append(own)
            if hosts is None:
                url = own.start().url
            else:  # bound to its host's address too, where the ranks reach it
                address = hosts.address(REDIS_HOST)
                own.args += ["--bind", address, "127.0.0.1", "--protected-mode", "no"]
                hosts.run(REDIS_HOST, own.start)
                url = f"redis://{address}:{own.port}/0"
        messages = _server("off")
        started.append(messages)
        channel_url = messages.start().url if hosts is None else hosts.run(RANKS_HOST, messages.start).url
        yield config.with_(url=url, channel_url=channel_url), own, hosts
    finally:
        for server in started:
            server.cleanup()
        if hosts is not None:
            hosts.cleanup()


Progress = Callable[[int], None]


def run_with_chaos(
    config: SimConfig,
    interval_s: float,
    fsync: str,
    run: Callable[[SimConfig, Progress], Summary],
    fault: str = "auto",
) -> tuple[Summary, ChaosReport]:
    """Run the simulation through ``run(config, on_progress)`` while faults hit the buffer's
    Redis every ``interval_s`` seconds on average (seeded by the run's seed). With ``fault``
    ``partition`` the run happens on a host apart from its Redis (see the module docstring)."""
    if not interval_s > 0:
        raise InvalidConfig("chaos_interval_s", interval_s, "must be positive")
    with _servers(config, fsync, fault) as (chaos_config, own, hosts):
        target = "own redis-server, appendfsync " + fsync if own is not None else config.url
        if hosts is not None:
            target += ", on a host of its own"
        total = config.instances * config.ranks * config.requests
        injector = _Injector(_fault_for(chaos_config.url, own, hosts), interval_s, config.seed, total)
        injector.thread.start()
        try:
            if hosts is None:
                summary = run(chaos_config, injector.tick)
            else:  # the ranks' processes start on the thread's host, and stay there
                summary = hosts.run(RANKS_HOST, run, chaos_config, injector.tick)
        finally:
            injector.stop.set()
            injector.active.set()
            injector.thread.join(FAULT_TIMEOUT_S * 4)
        return summary, ChaosReport(target, injector.report_faults, injector.report_failed)
