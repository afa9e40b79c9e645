"""Redis Cluster and Sentinel on hosts of our own (:mod:`tests.netns`): a server per host on port
6379 (a sentinel on 26379), each read and configured from inside its own host, which no cut
reaches. The Cluster is created with redis-cli from inside its first node's host."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis.crc

from tests.netns import HostedRedis, Hosts
from tests.servers import require_binary, wait_until
from tests.topology import FAST_SYNC


def slot_of(namespace: str, instance: str = "p0", rank: int = 0) -> int:
    """The hash slot of one rank's keys (their tag is ``{namespace/instance/rank}``)."""
    return int(redis.crc.key_slot(f"{{{namespace}/{instance}/{rank}}}".encode()))


class HostedCluster:
    """``len(node_hosts) // (1 + replicas)`` primaries with ``replicas`` replicas each, a node
    per host."""

    def __init__(self, hosts: Hosts, node_hosts: Sequence[str], replicas: int, node_timeout_ms: int) -> None:
        self.hosts = hosts
        self.replicas = replicas
        self.primaries = len(node_hosts) // (1 + replicas)
        args = [
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms),
            "--cluster-require-full-coverage", "no",  # the other primaries answer during a cut
            *FAST_SYNC,
        ]  # fmt: skip
        self.nodes = {host: HostedRedis(hosts, host, args) for host in node_hosts}

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{n.address}:{n.port}" for n in self.nodes.values())

    def start(self) -> HostedCluster:
        for node in self.nodes.values():
            node.start()
        first = next(iter(self.nodes))
        created = subprocess.run(
            [
                *self.hosts.exec_prefix(first), require_binary("redis-cli"), "--cluster", "create",
                *(f"{n.address}:{n.port}" for n in self.nodes.values()),
                "--cluster-replicas", str(self.replicas), "--cluster-yes",
            ],
            capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout[-2000:]!r} {created.stderr!r}")
        wait_until(self.healthy, timeout=40, what="cluster_state:ok with every replica attached")
        return self

    def host_of(self, address: str) -> str:
        return next(h for h, n in self.nodes.items() if n.address == address)

    def view(self, host: str) -> list[dict[str, Any]]:
        """CLUSTER NODES as node ``host`` sees it: host, role, primary's host, flags, slots."""

        def read(client: Any) -> list[dict[str, Any]]:
            nodes = client.cluster("nodes")
            ids = {info["node_id"]: address.split(":")[0] for address, info in nodes.items()}
            return [
                {
                    "host": self.host_of(address.split(":")[0]),
                    "primary": self.host_of(ids[info["master_id"]]) if info["master_id"] in ids else None,
                    "flags": info["flags"],
                    "slots": info["slots"],
                }
                for address, info in nodes.items()
            ]

        return self.nodes[host].admin(read)

    def role(self, host: str) -> tuple[str, str | None]:
        """``("master", None)`` or ``("slave", primary's host)`` by the node's own INFO."""
        info = self.nodes[host].admin(lambda c: c.info("replication"))
        if info["role"] == "master":
            return "master", None
        primary = self.host_of(info["master_host"])
        return ("slave" if info.get("master_link_status") == "up" else "slave-down"), primary

    def owner(self, slot: int, asked: str | None = None) -> str:
        """The host of the primary serving ``slot``, as node ``asked`` reports it."""
        host = asked or next(iter(self.nodes))

        def read(client: Any) -> str:
            for entry in client.execute_command("CLUSTER", "SLOTS"):
                if int(entry[0]) <= slot <= int(entry[1]):
                    address = entry[2][0]
                    return self.host_of(address.decode() if isinstance(address, bytes) else address)
            raise LookupError(slot)

        return self.nodes[host].admin(read)

    def replica_of(self, primary: str) -> str:
        return next(h for h in self.nodes if h != primary and self.role(h) == ("slave", primary))

    def healthy(self) -> bool:
        """Every node says cluster_state:ok, and each of the primaries has its replicas up."""
        for node in self.nodes.values():
            if node.admin(lambda c: c.cluster("info")).get("cluster_state") != "ok":
                return False
        roles = {h: self.role(h) for h in self.nodes}
        primaries = [h for h, (r, _) in roles.items() if r == "master"]
        replicas = [p for r, p in roles.values() if r == "slave"]
        return len(primaries) == self.primaries and all(replicas.count(p) == self.replicas for p in primaries)

    def cleanup(self) -> None:
        for node in self.nodes.values():
            node.cleanup()


SENTINEL_PORT = 26379
SENTINEL_SERVICE = "rls-primary"
SENTINEL_DOWN_AFTER_MS = 1000
SENTINEL_FAILOVER_TIMEOUT_MS = 3000


class HostedSentinel(HostedRedis):
    """A ``redis-server --sentinel`` on host ``host``, watching ``primary`` (quorum 2)."""

    def __init__(self, hosts: Hosts, host: str, primary: HostedRedis) -> None:
        super().__init__(hosts, host, port=SENTINEL_PORT)
        self.config = Path(self.dir) / "sentinel.conf"
        self.config.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    f"bind {self.address}",
                    "protected-mode no",
                    f"dir {self.dir}",
                    f"logfile {self.logfile}",
                    f"sentinel monitor {SENTINEL_SERVICE} {primary.address} {primary.port} 2",
                    f"sentinel down-after-milliseconds {SENTINEL_SERVICE} {SENTINEL_DOWN_AFTER_MS}",
                    f"sentinel failover-timeout {SENTINEL_SERVICE} {SENTINEL_FAILOVER_TIMEOUT_MS}",
                    f"sentinel parallel-syncs {SENTINEL_SERVICE} 1",
                    "",
                ]
            )
        )

    def command(self) -> list[str]:
        return [*self.hosts.exec_prefix(self.host), self.binary, str(self.config), "--sentinel"]

    def primary_address(self) -> str:
        """The primary this sentinel names now."""
        address = self.admin(lambda c: c.sentinel_get_master_addr_by_name(SENTINEL_SERVICE))[0]
        return address.decode() if isinstance(address, bytes) else str(address)


class HostedSentinelGroup:
    """A primary and two replicas on ``server_hosts``, a sentinel on each of ``sentinel_hosts``."""

    def __init__(
        self, hosts: Hosts, server_hosts: Sequence[str], sentinel_hosts: Sequence[str], args: Sequence[str] = ()
    ) -> None:
        self.hosts = hosts
        first, *others = server_hosts
        self.servers = {first: HostedRedis(hosts, first, [*FAST_SYNC, *args])}
        primary = self.servers[first]
        for host in others:
            self.servers[host] = HostedRedis(
                hosts, host, [*FAST_SYNC, *args, "--replicaof", primary.address, str(primary.port)]
            )
        self.sentinels = {host: HostedSentinel(hosts, host, primary) for host in sentinel_hosts}

    @property
    def url(self) -> str:
        seeds = ",".join(f"{s.address}:{s.port}" for s in self.sentinels.values())
        return f"redis+sentinel://{seeds}/{SENTINEL_SERVICE}"

    def host_of(self, address: str) -> str:
        return next(h for h, s in self.servers.items() if s.address == address)

    def start(self) -> HostedSentinelGroup:
        for server in self.servers.values():
            server.start()
        wait_until(lambda: all(self.role(h)[0] == "slave" for h in list(self.servers)[1:]), 20, what="replicas synced")
        for sentinel in self.sentinels.values():
            sentinel.start()
        wait_until(self.agreed, timeout=40, what="sentinels see the primary, both replicas and each other")
        return self

    def role(self, host: str) -> tuple[str, str | None]:
        """``("master", None)``, or ``("slave", primary's host)`` with its link up."""
        info = self.servers[host].admin(lambda c: c.info("replication"))
        if info["role"] == "master":
            return "master", None
        state = "slave" if info.get("master_link_status") == "up" else "slave-down"
        return state, self.host_of(info["master_host"])

    def agreed(self, sentinel_hosts: Sequence[str] | None = None) -> bool:
        """The sentinels (all, or those named) name one primary, which knows its two replicas."""
        chosen = [self.sentinels[h] for h in (sentinel_hosts or self.sentinels)]
        for sentinel in chosen:
            state = sentinel.admin(lambda c: c.sentinel_master(SENTINEL_SERVICE))
            if int(state["num-other-sentinels"]) < 2 or int(state["num-slaves"]) < 2:
                return False
            if "down" in str(state["flags"]) or "failover" in str(state["flags"]):
                return False
        primaries = {s.primary_address() for s in chosen}
        return len(primaries) == 1

    def cleanup(self) -> None:
        for process in [*self.sentinels.values(), *self.servers.values()]:
            process.cleanup()
