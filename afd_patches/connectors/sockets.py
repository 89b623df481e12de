"""``backend: tcp``: the AFD tensor traffic on plain TCP sockets, one per FFN/attention pair.

Why
    On CPU the exchange is a few kilobytes per layer, so its cost is thread
    wake-ups, not bytes. gloo receives on a loop thread of its own and hands
    each message to the waiting thread, and that loop thread also wakes every
    10 ms while the group is idle (about 100 wake-ups per second and process).
    Here the thread that waits reads the socket itself: one wake-up per message
    on the receiving side, none on the sending side, and nothing at all while
    idle (figures: ``docs/benchmarks.md``).

Group
    ``SocketLinks.form`` runs after the rendezvous (``handshake``), using the
    group's ``TCPStore`` only to find each other: every FFN rank listens on an
    ephemeral port of the local address that routes to the group's ``host``
    (for a ``host`` of ``0.0.0.0``/``::``: on every interface, published as the
    address the machine's host name resolves to, as gloo does) and publishes
    ``{host, port, cookie}`` under ``afd/data/<global rank>``;
    each attention rank connects to its FFN rank and proves itself with
    ``auth.proof(token, "afd-data-join", nonce, cookie)`` plus its global rank;
    the FFN rank answers with its own proof (``afd-data-ack``) once every attention rank it serves is
    in, which is also the "group formed" signal (the warm-up of gloo/NCCL).
    Connections that fail the proof or claim a rank that is not served or
    already connected are dropped; the others' formation goes on. Then every
    rank waits for all (``barrier``, a counter in the store), so no pair starts,
    finishes and takes FFN rank 0's store down while another is connecting.

``SocketLinks`` imitates the part of a torch process group the connector uses:
``send(tensors, peer, tag)`` writes every tensor's bytes, in order, before it
returns (a completed work); ``recv(tensors, peer, tag)`` returns a work whose
``wait(timeout=...)`` reads exactly the tensors' bytes from ``peer``'s socket
in the calling thread. Tags are ignored: each pair's stream keeps order, and
the connector reads a header before it posts the payload's receive.
``wait_any`` gives the first of several peers with data (``pingpong``), with
no thread per peer.

Failures (raised as ``RuntimeError``, whose text the connector translates):
a wait past its timeout says "timed out"; a peer that closed or died says
"connection closed"; ``interrupt(peer)`` (a lost peer, ``close()`` from
another thread) shuts the socket down, so a wait blocked on it returns at once.

Limits: host memory only (a CUDA tensor is moved by the connector first).
Sends are synchronous and bounded by ``send_timeout_s`` (a peer that stops
reading fails them). The store is unauthenticated (as torch's): without a
token, a party that can read it can also connect; with a token, both sides
of every data connection prove they hold it. Nothing is encrypted.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from afd_patches.connectors import auth
from afd_patches.connectors.base import ConnectorError, ConnectorTimeout

LABEL_JOIN, LABEL_ACK = b"afd-data-join", b"afd-data-ack"
HELLO = struct.Struct("<q16s32s")  # global rank, nonce, proof
ACK_BYTES = 32
HELLO_READ_S = 5.0  # how long an accepted connection has to prove itself
POLL_S = 0.1  # how often formation loops look at their deadline and cancel flag
WILDCARDS = ("0.0.0.0", "::")
BARRIER_POLL_S = 0.01  # how often the formation barrier reads its counter (only during init)


def key(global_rank: int) -> str:
    """The store key under which FFN global rank ``global_rank`` publishes its data address."""
    return f"afd/data/{global_rank}"


def local_address(host: str) -> tuple[int, str]:
    """(address family, local IP) this machine uses to reach ``host`` (no packet is sent)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return family, probe.getsockname()[0]


def _seconds(timeout: Any) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def _bytes_of(obj: torch.Tensor | bytes | bytearray) -> memoryview:
    """A byte view (writable for a tensor or bytearray) of a contiguous host tensor or a bytes object, no copy."""
    if isinstance(obj, torch.Tensor):
        return memoryview(obj.reshape(-1).view(torch.uint8).numpy())
    return memoryview(obj)


class _Done:
    """A send: complete when ``send`` returned."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Recv:
    """A posted receive on one peer's socket; ``wait`` does the reading."""

    def __init__(self, links: SocketLinks, peer: int, views: list[memoryview]) -> None:
        self.links, self.peer, self.views = links, peer, views

    def wait(self, timeout: Any = None) -> bool:
        deadline = time.monotonic() + _seconds(timeout if timeout is not None else self.links.send_timeout_s)
        for view in self.views:
            self.links.read_into(self.peer, view, deadline)
        return True


class SocketLinks:
    """One connected socket per peer; see the module docstring."""

    def __init__(self, socks: dict[int, socket.socket], send_timeout_s: float) -> None:
        self.send_timeout_s = send_timeout_s
        self._rx = socks
        self._tx = {peer: s.dup() for peer, s in socks.items()}  # own timeout for sends (close() sends too)
        self._locks = {peer: threading.Lock() for peer in socks}
        for s in [*self._rx.values(), *self._tx.values()]:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(send_timeout_s)

    # ------------------------------------------------------------ formation
    @classmethod
    def form(cls, role_is_ffn: bool, me: int, peers: list[int], store: Any, host: str, token: bytes | None,
             deadline: float, cancelled: Callable[[], bool], send_timeout_s: float) -> SocketLinks:
        """Connect this rank to each of ``peers`` (see "Group"); ``ConnectorTimeout`` at ``deadline``."""
        socks = (_accept_peers if role_is_ffn else _join_ffn)(me, peers, store, host, token, deadline, cancelled)
        return cls(socks, send_timeout_s)

    @classmethod
    def form_group(cls, role_is_ffn: bool, me: int, peers: list[int], store: Any, host: str, token: bytes | None,
                   deadline: float, cancelled: Callable[[], bool], send_timeout_s: float,
                   world_size: int) -> SocketLinks:
        """``form``, then ``barrier`` over the ``world_size`` ranks (closing the sockets if that fails)."""
        links = cls.form(role_is_ffn, me, peers, store, host, token, deadline, cancelled, send_timeout_s)
        try:
            barrier(store, world_size, deadline, cancelled, hosts_store=me == 0)
        except BaseException:
            links.shutdown()
            raise
        return links

    # ---------------------------------------------------------- group-like API
    def send(self, tensors: list[torch.Tensor | bytes], peer: int, tag: int = 0,
             timeout_s: float | None = None) -> _Done:
        """Write every tensor's (or bytes object's) bytes to ``peer`` (bounded by ``timeout_s``, default
        ``send_timeout_s``)."""
        views = [v for v in map(_bytes_of, tensors) if len(v)]
        budget = self.send_timeout_s if timeout_s is None else timeout_s
        lock = self._locks[peer]
        if not lock.acquire(timeout=budget):
            raise RuntimeError(f"send to global rank {peer} timed out waiting for another send")
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
        except TimeoutError:
            raise RuntimeError(f"send to global rank {peer} timed out after {budget:g}s") from None
        except OSError as e:
            raise RuntimeError(f"connection to global rank {peer} closed ({e})") from None
        finally:
            lock.release()
        return _Done()

    def recv(self, tensors: list[torch.Tensor | bytearray], peer: int, tag: int = 0) -> _Recv:
        return _Recv(self, peer, [v for v in map(_bytes_of, tensors) if len(v)])

    def read_into(self, peer: int, view: memoryview, deadline: float) -> None:
        """Fill ``view`` from ``peer``'s socket by ``deadline``, in this thread."""
        sock, got = self._rx[peer], 0
        try:
            while got < len(view):
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                n = sock.recv_into(view[got:])
                if not n:
                    raise RuntimeError(f"connection to global rank {peer} closed")
                got += n
        except TimeoutError:
            raise RuntimeError(f"receive from global rank {peer} timed out") from None
        except OSError as e:
            raise RuntimeError(f"connection to global rank {peer} closed ({e})") from None

    def wait_any(self, peers: list[int], timeout_s: float) -> int | None:
        """The first of ``peers`` whose socket has data (or was closed/interrupted); None after ``timeout_s``."""
        with selectors.DefaultSelector() as sel:
            for peer in peers:
                sel.register(self._rx[peer], selectors.EVENT_READ, peer)
            ready = sel.select(min(timeout_s, threading.TIMEOUT_MAX))
        return ready[0][0].data if ready else None

    def interrupt(self, peer: int) -> None:
        """Shut ``peer``'s socket down: a wait blocked on it returns at once; it is unusable from here."""
        try:
            self._rx[peer].shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already shut down or never connected

    def shutdown(self) -> None:
        """Close every socket (after ``interrupt``-ing it). Idempotent."""
        for peer in list(self._rx):
            self.interrupt(peer)
        for s in [*self._rx.values(), *self._tx.values()]:
            s.close()

    abort = shutdown


class SocketArrivals:
    """``Arrivals`` for ``SocketLinks`` (``pingpong``): the first posted header receive whose peer has data."""

    def __init__(self, links: SocketLinks) -> None:
        self._links = links
        self._watched: dict[int, tuple[_Recv, float]] = {}

    def watch(self, peer: int, work: _Recv, timeout_s: float) -> None:
        self._watched[peer] = (work, timeout_s)

    def next(self, timeout_s: float) -> tuple[int, RuntimeError | None] | None:
        peer = self._links.wait_any(list(self._watched), timeout_s)
        if peer is None:
            return None
        item = self._watched.pop(peer, None)
        if item is None:  # stop() ran meanwhile (close() from another thread)
            return peer, RuntimeError(f"connection to global rank {peer} closed")
        work, bound = item
        try:
            work.wait(bound)
        except RuntimeError as e:
            return peer, e
        return peer, None

    def stop(self) -> None:
        self._watched.clear()


# ---------------------------------------------------------------- formation
def barrier(store: Any, world_size: int, deadline: float, cancelled: Callable[[], bool], hosts_store: bool) -> None:
    """Return once every rank of the group called this (a counter in the store), like a torch group's
    formation: FFN rank 0, which hosts the store, cannot finish and take it down while another pair of
    the group is still connecting. The rank that ``hosts_store`` also waits until every rank has made
    its last read of that counter (a second counter), so none of them finds the store gone.
    ``ConnectorTimeout`` at ``deadline``."""
    store.add("afd/data/formed", 1)
    _wait_count(store, "afd/data/formed", world_size, deadline, cancelled)
    store.add("afd/data/left", 1)
    if hosts_store:
        _wait_count(store, "afd/data/left", world_size, deadline, cancelled)


def _wait_count(store: Any, counter: str, target: int, deadline: float, cancelled: Callable[[], bool]) -> None:
    while store.add(counter, 0) < target:
        if cancelled():
            raise ConnectorError("cancelled by close()")
        if time.monotonic() >= deadline:
            raise ConnectorTimeout("not every rank of the group formed its data connections")
        time.sleep(BARRIER_POLL_S)


def _accept_peers(me: int, peers: list[int], store: Any, host: str, token: bytes | None, deadline: float,
                  cancelled: Callable[[], bool]) -> dict[int, socket.socket]:
    family, ip = local_address(host)
    bind = ip
    if host in WILDCARDS:  # the group listens on every interface: so does this port, named as gloo names its own
        bind, ip = host, socket.gethostbyname(socket.gethostname())
    listener = socket.create_server((bind, 0), family=family, backlog=max(len(peers), 16))
    cookie = secrets.token_bytes(16)
    socks: dict[int, socket.socket] = {}
    nonces: dict[int, bytes] = {}
    try:
        store.set(key(me), json.dumps({"host": ip, "port": listener.getsockname()[1], "cookie": cookie.hex()}))
        listener.settimeout(POLL_S)
        while len(socks) < len(peers):
            if cancelled():
                raise ConnectorError("cancelled by close()")
            if time.monotonic() >= deadline:
                missing = sorted(set(peers) - set(socks))
                raise ConnectorTimeout(f"global rank(s) {missing} did not open their data connection")
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            try:
                conn.settimeout(min(HELLO_READ_S, max(deadline - time.monotonic(), 0.1)))
                data = b""
                while len(data) < HELLO.size:
                    chunk = conn.recv(HELLO.size - len(data))
                    if not chunk:
                        break
                    data += chunk
                rank, nonce, given = HELLO.unpack(data) if len(data) == HELLO.size else (-1, b"", b"")
            except OSError:
                rank, nonce, given = -1, b"", b""
            if rank not in peers or rank in socks or not auth.verify(token, LABEL_JOIN, nonce, cookie, given):
                conn.close()  # a stranger, a wrong token, a rank not served here or already in: drop it only
                continue
            socks[rank], nonces[rank] = conn, nonce
        for rank, conn in socks.items():
            conn.sendall(auth.proof(token, LABEL_ACK, nonces[rank], cookie))
    except BaseException:
        for conn in socks.values():
            conn.close()
        raise
    finally:
        listener.close()
    return socks


def _join_ffn(me: int, peers: list[int], store: Any, host: str, token: bytes | None, deadline: float,
              cancelled: Callable[[], bool]) -> dict[int, socket.socket]:
    (ffn,) = peers
    while not store.check([key(ffn)]):
        if cancelled():
            raise ConnectorError("cancelled by close()")
        if time.monotonic() >= deadline:
            raise ConnectorTimeout(f"FFN global rank {ffn} did not publish its data address")
        time.sleep(POLL_S)
    info = json.loads(store.get(key(ffn)))
    cookie, nonce = bytes.fromhex(info["cookie"]), os.urandom(16)
    try:
        sock = socket.create_connection((info["host"], int(info["port"])),
                                        timeout=max(deadline - time.monotonic(), 0.1))
    except OSError as e:
        raise ConnectorError(f"cannot open the data connection to {info['host']}:{info['port']} ({e})") from e
    try:
        sock.sendall(HELLO.pack(me, nonce, auth.proof(token, LABEL_JOIN, nonce, cookie)))
        answer = b""
        sock.settimeout(POLL_S)
        while len(answer) < ACK_BYTES:
            if cancelled():
                raise ConnectorError("cancelled by close()")
            if time.monotonic() >= deadline:
                raise ConnectorTimeout(f"FFN global rank {ffn} did not accept the data connection")
            try:
                chunk = sock.recv(ACK_BYTES - len(answer))
            except TimeoutError:
                continue
            if not chunk:
                raise ConnectorError(f"FFN global rank {ffn} refused the data connection (token or rank)")
            answer += chunk
        if not auth.verify(token, LABEL_ACK, nonce, cookie, answer):
            raise ConnectorError(f"the data connection's answer does not prove the group's token "
                                 f"({info['host']}:{info['port']} is not FFN global rank {ffn})")
    except BaseException:
        sock.close()
        raise
    return {ffn: sock}
