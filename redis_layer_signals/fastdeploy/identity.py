"""One identity, one owner, fenced by the server: the claim a bridge process holds on its
(instance, rank) in Redis, and what the process does with the server's refusals.

Where a process owns its rank (``registers_tasks``, FastDeploy's layout) its writer makes Redis
a copy of what the process decided, slot by slot, and its state wins over what Redis holds. Two
live processes writing for one (instance, rank), two messagers given one name, would erase
each other's tasks and signals. So, top to bottom:

1. **Claim.** The writer first claims the identity (lua/claim.lua): a key holding its token,
   host name, pid, the lease (renewed every third of ``DEFAULT_LEASE_S``, on the server's
   clock) and a *generation*, which grows with every new claim. A second live claimant is
   refused (``IdentityTaken``): it writes nothing and its process is served locally, as
   FastDeploy's own fix serves it; the holder's next renewal reads the note of that refusal
   and logs it too (``clash_message``).
2. **Take over.** A process that restarts takes over once its predecessor's lease has run out
   (``LAPSED``, logged naming the predecessor's host and pid: if it still runs, its writes are
   refused from now on), or at once when the predecessor is provably gone (``TOOK``: same host
   name and pid namespace, and its pid no longer alive).
3. **Fence.** Every write the owner makes carries its ``Claim`` (token and generation): the
   writer's ``apply``, its renewals. The Lua function checks it first (``owner_fence`` in
   lua/_lib.lua) and refuses a claim older than the one Redis holds: nothing is written, the
   reply says ``fenced`` and names the holder, and the refusal is counted (``ownership_fenced``)
   and noted for the holder to log.
4. **Lost.** The refused process turns that reply into ``OwnershipLost`` (``lost``): it logs
   one ERROR naming the new owner's host and pid, stops writing, and gives up the early signals
   Redis holds for the rank (the new owner adopted them). Until then, it hands out such a
   signal only while its lease holds by its own monotonic clock (``holds``), which ends before
   the server's (it counts from when the claim was sent): the new owner can claim only after
   the server's lease ended, so no early signal is handed out by both. A task that registers
   past that point gets its signal at the next renewal, if the process still owns the rank.

The lease is judged on clocks that do not jump: the server's (``TIME``, in the Lua) and this
host's monotonic clock, never its wall clock.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from dataclasses import dataclass

from ..buffer.sync import SignalBuffer
from ..errors import InvalidConfig, OwnershipLost
from ..protocol.calls import Claim, Prepared, ScriptCall
from ..protocol.replies import text

IDENTITY_KEPT_S = 3600.0
"""How long the identity key outlives its lease (and the note of a refused process its writing):
whoever claims next within it learns whom it replaced."""
DEFAULT_LEASE_S = 15.0
"""How long a claim outlives its last renewal. A process that died frees its identity after
this at the latest (at once when a successor on its host sees that its pid is gone)."""
RENEWALS_PER_LEASE = 3
"""The writer renews its claim every ``lease / 3``: two renewals may fail before the lease ends."""
CLAIMED, RENEWED, TOOK, LAPSED, TAKEN = "claimed", "renewed", "took", "lapsed", "taken"
"""What a claim can answer: the identity was free, the caller held it already, the caller
replaced a holder proven gone, or one whose lease had run out, or another live process holds
it (refused)."""


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
        """The process a claim or a clash note names: "<token>|<host>|<pid>|<pid namespace>|..."."""
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
class Clash:
    """A process the server refused the rank since the holder's last renewal (lua/claim.lua)."""

    owner: Owner
    refused: str
    """``"write"`` (the fence refused its write) or ``"claim"`` (its claim was refused)."""

    @classmethod
    def parse(cls, value: str) -> Clash:
        """The clash key's note, "<token>|<host>|<pid>|<pid namespace>|<at ms>|<write or claim>"."""
        return cls(Owner.parse(value), value.rsplit("|", 1)[-1])


@dataclass(frozen=True)
class ClaimResult:
    outcome: str
    """``CLAIMED``, ``RENEWED``, ``TOOK``, ``LAPSED`` or ``TAKEN``."""
    holder: Owner | None = None
    """The other process: the one replaced (``TOOK``, ``LAPSED``) or the one holding it (``TAKEN``)."""
    generation: int = 0
    """The caller's claim's generation (0 when refused): its writes carry it."""
    clash: Clash | None = None
    """``RENEWED``: a process the server refused the rank since the last renewal."""


class _Claim(Prepared[ClaimResult]):
    __slots__ = ()

    def parse(self, reply: object) -> ClaimResult:
        outcome, generation, value = text(reply).split("|", 2)
        gen = int(generation) if generation else 0
        if outcome == RENEWED:
            return ClaimResult(outcome, None, gen, Clash.parse(value) if value else None)
        return ClaimResult(outcome, Owner.parse(value) if value else None, gen)


class IdentityClaim:
    """The claim of one bridge on its (instance, rank): claim or renew, give up, and when the
    lease it holds ends by this host's monotonic clock (measured from when the claim was sent,
    so earlier than the server's). Builds no connection: every method but ``valid_for``,
    ``renewal_due``, ``held`` and ``lost`` is one call, made by the bridge's writer thread."""

    def __init__(self, buffer: SignalBuffer, instance: str, rank: int, token: str, lease_s: float) -> None:
        self.buffer = buffer
        self.instance = instance
        self.rank = rank
        self.me = this_process(token)
        self.lease_s = lease_seconds(lease_s)
        self.renew_s = self.lease_s / RENEWALS_PER_LEASE
        keys = buffer.protocol.keys.rank(instance, rank)
        self._keys = [keys.identity, keys.stats, keys.clash]
        self._lease_ms = str(max(1, round(self.lease_s * 1000)))
        self._kept_ms = str(round(IDENTITY_KEPT_S * 1000))
        self._lock = threading.Lock()
        self._valid_until = 0.0
        self._last_attempt = -float("inf")
        self._claim: Claim | None = None

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
            if result.outcome == TAKEN:
                self._valid_until, self._claim = 0.0, None
            else:
                self._valid_until = sent + self.lease_s
                self._claim = Claim(self.me.token, result.generation, self.me.field())
        return result

    def release(self) -> bool:
        """Give the identity up (only this process's claim is deleted): a successor on any host
        claims it at once. True when it was this process's."""
        with self._lock:
            self._valid_until, self._claim = 0.0, None
        return self._send("release", "").outcome == "released"

    def held(self) -> Claim | None:
        """The claim this process's writes carry, None while it holds none."""
        with self._lock:
            return self._claim

    def lost(self, holder: Owner | None, refused: str = "write") -> OwnershipLost:
        """The error for a write or renewal the server refused (``holder``: the process whose
        claim Redis holds): the claim is no longer this process's, its lease no longer valid."""
        with self._lock:
            self._valid_until, self._claim = 0.0, None
        other = holder.describe() if holder is not None else "another process"
        return OwnershipLost(self.instance, self.rank, other, self.me.describe(), refused)

    def check_applied(self, fenced_by: str | None) -> None:
        """Raise ``OwnershipLost`` when the fence refused a write (``fenced_by``: the claim
        Redis holds, from ``Applied``); nothing when the write landed."""
        if fenced_by is not None:
            raise self.lost(Owner.parse(fenced_by) if fenced_by else None)

    def valid_for(self, seconds: float) -> bool:
        """The lease holds for at least ``seconds`` more (by this host's clock)."""
        with self._lock:
            return time.monotonic() + seconds < self._valid_until

    def holds(self) -> bool:
        """The lease holds now (by this host's monotonic clock): the process surely owns the rank."""
        return self.valid_for(0)

    def renewal_due(self) -> bool:
        """A third of the lease has passed since the last attempt to claim or renew."""
        with self._lock:
            return time.monotonic() >= self._last_attempt + self.renew_s

    def _send(self, action: str, takeover: str, count: bool = False) -> ClaimResult:
        args = [action, self.me.token, self.me.field(), self._lease_ms, takeover, "1" if count else "0", self._kept_ms]
        return self.buffer.execute(_Claim("claim", ScriptCall("claim", list(self._keys), args)))


def lapsed_message(instance: str, rank: int, claim: ClaimResult) -> str:
    """What the new owner logs when it replaced a claim whose lease had run out: that process
    may still run (partitioned from Redis), and its writes are refused from now on."""
    holder = claim.holder.describe() if claim.holder is not None else "another process"
    return (
        f"{instance}/{rank}: claimed the identity {holder} held: its lease ran out. If that process "
        "still runs (cut off from Redis), it is refused from now on and gives up the rank's early signals"
    )


def clash_message(instance: str, rank: int, me: Owner, clash: Clash) -> str:
    """What the owner logs when its renewal reads that the server refused another process the
    rank since: two messagers serve one identity."""
    what = "write" if clash.refused == "write" else "claim"
    return (
        f"{instance}/{rank}: Redis refused a {what} of {clash.owner.describe()} for this identity, which "
        f"this process, {me.describe()}, owns: two messagers serve one instance and rank"
    )


def release_quietly(claim: IdentityClaim) -> None:
    """``release`` on the way out, when Redis may not answer: the lease frees it then."""
    with contextlib.suppress(Exception):
        claim.release()
