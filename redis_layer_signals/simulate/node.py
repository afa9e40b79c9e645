"""One prefill node: its ranks, each a GPU thread and a sender thread, and the checks run on
them when they are done."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .channels import Channel, LocalChannel, RedisChannel, inbox_key
from .config import SimConfig
from .modes import Handoff
from .producer import produce
from .rank import RankContext
from .report import RankReport
from .sender import Sender
from .workload import workload

JOIN_GRACE_S = 5.0
FORWARD_RETRY_S = 0.2
"""Pause before reading a rank's inbox again after its connection was lost."""


def run_ranks(
    config: SimConfig,
    run_id: str,
    instance: str,
    ranks: list[int],
    handoff: Handoff,
    registrar: Channel,
    progress: Callable[[int], None],
    client: Any = None,
    inboxes: Callable[[str, int], LocalChannel] | None = None,
) -> list[RankReport]:
    """Run the ranks to the end. Registration notices reach a rank through ``inboxes`` (threads
    of one process) or, when ``client`` is set, through its Redis list, named after ``run_id``."""
    deadline = time.monotonic() + config.timeout_s
    contexts = []
    for r in ranks:
        ctx = RankContext(
            config, instance, r, workload(config, instance, r, run_id), handoff, registrar, progress, deadline
        )
        if inboxes is not None:
            ctx.inbox = inboxes(instance, r)
        else:
            ctx.reply_to = inbox_key(config.namespace, instance, r, run_id)
        contexts.append(ctx)
    before = {ctx.rank: handoff.counters(instance, ctx.rank) for ctx in contexts}
    senders = [Sender(ctx) for ctx in contexts]
    workers, forwarders = [], []
    for ctx, sender in zip(contexts, senders, strict=True):
        workers.append(threading.Thread(target=produce, args=(ctx,), name=f"gpu-{ctx.name}", daemon=True))
        workers.append(threading.Thread(target=sender.run, name=f"sender-{ctx.name}", daemon=True))
        if client is not None:
            channel = RedisChannel(client, ctx.reply_to)
            forwarders.append(threading.Thread(target=forward, args=(channel, ctx), daemon=True))
    for thread in [*workers, *forwarders]:
        thread.start()
    for thread in workers:
        # Both loops end by the deadline on their own; the grace covers one last call.
        thread.join(max(0.0, deadline - time.monotonic()) + JOIN_GRACE_S)
    for ctx in contexts:
        ctx.stop.set()
    for thread in [*workers, *forwarders]:
        thread.join(JOIN_GRACE_S)
    return [check(ctx, sender, before[ctx.rank]) for ctx, sender in zip(contexts, senders, strict=True)]


def forward(channel: Channel, ctx: RankContext) -> None:
    """Move registration notices from the rank's Redis inbox to its sender. A connection lost
    while it waits (the primary stopped, a failover under way) is waited out: the next read
    reconnects, to the new primary once there is one."""
    while not ctx.stop.is_set():
        try:
            message = channel.get(0.1)
        except (RedisConnectionError, RedisTimeoutError):
            ctx.stop.wait(FORWARD_RETRY_S)
            continue
        if message is not None:
            ctx.inbox.put(message)


def check(ctx: RankContext, sender: Sender, before: dict[str, int]) -> RankReport:
    config = ctx.config
    unresolved = len(ctx.requests) - len(sender.resolved)
    if unresolved:
        ctx.violation(f"{unresolved} requests unresolved when the run timed out")
    hung = sorted(rid for rid, how in sender.resolved.items() if how == "hung")
    if hung:
        ctx.violation(f"{len(hung)} requests hung (not every layer sent {config.hang_timeout_s:g}s after prefill)")
    lost, duplicates, notes = sender.lost_and_duplicates()
    for note in notes:
        ctx.violation(note)
    if sender.parked:
        ctx.violation(f"delivered signals for slots whose task never arrived: {sorted(sender.parked)}")
    if ctx.free.qsize() != config.batch:
        ctx.violation(f"{config.batch - ctx.free.qsize()} slots never released")
    live, pending = ctx.handoff.leftovers(ctx.instance, ctx.rank)
    if live:
        ctx.violation(f"slots {live} still hold a task at the end")
    after = ctx.handoff.counters(ctx.instance, ctx.rank)
    for name in ("superseded", "expired", "dropped_no_task"):
        ctx.count(name, after.get(name, 0) - before.get(name, 0))
    accounting(ctx, pending)
    for key in ctx.handoff.stray_keys(ctx.instance, ctx.rank):
        ctx.violation(f"key left in Redis: {key}")
    return RankReport(ctx.instance, ctx.rank, dict(ctx.counts), lost, duplicates, ctx.record_ms, list(ctx.violations))


def accounting(ctx: RankContext, pending: int) -> None:
    """Invariant 1 in numbers: each signal was delivered, or buffered and then ended in exactly
    one place (recovered, dropped with a reason, superseded, expired) or is still pending."""
    c = ctx.counts
    if c.get("signals", 0) != c.get("delivered", 0) + c.get("buffered", 0) + c.get("dropped_no_task", 0):
        ctx.violation(f"accounting: signals {c.get('signals', 0)} != delivered + buffered + dropped ({c})")
    ended = sum(v for k, v in c.items() if k.startswith("dropped_") and k != "dropped_no_task")
    ended += c.get("recovered", 0) + c.get("finish_dropped", 0) + c.get("superseded", 0) + c.get("expired", 0)
    if c.get("buffered", 0) != ended + pending:
        ctx.violation(f"accounting: buffered {c.get('buffered', 0)} != ended {ended} + pending {pending}")
    if pending:
        ctx.violation(f"{pending} signals still pending at the end")
