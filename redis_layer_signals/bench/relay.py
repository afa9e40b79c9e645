"""A TCP relay that delays every chunk: a link with a one-way latency, for the benchmarks
(a slow link to Redis) and the simulated hosts (a slow path between two of them).

Each chunk read from one side is written to the other ``delay_s`` later, in order, both ways.
Closing the relay shuts its sockets, which wakes the threads blocked on them.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any


def _daemon(target: Callable[[], None]) -> Any:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


class DelayRelay:
    """Relays each connection ``listener`` accepts to ``target``, ``delay_s`` late each way.
    ``start`` runs the accepting loop (on a thread of a simulated host, say); the relayed
    connections' threads are its own."""

    def __init__(
        self,
        listener: socket.socket,
        target: tuple[str, int],
        delay_s: float,
        start: Callable[[Callable[[], None]], Any] = _daemon,
    ) -> None:
        self.listener = listener
        self.target = target
        self.delay_s = delay_s
        self.closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self.listener.settimeout(0.2)  # the accepting loop sees ``close`` within this
        self.port = int(self.listener.getsockname()[1])
        start(self._accept)

    @classmethod
    def on_loopback(cls, target_port: int, delay_s: float) -> DelayRelay:
        """A relay on 127.0.0.1 to a local server's port."""
        return cls(socket.create_server(("127.0.0.1", 0)), ("127.0.0.1", target_port), delay_s)

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                inbound, _ = self.listener.accept()
            except OSError:
                continue
            try:
                outbound = socket.create_connection(self.target, timeout=5)
            except OSError:
                inbound.close()
                continue
            inbound.settimeout(None)
            outbound.settimeout(None)
            self._sockets += [inbound, outbound]
            for source, sink in ((inbound, outbound), (outbound, inbound)):
                held: queue.Queue[tuple[float, bytes]] = queue.Queue()
                threading.Thread(target=self._read, args=(source, held), daemon=True).start()
                threading.Thread(target=self._write, args=(sink, held), daemon=True).start()

    def _read(self, source: socket.socket, held: queue.Queue[tuple[float, bytes]]) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                held.put((time.monotonic() + self.delay_s, data))
        held.put((0.0, b""))

    def _write(self, sink: socket.socket, held: queue.Queue[tuple[float, bytes]]) -> None:
        with contextlib.suppress(OSError):
            while True:
                due, data = held.get()
                if not data:
                    break
                time.sleep(max(0.0, due - time.monotonic()))
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.closed.set()
        for sock in [self.listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the threads blocked reading it
            with contextlib.suppress(OSError):
                sock.close()
