"""A small fault-injecting TCP proxy for the tests: latency, a bandwidth cap, and a reset on demand.

toxiproxy is what we would reach for, but neither the Python nor the Debian registry carries its server,
so this is the part of it the AFD tests need. ``FaultProxy(listen, target)`` accepts on ``listen`` and
opens one connection to ``target`` per client; each direction is pumped by its own thread.

- ``latency_s``: every chunk is delivered that long after it was read (order kept, like a long wire).
- ``rate_bps``: at most that many bytes per second per direction (``None``: unlimited).
- ``reset()``: every open pair is cut with a TCP RST on both sides (``SO_LINGER`` 0), as a middlebox or a
  crashed host would; the proxy keeps accepting new connections.
- ``bytes_through``: bytes forwarded so far, per direction (``"up"``: client → target).

Loopback only, for tests; settings may change while connections are open.
"""

from __future__ import annotations

import collections
import socket
import struct
import threading
import time
from typing import Any

CHUNK = 64 * 1024


class FaultProxy:
    def __init__(self, listen: tuple[str, int], target: tuple[str, int], latency_s: float = 0.0,
                 rate_bps: float | None = None) -> None:
        self.target, self.latency_s, self.rate_bps = target, latency_s, rate_bps
        self.bytes_through = {"up": 0, "down": 0}
        self._server = socket.create_server(listen, backlog=64)
        self.address = self._server.getsockname()[:2]
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._accept, name="faultproxy-accept", daemon=True).start()

    def _accept(self) -> None:
        self._server.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except (TimeoutError, OSError):
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _rst(client)
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(None)
            with self._lock:
                self._pairs.append((client, upstream))
            for src, dst, name in ((client, upstream, "up"), (upstream, client, "down")):
                threading.Thread(target=self._pump, args=(src, dst, name), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, name: str) -> None:
        """Read from ``src``; hand chunks to a writer that delays and paces them to ``dst``."""
        queue: collections.deque[tuple[float, bytes]] = collections.deque()
        ready = threading.Condition()
        done = threading.Event()

        def write() -> None:
            while True:
                with ready:
                    while not queue and not done.is_set():
                        ready.wait()
                    if not queue:
                        break
                    due, data = queue.popleft()
                time.sleep(max(due - time.monotonic(), 0))
                for i in range(0, len(data), 4096 if self.rate_bps else len(data)):
                    piece = data[i : i + 4096] if self.rate_bps else data
                    try:
                        dst.sendall(piece)
                    except OSError:
                        return
                    self.bytes_through[name] += len(piece)
                    if self.rate_bps:
                        time.sleep(len(piece) / self.rate_bps)
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        while True:
            try:
                data = src.recv(CHUNK)
            except OSError:
                data = b""
            with ready:
                if data:
                    queue.append((time.monotonic() + self.latency_s, data))
                else:
                    done.set()
                ready.notify()
            if not data:
                return

    def reset(self) -> int:
        """Cut every open pair with a RST on both sides; how many pairs were cut."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for a, b in pairs:
            _rst(a)
            _rst(b)
        return len(pairs)

    def close(self) -> None:
        self._stop.set()
        self.reset()
        self._server.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _rst(s: socket.socket) -> None:
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    except OSError:
        pass
