"""Entry points: a whole deployment (``simulate``), or one role of it (a prefill node, the
registrar) for a cluster whose parts run on different hosts and share only Redis.

On ``memory://`` every part is a thread of this process. On a real Redis every instance x
rank is its own process, and so is the registrar, so the buffer is really shared.
"""

from __future__ import annotations

import multiprocessing
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from ..buffer.sync import SignalBuffer
from ..errors import InvalidConfig
from ..transport.connection import sync_client
from .channels import REGISTRAR, LocalChannel, RedisChannel, inbox_key
from .config import SimConfig
from .modes import make_handoff
from .node import run_ranks
from .registrar import RegistrarReport, serve
from .report import RankReport, Summary, server_words, summarize

Progress = Callable[[int], None]
CLIENT_TIMEOUT_S = 5.0
"""Socket timeout of the clients that carry the simulation's own messages (BLPOP waits less)."""
STOP_GRACE_S = 15.0


def simulate(config: SimConfig, progress: Progress | None = None) -> Summary:
    """Run the deployment described by ``config`` and check every request; see the package doc."""
    tick = progress or (lambda _n: None)
    run_id = secrets.token_hex(3)
    started = time.monotonic()
    if config.in_process:
        ranks, registrar, extra = _threads(config, run_id, tick)
        processes = 1
    else:
        ranks, registrar, extra = _processes(config, run_id, tick)
        processes = config.instances * config.ranks + 1
    elapsed = time.monotonic() - started
    where = server_words(config.url)
    return summarize(config.mode.value, config.seed, processes, elapsed, ranks, registrar.register_ms, extra, where)


def require_shared(config: SimConfig, role: str) -> None:
    """A node or registrar alone meets its peers only through a Redis they share."""
    if config.in_process:
        raise InvalidConfig("url", config.url, f"rls {role} needs a Redis its peers share; memory:// is one process's")


def preflight(config: SimConfig) -> None:
    """Reach Redis once: unreachable is one BufferUnavailable here, not a crash per process;
    and read its servers here, so that a setting that can lose signals is warned about by the
    process that starts the others (``server.said``), before any of them runs."""
    if not config.in_process:
        with SignalBuffer.from_url(config.url, namespace=config.namespace) as probe:
            probe.now_ms()
            probe.server_policies()


def _messages_client(config: SimConfig) -> Any:
    """A client of the Redis that carries the simulation's own messages (``channel_url``,
    else the buffer's)."""
    return sync_client(config.channel_url or config.url, CLIENT_TIMEOUT_S)


def _threads(config: SimConfig, run_id: str, tick: Progress) -> tuple[list[RankReport], RegistrarReport, list[str]]:
    shared = make_handoff(config)  # drop/local: one dict for the whole process, as in FastDeploy
    inboxes = {(i, r): LocalChannel() for i in config.instance_names() for r in range(config.ranks)}
    registrar_inbox = LocalChannel()
    done = threading.Event()
    registrar_report: list[RegistrarReport] = []
    registrar = threading.Thread(
        target=lambda: registrar_report.append(
            serve(shared, registrar_inbox, lambda m: inboxes[(m["instance"], m["rank"])], done.is_set)
        ),
        daemon=True,
    )
    registrar.start()
    reports: list[RankReport] = []
    lock = threading.Lock()

    def node(instance: str) -> None:
        out = run_ranks(
            config,
            run_id,
            instance,
            list(range(config.ranks)),
            shared,
            registrar_inbox,
            tick,
            inboxes=lambda i, r: inboxes[(i, r)],
        )
        with lock:
            reports.extend(out)

    nodes = [threading.Thread(target=node, args=(i,), daemon=True) for i in config.instance_names()]
    for thread in nodes:
        thread.start()
    for thread in nodes:
        thread.join(config.timeout_s + STOP_GRACE_S)
    done.set()
    registrar.join(STOP_GRACE_S)
    shared.close()
    extra = [] if len(reports) == config.instances * config.ranks else ["a node thread did not finish"]
    return sorted(reports, key=_rank_order), (registrar_report or [RegistrarReport()])[0], extra


def _processes(config: SimConfig, run_id: str, tick: Progress) -> tuple[list[RankReport], RegistrarReport, list[str]]:
    preflight(config)
    context = multiprocessing.get_context("spawn")
    events: Any = context.Queue()
    registrar = context.Process(target=registrar_process, args=(config, run_id, events), name="registrar", daemon=True)
    registrar.start()
    nodes = {}
    for instance in config.instance_names():
        for rank in range(config.ranks):
            process = context.Process(
                target=node_process,
                args=(config, run_id, instance, rank, events),
                name=f"{instance}/{rank}",
                daemon=True,
            )
            process.start()
            nodes[(instance, rank)] = process
    reports: list[RankReport] = []
    registrar_report: RegistrarReport | None = None
    extra: list[str] = []
    deadline = time.monotonic() + config.timeout_s + STOP_GRACE_S
    stop_sent = False
    while time.monotonic() < deadline:
        if len(reports) == len(nodes) and not stop_sent:
            client = _messages_client(config)
            RedisChannel(client, inbox_key(config.namespace, *REGISTRAR, run_id)).put({"kind": "stop"})
            client.close()
            stop_sent = True
        if stop_sent and registrar_report is not None:
            break
        try:
            kind, payload = events.get(timeout=0.1)
        except queue.Empty:
            if _dead_without_report(nodes, reports) or (not registrar.is_alive() and registrar_report is None):
                extra.append("a simulation process exited without a report")
                break
            continue
        if kind == "progress":
            tick(int(payload))
        elif kind == "ranks":
            reports.extend(payload)
        elif kind == "registrar":
            registrar_report = payload
        elif kind == "error":
            extra.append(str(payload))
            break  # the others would only wait for it: stop them now
    else:
        extra.append(f"the run did not finish within {config.timeout_s:g}s")
    failed = bool(extra)
    for process in [registrar, *nodes.values()]:
        if failed and process.is_alive():
            process.terminate()
        process.join(STOP_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join(STOP_GRACE_S)
    return sorted(reports, key=_rank_order), registrar_report or RegistrarReport(), extra


def _dead_without_report(nodes: dict[tuple[str, int], Any], reports: list[RankReport]) -> bool:
    reported = {(r.instance, r.rank) for r in reports}
    return any(not p.is_alive() and key not in reported for key, p in nodes.items())


def _rank_order(report: RankReport) -> tuple[str, int]:
    return report.instance, report.rank


def node_process(config: SimConfig, run_id: str, instance: str, rank: int, events: Any) -> None:
    """One instance x rank in its own process; reports through ``events``."""
    try:
        reports = run_node(config, run_id, instance, [rank], lambda n: events.put(("progress", n)), run=run_id)
        events.put(("ranks", reports))
    except Exception as exc:
        events.put(("error", f"{instance}/{rank}: {type(exc).__name__}: {exc}"))


def registrar_process(config: SimConfig, run_id: str, events: Any) -> None:
    try:
        events.put(("registrar", run_registrar(config, run=run_id)))
    except Exception as exc:
        events.put(("error", f"registrar: {type(exc).__name__}: {exc}"))


def run_node(
    config: SimConfig, run_id: str, instance: str, ranks: list[int], tick: Progress, run: str = ""
) -> list[RankReport]:
    """A prefill node on a shared Redis: its ranks as threads, its registrar somewhere else.
    ``run`` names the registrar's inbox of one ``simulate`` run; empty: the shared one."""
    client = _messages_client(config)
    handoff = make_handoff(config)
    try:
        registrar = RedisChannel(client, inbox_key(config.namespace, *REGISTRAR, run))
        return run_ranks(config, run_id, instance, ranks, handoff, registrar, tick, client=client)
    finally:
        handoff.close()
        client.close()


def run_registrar(config: SimConfig, idle_exit_s: float = 0.0, run: str = "") -> RegistrarReport:
    """The registrar on a shared Redis: serves every node of the namespace until told to stop
    (or ``idle_exit_s`` of quiet); answers each task on the list its message names."""
    require_shared(config, "registrar")
    client = _messages_client(config)
    handoff = make_handoff(config)
    try:
        inbox = RedisChannel(client, inbox_key(config.namespace, *REGISTRAR, run))
        return serve(handoff, inbox, lambda m: RedisChannel(client, str(m["reply_to"])), lambda: False, idle_exit_s)
    finally:
        handoff.close()
        client.close()


def node_summary(config: SimConfig, instance: str, tick: Progress | None = None) -> Summary:
    """``rls node``: one node's ``config.ranks`` ranks against a shared Redis and registrar,
    checked."""
    require_shared(config, "node")
    started = time.monotonic()
    reports = run_node(config, secrets.token_hex(3), instance, list(range(config.ranks)), tick or (lambda _n: None))
    elapsed = time.monotonic() - started
    return summarize(config.mode.value, config.seed, 1, elapsed, reports, [], [], server_words(config.url))
