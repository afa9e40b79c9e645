"""Key layout (docs/key-layout.md). Every key of one instance and rank shares the hash tag
``{ns/instance/rank}``, so each function call touches a single Cluster slot; key names are
built here, never inside Lua."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..constants import KEY_PREFIX

PENDING_LAYERS = "layers"
"""The pending hash's field that lists the layers buffered on the rank (see lua/_lib.lua)."""


@dataclass(frozen=True)
class RankKeys:
    """The keys of one (namespace, instance, rank)."""

    tag: str
    live: str  # hash: slot -> "<lease deadline ms, 16 digits>|<request id>", "<slot>:doc" ->
    # task document, "<slot>:recovery" -> first recovery
    pending: str  # hash: "<slot>:<layer>" -> one early signal; "layers" -> the rank's layers
    expiry: str  # zset: slot group (slot // 8) scored at or before its earliest pending deadline
    stats: str  # hash: counters; the only key without a TTL
    ended: str  # hash: slot -> "<finished at ms>|<request id>", the slot's latest finish

    def reply(self, token: str) -> str:
        """Idempotency key of one call: holds its reply while a resend could still come."""
        return f"{KEY_PREFIX}:{self.tag}:reply:{token}"

    def writer(self, token: str) -> str:
        """The last batch one writing process applied (lua/apply.lua), and its reply."""
        return f"{KEY_PREFIX}:{self.tag}:writer:{token}"

    @property
    def identity(self) -> str:
        """The process that owns the rank: its claim, lease and generation (lua/claim.lua)."""
        return f"{KEY_PREFIX}:{self.tag}:identity"

    @property
    def clash(self) -> str:
        """The last process the ownership fence refused, for the owner to log (lua/_lib.lua)."""
        return f"{KEY_PREFIX}:{self.tag}:clash"

    @property
    def per_request(self) -> tuple[str, str, str, str]:
        """Keys that hold per-request state and must carry a TTL."""
        return (self.live, self.pending, self.expiry, self.ended)


class KeySpace:
    """Builds (and caches) the key names of one namespace."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._ranks: dict[tuple[str, int], RankKeys] = {}
        self._tag_re = re.compile(rf"^{re.escape(KEY_PREFIX)}:\{{{re.escape(namespace)}/([^/{{}}]+)/(\d+)\}}:")

    def rank(self, instance: str, rank: int) -> RankKeys:
        cached = self._ranks.get((instance, rank))
        if cached is None:
            tag = f"{{{self.namespace}/{instance}/{rank}}}"
            base = f"{KEY_PREFIX}:{tag}:"
            cached = RankKeys(
                tag=tag,
                live=base + "live",
                pending=base + "pending",
                expiry=base + "expiry",
                stats=base + "stats",
                ended=base + "ended",
            )
            self._ranks[(instance, rank)] = cached
        return cached

    def pattern(self, kind: str = "*") -> str:
        """SCAN pattern for this namespace's keys (identifiers hold no glob characters)."""
        return f"{KEY_PREFIX}:{{{self.namespace}/*}}:{kind}"

    def owner(self, key: str | bytes) -> tuple[str, int] | None:
        """(instance, rank) of one of this namespace's keys, else None."""
        text = key.decode() if isinstance(key, bytes) else key
        match = self._tag_re.match(text)
        if match is None:
            return None
        return match.group(1), int(match.group(2))
