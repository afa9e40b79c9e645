"""Settings of one simulated deployment; one frozen dataclass so new options (fault injection,
other workloads) are one field away and every process gets the same picture."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from .. import validation
from ..constants import DEFAULT_NAMESPACE, DEFAULT_URL
from ..errors import InvalidConfig
from ..transport.connection import MEMORY, scheme_of


class Mode(str, Enum):
    """Where early signals wait for their cache task."""

    REDIS = "redis"  # this library: a buffer in Redis, shared by every process
    DROP = "drop"  # before the fix: a signal for an unregistered slot is dropped
    LOCAL = "local"  # FastDeploy's fix: a process-local dict, lost across processes


DEFAULT_REQUESTS = 32
"""Requests per instance x rank: 128 on the default 2 x 2, a few seconds on memory://."""
DEFAULT_LAYERS = 61
"""DeepSeek-V3-sized model."""
DEFAULT_CHUNK_TOKENS = 2048
DEFAULT_EARLY_SHARE = 0.3
DEFAULT_HANG_TIMEOUT_S = 3.0
"""A request whose layers are not all sent this long after its prefill ended is hung."""


@dataclass(frozen=True)
class SimConfig:
    url: str = DEFAULT_URL
    namespace: str = DEFAULT_NAMESPACE
    mode: Mode = Mode.REDIS
    instances: int = 2
    ranks: int = 2
    requests: int = DEFAULT_REQUESTS
    layers: int = DEFAULT_LAYERS
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    max_prompt_tokens: int = 4 * DEFAULT_CHUNK_TOKENS
    batch: int = 8
    early_share: float = DEFAULT_EARLY_SHARE
    abort_share: float = 0.05
    max_delay_ms: float = 20.0
    hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S
    timeout_s: float = 600.0
    seed: int = 0
    channel_url: str = ""  # --chaos: the simulation's messages on a Redis apart; empty: url

    def __post_init__(self) -> None:
        validation.identifier(self.namespace, "namespace", InvalidConfig)
        if not isinstance(self.url, str) or "://" not in self.url:
            raise InvalidConfig("url", self.url, "must be a URL such as memory:// or redis://host:6379/0")
        if self.channel_url and "://" not in self.channel_url:
            raise InvalidConfig("channel_url", self.channel_url, "must be a URL such as redis://host:6379/0")
        for name, low in (
            ("instances", 1),
            ("ranks", 1),
            ("requests", 1),
            ("layers", 1),
            ("chunk_tokens", 1),
            ("max_prompt_tokens", 1),
            ("batch", 1),
        ):
            validation.integer(getattr(self, name), name, InvalidConfig, low, 2**31)
        if self.batch > 512:
            raise InvalidConfig("batch", self.batch, "must be at most 512 (the buffer's max_slots)")
        for name in ("early_share", "abort_share"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
                raise InvalidConfig(name, value, "must be a share between 0 and 1")
        for name in ("max_delay_ms", "hang_timeout_s", "timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0:
                raise InvalidConfig(name, value, "must be a non-negative number")
        if not isinstance(self.seed, int):
            raise InvalidConfig("seed", self.seed, "must be an int")

    @property
    def in_process(self) -> bool:
        """memory:// lives in this process only, so the run uses threads instead of processes."""
        return scheme_of(self.url) == MEMORY

    def instance_names(self) -> list[str]:
        return [f"p{i}" for i in range(self.instances)]

    def with_(self, **changes: Any) -> SimConfig:
        return replace(self, **changes)
