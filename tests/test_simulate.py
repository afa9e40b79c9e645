"""`rls simulate` end to end: on memory:// (threads), on a real Redis with a process per rank,
and the two baselines showing the failure the buffer fixes. Expected figures are derived from
the seeded workload, independently of the run."""

from __future__ import annotations

import json
import signal
import threading
import types
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import redis

from redis_layer_signals.errors import InvalidConfig
from redis_layer_signals.models import CacheTask, FinishResult, RecordResult, RegisterResult
from redis_layer_signals.simulate import Mode, SimConfig, Summary, simulate
from redis_layer_signals.simulate import node as sim_node
from redis_layer_signals.simulate import runner as sim_runner
from redis_layer_signals.simulate.channels import REGISTRAR, LocalChannel, RedisChannel, inbox_key
from redis_layer_signals.simulate.modes import LocalHandoff, RedisHandoff
from redis_layer_signals.simulate.workload import Request, workload
from tests.servers import RedisServer

SMALL = {"instances": 2, "ranks": 2, "requests": 8, "layers": 6, "early_share": 0.5, "abort_share": 0.2}


def planned(config: SimConfig) -> list[Request]:
    """The seeded workload of every rank (the run id only changes the request names)."""
    return [r for i in config.instance_names() for k in range(config.ranks) for r in workload(config, i, k, "x")]


def expected_signals(config: SimConfig) -> int:
    return sum(len(r.chunks(config.chunk_tokens)) * config.layers for r in planned(config))


def test_simulate_on_memory_sends_every_layer_of_every_chunk_exactly_once() -> None:
    config = SimConfig(url="memory://sim-ok", namespace="sim", **SMALL)  # type: ignore[arg-type]
    plan = planned(config)
    early = sum(r.early for r in plan)
    aborted = sum(r.abort for r in plan)
    assert early > 0 and aborted > 0  # the seed exercises both paths

    summary = simulate(config)

    assert summary.violations == [] and summary.ok
    assert summary.requests == len(plan) == config.instances * config.ranks * config.requests
    assert summary.completed == len(plan) - aborted and summary.aborted == aborted
    assert summary.signals == expected_signals(config)
    assert summary.lost == summary.hung == summary.duplicates == 0
    # An early task registers only after its request's first layer-0 signal was recorded,
    # so each early request had at least that signal buffered, and recovered it.
    assert summary.buffered_early >= early + aborted * config.layers
    assert summary.recovered >= early
    # An aborted request's every layer waited (newest per layer) and finish dropped them.
    assert summary.dropped == {"finish": aborted * config.layers}
    assert summary.signals == summary.delivered + summary.buffered_early
    assert summary.record_p50_ms is not None and summary.register_p99_ms is not None


def test_simulate_on_real_redis_with_a_process_per_rank_leaves_only_counters_and_expiring_marks(
    redis_server: RedisServer, namespace: str
) -> None:
    config = SimConfig(url=redis_server.url, namespace=namespace, timeout_s=120, **SMALL)  # type: ignore[arg-type]
    summary = simulate(config)

    assert summary.violations == []
    assert summary.processes == config.instances * config.ranks + 1
    assert summary.signals == expected_signals(config)
    assert summary.completed + summary.aborted == summary.requests == len(planned(config))
    assert summary.recovered >= sum(r.early for r in planned(config))
    client = redis_server.client()
    left = [k.decode() for k in client.scan_iter(match=f"rls:{{{namespace}/*", count=1000)]
    marks = [k for k in left if ":reply:" in k or k.endswith(":ended")]  # replies, finishes: a TTL each
    assert left and all(k.endswith(":stats") or (k in marks and client.pttl(k) > 0) for k in left), left
    counted = [int(client.hget(k, f) or 0) for k in left if k.endswith(":stats") for f in ("delivered", "buffered")]
    assert sum(counted) == summary.signals


def test_tasks_left_on_the_shared_registrar_list_by_an_earlier_run_do_not_reach_a_new_run(
    redis_server: RedisServer, namespace: str
) -> None:
    client = redis_server.client()
    shared = inbox_key(namespace, *REGISTRAR)
    stale = {
        "kind": "task",
        "instance": "p0",
        "rank": 0,
        "slot": 0,
        "request_id": "old-run-req",
        "need": 1,
        "layers": 1,
        "delay_ms": 0,
        "reply_to": inbox_key(namespace, "p0", 0),
    }
    client.rpush(shared, json.dumps(stale))
    config = SimConfig(
        url=redis_server.url, namespace=namespace, instances=1, ranks=1, requests=4, layers=3, timeout_s=120
    )
    summary = simulate(config)
    assert summary.violations == [] and summary.completed + summary.aborted == 4
    assert client.llen(shared) == 1  # still there for whichever `rls registrar` serves the namespace


def test_drop_baseline_hangs_every_request_whose_task_came_after_its_first_signal() -> None:
    config = SimConfig(url="memory://sim-drop", mode=Mode.DROP, hang_timeout_s=0.3, **SMALL)  # type: ignore[arg-type]
    summary = simulate(config)

    early = sum(r.early for r in planned(config))
    assert summary.hung == early > 0
    assert summary.lost > 0 and summary.dropped["no_task"] > 0
    assert not summary.ok and any("never sent" in v for v in summary.violations)


def test_local_baseline_works_in_one_process() -> None:
    config = SimConfig(url="memory://sim-local", mode=Mode.LOCAL, **SMALL)  # type: ignore[arg-type]
    summary = simulate(config)
    assert summary.violations == [] and summary.lost == 0 and summary.recovered > 0


def test_local_baseline_loses_early_signals_when_registration_is_in_another_process(
    redis_server: RedisServer, namespace: str
) -> None:
    config = SimConfig(
        url=redis_server.url, namespace=namespace, mode=Mode.LOCAL, hang_timeout_s=0.5, timeout_s=120, **SMALL
    )  # type: ignore[arg-type]
    summary = simulate(config)

    early = sum(r.early for r in planned(config))
    assert summary.recovered == 0  # the registrar's dict never saw the nodes' early signals
    assert summary.hung == early > 0 and summary.lost > 0
    assert not summary.ok


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("layers", 0),
        ("requests", -1),
        ("early_share", 1.5),
        ("abort_share", -0.1),
        ("batch", 600),
        ("namespace", "a b"),
        ("url", "localhost"),
        ("hang_timeout_s", -1),
    ],
)
def test_bad_simulation_settings_raise_a_value_error_naming_field_and_value(field: str, value: object) -> None:
    with pytest.raises(InvalidConfig) as caught:
        SimConfig(**{field: value})  # type: ignore[arg-type]
    assert isinstance(caught.value, ValueError)
    assert caught.value.field == field and caught.value.value == value


def test_same_seed_same_workload_other_seed_other_workload() -> None:
    base = SimConfig(url="memory://sim-seed", requests=4, layers=2, instances=1, ranks=1)
    first, again = simulate(base), simulate(base)
    other = simulate(base.with_(seed=7))
    assert (first.signals, first.aborted) == (again.signals, again.aborted) == (expected_signals(base), first.aborted)
    assert other.signals == expected_signals(base.with_(seed=7)) != first.signals


class _DoubleHandoff(LocalHandoff):
    """A broken buffer: hands each recovered signal out twice."""

    def register(self, task: CacheTask) -> RegisterResult:
        result = super().register(task)
        return RegisterResult(task, result.recovered * 2, result.dropped)


class _LossyHandoff(LocalHandoff):
    """A broken buffer: says it buffered layer 1's early signals, then forgets them."""

    def record(self, instance: str, rank: int, layer: int, entries: Sequence[tuple[int, int]]) -> RecordResult:
        result = super().record(instance, rank, layer, entries)
        if layer == 1:
            with self.lock:
                for signal in result.buffered:
                    self.early.get((instance, rank, signal.slot), {}).pop(1, None)
        return result


class _StaleHandoff(LocalHandoff):
    """A broken buffer: finish reports the slot's early signals dropped but keeps them."""

    def finish(self, instance: str, rank: int, slot: int, request_id: str) -> FinishResult:
        with self.lock:
            kept = dict(self.early.get((instance, rank, slot), {}))
        result = super().finish(instance, rank, slot, request_id)
        if kept:
            with self.lock:
                self.early[(instance, rank, slot)] = kept
        return result


@pytest.mark.parametrize(
    ("broken", "symptom"),
    [
        (_DoubleHandoff, lambda s: s.duplicates > 0),
        (_LossyHandoff, lambda s: s.lost > 0 and any("accounting" in v for v in s.violations)),
        (_StaleHandoff, lambda s: any("still pending at the end" in v for v in s.violations)),
    ],
)
def test_checks_catch_a_buffer_that_hands_a_signal_twice_loses_one_or_leaks_one(
    monkeypatch: pytest.MonkeyPatch, broken: type[LocalHandoff], symptom: Callable[[Summary], bool]
) -> None:
    monkeypatch.setattr(sim_runner, "make_handoff", lambda _config: broken())
    config = SimConfig(url="memory://sim-broken", mode=Mode.LOCAL, hang_timeout_s=0.3, **SMALL)  # type: ignore[arg-type]
    summary = simulate(config)
    assert not summary.ok
    assert symptom(summary), summary.violations[:8]


# -- what the table says -------------------------------------------------------------------


def table_rows(stdout: str) -> dict[str, tuple[str, str]]:
    """The result table's rows: ``{"dropped by reason": ("finish 12", "finish: ...")}``."""
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
        if len(cells) == 3 and cells[0] and cells[0] != "figure":
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def test_the_demo_table_says_what_each_figure_means_and_the_embedded_server_it_ran_on() -> None:
    """`dropped by reason | finish 305` beside OK said nothing of why, and `--mode redis` hid
    that the run was on the embedded server."""
    from tests.servers import rls

    layers = 3
    done = rls("simulate", "--requests", "4", "--layers", str(layers), "--abort-share", "0.5", "--seed", "1")
    assert done.returncode == 0, done.stderr
    header = done.stdout.split("┏", 1)[0]
    assert "run on the embedded server (memory://" in header and "redis://" not in header, header
    assert "--mode redis (this library's buffer), seed 1, 1 process" in " ".join(header.split()), header
    rows = table_rows(done.stdout)
    assert len(rows) == 16 and all(meaning for _value, meaning in rows.values()), rows
    aborted = int(rows["completed / aborted"][0].split("/")[1])
    value, meaning = rows["dropped by reason"]
    assert aborted > 0 and value == f"finish {aborted * layers}"  # each aborted request's newest signal per layer
    assert meaning.startswith("finish: the aborted requests' waiting signals") and "as designed" in meaning
    assert "must be 0" in rows["lost layer-chunks"][1] and rows["lost layer-chunks"][0] == "0"


def test_the_demo_table_names_the_redis_url_it_ran_on_without_its_password() -> None:
    from tests.servers import rls, running

    with running() as server:
        server.client().config_set("requirepass", "s3cret")
        url = f"redis://:s3cret@127.0.0.1:{server.port}/0"
        done = rls("simulate", "--requests", "1", "--layers", "2", "--instances", "1", "--ranks", "1", "--redis", url)
    assert done.returncode == 0, done.stderr
    header = " ".join(done.stdout.split("┏", 1)[0].split())
    assert f"run on redis://:***@127.0.0.1:{server.port}/0" in header and "embedded" not in header, header
    assert "s3cret" not in done.stdout + done.stderr
    assert "2 processes" in header  # a rank and the registrar, each its own process


def test_stray_keys_check_does_not_fail_on_a_stopped_primary_that_never_held_the_rank(cluster: Any) -> None:
    """The end-of-run check of a node looks for the rank's keys on the one Cluster node that holds
    its hash tag: a primary stopped mid-run elsewhere (its container stopped) used to fail the
    check of every rank, though nothing of theirs was on it."""
    handoff = RedisHandoff(SimConfig(url=cluster.url, namespace=f"stray-{uuid.uuid4().hex[:8]}"))
    try:
        handoff.record("p0", 0, 0, [(1, 10)])  # a pending signal: the rank's keys exist
        keys = handoff.buffer.protocol.keys.rank("p0", 0)
        owner = cluster.node_for_key(keys.stats)
        other = next(node for node in cluster.primary_nodes() if node.port != owner.port)
        assert other.process is not None
        other.process.send_signal(signal.SIGSTOP)
        try:
            stray = handoff.stray_keys("p0", 0)
        finally:
            other.process.send_signal(signal.SIGCONT)
        assert keys.pending in stray, stray
    finally:
        handoff.close()


def test_a_node_keeps_forwarding_registrations_after_its_inbox_connection_drops() -> None:
    """The thread that moves registration notices from a rank's Redis inbox to its sender died on
    the first ConnectionError (the Sentinel primary's container stopped): every later request of
    the rank waited for its task until the run timed out."""
    ctx = types.SimpleNamespace(stop=threading.Event(), inbox=LocalChannel())
    message = {"slot": 1}

    class DroppingChannel:
        def __init__(self) -> None:
            self.reads = 0

        def put(self, message: dict[str, Any]) -> None:
            raise AssertionError("forward only reads")

        def get(self, timeout: float) -> dict[str, Any] | None:
            self.reads += 1
            if self.reads == 1:
                raise redis.exceptions.ConnectionError("Connection closed by server.")
            if self.reads == 2:
                return message
            ctx.stop.set()
            return None

    thread = threading.Thread(target=sim_node.forward, args=(DroppingChannel(), ctx), daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert ctx.inbox.get(0) == message


def test_a_node_resends_its_messages_through_a_failover() -> None:
    """A node's message to the registrar (RPUSH on its inbox) raised on the first connection error
    while a Cluster primary's container was stopped, and the thread producing the rank's
    requests died with it."""

    class FailoverClient:
        """Refuses the first send as a stopped primary does, then takes them."""

        def __init__(self) -> None:
            self.sent: list[str] = []
            self.attempts = 0

        def pipeline(self, transaction: bool) -> Any:
            client = self

            class Pipe:
                def rpush(self, key: str, data: str) -> None:
                    self.data = data

                def pexpire(self, key: str, ms: int) -> None:
                    pass

                def execute(self) -> None:
                    client.attempts += 1
                    if client.attempts == 1:
                        raise redis.exceptions.ConnectionError("Error 111 connecting. Connection refused.")
                    client.sent.append(self.data)

            return Pipe()

        def blpop(self, keys: list[str], timeout: float) -> Any:
            raise redis.exceptions.ClusterDownError("The cluster is down")

    client = FailoverClient()
    channel = RedisChannel(client, "rls:{ns/registrar/0}:sim:inbox")
    channel.put({"slot": 1})
    assert [json.loads(data) for data in client.sent] == [{"slot": 1}]
    assert channel.get(0.01) is None


def test_a_nodes_end_check_reads_through_a_cluster_that_is_down_for_a_failover() -> None:
    """The end check's own reads (counters, live slots, stray keys) raised "The cluster is down"
    when a node finished while a stopped primary's replica was still being promoted."""
    handoff = RedisHandoff(SimConfig(url=f"memory://{uuid.uuid4().hex}", namespace="down"))
    try:
        handoff.record("p0", 0, 0, [(1, 10)])
        client = handoff.buffer.client
        real_hgetall = client.hgetall
        calls = {"n": 0}

        def hgetall(key: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                raise redis.exceptions.ClusterDownError("The cluster is down")
            return real_hgetall(key)

        client.hgetall = hgetall
        assert handoff.leftovers("p0", 0) == ([], 1)
    finally:
        handoff.close()
