"""``rls``: the simulation and the operator's commands. Every command takes ``--redis`` and
``--namespace`` (or ``RLS_REDIS_URL`` / ``RLS_NAMESPACE``). Errors print one line on stderr and
exit non-zero; a traceback would only hide which URL or argument was wrong."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import __version__
from .buffer.sync import SignalBuffer
from .cli_help import HelpTyper
from .config import shared_url
from .constants import DEFAULT_NAMESPACE, DEFAULT_URL
from .errors import BufferUnavailable, SignalBufferError
from .extras import install_hint
from .ops import admin
from .server import eviction, said
from .simulate import Mode, SimConfig, Summary, node_summary, run_registrar, simulate
from .simulate.chaos import foreign_faults, run_with_chaos
from .simulate.report import clip, table, without_password
from .simulate.runner import preflight, require_shared

EXIT_FAILED = 1
"""Checks failed, or the command could not run (bad URL, unreachable Redis, bad argument)."""
EXIT_USAGE = 2
"""A bad or missing argument (an operator command without a server among them)."""
EXIT_EMPTY = 3
"""``inspect``, ``stats`` or ``purge`` found no key of the namespace on the server: a misspelt
``--namespace``, a purged one, or one nothing ever ran on."""
_PARSER_ERROR: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
"""The base of the argument parser's own errors (typer ships its parser privately)."""

app = HelpTyper(
    name="rls",
    help="Early layer signals buffered in Redis for PD-disaggregated serving: simulate, inspect, operate.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"rls {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Early layer signals buffered in Redis for PD-disaggregated serving: simulate, inspect, operate."""


RedisUrl = Annotated[
    str,
    typer.Option(
        "--redis",
        envvar="RLS_REDIS_URL",
        metavar="url",
        help="The server: memory:// (embedded) or a Redis URL.",
    ),
]
Namespace = Annotated[
    str, typer.Option("--namespace", envvar="RLS_NAMESPACE", metavar="name", help="Namespace of the keys.")
]
JsonPath = Annotated[
    Path | None, typer.Option("--json", metavar="file", help="Also write the figures as JSON to this file.")
]
# `rls node` and `rls registrar` meet their peers through the Redis they share: no default either
# (memory:// would be one process's, and the run would wait for peers that never come).
SharedUrl = Annotated[
    str | None,
    typer.Option(
        "--redis",
        envvar="RLS_REDIS_URL",
        metavar="url",
        show_default=False,
        help="The Redis the nodes and the registrar share (memory:// only within one process).",
    ),
]
# The operator commands have no default server: memory:// would be a fresh, empty one in this
# process, whose zeros look like a healthy idle namespace.
OperatorUrl = Annotated[
    str | None,
    typer.Option(
        "--redis",
        envvar="RLS_REDIS_URL",
        show_default=False,
        metavar="url",
        help="The server to operate on, required: redis://, rediss://, unix://, redis+sentinel:// or redis+cluster://.",
    ),
]

# Options of the simulated deployment, shared by `simulate` and `node`; defaults are SimConfig's.
SimMode = Annotated[
    Mode,
    typer.Option(metavar="mode", help="redis: this library; drop: before the fix; local: a dict per process."),
]
Ranks = Annotated[int, typer.Option(min=1, help="Ranks per instance.")]
Requests = Annotated[int, typer.Option(min=1, help="Requests per rank.")]
Layers = Annotated[int, typer.Option(min=1, help="Layers per request.")]
ChunkTokens = Annotated[int, typer.Option(min=1, help="Tokens per prefill chunk.")]
Batch = Annotated[int, typer.Option(min=1, max=512, help="Engine slots per rank.")]
EarlyShare = Annotated[float, typer.Option(min=0.0, max=1.0, metavar="share", help="Tasks late for layer 0.")]
AbortShare = Annotated[float, typer.Option(min=0.0, max=1.0, metavar="share", help="Requests aborted early.")]
HangTimeout = Annotated[float, typer.Option(min=0.0, help="Hang deadline after prefill.")]
Timeout = Annotated[float, typer.Option(min=0.0, help="Seconds the run may take.")]
Seed = Annotated[int, typer.Option(help="Seed of the random workload.")]


def _buffer(url: str, namespace: str) -> SignalBuffer:
    """A buffer on ``url`` whose servers have been read, so a setting that can lose or evict
    signals is said before the command's output, as the buffers of a deployment say it."""
    buf = SignalBuffer.from_url(url, namespace=namespace)
    try:
        buf.server_policies()
    except BaseException:
        buf.close()
        raise
    return buf


def _server_of(command: str, url: str | None) -> str:
    """The explicit server of an operator command; none given is a usage error."""
    if url is None or not url.strip():
        _fail(
            f"{command} needs a server: pass --redis URL or set RLS_REDIS_URL "
            "(it has no default: memory:// would be an empty server of this process)",
            EXIT_USAGE,
        )
    return url


def _empty(buf: SignalBuffer, namespace: str) -> bool:
    return not admin.namespace_keys(buf.client, namespace)


def _report_empty(namespace: str) -> NoReturn:
    err.print(
        f"namespace {namespace!r} has no keys on this server (misspelt, purged, or never used)",
        markup=False,
        soft_wrap=True,
    )
    raise typer.Exit(EXIT_EMPTY)


# -- the simulation ----------------------------------------------------------------------------


@app.command("simulate")
def simulate_command(
    redis: RedisUrl = DEFAULT_URL,
    namespace: Namespace = DEFAULT_NAMESPACE,
    mode: SimMode = SimConfig.mode,
    instances: Annotated[int, typer.Option(min=1, help="Prefill instances.")] = SimConfig.instances,
    ranks: Ranks = SimConfig.ranks,
    requests: Requests = SimConfig.requests,
    layers: Layers = SimConfig.layers,
    chunk_tokens: ChunkTokens = SimConfig.chunk_tokens,
    max_prompt_tokens: Annotated[int, typer.Option(min=1, help="Longest prompt, in tokens.")] = (
        SimConfig.max_prompt_tokens
    ),
    batch: Batch = SimConfig.batch,
    early_share: EarlyShare = SimConfig.early_share,
    abort_share: AbortShare = SimConfig.abort_share,
    max_delay_ms: Annotated[float, typer.Option(min=0.0, help="Longest delay of a late task.")] = (
        SimConfig.max_delay_ms
    ),
    hang_timeout_s: HangTimeout = SimConfig.hang_timeout_s,
    timeout_s: Timeout = SimConfig.timeout_s,
    seed: Seed = SimConfig.seed,
    json_path: JsonPath = None,
    chaos: Annotated[bool, typer.Option("--chaos", help="Restart or fail over the Redis mid-run.")] = False,
    chaos_interval_s: Annotated[float, typer.Option(min=0.05, help="Mean seconds between faults.")] = 1.0,
    chaos_fsync: Annotated[str, typer.Option(metavar="policy", help="appendfsync for --chaos.")] = "always",
    chaos_fault: Annotated[str, typer.Option(metavar="fault", help="auto (restart, failover) or partition.")] = "auto",
    chaos_outage: Annotated[
        str | None,
        typer.Option(metavar="restart", help="Instead: an outage under FastDeploy's messager; empty, aof or never."),
    ] = None,
    chaos_down_s: Annotated[float, typer.Option(min=0.1, help="Length of a --chaos-outage.")] = 2.0,
    chaos_retry_s: Annotated[float, typer.Option(min=0.05, help="retry_s in a --chaos-outage.")] = 0.5,
    yes: Annotated[bool, typer.Option("--yes", help="Let --chaos hit a server it did not start.")] = False,
    tp: Annotated[
        int | None,
        typer.Option("--tp", min=1, max=8, show_default=False, help="Instead: N-rank tensor-parallel groups."),
    ] = None,
) -> None:
    """A PD deployment in miniature: checks every layer is sent exactly once.

    In the docs: --tp in simulation.md, --chaos in operations/failures.md, --chaos-outage in
    fastdeploy.md."""
    if tp is not None and (chaos or chaos_outage is not None):
        err.print("--tp runs without --chaos and --chaos-outage", markup=False)
        raise typer.Exit(EXIT_USAGE)
    harm = foreign_faults(redis) if chaos and chaos_outage is None else None
    if harm is not None and not yes:
        err.print(
            f"refusing --chaos on {without_password(redis)}, a server this run did not start, without --yes: "
            f"it would run {harm}",
            markup=False,
            soft_wrap=True,
        )
        raise typer.Exit(EXIT_FAILED)
    if chaos_outage is not None:  # see simulate/outage.py
        outage_run(chaos_outage, requests, layers, seed, chaos_retry_s, chaos_down_s, json_path)
        return
    config = SimConfig(
        url=redis,
        namespace=namespace,
        mode=mode,
        instances=instances,
        ranks=ranks,
        requests=requests,
        layers=layers,
        chunk_tokens=chunk_tokens,
        max_prompt_tokens=max_prompt_tokens,
        batch=batch,
        early_share=early_share,
        abort_share=abort_share,
        max_delay_ms=max_delay_ms,
        hang_timeout_s=hang_timeout_s,
        timeout_s=timeout_s,
        seed=seed,
    )
    if tp is not None:  # see simulate/tp.py
        tp_run(config, tp, json_path)
        return
    if chaos:  # --chaos: see simulate/chaos.py
        summary, faults = run_with_chaos(config, chaos_interval_s, chaos_fsync, run_simulation, chaos_fault)
        out.print(f"chaos on {faults.target}: {len(faults.faults)} faults ({', '.join(sorted(set(faults.faults)))})")
        for failure in faults.failed:
            err.print(f"  chaos fault not applied: {failure}", markup=False)
        if not faults.faults:
            out.print(table(summary))
            err.print(
                "[red]FAILED[/red]: no fault was injected, so this chaos run proves nothing "
                "(the run ended before its fault window: raise --requests)"
            )
            raise typer.Exit(EXIT_FAILED)
    else:
        summary = run_simulation(config)
    finish_run(summary, json_path)


def run_simulation(config: SimConfig, on_progress: Callable[[int], None] | None = None) -> Summary:
    """``simulate`` with a progress bar; the hook options such as fault injection extend."""
    total = config.instances * config.ranks * config.requests
    preflight(config)
    with _progress() as progress:
        task = progress.add_task(f"simulate --mode {config.mode.value}", total=total)

        def tick(n: int) -> None:
            progress.advance(task, n)
            if on_progress is not None:
                on_progress(n)

        return simulate(config, tick)


def tp_run(config: SimConfig, tp: int, json_path: Path | None) -> None:
    """``simulate --tp``: each instance a TP group sharing FastDeploy's barriers."""
    from .simulate.tp import check_tp, simulate_tp, tp_table

    check_tp(config, tp)
    preflight(config)
    with _progress() as progress:
        task = progress.add_task(f"simulate --tp {tp} --mode {config.mode.value}", total=config.instances)
        report = simulate_tp(config, tp, lambda n: progress.advance(task, n))
    out.print(tp_table(report))
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if problems := report.problems():
        err.print(f"[red]FAILED[/red]: {len(problems)} of {len(report.groups)} group(s) did not agree")
        for line in clip(problems):
            err.print(f"  - {line}", markup=False)
        raise typer.Exit(EXIT_FAILED)
    out.print(
        f"[green]OK[/green]: every group of {tp} ranks agreed: identical batch sequences on every rank, "
        "no barrier timed out, every request sent once"
    )


def outage_run(
    restart: str, requests: int, layers: int, seed: int, retry_s: float, down_s: float, json_path: Path | None
) -> None:
    """``simulate --chaos-outage``: the FastDeploy reference messager through a Redis outage."""
    from .simulate.outage import run_outage

    err.print(f"reference messager, {requests} requests, Redis SIGKILLed for {down_s}s, restart: {restart}")
    report = run_outage(restart, requests=requests, seed=seed, layers=layers, retry_s=retry_s, down_s=down_s)
    outcome, health = report.outcome, report.outcome.health
    problems = report.problems()
    figures = {
        "restart": restart,
        "killed_at_step": report.killed_at_step,
        "down_s": round(report.down_s, 2),
        "requests": len(outcome.plans),
        "finished": len(outcome.finished),
        "acknowledged": len(outcome.acks & {p.request.request_id for p in outcome.plans}),
        "block_writes": sum(outcome.block_writes.values()),
        "expected_block_writes": len(outcome.expected()),
        "layer0_signals": outcome.layer0_signals(),
        "calls_served_locally": sum(health.local_calls.values()),
        "entries_written_back": health.reconciled_entries,
        "degraded_s": round(health.degraded_seconds, 2),
        "counters_before_kill": {k: v for k, v in report.before.items() if v},
        "counters_at_end": {k: v for k, v in (outcome.stats or {}).items() if v} if outcome.stats else None,
        "decided_locally_not_written_back": outcome.local_counts,
        "problems": problems,
    }
    grid = Table("figure", "value")
    for name, value in figures.items():
        grid.add_row(name, str(value))
    out.print(grid)
    if json_path is not None:
        json_path.write_text(json.dumps(figures, indent=2) + "\n")
    if figures["problems"]:
        err.print(f"[red]FAILED[/red]: {len(problems)} problem(s)")
        for line in clip(problems):
            err.print(f"  - {line}", markup=False)
        raise typer.Exit(EXIT_FAILED)
    out.print(
        "[green]OK[/green]: every request finished and acknowledged, every block sent once, every signal counted once"
    )


def finish_run(summary: Summary, json_path: Path | None) -> None:
    out.print(table(summary))
    if summary.mode == Mode.REDIS.value and summary.late_tasks:
        out.print(
            f"{summary.late_tasks} requests got their cache task after their first layer-0 signal: "
            f"{summary.buffered_early} early signals waited in the buffer and {summary.recovered} came back on "
            "register (the rest: superseded, dropped or expired, in the table). "
            "Before the fix those signals were dropped and the requests hung (compare: --mode drop)."
        )
    if json_path is not None:
        json_path.write_text(json.dumps(summary.to_json(), indent=2) + "\n")
    if summary.violations:
        err.print(f"[red]FAILED[/red]: {len(summary.violations)} violation(s)")
        for line in clip(summary.violations):
            err.print(f"  - {line}", markup=False)
        raise typer.Exit(EXIT_FAILED)
    out.print("[green]OK[/green]: every layer of every chunk sent exactly once, every slot released, no key left")


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err
    )


@app.command("node")
def node_command(
    instance: Annotated[str, typer.Option(metavar="name", help="This prefill instance's name.")],
    redis: SharedUrl = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    mode: SimMode = SimConfig.mode,
    ranks: Ranks = SimConfig.ranks,
    requests: Requests = SimConfig.requests,
    layers: Layers = SimConfig.layers,
    chunk_tokens: ChunkTokens = SimConfig.chunk_tokens,
    batch: Batch = SimConfig.batch,
    early_share: EarlyShare = SimConfig.early_share,
    abort_share: AbortShare = SimConfig.abort_share,
    hang_timeout_s: HangTimeout = SimConfig.hang_timeout_s,
    timeout_s: Timeout = SimConfig.timeout_s,
    seed: Seed = SimConfig.seed,
    json_path: JsonPath = None,
) -> None:
    """One simulated prefill node (its ranks) on a shared Redis; needs `rls registrar` running."""
    config = SimConfig(
        url=shared_url(redis),
        namespace=namespace,
        mode=mode,
        ranks=ranks,
        requests=requests,
        layers=layers,
        chunk_tokens=chunk_tokens,
        batch=batch,
        early_share=early_share,
        abort_share=abort_share,
        hang_timeout_s=hang_timeout_s,
        timeout_s=timeout_s,
        seed=seed,
    )
    require_shared(config, "node")
    preflight(config)
    with _progress() as progress:
        task = progress.add_task(f"node {instance}", total=ranks * requests)
        summary = node_summary(config, instance, lambda n: progress.advance(task, n))
    finish_run(summary, json_path)


@app.command("registrar")
def registrar_command(
    redis: SharedUrl = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    mode: SimMode = SimConfig.mode,
    idle_exit_s: Annotated[
        float, typer.Option(min=0.0, help="Exit after this many seconds without tasks, 0 for never.")
    ] = 0.0,
) -> None:
    """The registrar of simulated nodes: registers their cache tasks on the shared Redis."""
    config = SimConfig(url=shared_url(redis), namespace=namespace, mode=mode)
    require_shared(config, "registrar")
    preflight(config)
    report = run_registrar(config, idle_exit_s)
    out.print(f"registrar: {report.registered} tasks registered")


# -- operator commands -------------------------------------------------------------------------


@app.command("inspect")
def inspect_command(
    redis: OperatorUrl = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    instance: Annotated[str | None, typer.Option(metavar="name", help="Only this instance.")] = None,
    rank: Annotated[int | None, typer.Option(min=0, help="Only this rank.")] = None,
    slot: Annotated[int | None, typer.Option(min=0, help="Only this slot.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Live tasks and pending signals, with their ages and remaining TTLs.

    Exit 3: the namespace has no keys."""
    with _buffer(_server_of("inspect", redis), namespace) as buf:
        shot = admin.snapshot(buf, instance, rank, slot)
        if not shot.tasks and not shot.pending and _empty(buf, namespace):
            _report_empty(namespace)
    if as_json:
        out.print_json(json.dumps(shot.to_json()))
        return
    tasks = Table(title=f"live tasks in {namespace!r} ({len(shot.tasks)})")
    for column in ("instance", "rank", "slot", "request", "need tokens", "layers", "lease left ms"):
        tasks.add_column(column)
    for t in shot.tasks:
        tasks.add_row(
            t.instance,
            str(t.rank),
            str(t.slot),
            t.request_id,
            str(t.need_prefill_tokens),
            str(t.num_layers),
            str(t.lease_left_ms),
        )
    pending = Table(title=f"pending early signals in {namespace!r} ({len(shot.pending)})")
    for column in ("instance", "rank", "slot", "layer", "tokens", "request", "age ms", "ttl ms"):
        pending.add_column(column)
    for p in shot.pending:
        pending.add_row(
            p.instance,
            str(p.rank),
            str(p.slot),
            str(p.layer),
            str(p.tokens),
            p.request_id or "-",
            str(p.age_ms),
            str(p.ttl_ms),
        )
    out.print(tasks)
    out.print(pending)


@app.command("stats")
def stats_command(
    redis: OperatorUrl = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh until interrupted.")] = False,
    interval: Annotated[float, typer.Option(min=0.05, help="Seconds between refreshes.")] = 1.0,
    count: Annotated[int, typer.Option(min=0, help="With --watch: stop after this many refreshes, 0 for never.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """The namespace's counters, summed over its ranks.

    Expired signals are swept first. Exit 3: the namespace has no keys, which --watch only
    warns about."""
    with _buffer(_server_of("stats", redis), namespace) as buf:
        counters = buf.stats()
        if not any(counters.values()) and _empty(buf, namespace):
            if not watch:
                _report_empty(namespace)
            warn(f"namespace {namespace!r} has no keys on this server yet: watching")
        if as_json:
            out.print_json(json.dumps(counters))
            return
        policies = buf.server_policies()
        if not watch:
            out.print(_stats_table(namespace, counters, policies))
            return
        shown = 0
        with Live(_stats_table(namespace, counters, policies), console=out, auto_refresh=False) as live:
            shown += 1
            while count == 0 or shown < count:
                time.sleep(interval)
                live.update(_stats_table(namespace, buf.stats(), policies), refresh=True)
                shown += 1


def _stats_table(namespace: str, counters: dict[str, int], policies: dict[str, str]) -> Table:
    """The counters, captioned with each server's maxmemory-policy: under an evicting one they
    may no longer add up (see docs/operations/redis-settings.md)."""
    evicting = eviction.evicting(policies)
    servers = ", ".join(f"{server} {policy}" for server, policy in policies.items())
    caption = f"maxmemory-policy: {servers}"
    if evicting:
        caption += " (may evict signals and tasks silently: set noeviction)"
    result = Table(title=f"counters of {namespace!r}", caption=caption)
    result.add_column("counter")
    result.add_column("value", justify="right")
    for name, value in counters.items():
        result.add_row(name, str(value))
    return result


@app.command("purge")
def purge_command(
    namespace: Annotated[
        str, typer.Option("--namespace", envvar="RLS_NAMESPACE", metavar="name", help="The namespace to remove.")
    ],
    redis: OperatorUrl = None,
    yes: Annotated[bool, typer.Option("--yes", help="Really delete.")] = False,
) -> None:
    """Remove every key of one namespace.

    SCAN by its prefix; other namespaces are untouched. Exit 3: it has no keys."""
    with _buffer(_server_of("purge", redis), namespace) as buf:
        if not yes:
            found = len(admin.namespace_keys(buf.client, namespace))
            if not found:
                _report_empty(namespace)
            err.print(f"refusing to purge namespace {namespace!r} ({found} keys) without --yes", markup=False)
            raise typer.Exit(EXIT_FAILED)
        removed = admin.purge(buf.client, namespace)
        if not removed:
            _report_empty(namespace)
    out.print(f"purged {removed} keys of namespace {namespace!r}", markup=False)


@app.command("metrics")
def metrics_command(
    redis: OperatorUrl = None,
    namespace: Namespace = DEFAULT_NAMESPACE,
    port: Annotated[int, typer.Option(min=0, max=65535, help="HTTP port of /metrics.")] = 9108,
    host: Annotated[str, typer.Option(metavar="address", help="Address to listen on.")] = "0.0.0.0",
    duration_s: Annotated[
        float, typer.Option(min=0.0, help="Stop after this many seconds, 0 to run until interrupted.")
    ] = 0.0,
) -> None:
    """Serve the namespace's counters and latency histograms in the Prometheus text format."""
    from .ops.metrics import BufferMetrics

    metrics = BufferMetrics()
    url = _server_of("metrics", redis)
    with SignalBuffer.from_url(url, namespace=namespace, observer=metrics.observe) as buf:
        try:
            buf.client.ping()
            buf.server_policies()  # its warnings now, not at the first scrape
        except Exception as exc:  # keep serving: the exporter reports rls_up 0 until Redis answers
            warn(f"Redis does not answer yet ({error_message(exc)}); serving rls_up 0 until it does")
        metrics.track(buf)
        server = metrics.serve(port, host)
        err.print(f"serving metrics of {namespace!r} on http://{host}:{server.server_port}/metrics", markup=False)
        deadline = time.monotonic() + duration_s if duration_s else None
        try:
            while deadline is None or time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            server.shutdown()


# -- library (the rls_v2 Functions library on the server) -------------------------------------

library_app = HelpTyper(
    help="The rls_v2 Functions library on the server: load it once (as the operator), check it.",
    no_args_is_help=True,
)
app.add_typer(library_app, name="library")


@library_app.command("load")
def library_load_command(
    redis: OperatorUrl = None,
    replace: Annotated[
        bool, typer.Option("--replace", help="Replace an rls_v2 built from other code (its clients then fail).")
    ] = False,
) -> None:
    """Load this release's rls_v2 on the server (every primary of a Cluster) and print its digest.

    Without --replace, a server that has another rls_v2 is left as it is and the command fails
    naming both digests."""
    from .server import library
    from .transport import connection

    client = connection.sync_client(_server_of("library load", redis), retry_s=5.0)
    digest = library.library().digest
    try:
        for name, node in library.nodes(client):
            if replace:
                library.load_library(node, replace=True)
                done = "loaded"
            else:
                done = "loaded" if library.ensure_library(node) else "already loaded"
            typer.echo(f"{name}: {library.LIBRARY_NAME} {done}, digest {digest}")  # one line, never wrapped
    finally:
        client.close()


@library_app.command("status")
def library_status_command(redis: OperatorUrl = None) -> None:
    """Whether the server's rls_v2 (on every primary of a Cluster) is exactly this release's code.

    Compares the code itself (FUNCTION LIST WITHCODE), not only the digest it reports; exits 1
    when a node has none or other code."""
    from .server import library
    from .transport import connection

    client = connection.sync_client(_server_of("library status", redis), retry_s=5.0)
    ours = library.library()
    failed = False
    try:
        for name, node in library.nodes(client):
            code = library.served_code(node)
            if code is None:
                state = "missing"
            elif code == ours.code:
                state = f"this release's code, digest {ours.digest}"
            else:
                reported = library.served_digest(node)
                state = f"OTHER code (it reports digest {reported or 'none'}; this release's is {ours.digest})"
            failed = failed or code != ours.code
            typer.echo(f"{name}: {library.LIBRARY_NAME} {state}")
    finally:
        client.close()
    if failed:
        raise typer.Exit(EXIT_FAILED)


# -- bench (performance; logic in redis_layer_signals.bench) ----------------------------------


@app.command("bench")
def bench_command(
    redis: Annotated[
        str | None,
        typer.Option(
            "--redis", metavar="url", help="Benchmark this server instead of starting one (RLS_REDIS_URL is not read)."
        ),
    ] = None,
    server: Annotated[
        str,
        typer.Option(
            metavar="binary",
            help="Server binary started when --redis is not given: a path, a name on PATH, or 'valkey'.",
        ),
    ] = "redis-server",
    sizes: Annotated[str, typer.Option(metavar="list", help="Entries per record call, comma-separated.")] = "1,32,512",
    pending: Annotated[
        str, typer.Option(metavar="list", help="Pending layers before register, comma-separated.")
    ] = "0,1,8,61",
    layers: Annotated[
        str,
        typer.Option(
            metavar="list",
            help="Pending layers per slot under record (the record-onto-pending cases), comma-separated.",
        ),
    ] = "1,8,61",
    layer_sizes: Annotated[
        str, typer.Option(metavar="list", help="Entries per record call onto pending layers, comma-separated.")
    ] = "32,512",
    iterations: Annotated[int, typer.Option(min=1, help="Timed calls per case.")] = 2000,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed calls first.")] = 200,
    processes: Annotated[int, typer.Option(min=1, help="Contending processes.")] = 4,
    duration: Annotated[float, typer.Option(min=0.1, help="Seconds per contention run.")] = 3.0,
    out: Annotated[
        Path | None,
        typer.Option(
            show_default=False,
            metavar="dir",
            help="Directory for results.md, results.json and the plots; by default a new rls-bench-<time>.",
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of markdown.")] = False,
    plot: Annotated[bool, typer.Option("--plot/--no-plot", help="Write the PNG (needs matplotlib).")] = True,
    hooks: Annotated[
        bool,
        typer.Option(
            "--hooks",
            help="Instead: the FastDeploy bridge's hooks against FastDeploy's dict (healthy, 300 ms link, "
            "outage) and Redis's CPU per request; writes hooks.md and hooks.json.",
        ),
    ] = False,
    gc_freeze: Annotated[
        bool,
        typer.Option(
            "--gc-freeze/--no-gc-freeze",
            help="With --hooks: gc.freeze() after the imports and a warm-up case, as a server process "
            "that freezes its startup heap (without it, a full collection traverses every import's objects).",
        ),
    ] = True,
    tp: Annotated[
        int,
        typer.Option(
            "--tp",
            min=1,
            max=8,
            help="With --hooks: tensor-parallel ranks, that many bridges of one group sharing one "
            "Redis, a process each (with its dict), fed the same steps at once.",
        ),
    ] = 1,
    step_ms: Annotated[
        float,
        typer.Option(
            "--step-ms",
            min=0,
            help="With --hooks: untimed milliseconds between forward steps, the GPU's part of a step "
            "(0: the drivers never pause).",
        ),
    ] = 20.0,
) -> None:
    """Measure record, register and finish on one server.

    Against a local dict, naive WATCH/MULTI and a no-op EVALSHA floor; writes markdown, JSON
    and a plot. --hooks: the FastDeploy bridge's hooks instead (docs/performance.md)."""
    from .bench import runner

    if hooks:
        from .bench import hooks as hook_bench

        hook_argv = ([] if out is None else ["--out", str(out)]) + ([] if gc_freeze else ["--no-gc-freeze"])
        hook_argv += ["--tp", str(tp), "--step-ms", str(step_ms)]
        raise typer.Exit(hook_bench.main(hook_argv))

    argv = ["--sizes", sizes, "--pending", pending, "--iterations", str(iterations), "--warmup", str(warmup)]
    argv += ["--layers", layers, "--layer-sizes", layer_sizes]
    argv += ["--processes", str(processes), "--duration", str(duration)]
    argv += [] if out is None else ["--out", str(out)]
    argv += (["--redis", redis] if redis else []) + (["--json"] if json_output else []) + ["--server", server]
    argv += [] if plot else ["--no-plot"]
    raise typer.Exit(runner.main(argv))


# -- fastdeploy (the integration applied to FastDeploy's file; logic in .fastdeploy.patch) ------

fastdeploy_app = HelpTyper(help="FastDeploy's cache messager, integrated.", no_args_is_help=True)
app.add_typer(fastdeploy_app, name="fastdeploy")
EXIT_NEEDS_PATCH = 1
"""``fastdeploy patch --check``: the file needs patching; the diff is on stdout."""
EXIT_STRUCTURE = 2
"""``fastdeploy patch``: the file is not a release the codemod knows; nothing was written."""
EXIT_FILE = 3
"""``fastdeploy patch``: a file could not be read or written (or the fastdeploy extra is missing);
nothing changed."""
FASTDEPLOY_EXTRA = ("libcst", "numpy")
"""What the ``fastdeploy`` extra adds to the base install: without either the command cannot run."""


@fastdeploy_app.command("patch")
def fastdeploy_patch_command(
    file: Annotated[
        Path, typer.Argument(metavar="FILE", help="FastDeploy's fastdeploy/cache_manager/cache_messager.py.")
    ],
    check: Annotated[
        bool, typer.Option("--check", help="Print the diff, write nothing; exit 1 if the file needs patching.")
    ] = False,
    output: Annotated[
        Path | None, typer.Option("--output", help="Write the patched file here; FILE is left as it is.")
    ] = None,
    root: Annotated[
        Path | None,
        typer.Option(
            "--root",
            metavar="dir",
            show_default=False,
            help="With --check: the diff's paths are relative to this directory, for `patch -p1` run there "
            "(default: the directory above the fastdeploy/ folder holding FILE, else FILE's directory).",
        ),
    ] = None,
    force: Annotated[
        bool,
        typer.Option("--force", help="Replace a read-only FILE or --output file, or a FILE.orig holding another file."),
    ] = False,
) -> None:
    """Apply the FastDeploy integration to FILE, FastDeploy's cache_messager.py.

    Edits `CacheMessagerV1` (release/2.6 with PR 7872, or after PR 8035): the import, the
    bridge in `__init__` and the three hook points. Rewrites FILE (through a symlink, its
    target), keeping the original as FILE.orig; a file already patched is left alone.

    Exit codes: 0 patched or already patched; 1 --check found work to do (the diff is on
    stdout); 2 the file's structure, or code it would remove, is not one the codemod knows;
    3 a file could not be read or written, or the fastdeploy extra is missing. Only exit 0
    writes anything."""
    try:
        from .fastdeploy import patch, patch_files
    except ModuleNotFoundError as exc:
        if exc.name not in FASTDEPLOY_EXTRA:
            raise
        _fail(
            f"rls fastdeploy patch needs the fastdeploy extra ({exc.name} is missing): {install_hint('fastdeploy')}",
            EXIT_FILE,
        )
    if check and output is not None:
        _fail("--check writes nothing: give --check or --output, not both", EXIT_USAGE)
    try:
        target = patch_files.resolve(file)
        name = patch_files.diff_name(target, root) if check else ""
        result = patch.patch_source(patch_files.read(target))
    except patch_files.FileProblem as exc:
        _fail(str(exc), EXIT_FILE)
    except patch.UnreadableSource as exc:
        _fail(f"{file}: {exc}", EXIT_FILE)
    except patch.StructureMismatch as exc:
        _fail(f"{file}: {exc}", EXIT_STRUCTURE)
    except ValueError as exc:  # --root does not hold FILE
        _fail(str(exc), EXIT_USAGE)
    shown = file if target == file.absolute() else f"{file} -> {target}"
    try:
        if check:
            if result.changed:
                sys.stdout.flush()
                sys.stdout.buffer.write(result.diff(name))
                sys.stdout.flush()
                raise typer.Exit(EXIT_NEEDS_PATCH)
            out.print(f"{shown}: already patched", markup=False, soft_wrap=True)
        elif output is not None:
            written = patch_files.write_copy(output, result.patched, mode_of=target, force=force)
            what = "the patched form" if result.changed else "a copy (already patched)"
            out.print(f"{written}: {what} of {shown}", markup=False, soft_wrap=True)
        elif not result.changed:
            out.print(f"{shown}: already patched, left as it is", markup=False, soft_wrap=True)
        else:
            backup = patch_files.replace(target, result.patched, result.original, force=force)
            # The backup named as the file was (relative stays relative), the link's target's otherwise.
            kept = f"{file}{backup.name[len(target.name) :]}" if target == file.absolute() else str(backup)
            out.print(f"{shown}: patched\noriginal kept as {kept}", markup=False, soft_wrap=True)
    except patch_files.FileProblem as exc:
        _fail(str(exc), EXIT_FILE)


# -- entry point -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """``rls``: runs a command, turning every expected failure into one line and an exit code."""
    command = typer.main.get_command(app)
    _say_warnings()
    try:
        code: Any = command.main(args=argv, prog_name="rls", standalone_mode=False)
    except (typer.Abort, KeyboardInterrupt):
        _fail("interrupted", 130)
    except _PARSER_ERROR as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # `rls`, `rls library`: the help, as --help prints it
            print(getattr(exc, "format_message", exc.__str__)())
            sys.exit(EXIT_USAGE)
        _fail(getattr(exc, "format_message", exc.__str__)(), int(getattr(exc, "exit_code", EXIT_USAGE)))
    except (SignalBufferError, RedisError, ValueError, OSError, ModuleNotFoundError) as exc:  # an extra missing
        _fail(error_message(exc), EXIT_FAILED)
    sys.exit(code if isinstance(code, int) else 0)


class _WarningLines(logging.Handler):
    """The library's warnings in the command's voice (``warn``)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            warn(record.getMessage())
        except Exception:
            self.handleError(record)


def _say_warnings() -> None:
    """The library's warnings (an evicting server, a setting that can lose writes) on stderr in
    the command's voice, once per command and server: ``rls: warning: Redis 10.0.0.5:6379 has
    appendonly no: ...``. The processes a command starts (simulate's ranks, bench's contenders)
    leave unsaid what it said (``server.said``). A process that configured logging itself keeps
    its own handlers."""
    said.share_with_children()
    library = logging.getLogger("redis_layer_signals")
    if library.handlers or logging.getLogger().handlers:
        return
    handler = _WarningLines(logging.WARNING)
    library.addHandler(handler)


def warn(message: str) -> None:
    """One ``rls: warning: ...`` line on stderr, as ``_fail`` says an error (read when it is
    said: a live progress display moves ``sys.stderr`` while it runs)."""
    line = " ".join(str(message).split())
    print(f"rls: warning: {line}", file=sys.stderr)


def error_message(exc: BaseException) -> str:
    """What went wrong, in the words a user acts on: no exception class, no name of the library's
    internal step (``BufferUnavailable: time: ...`` said which read gave up, not what to fix)."""
    if isinstance(exc, BufferUnavailable):
        return f"Redis unavailable (retried for {exc.retry_s:g}s): {exc.__cause__ or exc}"
    if isinstance(exc, AuthenticationError):
        return f"Redis refused the login: {exc}"
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        return f"Redis unavailable: {exc}"
    if isinstance(exc, ResponseError):
        return f"Redis answered with an error: {exc}"
    return str(exc) or type(exc).__name__


def _fail(message: str, code: int) -> NoReturn:
    line = " ".join(str(message).split())
    print(f"rls: error: {line}", file=sys.stderr)
    sys.exit(code)
