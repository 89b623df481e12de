"""``backend: tcp``: the AFD tensor traffic on the sessions' own sockets, one per FFN/attention pair.

Why
    On CPU the exchange is a few kilobytes per layer, so its cost is thread wake-ups, not bytes. Here the
    thread that waits reads the socket itself: one wake-up per message on the receiving side, none on the
    sending side (figures: docs/benchmarks.md).

Where the sockets come from
    Each link is the socket of an authenticated session (``afd_patches.connectors.session``): the
    rendezvous session itself for attention ranks served by FFN rank 0, a data session with their FFN rank
    for the others (``afd_patches.connectors.rendezvous``). No address is read from anywhere an
    unauthenticated party can write: there is no store on this backend.

Stream
    A message is the header (``wire.HEADER_BYTES``) followed by its payload; each pair's stream keeps
    order, so there are no tags. ``KIND_PING`` headers are keep-alives: every ``ping_s`` a thread sends
    one to each peer this rank has sent nothing to for that long, and a reader skips them. A wait for a
    header ends with ``PeerSilent`` when nothing at all (data or ping) came from that peer for ``alive_s``,
    whatever the wait's own bound (an FFN rank waits for the next step of an idle group for a week, but
    notices a frozen attention rank within ``alive_s``), with ``LinkClosed`` when the peer's socket closed,
    and with ``LinkTimeout`` at the wait's own bound. Silence is judged only after taking what already sits
    in the socket: a side that did not read for a while (an idle attention engine reads only inside an
    exchange) finds its peer's keep-alives there and counts the peer as heard from now.

Drops (``schedule: batched``)
    ``drop`` sends a rank that missed a step a ``KIND_DROP`` header and closes its link; ``add`` gives it a
    new link once it re-joined the live group (``afd_patches.connectors.rendezvous.Rejoins``).

Limits
    Host memory only (the connector moves a CUDA tensor first). Sends are synchronous, bounded by
    ``alive_s`` (a peer that stops reading fails them). The stream after the session is not MAC'd or
    encrypted (SECURITY.md). An idle pair wakes once per ``ping_s`` on each side.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time

import torch

from afd_patches.connectors import wire
from afd_patches.connectors.transport import (
    DONE,
    Handle,
    LinkClosed,
    LinkInterrupted,
    LinkTimeout,
    PeerSilent,
    Transport,
)

_PING = wire.pack(wire.KIND_PING)


def _view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class TcpTransport(Transport):
    """``socks`` maps each peer's global rank to its session socket and the bytes already read past the
    session's last message."""

    def __init__(self, socks: dict[int, tuple[socket.socket, bytes]], alive_s: float, ping_s: float) -> None:
        self.alive_s, self.ping_s = alive_s, ping_s
        self._rx: dict[int, socket.socket] = {}
        self._carry: dict[int, bytearray] = {}
        self._tx: dict[int, socket.socket] = {}  # a dup of the link: its own timeout for sends
        self._locks = {peer: threading.Lock() for peer in socks}
        self._heard: dict[int, float] = {}
        self._sent: dict[int, float] = {}
        self._ready: dict[int, wire.Header] = {}
        self._partial: dict[int, bytearray] = {}  # the bytes of a header taken so far (``first``)
        self._begun: dict[int, float] = {}  # when that header's first byte came
        self._interrupted: set[int] = set()
        for peer, (sock, buf) in socks.items():
            self._attach(peer, sock, buf)
        self._stop = threading.Event()
        self._pinger = threading.Thread(target=self._ping_loop, name="afd-tcp-ping", daemon=True)
        self._pinger.start()

    # ------------------------------------------------------------------ sending
    def send(self, peer: int, words: list[int], tensor: torch.Tensor | None) -> Handle:
        parts = [memoryview(wire.HEADER.pack(*words))]
        if tensor is not None and tensor.numel():
            parts.append(_view(tensor))
        self._write(peer, parts, self.alive_s, blocking=True)
        return DONE

    def _write(self, peer: int, views: list[memoryview], budget: float, blocking: bool) -> bool:
        lock = self._locks[peer]
        if not lock.acquire(timeout=budget if blocking else 0):
            if blocking:
                raise LinkTimeout(peer, f"send to global rank {peer}: another send held the link for {budget:g}s")
            return False
        try:
            sock, deadline = self._tx[peer], time.monotonic() + budget
            while views:
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                sent = sock.sendmsg(views)
                while views and sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                if views and sent:
                    views[0] = views[0][sent:]
            self._sent[peer] = time.monotonic()
        except TimeoutError:
            raise LinkTimeout(peer, f"send to global rank {peer} did not complete within {budget:g}s") from None
        except OSError as e:
            raise self._closed(peer, e) from None
        finally:
            lock.release()
        return True

    def _ping_loop(self) -> None:
        while not self._stop.wait(self.ping_s):
            now = time.monotonic()
            for peer, last in list(self._sent.items()):
                if now - last >= self.ping_s and peer not in self._interrupted:
                    try:
                        self._write(peer, [memoryview(_PING)], self.alive_s, blocking=False)
                    except (LinkTimeout, LinkClosed, LinkInterrupted):
                        pass  # the reader of that link reports it

    # ---------------------------------------------------------------- receiving
    def next_header(self, peer: int, timeout_s: float) -> wire.Header:
        """``peer``'s next header other than a keep-alive; once its first byte came, the rest must come within
        ``alive_s`` (``LinkTimeout``), whatever ``timeout_s``."""
        ready = self._ready.pop(peer, None)
        if ready is not None:
            return ready
        deadline = time.monotonic() + timeout_s
        while True:
            buf = bytearray(wire.HEADER_BYTES)
            view = memoryview(buf)
            partial = self._partial.pop(peer, None)
            if partial:  # begun in ``first``
                got, begun = len(partial), self._begun.pop(peer)
                view[:got] = partial
            else:
                got = self._read_into(peer, view, deadline, least=1)
                begun = self._heard[peer]  # when those bytes came
            if got < wire.HEADER_BYTES:
                self._read_into(peer, view[got:], min(deadline, begun + self.alive_s), header=True)
            header = wire.decode(buf)
            if header.kind != wire.KIND_PING:
                return header

    def payload(self, peer: int, header: wire.Header, nbytes: int, timeout_s: float) -> torch.Tensor:
        out = torch.empty(header.shape, dtype=getattr(torch, header.dtype))
        if nbytes:
            self._read_into(peer, _view(out), time.monotonic() + timeout_s)
        return out

    def first(self, peers: list[int], timeout_s: float) -> int | None:
        """The first of ``peers`` whose whole header arrived. A header is taken as its bytes come, from every peer
        at once, so one trickling its header holds nobody; it must be complete ``alive_s`` after its first byte
        (``LinkTimeout`` naming that peer)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for peer in peers:
                if peer in self._ready or (self._carry[peer] and self._pull(peer)):
                    return peer
            now = time.monotonic()
            late = next((p for p in peers if p in self._begun and now - self._begun[p] >= self.alive_s), None)
            if late is not None:
                raise LinkTimeout(late, f"the header from global rank {late} was not complete {self.alive_s:g}s "
                                        "after its first byte")
            silent = min(peers, key=lambda p: self._heard[p])
            bound = min(deadline, self._heard[silent] + self.alive_s,
                        *(self._begun[p] + self.alive_s for p in peers if p in self._begun)) - now
            with selectors.DefaultSelector() as sel:
                for peer in peers:
                    sel.register(self._rx[peer], selectors.EVENT_READ, peer)
                events = sel.select(min(max(bound, 0.0), threading.TIMEOUT_MAX))  # what arrived counts first
            for key, _ in events:
                if self._pull(key.data):
                    return key.data  # type: ignore[no-any-return]
            if not events:
                now = time.monotonic()
                if now - self._heard[silent] >= self.alive_s:
                    raise self._silent(silent)
                if now >= deadline:
                    return None

    def _pull(self, peer: int) -> bool:
        """Take what ``peer`` sent of its next header without waiting (the carry first); True once a whole header
        other than a keep-alive is in ``_ready``."""
        buf = self._partial.setdefault(peer, bytearray())
        carry = self._carry[peer]
        while True:
            if carry:
                n = min(len(carry), wire.HEADER_BYTES - len(buf))
                buf.extend(carry[:n])
                del carry[:n]
            else:
                chunk = bytearray(wire.HEADER_BYTES - len(buf))
                sock = self._rx[peer]
                sock.settimeout(0.0)
                try:
                    n = sock.recv_into(chunk)
                except (BlockingIOError, TimeoutError):
                    return False
                except OSError as e:
                    raise self._closed(peer, e) from None
                if not n:
                    raise self._closed(peer, None)
                buf.extend(chunk[:n])
                self._heard[peer] = time.monotonic()
            self._begun.setdefault(peer, time.monotonic())
            if len(buf) < wire.HEADER_BYTES:
                continue
            del self._partial[peer], self._begun[peer]
            header = wire.decode(buf)
            if header.kind != wire.KIND_PING:
                self._ready[peer] = header
                return True
            buf = self._partial.setdefault(peer, bytearray())

    def _read_into(self, peer: int, view: memoryview, deadline: float, least: int | None = None,
                   header: bool = False) -> int:
        """Fill ``view`` (``least`` bytes of it, if given) from ``peer``'s stream by ``deadline``; how many bytes.
        ``PeerSilent`` after ``alive_s`` of nothing; ``LinkTimeout`` at ``deadline`` (``header``: the rest of a
        header that began, whose bound is ``alive_s`` from its first byte)."""
        want = len(view) if least is None else least
        got = 0
        carry = self._carry[peer]
        if carry:
            got = min(len(carry), len(view))
            view[:got] = carry[:got]
            del carry[:got]
        sock = self._rx[peer]
        while got < want:
            now = time.monotonic()
            alive_until = self._heard[peer] + self.alive_s
            # an expired wait still takes what already arrived before it judges: a side that did not read for a
            # while (an idle attention engine) finds its peer's keep-alives waiting in the socket
            expired = now >= alive_until or now >= deadline
            sock.settimeout(0.0 if expired else max(min(deadline, alive_until) - now, 1e-3))
            try:
                n = sock.recv_into(view[got:])
            except (BlockingIOError, TimeoutError):
                if not expired:
                    continue
                if now >= alive_until:
                    raise self._silent(peer) from None
                if header:
                    raise LinkTimeout(peer, f"the header from global rank {peer} was not complete {self.alive_s:g}s "
                                            "after its first byte") from None
                raise LinkTimeout(peer, f"nothing from global rank {peer} in time") from None
            except OSError as e:
                raise self._closed(peer, e) from None
            if not n:
                raise self._closed(peer, None)
            got += n
            self._heard[peer] = time.monotonic()
        return got

    def _silent(self, peer: int) -> PeerSilent:
        return PeerSilent(peer, f"nothing, not even a keep-alive, from global rank {peer} for {self.alive_s:g}s: "
                                "the process is frozen, or gone without its connection closing")

    def _closed(self, peer: int, err: OSError | None) -> LinkClosed | LinkInterrupted:
        if peer in self._interrupted or self._stop.is_set():
            return LinkInterrupted(peer, f"the link to global rank {peer} was interrupted by this side")
        why = f" ({err})" if err else ""
        return LinkClosed(peer, f"the connection to global rank {peer} closed{why}")

    # ------------------------------------------------------------------ ending
    def interrupt(self, peer: int) -> None:
        self._interrupted.add(peer)
        try:
            self._rx[peer].shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already shut down

    def drop(self, peer: int, words: list[int]) -> None:
        """Send ``peer`` the ``KIND_DROP`` header ``words`` (at most ``ping_s``; best effort), then close its link:
        it reads the header, then the end of the stream. Waits on ``peer`` end with ``LinkInterrupted``."""
        try:
            self._write(peer, [memoryview(wire.HEADER.pack(*words))], self.ping_s, blocking=True)
        except (LinkTimeout, LinkClosed, LinkInterrupted):
            pass  # it finds the link closed instead
        with self._locks[peer]:  # not inside a keep-alive's write
            self._interrupted.add(peer)
            self._ready.pop(peer, None)
            self._partial.pop(peer, None)
            self._begun.pop(peer, None)
            try:
                self._rx[peer].shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # its end already closed
            self._rx[peer].close()
            self._tx[peer].close()

    def add(self, peer: int, sock: socket.socket, buf: bytes) -> None:
        """Give ``peer`` (dropped before, ``drop``) a new link: an authenticated session's socket and the bytes
        read past its last message (a rank that re-joined the group, ``rendezvous.Rejoins``)."""
        with self._locks[peer]:
            self._attach(peer, sock, buf)
            self._ready.pop(peer, None)
            self._partial.pop(peer, None)
            self._begun.pop(peer, None)
            self._interrupted.discard(peer)

    def _attach(self, peer: int, sock: socket.socket, buf: bytes) -> None:
        self._rx[peer], self._carry[peer], self._tx[peer] = sock, bytearray(buf), sock.dup()
        for s in (sock, self._tx[peer]):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(self.alive_s)
        self._heard[peer] = self._sent[peer] = time.monotonic()

    def close(self, clean: bool) -> None:
        self._stop.set()
        for peer in list(self._rx):
            self.interrupt(peer)
        for s in [*self._rx.values(), *self._tx.values()]:
            s.close()
