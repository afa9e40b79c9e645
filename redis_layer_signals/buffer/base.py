"""What the sync and async buffers share: options, protocol and hooks. Only the
transport (a redis-py client or a redis.asyncio one) differs between the two subclasses."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..config import BufferConfig
from ..protocol.calls import Clock, Protocol
from ..server.checks import ServerChecks
from .owed import OwedFinishes

Observer = Callable[[str, float], None]
"""Called with (operation, seconds) after each successful call: the metrics hook."""

if TYPE_CHECKING:  # typing.Self is Python 3.11+; the annotation is never evaluated at run time
    from typing_extensions import Self


class BufferBase:
    """Resolves the options (arguments, then ``RLS_*`` variables, then defaults) once.

    Build a buffer with ``from_url`` (it makes the client), or on a redis-py client you bring
    yourself, which is used as it is.
    """

    @staticmethod
    def make_client(url: str, retry_s: float) -> Any:
        """Builds the client for a URL and a retry budget (see ``connection``)."""
        raise NotImplementedError

    @staticmethod
    def sender_for(client: Any, checks: ServerChecks, wait_replicas: int, wait_timeout_ms: int) -> Any:
        """How this buffer's calls reach the server, chosen once (see ``transport.senders``)."""
        raise NotImplementedError

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
        max_layers: int | None = None,
        eviction: str | None = None,
        clock: Clock | None = None,
        observer: Observer | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Build a buffer on ``client``; each option left ``None`` falls back to its ``RLS_*``
        environment variable, then to its default.

        Args:
            client: A ``redis.Redis``, ``RedisCluster`` or Sentinel-managed client (for
                [`AsyncSignalBuffer`][redis_layer_signals.AsyncSignalBuffer], their
                ``redis.asyncio`` counterparts).
            url: Where the client points, for logs and ``rls`` only (``from_url`` passes it).
            namespace: Isolates deployments sharing one Redis: ``[A-Za-z0-9._-]{1,128}``
                (``RLS_NAMESPACE``, default ``default``).
            pending_ttl_s: How long an early signal waits for its task, in seconds
                (``RLS_PENDING_TTL_S``, default 60).
            task_ttl_s: Lease of a registered task, in seconds (``RLS_TASK_TTL_S``, default 900,
                FastDeploy's scheduler TTL).
            max_slots: Engine slots per rank; a slot must be below it (``RLS_MAX_SLOTS``, default 512).
            retry_s: How long a call resends after a lost reply or a connection error before it
                raises [`BufferUnavailable`][redis_layer_signals.BufferUnavailable]
                (``RLS_RETRY_S``, default 3).
            wait_replicas: Replicas that must confirm each ``record`` and ``register`` (``WAIT``);
                0 waits for none (``RLS_WAIT_REPLICAS``, default 0).
            wait_timeout_ms: How long one ``WAIT`` blocks before the call is resent
                (``RLS_WAIT_TIMEOUT_MS``, default 100).
            clock: Milliseconds since the epoch, instead of the server's ``TIME`` (tests and
                simulations).
            observer: Called with ``(operation, seconds)`` after each successful call, e.g.
                [`BufferMetrics.observe`][redis_layer_signals.metrics.BufferMetrics.observe].
            env: The variables to read instead of ``os.environ`` (``{}`` reads none).

        Raises:
            redis_layer_signals.InvalidConfig: An option out of range, or a variable that does not parse; it names
                the option and the value.
        """
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
            max_layers=max_layers,
            eviction=eviction,
        )
        self.client = client
        self.protocol = Protocol(self.config, clock)
        self.observer = observer
        self.checks = ServerChecks(self.config.eviction, self.config.wait_replicas, self.protocol.permissions)
        """What the buffer learned of its servers before its first write (see ``server.checks``)."""
        self.sender = self.sender_for(client, self.checks, self.config.wait_replicas, self.config.wait_timeout_ms)
        """How calls reach the server, chosen once for the client (see ``transport.senders``)."""
        self.owed = OwedFinishes(limit=self.config.max_slots)
        """Finishes that raised BufferUnavailable, sent again before the next call on their rank."""

    @property
    def policies(self) -> dict[str, str]:
        """Each server's maxmemory-policy as last read (see ``eviction``)."""
        return self.checks.policies

    @property
    def durability(self) -> dict[str, dict[str, str]]:
        """Each server's settings that decide what a restart or failover loses, as last read
        with the policy (see ``durability``)."""
        return self.checks.durability

    @classmethod
    def from_url(cls, url: str | None = None, **options: Any) -> Self:
        """Connect by URL and build the buffer; options as for the constructor.

        Args:
            url: ``memory://[name]`` (embedded fakeredis, the default), ``redis://``,
                ``rediss://`` (TLS), ``unix://``, ``redis+sentinel://host:port[,host:port]/service``
                or ``redis+cluster://host:port[,host:port]``; ACL user and password in the URL.
                ``None`` reads ``RLS_REDIS_URL``.
            **options: Any keyword option of the constructor: ``namespace``,
                ``pending_ttl_s``, ``task_ttl_s``, ``max_slots``, ``retry_s``,
                ``wait_replicas``, ``wait_timeout_ms``, ``clock``, ``observer``, ``env``.

        Raises:
            redis_layer_signals.InvalidConfig: A bad URL, an unknown option or one out of range.

        Example:
            ```python
            buf = SignalBuffer.from_url("redis://10.0.0.5:6379/0", namespace="prod", retry_s=5)
            ```
        """
        config, passthrough = BufferConfig.for_url(url, options)
        buffer = cls(cls.make_client(config.url, config.retry_s), **config.options(), **passthrough)
        buffer.config = config  # the same options, and whether the URL was left to the default
        return buffer
