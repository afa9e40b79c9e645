"""Missing ACL permissions, found before a function writes anything.

A Lua function that meets a command its caller may not run stops there, and what it wrote
before stays written. So before a buffer's first call on a rank (and again after every
reconnect, since a resend may reach another node), it calls ``rls_v2_permissions`` with the
rank's keys, which asks the server (``redis.acl_check_cmd``) about every command the rank's
functions may run, and a refused one raises ``NoPermissionError`` before any write. The
answer is kept per rank, so the calls after the first cost nothing more.

What this cannot cover: a permission taken away from a user while its buffers run (``ACL
SETUSER`` does not close the user's connections) is found only by the function that meets it.
Remove permissions with the clients stopped, or with ``ACL DELUSER``, which closes them.
"""

from __future__ import annotations

import re

from redis.exceptions import NoPermissionError as ServerRefused

from ..errors import NoPermissionError
from ..protocol.replies import text

__all__ = ["ServerRefused", "from_server", "refused"]

_COMMAND = re.compile(r"run the '([^']+)' command")


def refused(operation: str, reply: bytes | str) -> NoPermissionError | None:
    """The error for ``rls_v2_permissions``' reply, or None when everything is allowed."""
    message = text(reply)
    if not message:
        return None
    command, _, key = message.partition(" ")
    return NoPermissionError(operation, command, f"on {key}" if key else "")


def from_server(operation: str, error: ServerRefused, sent: str) -> NoPermissionError:
    """Our error for a server's NOPERM: it names the refused command when the server does
    (``this user has no permissions to run the 'hset' command``), else ``sent``, the command
    the client sent (a refused key is reported without one)."""
    match = _COMMAND.search(str(error))
    command = match.group(1).lower() if match else sent
    return NoPermissionError(operation, command, str(error))
