"""Message paths between the simulated GPU side, the registrar and the senders.

In one process they are queues; across processes and hosts they are Redis lists in the
namespace (``rls:{ns/instance/rank}:sim:inbox``), emptied as they are read so nothing stays.
"""

from __future__ import annotations

import json
import queue
import time
from typing import Any, Protocol

from redis.exceptions import ClusterDownError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..constants import KEY_PREFIX
from ..protocol.keys import KeySpace

CHANNEL_TTL_MS = 3_600_000
"""A list nobody reads (a crashed registrar) disappears after an hour."""
FAILOVER_ERRORS = (RedisConnectionError, RedisTimeoutError, ClusterDownError)
"""What a stopped primary gives until its replica takes over (Sentinel or Cluster failover)."""
RESEND_S = 60.0
"""How long a message is resent through a failover before the error is raised."""
PAUSE_S = 0.2
REGISTRAR = ("registrar", 0)
"""The (instance, rank) whose hash tag holds the registrar's inbox."""

Message = dict[str, Any]


class Channel(Protocol):
    def put(self, message: Message) -> None: ...

    def get(self, timeout: float) -> Message | None: ...


class LocalChannel:
    """Threads of one process."""

    def __init__(self) -> None:
        self.queue: queue.Queue[Message] = queue.Queue()

    def put(self, message: Message) -> None:
        self.queue.put(message)

    def get(self, timeout: float) -> Message | None:
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None


def inbox_key(namespace: str, instance: str, rank: int, run: str = "") -> str:
    """A rank's (or, for REGISTRAR, the registrar's) inbox. A run of ``rls simulate`` names its
    own lists, so nothing left by an earlier run reaches it; ``rls node`` and ``rls registrar``
    meet on the shared one."""
    suffix = f":{run}" if run else ""
    return f"{KEY_PREFIX}:{KeySpace(namespace).rank(instance, rank).tag}:sim:inbox{suffix}"


class RedisChannel:
    """A Redis list: RPUSH to send, BLPOP (bounded) to receive."""

    def __init__(self, client: Any, key: str) -> None:
        self.client = client
        self.key = key

    def put(self, message: Message) -> None:
        """Sends, resending through a failover for up to RESEND_S."""
        data = json.dumps(message, separators=(",", ":"))
        deadline = time.monotonic() + RESEND_S
        while True:
            try:
                pipe = self.client.pipeline(transaction=False)
                pipe.rpush(self.key, data)
                pipe.pexpire(self.key, CHANNEL_TTL_MS)
                pipe.execute()
                return
            except FAILOVER_ERRORS:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(PAUSE_S)

    def get(self, timeout: float) -> Message | None:
        """The next message, or None after ``timeout`` or while a failover is under way."""
        try:
            reply = self.client.blpop([self.key], timeout=max(0.01, timeout))
        except FAILOVER_ERRORS:
            time.sleep(PAUSE_S)
            return None
        if reply is None:
            return None
        data: Message = json.loads(reply[1])
        return data
