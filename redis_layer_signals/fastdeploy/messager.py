"""What FastDeploy's patched cache messager calls: a bridge for a prefill messager, else none.

Every ``CacheMessagerV1`` of a deployment calls ``bridge_for_messager`` once, in its
constructor. Only a prefill messager buffers early layer-0 signals: decode and mixed messagers
get None, and start nothing (no connection, no thread). A prefill messager's bridge is named
after its engine, unique per host (``instance_name``), and its rank is the messager's
``rank_id``, so each messager claims an identity of its own (see ``identity``).
"""

from __future__ import annotations

import re
import socket
from typing import Any

from ..buffer.sync import SignalBuffer
from ..config import shared_url
from .bridge import Layer0Bridge, ReadySource

PREFILL = "prefill"
"""FastDeploy's ``splitwise_role`` of a prefill instance, the only one that gets a bridge."""
UNROUTABLE = frozenset({"", "0.0.0.0", "::", "::1", "localhost"})
"""Addresses that name no host in particular (with every ``127.*``): the host name is used."""
MAX_INSTANCE = 128
"""An instance name is an identifier of at most this many characters."""
_NOT_IDENTIFIER = re.compile(r"[^A-Za-z0-9._-]")


def instance_name(pod_ip: str | None, engine_worker_queue_port: int, hostname: str | None = None) -> str:
    """One prefill engine's name: its pod IP (the host name when the IP is unset, a wildcard or
    loopback) and its ``engine_worker_queue_port``, which no two engines of a host share;
    characters outside ``[A-Za-z0-9._-]`` become ``-``, and a long host is cut to fit."""
    host = (pod_ip or "").strip()
    if host in UNROUTABLE or host.startswith("127."):
        host = hostname if hostname is not None else socket.gethostname()
    port = _NOT_IDENTIFIER.sub("-", str(engine_worker_queue_port))
    host = _NOT_IDENTIFIER.sub("-", host)[: MAX_INSTANCE - len(port) - 1] or "host"
    return f"{host}-{port}"


def bridge_for_messager(
    *,
    splitwise_role: str,
    pod_ip: str | None,
    engine_worker_queue_port: int,
    rank: int,
    nranks: int,
    block_size: int,
    num_layers: int,
    ready: ReadySource,
    logger: Any = None,
) -> Layer0Bridge | None:
    """The bridge of one ``CacheMessagerV1``, or None unless it is a prefill messager.

    The buffer comes from the environment (``RLS_REDIS_URL``, ``RLS_NAMESPACE``, ...): unset
    ``RLS_REDIS_URL`` raises ``InvalidConfig`` naming it, since the default ``memory://``
    would be a buffer private to this process. ``rank`` is the messager's ``rank_id``;
    ``nranks`` its tensor-parallel group's size; ``logger`` FastDeploy's logger, which the
    bridge then logs through. Makes no Redis call: the bridge's writer claims the identity
    and adopts what a predecessor left in the background.
    """
    if splitwise_role != PREFILL:
        return None
    buffer = SignalBuffer.from_url(shared_url())
    instance = instance_name(pod_ip, engine_worker_queue_port)
    try:
        bridge = Layer0Bridge(
            buffer,
            instance,
            rank,
            block_size,
            num_layers=num_layers,
            ready=ready,
            registers_tasks=True,
            nranks=nranks,
            logger=logger,
        )
    except BaseException:
        buffer.close()
        raise
    bridge.logger.info(
        "rls: layer-0 signals of %s rank %d buffered in Redis namespace %s",
        instance,
        rank,
        buffer.config.namespace,
    )
    return bridge
