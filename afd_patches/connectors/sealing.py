"""Sealing the group's store after formation (``seal_store``): from then on it takes requests from the ranks'
own connections only.

The store after formation
    torch's store keeps every value it is sent (up to 8 MiB each, no total bound) and every connection it
    accepts, for the group's whole life. So once FFN rank 0 has built its group it seals the store: each rank
    wrote, MAC'd, the local addresses of its own connections to the store (``store.client_key``); rank 0 drops
    every packet to the store's listening socket (a socket filter: new connections get no answer, and the
    port stays taken), then cuts every connection to the store that no rank named. From then on the store
    takes requests from the ranks' own connections only, and its memory is what the ranks write (their
    heartbeats). Before that, from the verdicts until rank 0 has built its gloo/NCCL group (it seals before its
    warm-up, so before any rank it serves returns from ``init``; well under a second on one host, at most the
    rendezvous' ``timeout_s``), a stranger who reaches the port can still connect and write, and what it
    wrote stays until the group ends. A rank whose connection to the store passes through address
    translation cannot be recognised: formation then fails, naming it (gloo and NCCL need direct addresses
    anyway). Linux only (``/proc``, ``SO_ATTACH_FILTER``); elsewhere the store stays open, with a warning.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct
import sys
import time
from datetime import timedelta

from afd_patches import LOGGER
from afd_patches.connectors.addresses import TCP_ESTABLISHED, TCP_LISTEN, TcpSocket, tcp_sockets
from afd_patches.connectors.base import ConnectorError
from afd_patches.connectors.store import MacStore, client_key

SO_ATTACH_FILTER = 26  # Linux (asm-generic numbering); the socket module does not export it
_DROP_EVERY_PACKET = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0), 8)  # BPF: ret #0
DRAIN_S = 2.0  # how long seal_store waits for the store to take the connections it had queued

logger = logging.getLogger(LOGGER)


def seal_store(store: MacStore, port: int, world_size: int, timeout_s: float, where: str) -> int:
    """FFN rank 0, its group built: the store it serves on ``port`` takes nothing more from anyone but
    the group's ranks (see "The store after formation"); returns how many connections it cut.

    Waits at most ``timeout_s`` for the ``client_key`` record of every rank. ``ConnectorError`` naming
    ``where`` when a record is missing or forged, a rank's connection seems to arrive translated
    (``translated_ranks``), or the store did not take the connections it had queued within ``DRAIN_S``. Logs
    one warning when it cut any. Limit: a rank that closed its connection early while a stranger's is open
    reads as translated, and the formation fails (the group then forms again)."""
    if not sys.platform.startswith("linux"):
        logger.warning("AFD: the group's store at %s stays open to anyone who reaches it while the group lives "
                       "(sealing it needs Linux)", where)
        return 0
    try:
        store.wait([client_key(r) for r in range(world_size)], timedelta(seconds=timeout_s))
        named = {r: {_address(line) for line in store.get(client_key(r)).decode().splitlines()}
                 for r in range(world_size)}
    except (RuntimeError, ValueError) as e:
        raise ConnectorError(f"AFD: cannot seal the group's store at {where}: a rank's record of its connection "
                             f"is missing or forged ({type(e).__name__}: {e})") from e
    listening = [s for s in tcp_sockets() if s.state == TCP_LISTEN and s.local[1] == port]
    sock = _claim(listening[0]) if len(listening) == 1 else None
    if sock is None:
        raise ConnectorError(f"AFD: cannot seal the group's store at {where}: its listening socket is not found")
    with sock:
        _drop_every_packet(sock)
    deadline = time.monotonic() + DRAIN_S
    while any(s.queue for s in tcp_sockets() if s.inode == listening[0].inode):
        if time.monotonic() >= deadline:
            raise ConnectorError(f"AFD: cannot seal the group's store at {where}: it did not take the connections "
                                 f"it had queued within {DRAIN_S:g}s")
        time.sleep(0.01)
    # a fresh look (``accept`` leaves the queue before its descriptor appears); established only: the store is
    # closing any peer that sent its FIN already, and rank 0's side of a finished rendezvous session is no
    # connection to the store
    connections = [s for s in tcp_sockets() if s.local[1] == port and s.state == TCP_ESTABLISHED]
    remotes = {s.remote for s in connections}
    allowed = set().union(*named.values())
    unseen = translated_ranks(named, remotes)
    if unseen:
        raise ConnectorError(f"AFD: cannot seal the group's store at {where}: the connection of global rank(s) "
                             f"{unseen} to it is not among its own (address translation between the ranks? gloo "
                             "and NCCL need direct addresses)")
    cut = sum(_cut(s) for s in connections if s.remote not in allowed)
    if cut:
        logger.warning("AFD: cut %d connection(s) to the group's store at %s that no rank of the group opened",
                       cut, where)
    return cut


def translated_ranks(named: dict[int, set[tuple[str, int]]], remotes: set[tuple[str, int]]) -> list[int]:
    """The ranks whose store connection seems to arrive from another address than the one they named: no
    connection from any address a rank named, while some connection comes from an address no rank named.
    A rank that is not seen while every connection is named has closed its own already (it finished its work
    before FFN rank 0 sealed): not an error."""
    if not remotes - set().union(*named.values()):
        return []
    return [r for r, addresses in named.items() if not addresses & remotes]


def _address(line: str) -> tuple[str, int]:
    ip, port = line.rsplit(" ", 1)
    return ip, int(port)


def _claim(entry: TcpSocket) -> socket.socket | None:
    """A socket object over a duplicate of ``entry``'s descriptor; ``None`` when that descriptor was closed,
    or now names another file, since ``entry`` was read."""
    try:
        fd = os.dup(entry.fd)
    except OSError:
        return None
    if os.fstat(fd).st_ino != entry.inode:
        os.close(fd)
        return None
    return socket.socket(fileno=fd)


def _drop_every_packet(sock: socket.socket) -> None:
    """Attach a socket filter that drops every packet that arrives for ``sock`` (the kernel copies it)."""
    program = struct.pack("HP", 1, ctypes.addressof(_DROP_EVERY_PACKET))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, program)


def _cut(entry: TcpSocket) -> bool:
    """Stop a connection the store accepted: nothing more arrives, the store reads its end and closes it, and
    that close resets the connection (the peer learns at once; no state lingers)."""
    sock = _claim(entry)
    if sock is None:
        return False
    with sock:
        try:
            _drop_every_packet(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the store closed it meanwhile
    return True
