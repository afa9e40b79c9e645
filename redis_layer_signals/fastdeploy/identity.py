"""One identity, one owner: the claim a bridge process holds on its (instance, rank) in Redis.

Where a process owns its rank (``registers_tasks``, FastDeploy's layout) its writer makes Redis
a copy of what the process decided, slot by slot, and its state wins over what Redis holds. Two
live processes writing for one (instance, rank), two messagers given one name, would erase
each other's tasks and signals. So the writer first claims the identity (lua/claim.lua): a key
holding its token, host name and pid, under a lease it renews (``DEFAULT_LEASE_S``, renewed
every third of it). A second live claimant is refused (``IdentityTaken``): it writes nothing
and its process is served locally, as FastDeploy's own fix serves it.

A process that restarts takes over once its predecessor's lease has run out, or at once when
the predecessor is provably gone: same host name and pid namespace, and its pid no longer alive.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass

from ..buffer.sync import SignalBuffer
from ..errors import InvalidConfig
from ..protocol.calls import Prepared, ScriptCall
from ..protocol.replies import text

DEFAULT_LEASE_S = 15.0
"""How long a claim outlives its last renewal. A process that died frees its identity after
this at the latest (at once when a successor on its host sees that its pid is gone)."""
RENEWALS_PER_LEASE = 3
"""The writer renews its claim every ``lease / 3``: two renewals may fail before the lease ends."""
CLAIMED, RENEWED, TOOK, TAKEN = "claimed", "renewed", "took", "taken"
"""What a claim can answer: the identity was free, the caller held it already, the caller
replaced a holder proven gone, or another live process holds it (refused)."""


def lease_seconds(value: object) -> float:
    """A lease option, checked: a number of seconds in (0, 3600]."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 3600:
        raise InvalidConfig("lease_s", value, "must be a number of seconds in (0, 3600]")
    return float(value)


@dataclass(frozen=True)
class Owner:
    """A process as the identity key names it."""

    token: str
    host: str
    pid: int
    pid_namespace: str = ""
    """``/proc/self/ns/pid`` where there is one: a pid means the same process only inside one."""

    def field(self) -> str:
        """What the key stores after the token: "<host>|<pid>|<pid namespace>"."""
        return f"{self.host}|{self.pid}|{self.pid_namespace}"

    def describe(self) -> str:
        return f"host {self.host} (pid {self.pid}, writer {self.token[:8]})"

    @classmethod
    def parse(cls, value: str) -> Owner:
        """The inverse of the key's value, "<token>|<host>|<pid>|<pid namespace>|<since ms>"."""
        parts = value.split("|")
        token, host = parts[0], parts[1] if len(parts) > 1 else "?"
        pid = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else -1
        return cls(token, host, pid, parts[3] if len(parts) > 3 else "")


def this_process(token: str) -> Owner:
    return Owner(token, socket.gethostname().replace("|", "-"), os.getpid(), pid_namespace())


def pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists here (one of another user's counts as alive)."""
    if pid <= 0:
        return True  # nothing to prove it gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def gone(holder: Owner, me: Owner) -> bool:
    """The holder is provably dead: it ran on this host, in this pid namespace, under a pid that
    is neither this process's nor alive."""
    return (
        holder.host == me.host
        and holder.pid_namespace == me.pid_namespace
        and holder.pid != me.pid
        and not pid_alive(holder.pid)
    )


@dataclass(frozen=True)
class ClaimResult:
    outcome: str
    """``CLAIMED``, ``RENEWED``, ``TOOK`` or ``TAKEN``."""
    holder: Owner | None = None
    """The other process: the one replaced (``TOOK``) or the one holding it (``TAKEN``)."""


class _Claim(Prepared[ClaimResult]):
    __slots__ = ()

    def parse(self, reply: object) -> ClaimResult:
        outcome, _, value = text(reply).partition("|")
        return ClaimResult(outcome, Owner.parse(value) if value else None)


class IdentityClaim:
    """The claim of one bridge on its (instance, rank): claim or renew, give up, and when the
    lease it holds ends by this host's clock (measured from when the claim was sent, so
    earlier than the server's). Builds no connection: every method but ``valid_for`` and
    ``renewal_due`` is one call, made by the bridge's writer thread."""

    def __init__(self, buffer: SignalBuffer, instance: str, rank: int, token: str, lease_s: float) -> None:
        self.buffer = buffer
        self.me = this_process(token)
        self.lease_s = lease_seconds(lease_s)
        self.renew_s = self.lease_s / RENEWALS_PER_LEASE
        keys = buffer.protocol.keys.rank(instance, rank)
        self._keys = [keys.identity, keys.stats]
        self._lease_ms = str(max(1, round(self.lease_s * 1000)))
        self._lock = threading.Lock()
        self._valid_until = 0.0
        self._last_attempt = -float("inf")

    def claim(self, count_refusal: bool = False) -> ClaimResult:
        """Claim the identity, or renew this process's claim; a holder proven gone is replaced
        at once. ``count_refusal``: a refusal adds one to the rank's ``identity_refused``
        counter (the first of an episode). Raises what the call raises (Redis unreachable)."""
        sent = time.monotonic()
        with self._lock:
            self._last_attempt = sent
        result = self._send("claim", "")
        if result.outcome == TAKEN and result.holder is not None:
            if gone(result.holder, self.me):
                result = self._send("claim", result.holder.token, count_refusal)
            elif count_refusal:
                result = self._send("claim", "", count_refusal)  # counted with the check, atomically
        with self._lock:
            self._valid_until = 0.0 if result.outcome == TAKEN else sent + self.lease_s
        return result

    def release(self) -> bool:
        """Give the identity up (only this process's claim is deleted): a successor on any host
        claims it at once. True when it was this process's."""
        with self._lock:
            self._valid_until = 0.0
        return self._send("release", "").outcome == "released"

    def valid_for(self, seconds: float) -> bool:
        """The lease holds for at least ``seconds`` more (by this host's clock)."""
        with self._lock:
            return time.monotonic() + seconds < self._valid_until

    def renewal_due(self) -> bool:
        """A third of the lease has passed since the last attempt to claim or renew."""
        with self._lock:
            return time.monotonic() >= self._last_attempt + self.renew_s

    def _send(self, action: str, takeover: str, count: bool = False) -> ClaimResult:
        args = [action, self.me.token, self.me.field(), self._lease_ms, takeover, "1" if count else "0"]
        return self.buffer.execute(_Claim("claim", ScriptCall("claim", list(self._keys), args)))


def release_quietly(claim: IdentityClaim) -> None:
    """``release`` on the way out, when Redis may not answer: the lease frees it then."""
    with contextlib.suppress(Exception):
        claim.release()
