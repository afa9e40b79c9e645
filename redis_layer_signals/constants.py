"""Names and defaults shared by the library, the functions' callers and the CLI."""

from __future__ import annotations

KEY_PREFIX = "rls"
"""Every key starts with ``rls:``; the next part is the hash tag ``{namespace/instance/rank}``."""

ENV_PREFIX = "RLS_"
"""Environment variables that configure a buffer: RLS_NAMESPACE, RLS_REDIS_URL, ..."""

DEFAULT_URL = "memory://"
DEFAULT_NAMESPACE = "default"
DEFAULT_PENDING_TTL_S = 60.0
"""How long an early signal waits for its task before it is expired and counted."""
DEFAULT_TASK_TTL_S = 900.0
"""Lease of a registered task: FastDeploy's scheduler TTL for a request."""
DEFAULT_MAX_SLOTS = 512
"""Engine slots per rank (FastDeploy's max batch size bound)."""
DEFAULT_RETRY_S = 3.0
"""How long one call keeps resending before it raises BufferUnavailable."""
DEFAULT_MAX_LAYERS = 1024
"""Layers a model may have: ``record`` refuses a layer at or above it. The deepest models
served today have about a hundred; each distinct pending layer costs the rank's calls time."""
DEFAULT_EVICTION = "warn"
"""What a buffer does on a server whose maxmemory-policy may evict: ``warn`` (log once, export
the metric) or ``refuse`` (raise EvictingServer). See docs/operations/redis-settings.md."""

MAX_BATCH = 512
"""Entries accepted by one ``record`` call: one function call, bounded work."""
MAX_RANK = 65535
MAX_SLOTS_LIMIT = 65535
"""The largest ``max_slots`` a buffer accepts: a slot is below it whatever the buffer."""
MAX_INT = 2**53
"""Layers, tokens and need_prefill_tokens are ints below this (exact in Lua's doubles)."""
IDENTIFIER_PATTERN = r"[A-Za-z0-9._-]{1,128}"
"""Namespaces, instances and request ids: no hash-tag braces, no separators, no globs."""

PENDING_KEY_GRACE_S = 30.0
"""Extra life of the pending hash beyond the pending TTL, so sweeps count expiries before
the key TTL (the backstop for a dead node) removes them silently."""
TASK_KEY_GRACE_S = 30.0
"""Extra life of the live hash (leases and task documents) beyond the task lease."""
REPLY_GRACE_S = 5.0
"""A reply is remembered for retry_s plus this, longer than any resend of the same call."""
WRITER_KEY_TTL_S = 24 * 3600.0
"""The FastDeploy bridge's writer key (its last applied batch and reply) outlives the writing
process by this: a resend of that batch, however late, is recognised meanwhile."""
SWEEP_LIMIT = 64
"""Slots one call may sweep for expired signals: bounds the time a function blocks the server."""

DEFAULT_WAIT_REPLICAS = 0
"""Replicas that must confirm a record or register before it returns (0: asynchronous, no WAIT)."""
DEFAULT_WAIT_TIMEOUT_MS = 100
"""How long one WAIT blocks; the call resends (replaying its reply) until retry_s runs out."""

WARN, REFUSE = "warn", "refuse"
"""What a buffer does on a server whose ``maxmemory-policy`` may evict (``eviction``)."""
EVICTION_MODES = (WARN, REFUSE)
