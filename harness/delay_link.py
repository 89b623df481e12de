"""A TCP relay on loopback that delivers every byte a set one-way delay after it arrived: a link of D ms for the
benchmarks and tests (not part of AFD, not a config key).

Why a relay: this kernel has no netem, and a delay inside the connector would be a second send path in the product.
The attention side is given the relay's port instead of the FFN's (the port is not among the settings the handshake
compares), so the whole session goes through it: the authenticated handshake, the tensors, the keep-alives.

How: per accepted connection the relay connects to ``upstream`` and runs two threads per direction. The reader takes
what arrives (``recv``, up to 1 MiB) and queues it stamped ``arrival + delay_s``; the writer sends each chunk once
its time has come (``Condition.wait`` with a timeout: a futex, so the wake-up is late by the kernel's timer slack,
about 50 µs, plus a thread switch). The sender is never blocked by the delay: its bytes leave its socket at once and
wait here, and several messages are in flight at a time, as on a long wire. Order is kept (one queue per
direction, sent first in, first out: a chunk stamped earlier than the one ahead of it, after ``delay_s`` was
lowered, waits for it). With ``delay_s`` 0 the reader sends itself whenever nothing is queued: one ``recv`` and one
``send`` per chunk, no thread hand-over.

``delay_s`` may change while connections are open (the benchmarks step D on engines started once); a chunk keeps the
stamp it got on arrival. ``stats()`` tells how many chunks went through and the least time one was held, so a test
can show the delay was applied.

Run alone: ``python -m harness.delay_link --upstream HOST:PORT [--delay-ms D]`` prints ``port N`` once it listens on
127.0.0.1, then takes one number per line on stdin (the new delay in ms, answered ``delay D``) until stdin ends.

Limits: loopback only; a fixed delay, no jitter, loss or bandwidth limit; a connection's two halves close together
(when either side closes, both sockets of the pair are shut down); the relay's own CPU (a few tens of µs per chunk in
Python) runs on the same machine as the engines.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

HOST = "127.0.0.1"
CHUNK = 1 << 20


class _Direction:
    """One direction of one connection: reader and writer threads around a queue of stamped chunks."""

    def __init__(self, relay: DelayLink, src: socket.socket, dst: socket.socket, name: str) -> None:
        self.relay, self.src, self.dst = relay, src, dst
        self.queue: collections.deque[tuple[float, float, bytes]] = collections.deque()
        self.cond = threading.Condition()
        self.closed = False
        for target, role in ((self._read, "read"), (self._write, "write")):
            threading.Thread(target=target, name=f"delay-link-{name}-{role}", daemon=True).start()

    def _read(self) -> None:
        try:
            while data := self.src.recv(CHUNK):
                arrived, delay = time.monotonic(), self.relay.delay_s
                with self.cond:
                    if not delay and not self.queue:
                        self.relay.count(0.0)
                        self.dst.sendall(data)
                        continue
                    self.queue.append((arrived, arrived + delay, data))
                    self.cond.notify()
        except OSError:
            pass
        finally:
            with self.cond:
                self.closed = True
                self.cond.notify()

    def _write(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.closed:
                        self.cond.wait()
                    if not self.queue:
                        break
                    arrived, due, data = self.queue[0]
                    now = time.monotonic()
                    if now < due:
                        self.cond.wait(due - now)
                        continue
                    self.queue.popleft()
                    self.relay.count(now - arrived)
                    self.dst.sendall(data)  # under the lock: the reader's direct send keeps its place in line
        except OSError:
            pass
        finally:
            for sock in (self.src, self.dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class DelayLink:
    """Listens on 127.0.0.1 (``port``) and relays each connection to ``upstream`` with ``delay_s`` each way."""

    def __init__(self, upstream: tuple[str, int], delay_s: float = 0.0) -> None:
        self.upstream, self.delay_s = upstream, delay_s
        self._listener = socket.create_server((HOST, 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._chunks, self._least_held = 0, float("inf")
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="delay-link-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, server]
            _Direction(self, client, server, "up")
            _Direction(self, server, client, "down")

    def count(self, held_s: float) -> None:
        """A chunk went through, ``held_s`` after it arrived."""
        with self._lock:
            self._chunks += 1
            self._least_held = min(self._least_held, held_s)

    def stats(self) -> tuple[int, float]:
        """(chunks relayed, the least seconds one was held) so far."""
        with self._lock:
            return self._chunks, self._least_held

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


class RelayProcess:
    """A ``DelayLink`` in a process of its own (``python -m harness.delay_link``), so that its threads do not share
    a GIL with the caller's; ``set_delay`` changes its delay while it runs."""

    def __init__(self, upstream: tuple[str, int], delay_s: float = 0.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "harness.delay_link", "--upstream", f"{upstream[0]}:{upstream[1]}",
             "--delay-ms", repr(delay_s * 1000)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdin and self.proc.stdout
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        line = self._stdout.readline()
        if not line.startswith("port "):
            self.stop()
            raise RuntimeError(f"the delay relay did not start: {line!r}")
        self.port = int(line.split()[1])

    def set_delay(self, delay_s: float) -> None:
        self._stdin.write(f"{delay_s * 1000!r}\n")
        self._stdin.flush()
        if not self._stdout.readline().startswith("delay "):
            raise RuntimeError("the delay relay did not take the new delay")

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@contextlib.contextmanager
def echo_server() -> Iterator[tuple[str, int]]:
    """An echo server on 127.0.0.1 for as long as the context lasts (threads); its address."""
    server = socket.create_server((HOST, 0))

    def echo(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with contextlib.suppress(OSError):
                while data := conn.recv(65536):
                    conn.sendall(data)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=echo, args=(server.accept()[0],), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()
    finally:
        server.close()


def round_trip(sock: socket.socket, payload: bytes) -> float:
    """Seconds ``payload`` takes through ``sock`` to an echo server and back; ``ValueError`` if other bytes come
    back."""
    start = time.perf_counter()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        if not (chunk := sock.recv(len(payload) - len(got))):
            raise ValueError("the connection closed before the echo came back")
        got += chunk
    if got != payload:
        raise ValueError("the echo came back with other bytes than were sent")
    return time.perf_counter() - start


def _median_round_trip(port: int, pings: int) -> float:
    """The median seconds 64 bytes take to 127.0.0.1:``port`` and back."""
    with socket.create_connection((HOST, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sorted(round_trip(sock, b"x" * 64) for _ in range(pings))[pings // 2]


def relay_cost(delays: list[float], pings: int = 300) -> dict[float, float]:
    """What a ``RelayProcess`` adds one way at each delay of ``delays`` (s): half the median round trip through it to
    an echo server, less the round trip without it. Key -1: the round trip without it."""
    with echo_server() as address:
        direct = _median_round_trip(address[1], pings)
        out = {-1.0: direct}
        relay = RelayProcess(address)
        try:
            for delay in delays:
                relay.set_delay(delay)
                out[delay] = (_median_round_trip(relay.port, pings) - direct) / 2
        finally:
            relay.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="HOST:PORT to relay to")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    args = parser.parse_args()
    host, _, port = args.upstream.rpartition(":")
    link = DelayLink((host, int(port)), args.delay_ms / 1000)
    print(f"port {link.port}", flush=True)
    for line in sys.stdin:
        link.delay_s = float(line) / 1000
        print(f"delay {float(line):g}", flush=True)
    link.close()


if __name__ == "__main__":
    main()
