"""Clients from URLs. The scheme picks the topology:

``memory://[NAME]`` an in-process fakeredis server with Lua (one per NAME, shared by every
buffer of the process); ``redis://``, ``rediss://`` (TLS) and ``unix://`` one server;
``redis+sentinel://[user:pass@]host:port[,host:port]/service[?db=N]`` the primary Sentinel names;
``redis+cluster://[user:pass@]host:port[,host:port]`` a Redis Cluster.

Clients made here answer in bytes, time out after ``retry_s`` and do not retry internally:
the buffer's own retry loop owns the time bound and the idempotency tokens. Sync clients'
sockets also wait at most until the deadline of the call in progress (``deadline``).

Sentinel: after ``SENTINEL FAILOVER`` the old primary keeps accepting writes until the
sentinels reconfigure it (up to about 10 s later), and those writes are lost when it becomes a
replica. A primary run with ``min-replicas-to-write 1`` refuses them (``NOREPLICAS``) instead;
the sentinel connections made here turn that refusal, like ``READONLY``, into a reconnect that
asks the sentinels for the primary again, so the resent call reaches the new one.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from redis.exceptions import ConnectionError, ResponseError

from ..errors import InvalidConfig
from . import routing, tls
from .deadline import with_deadline

MEMORY = "memory"
SINGLE_SCHEMES = ("redis", "rediss", "unix")
SENTINEL = "redis+sentinel"
CLUSTER = "redis+cluster"

_memory_servers: dict[str, Any] = {}
_memory_lock = threading.Lock()


@dataclass(frozen=True)
class MultiHostUrl:
    """A sentinel or cluster URL: several seed hosts, optional credentials and a path."""

    scheme: str
    hosts: list[tuple[str, int]]
    username: str | None = None
    password: str | None = None
    path: str = ""
    query: dict[str, list[str]] = field(default_factory=dict)


def scheme_of(url: str) -> str:
    if "://" not in url:
        raise InvalidConfig("url", shown(url), "must look like scheme://...")
    return url.split("://", 1)[0].lower()


def shown(url: str) -> str:
    """``url`` as an error may show it: its password, if any, replaced by ``***``."""
    userinfo, at, rest = url.partition("://")[2].rpartition("@")
    if not at or ":" not in userinfo:
        return url
    scheme = url.partition("://")[0]
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{rest}"


_DATABASE = re.compile(r"[0-9]+")


def check_database(url: str, scheme: str) -> None:
    """Refuse, before any connection, a database the URL gives that is not a number of 0 or
    more: redis-py reads ``redis://host:port/abc`` as database 0 and says nothing. It is the
    path of ``redis://`` and ``rediss://``, or ``?db=`` (also on ``unix://`` and
    ``redis+sentinel://``, whose path is the service); a Cluster has database 0 only."""
    parts = urlsplit(url)
    given: list[tuple[str, str]] = []
    if scheme in ("redis", "rediss", CLUSTER):
        path = unquote(parts.path).strip("/")
        if path:
            given.append(("the path", path))
    given.extend(("?db=", value) for value in parse_qs(parts.query).get("db", []))
    example = "redis+cluster://host:port" if scheme == CLUSTER else "redis://host:port/0 or ?db=0"
    for where, text in given:
        if _DATABASE.fullmatch(text) is None:
            why = f"database {text!r} ({where}) must be a number, 0 or more, as in {example}"
            raise InvalidConfig("url", shown(url), why)
        if scheme == CLUSTER and int(text) != 0:
            why = f"database {text!r} ({where}): a Redis Cluster has database 0 only, so give none"
            raise InvalidConfig("url", shown(url), why)


def parse_multi_host(url: str) -> MultiHostUrl:
    scheme, rest = url.split("://", 1)
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    username = password = None
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, has_password, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if has_password else None
    hosts = []
    for item in filter(None, netloc.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidConfig("url", shown(url), f"host {item!r} must be host:port")
        hosts.append((host.strip("[]"), int(port)))
    if not hosts:
        raise InvalidConfig("url", shown(url), "needs at least one host:port")
    return MultiHostUrl(scheme.lower(), hosts, username, password, path.strip("/"), parse_qs(query))


NOREPLICAS = "NOREPLICAS"
"""Error prefix of a write refused by ``min-replicas-to-write``: not (or no longer) a safe primary."""


class NotPrimaryAnymore(ConnectionError):
    """The sentinel-named primary refused a write (NOREPLICAS): ask the sentinels again."""


def _refused_by_old_primary(error: BaseException, is_master: bool) -> bool:
    return is_master and str(error).startswith(NOREPLICAS)


def memory_server(name: str) -> Any:
    import fakeredis

    with _memory_lock:
        server = _memory_servers.get(name)
        if server is None:
            server = fakeredis.FakeServer()
            _memory_servers[name] = server
        return server


def _timeouts(retry_s: float) -> dict[str, Any]:
    return {"socket_timeout": retry_s, "socket_connect_timeout": min(retry_s, 2.0)}


def sync_client(url: str, retry_s: float) -> Any:
    """A redis-py (or fakeredis) client for ``url``."""
    return _client(url, retry_s, is_async=False)


def async_client(url: str, retry_s: float) -> Any:
    """A redis.asyncio (or fakeredis async) client for ``url``."""
    return _client(url, retry_s, is_async=True)


def _client(url: str, retry_s: float, is_async: bool) -> Any:
    """One recipe for both flavours: redis-py mirrors its sync modules under ``redis.asyncio``."""
    scheme = scheme_of(url)
    if scheme == MEMORY:
        import fakeredis

        fake: Any = fakeredis.FakeAsyncRedis if is_async else fakeredis.FakeRedis
        return fake(server=memory_server(url.split("://", 1)[1]))
    check_database(url, scheme)
    package = "redis.asyncio" if is_async else "redis"
    from redis.backoff import NoBackoff

    no_retry = import_module(f"{package}.retry").Retry(NoBackoff(), 0)
    if scheme in SINGLE_SCHEMES:
        try:
            client = import_module(package).Redis.from_url(url, retry=no_retry, **_timeouts(retry_s))
        except ValueError as exc:  # a port or query argument redis-py cannot read
            raise InvalidConfig("url", shown(url), str(exc)) from exc
        if scheme == "rediss":  # a failed handshake says the server may not speak TLS (tls.py)
            client.connection_pool.connection_class = tls.hinting(client.connection_pool.connection_class)
        if not is_async:  # each socket operation bounded by the call's deadline (deadline.py)
            client.connection_pool.connection_class = with_deadline(client.connection_pool.connection_class)
        return client
    if scheme == CLUSTER:
        cluster = import_module(f"{package}.cluster")
        parsed = parse_multi_host(url)
        client = cluster.RedisCluster(
            startup_nodes=[cluster.ClusterNode(host, port) for host, port in parsed.hosts],
            username=parsed.username,
            password=parsed.password,
            retry=no_retry,  # MOVED/ASK are still followed; errors come back to the buffer's loop
            **_timeouts(retry_s),
        )
        if not is_async:
            _bound_cluster_nodes(client)
            routing.refresh_in_background(client)  # no refresh on a caller's thread
        return client
    if scheme == SENTINEL:
        parsed = parse_multi_host(url)
        service, db = _sentinel_target(url, parsed)
        # The sentinels' own clients must not retry either: redis-py's default (10 retries,
        # backoff up to 10 s between them) held a call 56 s asking sentinels a split cut off.
        sentinel = import_module(f"{package}.sentinel").Sentinel(
            parsed.hosts, sentinel_kwargs={**_timeouts(retry_s), "retry": no_retry}, **_timeouts(retry_s)
        )
        connection_class = _async_primary_connection() if is_async else with_deadline(_sync_primary_connection())
        if not is_async:  # asking the sentinels is bounded by the call's deadline too
            for asked in sentinel.sentinels:
                asked.connection_pool.connection_class = with_deadline(asked.connection_pool.connection_class)
        return sentinel.master_for(
            service,
            db=db,
            retry=no_retry,
            connection_class=connection_class,
            username=parsed.username,
            password=parsed.password,
        )
    raise InvalidConfig("url", shown(url), f"unknown scheme {scheme!r}")


def _bound_pool(redis_client: Any) -> Any:
    """Give ``redis_client``'s pool connections bounded by the call's deadline; the ones it
    made already (the cluster client's first CLUSTER SLOTS) are dropped, not closed."""
    pool = redis_client.connection_pool
    pool.connection_class = with_deadline(pool.connection_class)
    pool.reset()
    return redis_client


def _bound_cluster_nodes(client: Any) -> None:
    """A sync Cluster client makes one plain client per node, for the nodes it knows and for
    each it learns of later; all of them get bounded connections (see ``deadline``)."""
    manager = client.nodes_manager
    for node in client.get_nodes():
        if node.redis_connection is not None:
            _bound_pool(node.redis_connection)
    create = manager.create_redis_node

    def create_bounded(host: str, port: int, **kwargs: Any) -> Any:
        return _bound_pool(create(host, port, **kwargs))

    manager.create_redis_node = create_bounded


def _sync_primary_connection() -> type[Any]:
    """redis-py's sentinel connection, also reconnecting when the primary refuses (NOREPLICAS)."""
    from redis.sentinel import SentinelManagedConnection

    class PrimaryConnection(SentinelManagedConnection):
        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().read_response(*args, **kwargs)
            except ResponseError as exc:
                if not _refused_by_old_primary(exc, self.connection_pool.is_master):
                    raise
                self.disconnect()  # type: ignore[no-untyped-call]
                raise NotPrimaryAnymore(f"the primary refused a write, asking the sentinels again: {exc}") from exc

    return PrimaryConnection


def _async_primary_connection() -> type[Any]:
    from redis.asyncio.sentinel import SentinelManagedConnection

    class AsyncPrimaryConnection(SentinelManagedConnection):
        async def read_response(self, *args: Any, **kwargs: Any) -> Any:
            try:
                return await super().read_response(*args, **kwargs)
            except ResponseError as exc:
                if not _refused_by_old_primary(exc, self.connection_pool.is_master):
                    raise
                await self.disconnect()
                raise NotPrimaryAnymore(f"the primary refused a write, asking the sentinels again: {exc}") from exc

    return AsyncPrimaryConnection


def _sentinel_target(url: str, parsed: MultiHostUrl) -> tuple[str, int]:
    service = parsed.path.split("/")[0]
    if not service:
        raise InvalidConfig("url", shown(url), "a sentinel URL names its service: redis+sentinel://h:p/service")
    return service, int(parsed.query.get("db", ["0"])[0])  # a number: check_database
