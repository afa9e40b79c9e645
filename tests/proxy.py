"""A TCP proxy on loopback for the tests, between a client and one server, that can make the
server's replies trickle (one byte at a time, every ``trickle_s``), stop halfway through a
reply, or vanish (a black hole: bytes kept, nothing sent on). Requests always go through."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

PASS, TRICKLE, HALF, BLACK_HOLE = "pass", "trickle", "half", "black_hole"


class Proxy:
    def __init__(self, upstream_port: int, trickle_s: float = 0.3) -> None:
        self.upstream_port = upstream_port
        self.trickle_s = trickle_s
        self.mode = PASS
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._listener], [], [], 0.05)
            if not ready:
                continue
            client, _ = self._listener.accept()
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._sockets += [client, server]
            for target in (self._requests, self._replies):
                thread = threading.Thread(target=target, args=(client, server), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _requests(self, client: socket.socket, server: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                ready, _, _ = select.select([client], [], [], 0.05)
                if ready:
                    data = client.recv(65536)
                    if not data:
                        return
                    server.sendall(data)

    def _replies(self, client: socket.socket, server: socket.socket) -> None:
        held = b""
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                ready, _, _ = select.select([server], [], [], 0.05)
                if ready:
                    data = server.recv(65536)
                    if not data:
                        client.close()
                        return
                    held += data
                mode = self.mode
                if mode == PASS and held:
                    client.sendall(held)
                    held = b""
                elif mode == TRICKLE and held:
                    client.sendall(held[:1])
                    held = held[1:]
                    time.sleep(self.trickle_s)
                elif mode == HALF and held:
                    client.sendall(held[: max(1, len(held) // 2)])
                    held = b""
                    self.mode = BLACK_HOLE  # the rest never comes

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2)
        for sock in (*self._sockets, self._listener):
            with contextlib.suppress(OSError):
                sock.close()
