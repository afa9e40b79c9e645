"""A Docker engine of the test's own, for running docker-compose.yml for real.

Two daemons share one data root (the images): the first, in the host's network namespace, only
builds images (each build step on the host's network, as apt and pip reach their mirrors); the
second runs the compose profiles inside a network namespace the run makes, so every bridge, veth
and published port lives there and the host's links, nft rules and forwarding are never touched.
Neither daemon writes iptables rules or turns forwarding on. A DNS responder in that namespace
answers every name the compose network does not know with NXDOMAIN at once, as a host's resolver
would, and nothing is asked outside. Everything is stopped and removed by `stop`, even after a
failure: containers, networks, volumes, both daemons and their containerd, mounts, the namespace.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.servers import wait_until

DOCKERD = "/usr/sbin/dockerd"
DOCKER = "/usr/bin/docker"
"""Debian's client (API 1.41), not a newer one elsewhere on the PATH that dockerd 20.10 refuses."""
COMPOSE = "/usr/bin/docker-compose"
DEBOOTSTRAP = "/usr/sbin/debootstrap"
BINARIES = {DOCKERD: "docker.io", DOCKER: "docker.io", COMPOSE: "docker-compose", DEBOOTSTRAP: "debootstrap"}
RESOLVER_IP = "10.255.254.53"
"""The run namespace's own resolver (on its loopback): the daemon's only upstream DNS."""
STOP_TIMEOUT_S = 30

NXDOMAIN_RESPONDER = """
import socket, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind((sys.argv[1], 53))
while True:
    query, peer = sock.recvfrom(4096)
    if len(query) >= 12:  # same id and question, QR and RA set, RCODE 3: no such name
        sock.sendto(query[:2] + bytes([0x80 | (query[2] & 1), 0x83]) + query[4:6] + bytes(6) + query[12:], peer)
"""


def missing_binaries() -> list[str]:
    """What `make cluster-test` needs and this machine lacks, named with its Debian package."""
    missing = [f"{path} ({package})" for path, package in BINARIES.items() if not os.access(path, os.X_OK)]
    missing += [f"{tool} (iproute2)" for tool in ("ip", "nsenter") if shutil.which(tool) is None]
    return missing


def host_network() -> dict[str, str]:
    """What a run must leave as it found it: links, nft rules, forwarding, network namespaces."""

    def run(*command: str) -> str:
        return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False).stdout

    links = "\n".join(line.split(" link/")[0] for line in run("ip", "-o", "link").splitlines())
    return {
        "links": links,
        "nft": run("nft", "list", "ruleset"),
        "forwarding": run("sysctl", "net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"),
        "netns": run("ip", "netns", "list"),
    }


def sweep(data_root: Path) -> None:
    """What a run on this data root left when it was killed before its teardown: the processes
    with its data root or its exec root on their command line, their mounts, its namespace."""
    record = work_record(data_root)
    if not record.exists():
        return
    work, netns = record.read_text().split()
    marks = (str(data_root).encode(), work.encode(), netns.encode())
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if any(mark in (entry / "cmdline").read_bytes() for mark in marks):
                    os.kill(int(entry.name), signal.SIGKILL)
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for point in sorted((m for m in mounts if m.startswith((str(data_root), work))), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], timeout=30, check=False)
    subprocess.run(["ip", "netns", "delete", netns], capture_output=True, timeout=30, check=False)
    shutil.rmtree(work, ignore_errors=True)
    record.unlink()


def work_record(data_root: Path) -> Path:
    """Names the exec root and namespace of the run using ``data_root`` until it cleans up."""
    return data_root.parent / f"{data_root.name}.run"


class Engine:
    """dockerd with its own data root, exec root, pid file and socket; see the module docstring."""

    def __init__(self, data_root: Path) -> None:
        self.data_root = data_root
        # Short: the socket's path must fit in 108 bytes.
        self.work = Path(tempfile.mkdtemp(prefix="rls-engine-"))
        self.socket = self.work / "docker.sock"
        self.netns = f"rls-engine-{os.getpid()}"
        self.daemon: subprocess.Popen[bytes] | None = None
        self.resolver: subprocess.Popen[bytes] | None = None
        self.in_netns = False
        data_root.mkdir(parents=True, exist_ok=True)
        work_record(data_root).write_text(f"{self.work} {self.netns}\n")
        # Also when pytest is interrupted before the fixture's teardown.
        atexit.register(self.close)

    @property
    def env(self) -> dict[str, str]:
        return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DOCKER_HOST": f"unix://{self.socket}", "DOCKER": DOCKER}

    def nsenter(self) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.netns}"] if self.in_netns else []

    def start(self, *, netns: bool) -> None:
        """One daemon: for builds on the host's network, or (netns) for runs in the namespace."""
        self.in_netns = netns
        dns: list[str] = []
        if netns:
            subprocess.run(["ip", "netns", "add", self.netns], check=True, timeout=30)
            subprocess.run(["ip", "netns", "exec", self.netns, "ip", "link", "set", "lo", "up"], check=True, timeout=30)
            subprocess.run(
                ["ip", "netns", "exec", self.netns, "ip", "addr", "add", f"{RESOLVER_IP}/32", "dev", "lo"],
                check=True,
                timeout=30,
            )
            self.resolver = subprocess.Popen(
                [*self.nsenter(), sys.executable, "-c", NXDOMAIN_RESPONDER, RESOLVER_IP, self.netns],
                start_new_session=True,
            )
            dns = ["--dns", RESOLVER_IP]
        log = (self.work / ("dockerd-run.log" if netns else "dockerd-build.log")).open("ab")
        self.daemon = subprocess.Popen(
            [
                *self.nsenter(),
                DOCKERD,
                f"--data-root={self.data_root}",
                f"--exec-root={self.work / 'exec'}",
                f"--pidfile={self.work / 'dockerd.pid'}",
                f"--host=unix://{self.socket}",
                "--iptables=false",
                "--ip-forward=false",
                "--ip-masq=false",
                "--bridge=none",
                *dns,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        wait_until(self.answers, timeout=120, interval=0.5, what="dockerd answering on its socket")

    def answers(self) -> bool:
        if self.daemon is not None and self.daemon.poll() is not None:
            raise RuntimeError(f"dockerd exited {self.daemon.returncode}: {self.log_tail()}")
        return self.docker("version", check=False).returncode == 0

    def log_tail(self) -> str:
        return "\n".join(
            line for log in sorted(self.work.glob("dockerd-*.log")) for line in log.read_text().splitlines()[-15:]
        )

    def docker(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [DOCKER, *args], env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)}: {done.stderr.strip()}")
        return done

    def fetch(self, url: str) -> str:
        """GET ``url`` from inside the run's namespace (where the published ports are)."""
        script = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
        done = subprocess.run(
            [*self.nsenter(), sys.executable, "-c", script, url], capture_output=True, text=True, timeout=30
        )
        if done.returncode != 0:
            raise ConnectionError(f"{url}: {done.stderr.strip()[-300:]}")
        return done.stdout

    def stop(self) -> None:
        """Stop what the daemon runs, the daemon, its containerd and the resolver; unmount what
        they mounted; delete the namespace. Safe to call again and after a failed start."""
        if self.daemon is not None and self.daemon.poll() is None:
            ids = self.docker("ps", "-aq", check=False).stdout.split()
            if ids:
                self.docker("rm", "-f", "-v", *ids, check=False, timeout=180)
            self.docker("network", "prune", "-f", check=False)
            self.docker("volume", "prune", "-f", check=False)
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.daemon.pid, signal.SIGKILL)
                self.daemon.wait(STOP_TIMEOUT_S)
        self.daemon = None
        self._kill_leftovers()
        self._unmount()
        if self.resolver is not None:
            self.resolver.kill()
            self.resolver.wait(STOP_TIMEOUT_S)
            self.resolver = None
        if self.in_netns:
            subprocess.run(["ip", "netns", "delete", self.netns], timeout=30, check=False)
            self.in_netns = False

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.work, ignore_errors=True)
        work_record(self.data_root).unlink(missing_ok=True)

    def processes(self) -> list[int]:
        """Processes still running with this engine's exec root or data root on their command line."""
        marks = (str(self.work).encode(), str(self.data_root).encode(), self.netns.encode())
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if any(mark in (entry / "cmdline").read_bytes() for mark in marks):
                        found.append(int(entry.name))
        return found

    def _kill_leftovers(self) -> None:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while (left := self.processes()) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    def _unmount(self) -> None:
        roots = (str(self.work), str(self.data_root))
        mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        for point in sorted((m for m in mounts if m.startswith(roots)), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], timeout=30, check=False)
