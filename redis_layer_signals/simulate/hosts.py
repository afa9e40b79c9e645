"""Hosts of our own: a network namespace per host, joined to one bridge, and a nemesis that cuts,
slows and splits them (packets vanish; nothing answers with a reset). The partition tests and
``rls simulate --chaos --chaos-fault partition`` run on them.

Layout: a switch namespace holds a Linux bridge; each host namespace holds ``eth0`` (address
``10.213.0.N/24``, a range used only inside these namespaces) whose veth peer in the switch is
named after the host (``h1``...). Servers run in their host's namespace (``ip netns exec``) bound
to its address, so every host can use the usual ports. The test process itself stays outside:
``Hosts.run`` calls a function on a thread that entered a host's namespace (sockets made
there belong to it), which is how a test reads a server's INFO or runs a client in process.

The nemesis works where a switch or a security group does, in the switch namespace, so neither
end's kernel knows: an ``nft`` bridge-family table drops IPv4 frames (ARP still passes, so no
host learns a quick "unreachable"); random loss is an ``nft`` rule too (``numgen random``), and
a slow link is a relay that holds each chunk (``delay``), so both work on kernels built without
``sch_netem``.

Linux only, and root only.

Every namespace is named ``rls-<pid>-<n>-...``: ``remove_stale`` deletes those of dead
processes (a run killed before its cleanup), and ``Hosts.cleanup`` deletes a run's own.
Making them needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN); without it ``Hosts`` raises
``NamespacesUnavailable``, which fails the test with that message.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from ..bench.relay import DelayRelay

PREFIX = "rls-"
SUBNET = "10.213.0"
"""Every address lives only inside the namespaces made here; no traffic leaves them."""
CLONE_NEWNET = 0x40000000
TABLE = "rls_nemesis"
NAT_TABLE = "rls_delay"
CHAIN = "cut"

T = TypeVar("T")
_runs = itertools.count(1)


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, or ``ip``/``nft`` missing)."""


def _sh(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def require_namespaces() -> None:
    """Raise ``NamespacesUnavailable`` saying why these tests cannot run here."""
    missing = [tool for tool in ("ip", "nft") if shutil.which(tool) is None]
    if missing:
        raise NamespacesUnavailable(
            f"the partition tests need {', '.join(missing)}: run `make servers` as root (iproute2, nftables)"
        )
    if os.geteuid() != 0:
        raise NamespacesUnavailable("the partition tests make network namespaces and need root (CI runs as root)")


def namespaces() -> list[str]:
    return [line.split()[0] for line in _sh("ip", "netns", "list").stdout.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Delete the namespaces of runs whose process is gone (a run killed before its cleanup)."""
    removed = []
    for name in namespaces():
        found = re.match(rf"{re.escape(PREFIX)}(\d+)-\d+-", name)
        if found is None or os.path.exists(f"/proc/{found.group(1)}"):
            continue  # not ours, or a live run's (this one's included)
        _sh("ip", "netns", "del", name, check=False)
        removed.append(name)
    return removed


def _enter(namespace: str) -> None:
    """Move the calling thread into ``namespace`` (network namespaces are per thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
    finally:
        os.close(fd)


class Hosts:
    """``names`` hosts on one bridge; see the module docstring. Use as a context manager or
    call ``cleanup`` (it runs also after a failed creation)."""

    def __init__(self, names: Sequence[str]) -> None:
        require_namespaces()
        for name in names:
            if not re.fullmatch(r"h\d{1,2}", name):
                raise ValueError(f"host name {name!r}: use h1..h99 (it names an interface, 15 chars at most)")
        remove_stale()
        self.run_id = f"{PREFIX}{os.getpid()}-{next(_runs)}"
        self.switch = f"{self.run_id}-sw"
        self.names = list(names)
        self.addresses = {name: f"{SUBNET}.{index}" for index, name in enumerate(self.names, start=1)}
        self._threads: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._rules: list[str] = []
        self._delayed: set[str] = set()
        self._relays: list[DelayRelay] = []
        try:
            self._create()
        except BaseException:
            self.cleanup()
            raise

    def namespace(self, name: str) -> str:
        return f"{self.run_id}-{name}"

    def address(self, name: str) -> str:
        return self.addresses[name]

    def exec_prefix(self, name: str) -> list[str]:
        """Prefix for a command that must run on host ``name``."""
        return ["ip", "netns", "exec", self.namespace(name)]

    def _create(self) -> None:
        try:
            _sh("ip", "netns", "add", self.switch)
        except RuntimeError as exc:
            raise NamespacesUnavailable(f"cannot make a network namespace here: {exc}") from exc
        sw = ("ip", "-n", self.switch)
        _sh(*sw, "link", "add", "br0", "type", "bridge")
        _sh(*sw, "link", "set", "br0", "up")
        for name in self.names:
            host = self.namespace(name)
            _sh("ip", "netns", "add", host)
            _sh(*sw, "link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", host)
            _sh(*sw, "link", "set", name, "master", "br0", "up")
            _sh("ip", "-n", host, "addr", "add", f"{self.addresses[name]}/24", "dev", "eth0")
            _sh("ip", "-n", host, "link", "set", "eth0", "up")
            _sh("ip", "-n", host, "link", "set", "lo", "up")
        nft = ("ip", "netns", "exec", self.switch, "nft")
        _sh(*nft, "add", "table", "bridge", TABLE)
        _sh(*nft, "add", "chain", "bridge", TABLE, CHAIN, "{ type filter hook forward priority 0; policy accept; }")

    # -- running things on a host ------------------------------------------------------------

    def run(self, name: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``function(*args)`` on host ``name``'s thread (one per host, in its namespace)."""
        with self._lock:
            pool = self._threads.get(name)
            if pool is None:
                pool = ThreadPoolExecutor(1, f"netns-{name}", initializer=_enter, initargs=(self.namespace(name),))
                self._threads[name] = pool
        return pool.submit(function, *args, **kwargs).result()

    def thread(self, name: str, target: Callable[[], None]) -> threading.Thread:
        """A started thread running ``target`` on host ``name`` (for clients that run in process)."""

        def body() -> None:
            _enter(self.namespace(name))
            target()

        thread = threading.Thread(target=body, daemon=True, name=f"on-{name}")
        thread.start()
        return thread

    # -- the nemesis --------------------------------------------------------------------------

    def _rule(self, rule: str) -> None:
        _sh("ip", "netns", "exec", self.switch, "nft", "add", "rule", "bridge", TABLE, CHAIN, *rule.split())
        self._rules.append(rule)

    def isolate(self, name: str) -> None:
        """Cut host ``name`` off from every other host: its IPv4 packets vanish both ways."""
        self._rule(f"iifname {name} ether type ip drop")
        self._rule(f"oifname {name} ether type ip drop")

    def cut(self, a: str, b: str) -> None:
        """Cut the link between hosts ``a`` and ``b`` only (both directions)."""
        for src, dst in ((a, b), (b, a)):
            self._rule(f"iifname {src} oifname {dst} ether type ip drop")

    def split(self, side_a: Iterable[str], side_b: Iterable[str]) -> None:
        """Two sides that cannot reach each other; hosts on one side still talk."""
        others = list(side_b)
        for a in side_a:
            for b in others:
                self.cut(a, b)

    def lose(self, name: str, loss_pct: int) -> None:
        """Lose ``loss_pct`` percent of the IPv4 packets to and from host ``name``, at random."""
        self._rule(f"iifname {name} ether type ip numgen random mod 100 < {loss_pct} drop")
        self._rule(f"oifname {name} ether type ip numgen random mod 100 < {loss_pct} drop")

    def delay(self, server: str, client: str, port: int, delay_ms: int) -> None:
        """Every packet between host ``client`` and ``server``'s ``port`` arrives ``delay_ms``
        late, each way, for connections made from now on (established ones keep their path).

        For kernels without ``sch_netem``: an ``nft`` redirect in the server's host sends the
        client's new connections through a relay there that holds each chunk ``delay_ms``
        before passing it on, in both directions. ``heal`` removes the redirect and closes
        the relayed connections (the client reconnects, straight to the server)."""
        address = self.address(server)
        listener = self.run(server, socket.create_server, (address, 0))
        # Its threads, and the sockets they make, stay on the server's host.
        relay = DelayRelay(listener, (address, port), delay_ms / 1000, start=partial(self.thread, server))
        self._relays.append(relay)
        nft = ("ip", "netns", "exec", self.namespace(server), "nft")
        _sh(*nft, "add", "table", "ip", NAT_TABLE)
        _sh(*nft, "add", "chain", "ip", NAT_TABLE, "pre", "{ type nat hook prerouting priority -100; }")
        _sh(
            *nft, "add", "rule", "ip", NAT_TABLE, "pre", "ip", "saddr", self.address(client),
            "tcp", "dport", str(port), "redirect", "to", f":{relay.port}",
        )  # fmt: skip
        self._delayed.add(server)

    def heal(self) -> None:
        """Undo every cut, split and slowdown: the network is whole again."""
        _sh("ip", "netns", "exec", self.switch, "nft", "flush", "chain", "bridge", TABLE, CHAIN)
        self._rules.clear()
        for server in sorted(self._delayed):
            _sh("ip", "netns", "exec", self.namespace(server), "nft", "delete", "table", "ip", NAT_TABLE, check=False)
        self._delayed.clear()
        for relay in self._relays:
            relay.close()
        self._relays.clear()

    @property
    def rules(self) -> list[str]:
        """The nemesis' drop rules now in force."""
        return list(self._rules)

    # -- cleanup --------------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Delete every namespace of this run (their veths and the bridge go with them). The
        processes started in them must be stopped first; a leftover one keeps only a dead
        namespace, which ``ip netns del`` still unlinks."""
        for relay in self._relays:
            relay.close()
        for pool in self._threads.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._threads.clear()
        for name in namespaces():
            if name.startswith(f"{self.run_id}-"):
                _sh("ip", "netns", "del", name, check=False)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
