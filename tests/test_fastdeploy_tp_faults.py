"""A tensor-parallel group under the faults of an operator's bad day (issue 32), on fakeredis
and on a redis-server of the test's own: ranks racing in any interleaving, an aborted request,
Redis paused or cut off from one rank, a rank's process killed and started again, the
sequencer's process killed, ranks told different ``nranks``, a second process for a held rank,
and the group's directory and socket reached by another user.

The group agrees over a Unix socket in ``RLS_GROUP_DIR`` (a directory of each test's own), never
through Redis; ranks run as bridges of this process (``tp_group.Group``) or, where a process
must die, as processes of their own (``tp_group.RankProcess``). Nothing here asserts a time:
every wait is a wait-until with a generous deadline."""

from __future__ import annotations

import json
import os
import shutil
import signal as signals
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from redis_layer_signals.fastdeploy import Layer0Bridge, group_link
from redis_layer_signals.fastdeploy.group_link import group_dir
from redis_layer_signals.fastdeploy.health import BridgeHealth
from tests.proxy import BLACK_HOLE, PASS, Proxy
from tests.servers import RedisServer, running, wait_until
from tests.tp_group import Group, RankProcess, Workload, cache_info, check_agreement, signal, workload

NOBODY = 65534


pytestmark = pytest.mark.usefixtures("group_base")


@pytest.fixture
def processes() -> Iterator[list[RankProcess]]:
    started: list[RankProcess] = []
    yield started
    for process in started:
        if process.process.poll() is None:
            process.kill()


def healths(ranks: list[RankProcess]) -> list[dict[str, Any]]:
    return [rank.health() for rank in ranks]


def entries_of(batches: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    return [entry for batch in batches for entry in batch]


def answered(group: Group, timeout: float = 15.0) -> list[BridgeHealth]:
    """Every rank's health, asked from a thread of its own: a bridge whose lock is never given
    back (its hooks would hang FastDeploy's loops) fails the test instead of hanging it."""
    got: list[list[BridgeHealth]] = []
    asking = threading.Thread(target=lambda: got.append(group.health()), daemon=True)
    asking.start()
    asking.join(timeout)
    assert got, "a bridge did not answer: its lock is held for good"
    return got[0]


class HeldClock:
    """Milliseconds since the epoch that stand still until ``advance`` moves them: an entry
    cannot expire while the test looks at what it held back."""

    def __init__(self) -> None:
        self.now = int(time.time() * 1000)

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += ms


# -- 1. racing ranks: identical sequences, nothing twice, every registered request queued --------


@st.composite
def interleavings(draw: st.DrawFn) -> tuple[Workload, int, list[tuple[int, str, int]]]:
    """A workload, a group size, and one interleaving of every rank's reads and registrations:
    each rank reads the GPU's messages in order and registers the tasks in an order of its own."""
    work = workload(draw(st.integers(0, 10_000)), requests=4, aborted=draw(st.integers(0, 1)))
    nranks = draw(st.sampled_from([2, 3, 4]))
    queues: list[list[tuple[str, int]]] = []
    for _rank in range(nranks):
        tasks = draw(st.permutations(range(len(work.tasks))))
        ops: list[tuple[str, int]] = []
        messages, registered = 0, 0
        while messages < len(work.messages) or registered < len(tasks):
            read = registered == len(tasks) or (messages < len(work.messages) and draw(st.booleans()))
            if read:
                ops.append(("signal", messages))
                messages += 1
            else:
                ops.append(("task", tasks[registered]))
                registered += 1
        queues.append(ops)
    schedule: list[tuple[int, str, int]] = []
    while any(queues):
        rank = draw(st.sampled_from([r for r, ops in enumerate(queues) if ops]))
        kind, index = queues[rank].pop(0)
        schedule.append((rank, kind, index))
    return work, nranks, schedule


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=interleavings())
def test_any_interleaving_of_reads_and_registrations_queues_one_sequence_on_every_rank(
    case: tuple[Workload, int, list[tuple[int, str, int]]], group_base: Path
) -> None:
    """Every rank queues the same batches in the same order, none twice, every registered
    request's entries; an aborted request's entry is queued nowhere and holds nothing back.
    The hooks return nothing for a tensor-parallel rank: the group's releases come later."""
    work, nranks, schedule = case
    group = Group(f"memory://{uuid.uuid4().hex}", "hyp", nranks, instance=f"h{uuid.uuid4().hex[:8]}")
    try:
        group.finishing.update(work.need)
        for rank, kind, index in schedule:
            bridge = group.bridges[rank]
            if kind == "signal":
                assert bridge.on_kv_signal(signal(work.messages[index])) == []
            else:
                slot, request_id, need = work.tasks[index]
                assert bridge.on_cache_task(cache_info(slot, request_id, need)) == []
        registered = [entry for entry in work.stream if entry[0] not in work.aborted]
        group.wait_queued(len(registered))
        check_agreement(group.queued, work.stream)
        assert sorted(entries_of(group.queued[0])) == sorted(registered)
        for health in group.health():
            assert health.group_waiting == len(work.stream) - len(registered)
            # A sequencer checking which ranks live holds each rank's lock for an instant: a
            # rank starting then is no duplicate of itself.
            assert set(health.group_events) <= {"generation"}, health.group_events
    finally:
        group.close()


# -- 2. an aborted request holds back no later request, then expires ----------------------------


@pytest.mark.parametrize("nranks", [2, 4])
def test_an_aborted_request_holds_back_no_later_request_and_expires_after_pending_ttl(
    tp_url: str, namespace: str, nranks: int, groups: list[Group], caplog: pytest.LogCaptureFixture
) -> None:
    clock = HeldClock()
    group = Group(tp_url, namespace, nranks, pending_ttl_s=1.0, clock=clock)
    groups.append(group)
    for bridge in group.bridges:  # slot 9's request was aborted: its task never comes
        bridge.on_kv_signal(signal([(9, 64)]))
    later = [(1, "a", 100), (2, "b", 80), (3, "c", 30)]
    for bridge in group.bridges:
        for slot, request_id, need in later:
            bridge.on_cache_task(cache_info(slot, request_id, need))
        bridge.on_kv_signal(signal([(slot, need) for slot, _r, need in later]))
    group.wait_queued(len(later))
    for rank, health in enumerate(group.health()):  # the clock stood still: slot 9 still waits
        assert sorted(group.queued[rank]) == [[(1, 100)], [(2, 80)], [(3, 30)]], f"rank {rank}"
        assert (health.group_waiting, health.group_outcomes.get("expired", 0)) == (1, 0), f"rank {rank}"
    check_agreement(group.queued, [(9, 64), (1, 100), (2, 80), (3, 30)])
    clock.advance(1000)  # pending_ttl_s
    group.wait(
        lambda: all(h.group_outcomes.get("expired") == 1 and h.group_waiting == 0 for h in group.health()),
        "slot 9's entry to expire on every rank",
    )
    assert all(len(queued) == len(later) for queued in group.queued), "the aborted entry is queued nowhere"
    assert "dropped layer-0 entry (slot 9, 64 tokens" in caplog.text
    for bridge in group.bridges:
        assert bridge.flush(20.0)
    stats = group.buffers[0].stats()
    assert (stats["expired"], stats["registered"]) == (nranks, nranks * len(later))


# -- 3. Redis paused, or one rank's link black-holed: releases go on --------------------------------


def _requests(group: Group, first_slot: int, count: int) -> list[tuple[int, int]]:
    """``count`` requests registered and prefilled on every rank; their entries."""
    entries = [(slot, 10 + slot) for slot in range(first_slot, first_slot + count)]
    for bridge in group.bridges:
        for slot, tokens in entries:
            bridge.on_cache_task(cache_info(slot, f"r{slot}", tokens))
        bridge.on_kv_signal(signal(entries))
    return entries


@pytest.mark.parametrize("nranks", [2, 4])
def test_releases_go_on_while_redis_is_paused(namespace: str, nranks: int, groups: list[Group]) -> None:
    with running() as server:
        assert server.process is not None
        group = Group(server.url, namespace, nranks, retry_s=0.3)
        groups.append(group)
        group.wait_joined()
        assert all(bridge.flush(20.0) for bridge in group.bridges)
        os.kill(server.process.pid, signals.SIGSTOP)
        try:
            first = _requests(group, 0, 2)
            group.wait(lambda: all(h.degraded for h in group.health()), "every writer to find Redis gone")
            rest = _requests(group, 2, 3)
            group.wait_queued(len(first) + len(rest))
            assert server.process.poll() is None and _stopped(server.process.pid), "Redis was paused throughout"
        finally:
            os.kill(server.process.pid, signals.SIGCONT)
        check_agreement(group.queued, first + rest)
        assert sorted(entries_of(group.queued[0])) == sorted(first + rest)
        for bridge in group.bridges:
            assert bridge.flush(30.0)
        stats = group.buffers[0].stats()
        assert stats["registered"] == nranks * len(first + rest)
        assert stats["recorded"] == nranks * len(first + rest)


def _stopped(pid: int) -> bool:
    """The process is stopped (``T`` in /proc's state field)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_releases_go_on_while_one_ranks_link_to_redis_is_black_holed(
    redis_server: RedisServer, namespace: str, groups: list[Group]
) -> None:
    proxy = Proxy(redis_server.port)
    try:
        group = Group(redis_server.url, namespace, 2, urls={1: proxy.url}, retry_s=0.3)
        groups.append(group)
        group.wait_joined()
        assert all(bridge.flush(20.0) for bridge in group.bridges)
        proxy.mode = BLACK_HOLE
        first = _requests(group, 0, 2)
        group.wait(lambda: group.bridges[1].health().degraded, "rank 1's writer to find its link dead")
        rest = _requests(group, 2, 3)
        group.wait_queued(len(first) + len(rest))
        assert proxy.mode == BLACK_HOLE and group.bridges[1].health().degraded
        check_agreement(group.queued, first + rest)
        assert sorted(entries_of(group.queued[1])) == sorted(first + rest)
        proxy.mode = PASS
        for bridge in group.bridges:
            assert bridge.flush(30.0)
        assert group.buffers[0].stats()["registered"] == 2 * len(first + rest)
    finally:
        for made in groups:
            made.close()
        groups.clear()
        proxy.close()


# -- 4, 5. a rank's process restarts alone; the sequencer's process is killed -------------------


def _start(url: str, namespace: str, nranks: int, logs: Path, processes: list[RankProcess]) -> list[RankProcess]:
    ranks = [RankProcess(url, namespace, rank, nranks, logs / f"rank-{rank}.log") for rank in range(nranks)]
    processes += ranks
    wait_until(lambda: all(h["group_generation"] > 0 for h in healths(ranks)), 30, what="every rank to join")
    return ranks


def _serve(ranks: list[RankProcess], slot: int, request_id: str, tokens: int) -> None:
    for rank in ranks:
        rank.task(slot, request_id, tokens)
        rank.signal([(slot, tokens)])


def _queued_everywhere(ranks: list[RankProcess], entry: tuple[int, int]) -> bool:
    return all([entry] in rank.queued for rank in ranks)


def _restart_with_a_request_in_flight(
    url: str, namespace: str, tmp_path: Path, processes: list[RankProcess], kill_sequencer: bool, served: bool
) -> tuple[list[RankProcess], int, list[dict[str, Any]]]:
    """Three ranks serve request a (if ``served``); request b is registered on every rank and
    read by all but the victim (in flight: the group waits for the victim's report); the victim
    is killed -9 and started again. Returns the ranks (the victim's new process in its place),
    the victim, and every rank's health before the kill."""
    ranks = _start(url, namespace, 3, tmp_path, processes)
    if served:
        _serve(ranks, 1, "a", 100)
        wait_until(lambda: _queued_everywhere(ranks, (1, 100)), 30, what="request a on every rank")
        for rank in ranks:
            rank.finish(1, "a")
    before = healths(ranks)
    sequencer = [h["group_sequencer"] for h in before].index(True)
    victim = sequencer if kill_sequencer else (sequencer + 1) % 3
    for rank in ranks:
        rank.task(2, "b", 100)
        if rank.rank != victim:
            rank.signal([(2, 100)])
    survivors = [rank for rank in ranks if rank.rank != victim]
    wait_until(lambda: all(h["group_reported"] == 1 for h in healths(survivors)), 30, what="b reported")
    ranks[victim].kill()
    ranks[victim] = RankProcess(url, namespace, victim, 3, tmp_path / f"rank-{victim}-again.log")
    processes.append(ranks[victim])
    return ranks, victim, before


@pytest.mark.parametrize("case", ["member", "sequencer", "sequencer-before-any-release"])
def test_a_rank_restarted_alone_is_seen_by_every_rank_its_requests_in_flight_dropped_loudly(
    tp_url: str, namespace: str, tmp_path: Path, processes: list[RankProcess], case: str
) -> None:
    """A rank's process killed -9 and started again, while a request is in flight: every rank
    sees the restart, the survivors drop the request with an ERROR naming it, later requests
    are queued on every rank. Where the sequencer's process is the one killed, another rank
    takes over under a new generation, and the restart is seen even where the group had
    released nothing yet (the new sequencer never saw the rank's last process)."""
    kill_sequencer, served = case != "member", case != "sequencer-before-any-release"
    ranks, victim, before = _restart_with_a_request_in_flight(
        tp_url, namespace, tmp_path, processes, kill_sequencer, served
    )
    survivors = [rank for rank in ranks if rank.rank != victim]
    wait_until(
        lambda: all(h["group_events"].get("restart", 0) >= 1 for h in healths(ranks)),
        20,
        what="every rank to see the restart",
    )
    for rank in survivors:
        log = rank.log()
        assert f"ERROR p0/{rank.rank}: rank {victim} of the tensor-parallel group restarted" in log, log
        assert (
            f"ERROR p0/{rank.rank}: dropped layer-0 entry (slot 2, 100 tokens, request b): "
            "a rank of the group restarted while its request was in flight" in log
        ), log
    _serve(ranks, 3, "c", 50)
    wait_until(lambda: _queued_everywhere(ranks, (3, 50)), 20, what="request c on every rank")
    after = healths(ranks)
    for rank, health in zip(survivors, [after[r.rank] for r in survivors], strict=True):
        assert rank.queued == [[(1, 100)]] * served + [[(3, 50)]], f"rank {rank.rank}: b is lost, c is not"
        assert health["group_outcomes"].get("lost") == 1, health
    assert ranks[victim].queued == [[(3, 50)]], "the new process starts at the group's order so far"
    generations = {h["group_generation"] for h in after}
    assert len(generations) == 1, after
    if kill_sequencer:  # another rank took over under a new generation
        assert generations.pop() > before[0]["group_generation"]
        assert [h["group_sequencer"] for h in after].count(True) == 1
        assert not after[victim]["group_sequencer"]
    else:
        assert generations.pop() == before[0]["group_generation"]


# -- 6. ranks told different nranks ---------------------------------------------------------------


def test_ranks_told_different_nranks_say_so_on_every_rank_and_queue_nothing_divergent(
    tp_url: str, namespace: str, tmp_path: Path, processes: list[RankProcess]
) -> None:
    told = [4, 4, 4, 2]
    started = time.monotonic()
    ranks = [RankProcess(tp_url, namespace, r, n, tmp_path / f"rank-{r}.log") for r, n in enumerate(told)]
    processes += ranks

    def names_the_others(rank: RankProcess, health: dict[str, Any]) -> bool:
        others = [r for r in range(4) if told[r] != told[rank.rank]]
        problem = health["group_problem"]
        return all(f"rank {r} (pid {ranks[r].pid}) runs with nranks={told[r]}" in problem for r in others)

    wait_until(
        lambda: all(names_the_others(rank, h) for rank, h in zip(ranks, healths(ranks), strict=True)),
        20,
        what="every rank to name the ranks that differ",
    )
    for rank, health in zip(ranks, healths(ranks), strict=True):
        assert f"ERROR p0/{rank.rank}: the tensor-parallel group: the instance's ranks disagree on nranks" in rank.log()
        assert health["group_events"].get("nranks") == 1
    # Whatever else a rank says meanwhile (a sequencer that stops waiting for a live rank of its
    # range: rank 3 counts itself in group 1, rank 2 in group 0), the mismatch stays said:
    # sampled past the sequencers' wait for joins.
    until = started + group_link.JOIN_WAIT_S + 2 * group_link.CHECK_S
    while time.monotonic() < until:
        now = healths(ranks)
        assert all("disagree on nranks" in h["group_problem"] for h in now), now
        time.sleep(0.1)
    _serve(ranks, 1, "a", 100)
    wait_until(lambda: all(h["group_reported"] == 1 for h in healths(ranks)), 20, what="a reported on every rank")
    time.sleep(1.0)  # what would be released by now has been
    assert [rank.queued for rank in ranks] == [[], [], [], []]


@pytest.mark.timeout(90)  # a bridge whose lock is held for good does not close either
def test_a_rank_told_another_nranks_is_refused_by_the_sequencer_and_both_keep_saying_why(
    tp_url: str, namespace: str, groups: list[Group], caplog: pytest.LogCaptureFixture
) -> None:
    """Ranks 0 and 1 both count themselves in group 0, one with nranks 3: whichever sequences
    refuses the other's join. Each problem is said beside the others (the refusal, the
    mismatch, a live rank that did not join) and stays said while it lasts. The sequencer
    welcomes its own rank once it stops waiting for joins: that must not hang its hooks (it
    resolved the refusal under the bridge's lock, which it already held)."""
    started = time.monotonic()
    group = Group(tp_url, namespace, 2, nranks_of={1: 3})
    groups.append(group)
    group.wait(
        lambda: all("nranks" in h.group_events and h.group_events.get("refused") for h in group.health()),
        "both ranks to see the refusal and the mismatch",
    )
    until = started + group_link.JOIN_WAIT_S + 2 * group_link.CHECK_S  # past the wait for joins
    while time.monotonic() < until:
        health = answered(group)
        assert all("disagree on nranks" in h.group_problem for h in health), health
        time.sleep(0.05)
    for bridge in group.bridges:
        bridge.on_cache_task(cache_info(1, "a", 100))
        bridge.on_kv_signal(signal([(1, 100)]))
    group.wait(lambda: all(h.group_reported == 1 for h in group.health()), "a reported")
    assert "runs with nranks=3" in caplog.text and "runs with nranks=2" in caplog.text
    time.sleep(0.5)
    assert group.queued == [[], []]


# -- 7. a second process for a held rank ----------------------------------------------------------


def _files(folder: Path) -> dict[str, tuple[int, int, bytes | None]]:
    """What the group's directory holds: mode, mtime and content of each file (sockets: None)."""
    seen: dict[str, tuple[int, int, bytes | None]] = {}
    for path in sorted(folder.rglob("*")):
        stat = path.stat()
        content = path.read_bytes() if path.is_file() else None
        seen[str(path.relative_to(folder))] = (stat.st_mode, stat.st_mtime_ns, content)
    return seen


def test_a_second_process_for_a_held_rank_is_refused_writes_nothing_and_takes_over_once_it_exits(
    tp_url: str, namespace: str, tmp_path: Path, group_base: Path, processes: list[RankProcess]
) -> None:
    ranks = _start(tp_url, namespace, 2, tmp_path, processes)
    files = _files(group_base)
    second = RankProcess(tp_url, namespace, 1, 2, tmp_path / "second.log")
    processes.append(second)
    holder = f"rank 1 is held by pid {ranks[1].pid}"
    wait_until(lambda: holder in second.health()["group_problem"], 20, what="the second process to be refused")
    assert f"ERROR p0/1: the tensor-parallel group: {holder}" in second.log()
    for rank in [*ranks, second]:  # FastDeploy would feed the second process as well
        rank.task(1, "a", 100)
        rank.signal([(1, 100)])
    wait_until(lambda: _queued_everywhere(ranks, (1, 100)), 20, what="a on the group's ranks")
    health = second.health()
    assert (health["group_generation"], health["group_events"].get("duplicate")) == (0, 1), health
    assert not health["group_connected"] and not health["group_sequencer"]
    assert _files(group_base) == files, "the refused process wrote in the group's directory"
    time.sleep(0.5)
    assert second.queued == [] and [rank.queued for rank in ranks] == [[[(1, 100)]], [[(1, 100)]]]
    ranks[1].kill()  # the holder exits: the second process takes the rank over, as a restart
    wait_until(
        lambda: second.health()["group_generation"] > 0 and ranks[0].health()["group_events"].get("restart"),
        20,
        what="the second process to join",
    )
    assert second.health()["group_problem"] == ""
    _serve([ranks[0], second], 2, "b", 100)
    wait_until(lambda: _queued_everywhere([ranks[0], second], (2, 100)), 20, what="b on both ranks")
    assert ranks[0].queued == [[(1, 100)], [(2, 100)]] and second.queued == [[(2, 100)]]


# -- 8. the group's directory and socket belong to the user -----------------------------------------


def test_the_group_directory_is_made_0700_and_its_files_are_the_users(
    namespace: str, group_base: Path, groups: list[Group]
) -> None:
    path = group_dir(namespace, "p0")
    assert path.parent == group_base
    for folder in (group_base, path):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
        assert folder.stat().st_uid == os.getuid()
    group = Group(f"memory://{uuid.uuid4().hex}", namespace, 2)
    groups.append(group)
    group.wait_joined()
    assert {p.name for p in path.iterdir()} >= {"rank-0.lock", "rank-1.lock", "group-0.lock", "group-0.sock"}
    assert (path / "rank-0.lock").stat().st_mode & 0o077 == 0
    assert json.loads((path / "rank-1.lock").read_text())["pid"] == os.getpid()


@pytest.mark.parametrize("which", ["base", "instance"])
def test_a_group_directory_others_may_enter_is_refused_naming_it(
    namespace: str, group_base: Path, which: str, groups: list[Group], caplog: pytest.LogCaptureFixture
) -> None:
    group_base.mkdir(mode=0o700)
    instance_dir = group_base / group_dir(namespace, "p0").name
    loose = group_base if which == "base" else instance_dir
    loose.chmod(0o755)
    with pytest.raises(PermissionError, match=str(loose)):
        group_dir(namespace, "p0")
    group = Group(f"memory://{uuid.uuid4().hex}", namespace, 2)
    groups.append(group)
    for bridge in group.bridges:  # the hooks never raise, and nothing is queued
        assert bridge.on_cache_task(cache_info(1, "a", 100)) == []
        assert bridge.on_kv_signal(signal([(1, 100)])) == []
    group.wait(lambda: all(str(loose) in h.group_problem for h in group.health()), "the refusal in health")
    assert f"{loose} must belong to uid {os.getuid()} with mode 0700" in caplog.text
    assert not (loose / "group-0.sock").exists() and not (instance_dir / "rank-0.lock").exists()
    assert group.queued == [[], []]


def _as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: only root gives a directory to another uid or runs a process as nobody")


def test_a_group_directory_of_another_user_is_refused_naming_it(namespace: str, group_base: Path) -> None:
    _as_root()
    group_base.mkdir(mode=0o700)
    os.chown(group_base, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=f"{group_base}.*uid {NOBODY}"):
        group_dir(namespace, "p0")
    os.chown(group_base, 0, 0)
    instance_dir = group_dir(namespace, "p0")
    os.chown(instance_dir, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=str(instance_dir)):
        group_dir(namespace, "p0")


FOREIGN_CLIENT = """
import json, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    sock.connect(sys.argv[1])
except OSError as exc:
    print("connect", exc)
    sys.exit(3)
key = ["a", 5, 128, 0]
join = {"t": "join", "rank": 1, "nranks": 2, "pid": 1, "host": "h", "token": "foreign", "fresh": True,
        "queued": 0, "tail": [], "reported": [key]}
try:
    sock.sendall((json.dumps(join) + "\\n" + json.dumps({"t": "ready", "g": 1, "keys": [key]}) + "\\n").encode())
except OSError:
    pass
sock.settimeout(20)
try:
    data = sock.recv(65536)
except ConnectionResetError:  # closed with our lines unread
    data = b""
except OSError as exc:
    print("recv", exc)
    sys.exit(4)
print("heard", data)
sys.exit(0 if data == b"" else 5)
"""


def _python_for_nobody() -> str:
    """A Python another user may run (the test's own may sit in root's home): the system's."""
    found = shutil.which("python3", path="/usr/bin:/bin")
    assert found is not None, "the foreign client needs the system's python3"
    return found


def test_a_connection_from_another_user_is_closed_unheard(namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even where the directory lets another user reach the socket (opened up here by hand), the
    sequencer closes that user's connection unread: its join and report release nothing, where
    the same messages from the rank's own process would."""
    _as_root()
    base = Path(tempfile.mkdtemp(prefix="rls-tp-"))  # reachable by nobody once opened up
    monkeypatch.setenv("RLS_GROUP_DIR", str(base / "g"))
    group = Group(f"memory://{uuid.uuid4().hex}", namespace, 2, ranks=[0])
    try:
        only = group.bridges[0]  # rank 1 has no process yet: a foreign one tries to speak for it
        only.on_cache_task(cache_info(5, "a", 300))
        only.on_kv_signal(signal([(5, 128)]))
        path = group_dir(namespace, "p0")
        wait_until(lambda: (path / "group-0.sock").exists() and only.health().group_reported == 1, 20)
        for folder in (base, base / "g", path):
            folder.chmod(0o711)
        (path / "group-0.sock").chmod(0o777)
        done = subprocess.run(
            [_python_for_nobody(), "-I", "-c", FOREIGN_CLIENT, str(path / "group-0.sock")],
            user=NOBODY,
            group=NOBODY,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
        health = only.health()
        assert (health.group_reported, health.group_events.get("restart", 0)) == (1, 0), health
        assert group.queued[0] == []
    finally:
        group.close()
        for folder in (base, base / "g"):
            folder.chmod(0o700)
        shutil.rmtree(base, ignore_errors=True)


def test_group_dir_lives_in_rls_group_dir_else_the_users_runtime_dir(
    namespace: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("RLS_GROUP_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert group_dir(namespace, "p0").parent == tmp_path / "rls"
    assert group_dir(namespace, "p0") != group_dir(namespace, "p1")
    assert group_dir(namespace, "p0") != group_dir(f"{namespace}x", "p0")


# -- the sequencer's connection: broken, or joined late --------------------------------------------


def _link(bridge: Any) -> Any:
    """The bridge's transport to its group (``group_link.GroupLink``): where a test breaks a
    connection as an I/O error would."""
    return bridge._layout._link


def test_a_rank_whose_connection_to_the_sequencer_breaks_joins_again_and_goes_on(
    tp_url: str, namespace: str, groups: list[Group]
) -> None:
    """Its join carries its history: it is caught up and heard again, not left mute (its
    reports dropped, its releases ignored) while the others wait for it."""
    group = Group(tp_url, namespace, 3)
    groups.append(group)
    group.wait_joined()
    first = _requests(group, 0, 1)
    group.wait_queued(1)
    member = [h.group_sequencer for h in group.health()].index(False)
    _link(group.bridges[member])._line.sock.shutdown(socket.SHUT_RDWR)
    rest = _requests(group, 1, 3)
    group.wait_queued(4)
    check_agreement(group.queued, first + rest)
    assert all(sorted(entries_of(queued)) == sorted(first + rest) for queued in group.queued)


def test_a_rank_that_joins_a_new_sequencer_after_it_resumed_is_reset_once_not_forever(
    tp_url: str, namespace: str, groups: list[Group], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The sequencer's process exits; the rank that takes over resumes before the others joined
    (no wait for joins here): their histories are ahead of its order, so each is reset, once,
    and joins again as a new process; later requests are queued on every rank."""
    monkeypatch.setattr(group_link, "JOIN_WAIT_S", 0.0)
    group = Group(tp_url, namespace, 3)
    groups.append(group)
    group.wait_joined()
    _requests(group, 0, 1)
    group.wait_queued(1)
    sequencer = [h.group_sequencer for h in group.health()].index(True)
    group.bridges[sequencer].close()
    group.bridges[sequencer] = Layer0Bridge(
        group.buffers[sequencer], "p0", sequencer, num_layers=4, ready=group.ready[sequencer], nranks=3, probe_s=0.05
    )
    group.wait(lambda: all(h.group_generation > 1 for h in group.health()), "every rank to join the new sequencer")
    rest = _requests(group, 1, 2)
    group.wait(lambda: all(set(rest) <= set(entries_of(q)) for q in group.queued), "later requests on every rank")
    tails = [entries_of(queued)[-2:] for queued in group.queued]
    assert all(tail == tails[0] for tail in tails) and sorted(tails[0]) == sorted(rest), group.queued
    resets = [h.group_events.get("reset", 0) for h in group.health()]
    assert sum(resets) >= 1 and max(resets) == 1, group.health()
    assert caplog.text.count("lagged the group's order") == sum(resets)
