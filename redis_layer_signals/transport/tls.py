"""What a ``rediss://`` connection says when TLS does not start.

The usual cause is a plain server (started without ``tls-port``): it reads the ClientHello as
a command and waits for the rest, so redis-py only reports ``Timeout connecting to server``.
The connection classes here raise a ``ConnectionError`` that names the server and says what to
check instead; the buffer's retry loop resends as after any connection error, and the
``BufferUnavailable`` it ends with carries this message, the original error as its cause.

A certificate the client refuses is not wrapped: that server speaks TLS, and the SSL error
already names the certificate.
"""

from __future__ import annotations

import asyncio
import inspect
import ssl
import time
from typing import Any

from redis.exceptions import ConnectionError

from .deadline import BACKSTOP_S, call_deadline

PLAIN_SERVER_HINT = "is the server started with TLS (tls-port)? use redis:// for a plain server"

CONNECT_LEAD_S = BACKSTOP_S + 0.02
"""An async TLS connect ends this long before its call's deadline (``call_deadline``, which is
``BACKSTOP_S`` past the resend loop's end), so that the loop ends with this module's error."""

_classes: dict[type[Any], type[Any]] = {}


def not_tls(error: BaseException) -> bool:
    """Whether ``error``, met while TLS was starting, points at a server that does not speak
    TLS: a timeout, or an SSL error other than a refused certificate."""
    if isinstance(error, ssl.SSLCertVerificationError):
        return False
    return isinstance(error, (ssl.SSLError, TimeoutError, asyncio.TimeoutError))


def handshake_failed(host: str, port: int, error: BaseException) -> ConnectionError:
    """The error a sync connection raises once TCP connected and the TLS handshake failed."""
    return ConnectionError(f"TLS handshake with {host}:{port} did not complete ({_said(error)}): {PLAIN_SERVER_HINT}")


def connect_failed(host: str, port: int, error: BaseException) -> ConnectionError:
    """The error an async connection raises: redis.asyncio connects and starts TLS in one
    step, so a timeout there may also be a host that does not answer at all."""
    return ConnectionError(
        f"connecting to {host}:{port} over TLS did not complete ({_said(error)}): {PLAIN_SERVER_HINT}"
    )


def _said(error: BaseException) -> str:
    return str(error) or type(error).__name__


def hinting(connection_class: type[Any]) -> type[Any]:
    """``connection_class`` (redis-py's sync or async TLS connection) raising the errors above
    (one subclass per class)."""
    cached = _classes.get(connection_class)
    if cached is not None:
        return cached
    if inspect.iscoroutinefunction(connection_class._connect):

        async def _connect(self: Any) -> Any:
            ends = call_deadline.get()
            if ends is None:
                connect = super(hinted, self)._connect()
            else:  # give up a little before the call does, so that the call reports why
                ssl_context = getattr(self, "ssl_context", None)
                if ssl_context is not None:  # built now (it blocks while it reads the CA bundle),
                    ssl_context.get()  # so that the timer below only times the network
                left = ends - CONNECT_LEAD_S - time.monotonic()
                if left <= 0:
                    raise TimeoutError("too near the call's deadline to connect")
                connect = asyncio.wait_for(super(hinted, self)._connect(), left)
            try:
                return await connect
            except Exception as exc:
                if not_tls(exc):
                    raise connect_failed(self.host, self.port, exc) from exc
                raise

        members: dict[str, Any] = {"_connect": _connect}
    else:

        def _wrap_socket_with_ssl(self: Any, sock: Any) -> Any:
            try:
                return super(hinted, self)._wrap_socket_with_ssl(sock)
            except OSError as exc:
                if not_tls(exc):
                    raise handshake_failed(self.host, self.port, exc) from exc
                raise

        def _build_ssl_context(self: Any) -> Any:
            # redis-py shares a context only while a socket holds it: after a failed handshake
            # none does, and each reconnect would load the CA bundle again (0.1 s and more,
            # outside the call's deadline). The connection keeps the one it built.
            context = super(hinted, self)._build_ssl_context()
            self._rls_ssl_context = context
            return context

        members = {"_wrap_socket_with_ssl": _wrap_socket_with_ssl, "_build_ssl_context": _build_ssl_context}
    hinted: type[Any] = type(
        f"Hinting{connection_class.__name__}", (connection_class,), {**members, "__module__": __name__}
    )
    _classes[connection_class] = hinted
    return hinted
