"""A Redis Cluster on hosts of our own (:mod:`tests.netns`): a node per host on port 6379,
created with redis-cli from inside the first node's host, read through each node's own host."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
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
