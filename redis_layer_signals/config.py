"""Buffer options: explicit arguments first, then ``RLS_*`` environment variables, then defaults."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import validation
from .constants import (
    DEFAULT_EVICTION,
    DEFAULT_MAX_LAYERS,
    DEFAULT_MAX_SLOTS,
    DEFAULT_NAMESPACE,
    DEFAULT_PENDING_TTL_S,
    DEFAULT_RETRY_S,
    DEFAULT_TASK_TTL_S,
    DEFAULT_URL,
    DEFAULT_WAIT_REPLICAS,
    DEFAULT_WAIT_TIMEOUT_MS,
    ENV_PREFIX,
    EVICTION_MODES,
    MAX_INT,
    MAX_SLOTS_LIMIT,
)
from .errors import InvalidConfig


@dataclass(frozen=True)
class BufferConfig:
    """A buffer's resolved options (``buffer.config``), checked when built: the fields are the
    constructor's options of the same names, with their defaults."""

    namespace: str = DEFAULT_NAMESPACE
    url: str = DEFAULT_URL
    pending_ttl_s: float = DEFAULT_PENDING_TTL_S
    task_ttl_s: float = DEFAULT_TASK_TTL_S
    max_slots: int = DEFAULT_MAX_SLOTS
    retry_s: float = DEFAULT_RETRY_S
    wait_replicas: int = DEFAULT_WAIT_REPLICAS  # replication option: see replication.py
    wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS
    max_layers: int = DEFAULT_MAX_LAYERS
    eviction: str = DEFAULT_EVICTION  # warn | refuse: see eviction.py
    url_implicit: bool = field(default=False, compare=False)
    """``from_url`` was given no URL and ``RLS_REDIS_URL`` is unset: ``url`` is the default
    ``memory://``, a server private to this process (see ``require_shared``)."""

    def __post_init__(self) -> None:
        validation.identifier(self.namespace, "namespace", InvalidConfig)
        if not isinstance(self.url, str) or "://" not in self.url:
            raise InvalidConfig("url", self.url, "must be a URL such as memory:// or redis://host:6379/0")
        validation.positive_seconds(self.pending_ttl_s, "pending_ttl_s")
        validation.positive_seconds(self.task_ttl_s, "task_ttl_s")
        validation.positive_seconds(self.retry_s, "retry_s")
        validation.integer(self.max_slots, "max_slots", InvalidConfig, 1, MAX_SLOTS_LIMIT + 1)
        validation.integer(self.wait_replicas, "wait_replicas", InvalidConfig, 0, 65536)
        validation.integer(self.wait_timeout_ms, "wait_timeout_ms", InvalidConfig, 1, 2**31)
        validation.integer(self.max_layers, "max_layers", InvalidConfig, 1, MAX_INT)
        if self.eviction not in EVICTION_MODES:
            raise InvalidConfig("eviction", self.eviction, f"must be one of {', '.join(EVICTION_MODES)}")

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None, **explicit: Any) -> BufferConfig:
        """Build a config; ``None`` arguments fall back to ``RLS_<NAME>`` and then the default."""
        source = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name, parse in _ENV_FIELDS.items():
            given = explicit.pop(name, None)
            if given is not None:
                values[name] = given
                continue
            variable = ENV_PREFIX + ("REDIS_URL" if name == "url" else name.upper())
            raw = source.get(variable)
            if raw is not None and raw != "":
                try:
                    values[name] = parse(raw)
                except ValueError as exc:
                    raise InvalidConfig(variable, raw, f"cannot parse: {exc}") from exc
        if explicit:
            name = next(iter(explicit))
            raise InvalidConfig(name, explicit[name], "unknown option")
        return cls(**values)

    @classmethod
    def for_url(cls, url: str | None, options: dict[str, Any]) -> tuple[BufferConfig, dict[str, Any]]:
        """Split ``from_url`` options into the resolved config and the hooks passed through."""
        options = dict(options)
        env = options.pop("env", None)
        hooks: dict[str, Any] = {name: options.pop(name) for name in ("clock", "observer") if name in options}
        config = cls.resolve(env, url=url, **options)
        implicit = url is None and not (os.environ if env is None else env).get(URL_VARIABLE, "")
        return dataclasses.replace(config, url_implicit=implicit), hooks

    def options(self) -> dict[str, Any]:
        """Constructor arguments that reproduce this config without reading the environment."""
        return {
            "url": self.url,
            "namespace": self.namespace,
            "pending_ttl_s": self.pending_ttl_s,
            "task_ttl_s": self.task_ttl_s,
            "max_slots": self.max_slots,
            "retry_s": self.retry_s,
            "wait_replicas": self.wait_replicas,
            "wait_timeout_ms": self.wait_timeout_ms,
            "max_layers": self.max_layers,
            "eviction": self.eviction,
            "env": {},
        }


def require_shared(config: BufferConfig, who: str) -> None:
    """Refuse a buffer on the implicit ``memory://`` for ``who``, a component whose peers must
    share the buffer (the FastDeploy bridge): ``InvalidConfig`` naming the variable."""
    if config.url_implicit:
        raise InvalidConfig(URL_VARIABLE, None, f"not set, and {who} needs a Redis its peers share: {SHARED_URL_HINT}")


URL_VARIABLE = ENV_PREFIX + "REDIS_URL"
SHARED_URL_HINT = f"set {URL_VARIABLE} to the shared Redis, or {URL_VARIABLE}=memory:// for a private in-process buffer"


def shared_url(url: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The URL given, else ``RLS_REDIS_URL``. Neither is refused (``InvalidConfig`` naming the
    variable): the default ``memory://`` would be a buffer private to this process, which a
    deployment's other processes never see, and nothing would say so. An explicit
    ``memory://`` is accepted (tests, the demo)."""
    if url is not None and url.strip():
        return url
    value = (os.environ if env is None else env).get(URL_VARIABLE, "")
    if value.strip():
        return value
    raise InvalidConfig(
        URL_VARIABLE, None, f"not set, and the default memory:// is private to this process: {SHARED_URL_HINT}"
    )


_ENV_FIELDS: dict[str, Any] = {
    "namespace": str,
    "url": str,
    "pending_ttl_s": float,
    "task_ttl_s": float,
    "max_slots": int,
    "retry_s": float,
    "wait_replicas": int,
    "wait_timeout_ms": int,
    "max_layers": int,
    "eviction": str,
}
