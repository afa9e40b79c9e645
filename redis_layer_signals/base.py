"""What the sync and async buffers share: options, protocol and hooks. Only the
transport (a redis-py client or a redis.asyncio one) differs between the two subclasses."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .config import BufferConfig
from .protocol import Clock, Protocol

Observer = Callable[[str, float], None]
"""Called with (operation, seconds) after each successful call: the metrics hook."""

B = TypeVar("B", bound="BufferBase")


class BufferBase:
    """Resolves the options (arguments, then ``RLS_*`` variables, then defaults) once.

    ``url`` only records where the client points (``from_url`` passes it); a client you bring
    yourself is used as it is.
    """

    @staticmethod
    def make_client(url: str, retry_s: float) -> Any:
        """Builds the client for a URL and a retry budget (see :mod:`.connection`)."""
        raise NotImplementedError

    @staticmethod
    def direct_calls(client: Any) -> Any:
        """The transport that sends packed calls past the client's per-command machinery, or
        None to use the client's own methods (see :mod:`.wire`)."""
        return None

    def __init__(
        self,
        client: Any,
        *,
        url: str | None = None,
        namespace: str | None = None,
        pending_ttl_s: float | None = None,
        task_ttl_s: float | None = None,
        max_slots: int | None = None,
        retry_s: float | None = None,
        wait_replicas: int | None = None,
        wait_timeout_ms: int | None = None,
        clock: Clock | None = None,
        observer: Observer | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.config = BufferConfig.resolve(
            env,
            url=url,
            namespace=namespace,
            pending_ttl_s=pending_ttl_s,
            task_ttl_s=task_ttl_s,
            max_slots=max_slots,
            retry_s=retry_s,
            wait_replicas=wait_replicas,
            wait_timeout_ms=wait_timeout_ms,
        )
        self.client = client
        self.protocol = Protocol(self.config, clock)
        self.observer = observer
        self._direct = self.direct_calls(client)
        self._allowed: set[str] = set()
        """The first key of each rank whose permissions were checked since the last reconnect
        (see :mod:`.permissions`)."""

    @classmethod
    def from_url(cls: type[B], url: str | None = None, **options: Any) -> B:
        """Connect by URL (``RLS_REDIS_URL``, default ``memory://``); see :mod:`.connection`."""
        config, passthrough = BufferConfig.for_url(url, options)
        return cls(cls.make_client(config.url, config.retry_s), **config.options(), **passthrough)
