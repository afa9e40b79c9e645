"""Carries a tensor-parallel group's agreement between the ranks' processes of one host.

The rule is ``agreement``'s; this module moves its messages, without Redis, so an outage, a slow
link or one rank's black-holed connection to Redis holds back no release. Each rank's process
runs one thread (``rls-group``) with one event loop:

- **who is alive**: the process holds ``rank-<r>.lock`` (``flock``) for its life, with its pid,
  host, nranks and token inside. A second process of the rank cannot take it: it joins nothing,
  queues nothing of the group's and says so (ERROR, health, counter) until the first one exits.
- **who sequences**: the process that holds ``group-<g>.lock`` runs the group's ``Sequencer``
  in the same loop and listens on ``group-<g>.sock``; the file holds the generation, which
  grows with every holder. When the holder dies the kernel frees the lock and another rank
  takes it at once: a new generation gathers the live ranks' joins (at most ``JOIN_WAIT_S``).
- **who may speak**: the files live in a directory of this user's, mode 0700, named per
  namespace and instance (``group_dir``); a connection whose peer runs as another user is
  closed unread (``SO_PEERCRED``), and a join that disagrees on ``nranks`` is refused, loudly.
- **what is said**: one JSON object per line (``agreement.Message``); the sequencer's carry
  their generation, and a member ignores another's.

The hooks never wait here: they hand reports to the loop (``post``) and go on.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import selectors
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .agreement import Member, Message, Out, Progress, Sequencer
from .context import RankContext

TICK_S = 0.05
"""The loop's longest sleep: how soon a freed lock or a closed sequencer is noticed."""
JOIN_WAIT_S = 2.0
"""A new sequencer waits this long for the live ranks' joins before it resumes without the
ones missing (logged): they are caught up when they join."""
CHECK_S = 1.0
"""How often the loop checks its peers' settings and expires what waited too long."""
CLAIM_TRIES, CLAIM_RETRY_S = 10, 0.02
"""A rank's lock is held by another process only if it stays held this many tries, this far
apart: a sequencer that checks which ranks are alive (``_held``) holds each lock for an instant,
and a process starting then is no duplicate."""
RELAYED = ("absent", "refused")
"""Problems only the sequencer sees, told to every member so that every rank's health shows
them (each rank finds an ``nranks`` mismatch or a duplicate on its own)."""
MAX_LINE = 1 << 24
"""A peer that sends a longer line is cut off: nothing of ours is that long."""


def group_dir(namespace: str, instance: str) -> Path:
    """This user's directory for the instance's group files: ``RLS_GROUP_DIR``, else
    ``$XDG_RUNTIME_DIR/rls``, else ``<tmp>/rls-<uid>``; made with mode 0700, and refused when
    another user owns it or may enter it (another user could then speak for a rank)."""
    base = os.environ.get("RLS_GROUP_DIR") or (
        os.path.join(os.environ["XDG_RUNTIME_DIR"], "rls")
        if os.environ.get("XDG_RUNTIME_DIR")
        else os.path.join(tempfile.gettempdir(), f"rls-{os.getuid()}")
    )
    name = hashlib.sha256(f"{namespace}\0{instance}".encode()).hexdigest()[:16]
    path = Path(base) / name
    for folder in (Path(base), path):
        folder.mkdir(mode=0o700, exist_ok=True)
        stat = folder.stat()
        if stat.st_uid != os.getuid() or stat.st_mode & 0o077:
            raise PermissionError(
                f"{folder} must belong to uid {os.getuid()} with mode 0700 "
                f"(it has uid {stat.st_uid}, mode {stat.st_mode & 0o777:o}): another user could speak for a rank"
            )
    return path


def _lock(path: Path) -> int | None:
    """An exclusive ``flock`` on ``path`` (its descriptor), or None when another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def _held(path: Path) -> bool:
    """Whether a live process holds ``path``'s lock (it frees with its process)."""
    fd = _lock(path)
    if fd is None:
        return True
    os.close(fd)
    return False


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


@dataclass
class Line:
    """One connection: its socket, what it has not sent yet, and what came in unfinished."""

    sock: socket.socket
    member: int | None = None
    """The member it speaks for, once joined (the sequencer's side)."""
    token: str = ""
    inbox: bytearray = field(default_factory=bytearray)
    outbox: bytearray = field(default_factory=bytearray)

    def send(self, message: Message) -> None:
        self.outbox += json.dumps(message, separators=(",", ":")).encode() + b"\n"

    def flush(self) -> None:
        while self.outbox:
            try:
                sent = self.sock.send(self.outbox)
            except BlockingIOError:
                return
            del self.outbox[:sent]

    def lines(self) -> list[Message]:
        """Read what arrived; raises ConnectionError at the end of the stream."""
        while True:
            try:
                chunk = self.sock.recv(1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                raise ConnectionError("closed by the peer")
            self.inbox += chunk
            if len(self.inbox) > MAX_LINE:
                raise ConnectionError("a line longer than any message")
        messages = []
        while (end := self.inbox.find(b"\n")) >= 0:
            messages.append(json.loads(self.inbox[:end]))
            del self.inbox[: end + 1]
        return messages


@dataclass
class GroupState:
    """What ``health`` shows of the link (read under the bridge's lock)."""

    generation: int = 0
    sequencer: bool = False
    connected: bool = False
    problems: dict[str, str] = field(default_factory=dict)
    """Why the group cannot agree, by kind, while it cannot (a duplicate rank, an nranks
    mismatch, a rank that does not join, the loop failing): each the ERROR line's text. Each
    kind ends on its own: one resolved leaves the others said."""
    events: collections.Counter[str] = field(default_factory=collections.Counter)
    """``generation`` (this rank's sequencer was gone and this process took over), ``restart``
    (a rank restarted), ``reset`` (caught up past what a join carries), ``refused`` (a join
    refused), ``duplicate``, ``nranks``, ``absent`` (a rank that did not join in time), ``bug``
    (the loop failed)."""

    @property
    def problem(self) -> str:
        """Every problem said and not resolved, in the order they came."""
        return "; ".join(self.problems.values())


class GroupLink:
    """One rank's side of the transport, and the group's sequencer while this process leads."""

    def __init__(
        self,
        ctx: RankContext,
        member: Member,
        nranks: int,
        token: str,
        namespace: str,
        settle: Callable[[Progress], None],
    ) -> None:
        self.ctx = ctx
        self.member = member
        self.nranks = nranks
        self.rank = ctx.rank
        self.group = ctx.rank // nranks
        self.first = self.group * nranks
        """The first rank of the group (FastDeploy numbers ``rank_id`` across data-parallel
        groups: rank ``r`` is member ``r % nranks`` of group ``r // nranks``)."""
        self.token = token
        self.namespace = namespace
        self.settle = settle
        """Queues, logs and counts what a message of the sequencer settled (under the lock)."""
        self.state = GroupState()
        self._outbox: collections.deque[Message] = collections.deque()
        self._woken = False
        """A wake-up is on its way to the loop (under the bridge's lock): no second write."""
        """Reports the hooks posted, for the loop to send (under the bridge's lock)."""
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._dir: Path | None = None
        self._rank_fd: int | None = None
        self._lead_fd: int | None = None
        self._listener: socket.socket | None = None
        self._sequencer: Sequencer | None = None
        self._gather_until = 0.0
        self._peers: dict[int, Line] = {}
        self._line: Line | None = None
        """This member's connection to the sequencer."""
        self._joined = False
        """The sequencer welcomed this connection: reports go out as they come."""
        self._said: set[str] = set()
        self._missing_since: float | None = None
        """The sequencer: since when a rank of the group has not joined."""
        self._next_check = 0.0
        self._thread = threading.Thread(target=self._run, name="rls-group", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def post(self, progress: Progress) -> None:
        """Under the bridge's lock: hand a hook's reports to the loop (never blocks)."""
        if not (progress.report or progress.lost):
            return
        if progress.report:
            self._outbox.append({"t": "ready", "keys": progress.report})
        if progress.lost:
            self._outbox.append({"t": "lost", "keys": progress.lost})
        if not self._woken:  # one wake-up until the loop has read it
            self._woken = True
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"!")

    def join(self, timeout_s: float) -> None:
        with self.ctx.lock:
            wake = not self._woken  # once the loop has ended, its descriptors are closed
            self._woken = True
        if wake:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"!")
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self.ctx.closed.is_set():
                try:
                    self._step()
                    self._resolved("bug")
                except Exception as exc:  # a bug, an unexpected OS error, a refused directory
                    with self.ctx.lock:
                        self.ctx.errors["group"] += 1
                    self._problem("bug", f"the group's loop failed ({type(exc).__name__}: {exc}); trying again")
                    self._drop_line()
                    self._stop_leading()
                    self.ctx.closed.wait(CHECK_S)
        finally:
            self._drop_line()
            self._stop_leading()
            if self._rank_fd is not None:
                os.close(self._rank_fd)
            self._selector.close()
            with self.ctx.lock:  # a hook called after close never writes to a reused descriptor
                self._woken = True
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _step(self) -> None:
        now = time.monotonic()
        if self._dir is None:
            self._dir = group_dir(self.namespace, self.ctx.instance)
        if self._rank_fd is None and not self._claim_rank():
            with self.ctx.lock:
                self._forget_reports()  # a join carries them, once this process holds the rank
            self.ctx.closed.wait(CHECK_S)
            return
        if self._line is None:
            if self._lead_fd is None:
                self._try_lead()
            self._connect()
        if self._sequencer is not None and self._sequencer.gathering and self._gathered(now):
            self._lead_out(self._sequencer.resume())
        if now >= self._next_check:
            self._next_check = now + CHECK_S
            self._check()
        for key, _events in self._selector.select(TICK_S):
            self._ready(key)
        self._send_posted()
        self._flush()

    def _ready(self, key: selectors.SelectorKey) -> None:
        if key.fileobj == self._wake_r:
            with self.ctx.lock:
                self._woken = False
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
        elif key.data == "listen":
            self._accept()
        elif key.data == "member":
            self._hear_sequencer()
        else:
            self._hear_peer(key.data)

    # -- this rank ----------------------------------------------------------------------------

    def _claim_rank(self) -> bool:
        """Hold ``rank-<r>.lock`` for the process's life; False (said once) while another holds it."""
        assert self._dir is not None
        path = self._dir / f"rank-{self.rank}.lock"
        fd = _lock(path)
        for _try in range(CLAIM_TRIES - 1):
            if fd is not None:
                break
            if self.ctx.closed.wait(CLAIM_RETRY_S):
                return False
            fd = _lock(path)
        if fd is None:
            holder = _read_json(path)
            self._problem(
                "duplicate",
                f"rank {self.rank} is held by pid {holder.get('pid', '?')} on {holder.get('host', '?')} "
                f"(token {holder.get('token', '?')}): this process joins no group and queues nothing of it "
                "until that one exits",
            )
            return False
        info = {"pid": os.getpid(), "host": socket.gethostname(), "nranks": self.nranks, "token": self.token}
        _write(fd, json.dumps(info))
        self._rank_fd = fd
        self._resolved("duplicate")
        return True

    def _connect(self) -> None:
        assert self._dir is not None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(self._dir / f"group-{self.group}.sock"))
        except OSError:
            sock.close()
            return
        sock.setblocking(False)
        self._line = Line(sock)
        self._joined = False
        self._selector.register(sock, selectors.EVENT_READ, "member")
        join = {"rank": self.rank, "nranks": self.nranks, "pid": os.getpid(), "host": socket.gethostname()}
        with self.ctx.lock:
            join.update(self.member.joining(self.token))
            self._forget_reports()  # the join carries every report made so far
        self._line.send(join)
        with self.ctx.lock:
            self.state.connected = True

    def _hear_sequencer(self) -> None:
        assert self._line is not None
        try:
            messages = self._line.lines()
        except (ConnectionError, OSError, ValueError):
            self._drop_line()
            return
        for message in messages:
            if message.get("t") in ("problem", "resolved"):
                if self._sequencer is None:  # the sequencer's own rank said it already
                    self._relayed(message)
                continue
            if message.get("t") == "refused":
                self._problem("refused", f"the group refused this rank: {message.get('why')}")
                self._drop_line()
                self.ctx.closed.wait(CHECK_S)
                return
            welcomed = False
            with self.ctx.lock:
                progress = self.member.hear(message)
                if message.get("t") == "welcome" and self.member.generation == message.get("g"):
                    welcomed = True
                    self.state.generation = self.member.generation
                    self._joined = True  # what was reported since the join goes out now
                self.settle(progress)
                if progress.lost:
                    self._outbox.append({"t": "lost", "keys": progress.lost})
            if welcomed:  # outside the lock, which ``_resolved`` takes (it is not reentrant)
                self._resolved("refused")
            self._said_event(message, progress)

    def _said_event(self, message: Message, progress: Progress) -> None:
        kind = message.get("t")
        if kind == "restarted":
            with self.ctx.lock:
                self.state.events["restart"] += 1
            self.ctx.logger.error(
                "%s/%d: rank %s of the tensor-parallel group restarted (generation %s): %d entries of "
                "requests in flight dropped here, their requests are not sent",
                self.ctx.instance,
                self.rank,
                message.get("rank"),
                message.get("g"),
                len(progress.dropped),
            )
        elif kind == "reset":
            with self.ctx.lock:
                self.state.events["reset"] += 1
            self.ctx.logger.error(
                "%s/%d: this rank's queue lagged the group's order past what a join carries: %d entries "
                "in flight dropped, joining again as a new process",
                self.ctx.instance,
                self.rank,
                len(progress.dropped),
            )
            self._drop_line()

    def _forget_reports(self) -> None:
        """Under the lock: the reports waiting to be sent are in the member's, which a join
        carries; lost keys wait for the sequencer."""
        kept = [m for m in self._outbox if m["t"] == "lost"]
        self._outbox.clear()
        self._outbox.extend(kept)

    def _send_posted(self) -> None:
        """Send what the hooks posted, once the sequencer welcomed this connection. Until then
        they wait (a report made before the join went with it): each report reaches a
        sequencer once, so none is counted again after its key was released."""
        with self.ctx.lock:
            if not self._outbox or self._line is None or not self._joined:
                return
            ready = [key for m in self._outbox if m["t"] == "ready" for key in m["keys"]]
            lost = [key for m in self._outbox if m["t"] == "lost" for key in m["keys"]]
            self._outbox.clear()
            generation = self.member.generation
        # One line of each per wake-up, whatever the hooks posted meanwhile.
        if ready:
            self._line.send({"t": "ready", "g": generation, "keys": ready})
        if lost:
            self._line.send({"t": "lost", "g": generation, "keys": lost})

    def _drop_line(self) -> None:
        if self._line is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(self._line.sock)
            self._line.sock.close()
            self._line, self._joined = None, False
            with self.ctx.lock:
                self.state.connected = False

    # -- the sequencer, while this process leads ------------------------------------------

    def _try_lead(self) -> None:
        assert self._dir is not None
        fd = _lock(self._dir / f"group-{self.group}.lock")
        if fd is None:
            return
        raw = os.pread(fd, 64, 0).decode(errors="replace").strip()
        generation = (int(raw) if raw.isdigit() else 0) + 1
        _write(fd, str(generation))
        path = self._dir / f"group-{self.group}.sock"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # the last holder's: only the lock's holder touches it
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(64)
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, "listen")
        self._lead_fd, self._listener = fd, listener
        self._sequencer = Sequencer(self.nranks, generation, self.member.give_up_ms)
        self._gather_until = time.monotonic() + JOIN_WAIT_S
        self._drop_line()  # a line to the last sequencer: this process joins its own
        with self.ctx.lock:
            self.state.sequencer = True
            if self.state.generation:  # a takeover: this rank had joined another sequencer
                self.state.events["generation"] += 1
        if self.state.generation:  # this rank had joined another: its sequencer is gone
            self.ctx.logger.warning(
                "%s/%d: this process now sequences the tensor-parallel group %d (generation %d): the last "
                "sequencer's process is gone; gathering the live ranks",
                self.ctx.instance,
                self.rank,
                self.group,
                generation,
            )

    def _stop_leading(self) -> None:
        for line in list(self._peers.values()):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(line.sock)
            line.sock.close()
        self._peers.clear()
        if self._listener is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(self._listener)
            if self._dir is not None:
                with contextlib.suppress(FileNotFoundError):
                    (self._dir / f"group-{self.group}.sock").unlink()
            self._listener.close()
            self._listener = None
        if self._lead_fd is not None:
            os.close(self._lead_fd)
            self._lead_fd = None
        self._sequencer = None
        with self.ctx.lock:
            self.state.sequencer = False
        self._resolved("absent")  # a sequencer's view: the next one says it again if it holds

    def _live(self) -> set[int]:
        """The group's ranks whose process holds its rank lock."""
        assert self._dir is not None
        return {
            r
            for r in range(self.first, self.first + self.nranks)
            if r == self.rank or _held(self._dir / f"rank-{r}.lock")
        }

    def _missing(self) -> set[int]:
        """The live ranks that have not joined this process's sequencer."""
        assert self._sequencer is not None
        return self._live() - {self.first + m for m in self._sequencer.joined}

    def _gathered(self, now: float) -> bool:
        assert self._sequencer is not None
        missing = self._missing()
        if not missing:
            self._resolved("absent")
            return True
        return now >= self._gather_until  # the missing ones are named by ``_absent``

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _address = self._listener.accept()
        except BlockingIOError:
            return
        if _peer_uid(sock) != os.getuid():
            sock.close()  # another user: nothing it says is heard
            return
        sock.setblocking(False)
        line = Line(sock)
        self._peers[sock.fileno()] = line
        self._selector.register(sock, selectors.EVENT_READ, line)

    def _hear_peer(self, line: Line) -> None:
        assert self._sequencer is not None
        try:
            messages = line.lines()
        except (ConnectionError, OSError, ValueError):
            self._close_peer(line)
            return
        now_ms = self.ctx.mono_ms()
        for message in messages:
            if line.member is None:
                refusal = self._refusal(message)
                if refusal:
                    line.send({"t": "refused", "why": refusal})
                    line.flush()
                    self._problem("refused", refusal)
                    self._close_peer(line)
                    return
                line.member, line.token = int(message["rank"]) - self.first, str(message.get("token"))
                self._lead_out(self._sequencer.join(line.member, message, now_ms))
            else:
                self._lead_out(self._sequencer.hear(line.member, message, now_ms))

    def _refusal(self, join: Message) -> str:
        """Why a join is refused ('' when it is not)."""
        rank, nranks = join.get("rank"), join.get("nranks")
        who = f"rank {rank} (pid {join.get('pid')} on {join.get('host')})"
        if nranks != self.nranks:
            return f"{who} runs with nranks={nranks}, the group's sequencer (rank {self.rank}) with {self.nranks}"
        if not isinstance(rank, int) or not self.first <= rank < self.first + self.nranks:
            return f"{who} is not a rank of group {self.group} ({self.first} to {self.first + self.nranks - 1})"
        for other in list(self._peers.values()):
            if other.member == rank - self.first:
                if other.token == join.get("token"):
                    self._close_peer(other)  # the same process again: its old line is done
                    continue
                return f"{who}: another process (token {other.token}) speaks for rank {rank} already"
        return ""

    def _close_peer(self, line: Line) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(line.sock)
        self._peers.pop(line.sock.fileno(), None)
        line.sock.close()
        if line.member is not None and self._sequencer is not None:
            self._sequencer.left(line.member)

    def _lead_out(self, out: Out) -> None:
        by_member = {line.member: line for line in self._peers.values() if line.member is not None}
        for member, message in out:
            line = by_member.get(member)
            if line is not None:
                line.send(message)

    def _flush(self) -> None:
        for line in [*self._peers.values(), *([self._line] if self._line else [])]:
            try:
                line.flush()
            except OSError:
                if line is self._line:
                    self._drop_line()
                else:
                    self._close_peer(line)

    # -- checks and words ----------------------------------------------------------------------

    def _check(self) -> None:
        """Every ``CHECK_S``: expire what waited too long, and look at the peers' settings."""
        with self.ctx.lock:
            progress = self.member.expire(self.ctx.mono_ms())
            if progress.dropped:
                self.settle(progress)
        if self._sequencer is not None and not self._sequencer.gathering:
            self._lead_out(self._sequencer.expire(self.ctx.mono_ms()))
            self._absent()
        assert self._dir is not None
        differ = []
        for path in sorted(self._dir.glob("rank-*.lock")):
            r = path.name[5:-5]
            if r == str(self.rank):
                continue
            info = _read_json(path)
            if info.get("nranks", self.nranks) != self.nranks and _held(path):
                differ.append(f"rank {r} (pid {info.get('pid')}) runs with nranks={info.get('nranks')}")
        if differ:
            self._problem(
                "nranks",
                f"the instance's ranks disagree on nranks: this one runs with {self.nranks}, " + ", ".join(differ),
            )
        else:
            self._resolved("nranks")

    def _absent(self) -> None:
        """The sequencer: ranks that have not joined for ``JOIN_WAIT_S`` hold back every release.
        Named with what this host knows of them: alive here and not joining (another nranks, a
        hung process), or not running on this host (a group runs on one host)."""
        assert self._sequencer is not None and self._dir is not None
        now = time.monotonic()
        missing = sorted(
            set(range(self.first, self.first + self.nranks)) - {self.first + m for m in self._sequencer.joined}
        )
        if not missing:
            self._missing_since = None
            self._resolved("absent")
            return
        if self._missing_since is None:
            self._missing_since = now
        if now - self._missing_since < JOIN_WAIT_S:
            return
        alive = [r for r in missing if _held(self._dir / f"rank-{r}.lock")]
        gone = [r for r in missing if r not in alive]
        words = []
        if alive:
            words.append(f"ranks {alive} run on this host but have not joined (another nranks? a hung process?)")
        if gone:
            words.append(
                f"ranks {gone} do not run on this host (not started yet, or on another host: "
                "a group's ranks must share one)"
            )
        self._problem(
            "absent",
            f"group {self.group} cannot release anything: " + "; ".join(words),
        )

    def _relayed(self, message: Message) -> None:
        kind = f"group-{message.get('kind')}"
        if message["t"] == "problem":
            self._problem(kind, f"the sequencer says: {message.get('text')}")
        else:
            self._resolved(kind)

    def _problem(self, kind: str, text: str, error: bool = True) -> None:
        """Say why the group cannot agree: once per kind until it is resolved; health shows it.
        The sequencer tells every member, so that every rank's health shows it."""
        with self.ctx.lock:
            self.state.problems[kind] = text
            if kind not in self._said and not kind.startswith("group-"):  # relayed: counted there
                self.state.events[kind] += 1
        if self._sequencer is not None and kind in RELAYED and kind not in self._said:
            self._lead_out(self._sequencer.broadcast({"t": "problem", "kind": kind, "text": text}))
        self._say(kind, text, error)

    def _resolved(self, kind: str) -> None:
        """The problem of ``kind`` is over (the others stay): said once, at WARNING."""
        if kind in self.state.problems:
            with self.ctx.lock:
                self.state.problems.pop(kind, None)
        if kind in self._said:
            self._said.discard(kind)
            if self._sequencer is not None and kind in RELAYED:
                self._lead_out(self._sequencer.broadcast({"t": "resolved", "kind": kind}))
            self.ctx.logger.warning(
                "%s/%d: the tensor-parallel group: resolved (%s)", self.ctx.instance, self.rank, kind
            )

    def _say(self, kind: str, text: str, error: bool = True) -> None:
        if kind in self._said:
            return
        self._said.add(kind)
        log = self.ctx.logger.error if error else self.ctx.logger.warning
        log("%s/%d: the tensor-parallel group: %s", self.ctx.instance, self.rank, text)
