"""``backend: gloo`` and ``backend: nccl``: the AFD traffic as torch.distributed point-to-point messages.

Group
    One standalone process group per AFD group, built here from torch's own classes (no global
    torch.distributed state, no ``new_group``): FFN rank 0 serves a ``TCPStore`` on the rendezvous' listening
    socket once the rendezvous is done, every rank is its client, and the gloo/NCCL backend is built over
    ``MacStore`` on top of it. World size ``A + F`` in FFN-first order (``afd_patches.topology``).

Where gloo listens
    gloo's pair listener binds ``pair_address(host)`` only: ``host`` itself where it is an address of this
    machine (FFN rank 0, and every rank of a group on one host), else the address this machine reaches
    ``host`` from. Left to torch, gloo would bind whatever the machine's name resolves to (127.0.0.1, or the
    LAN address) whatever ``host`` says. A wildcard ``host`` (``0.0.0.0``, ``::``) keeps torch's choice.

The store is not trusted
    torch's ``TCPStore`` has no authentication: anyone who reaches the port can read and write every record.
    So every record this group writes there (gloo's addresses, NCCL's unique id, the heartbeats) carries an
    HMAC under the group's key (``auth.group_key``, from the group id that reached every rank inside its
    authenticated rendezvous session), bound to the record's name; a record that does not verify fails the
    read (``MacStore.tampered`` names it). A stranger can therefore make formation fail (the connector
    reports it; the FFN waits for the next group), but cannot point a rank at another address or
    communicator. Counters (``add``) cannot be MAC'd; gloo and NCCL use none for anything a rank acts on.

The store after formation (``seal_store``)
    torch's store keeps every value it is sent (up to 8 MiB each, no total bound) and every connection it
    accepts, for the group's whole life. So once FFN rank 0 has built its group it seals the store: each rank
    wrote, MAC'd, the local addresses of its own connections to the store (``client_key``); rank 0 drops
    every packet to the store's listening socket (a socket filter: new connections get no answer, and the
    port stays taken), then cuts every connection to the store that no rank named. From then on the store
    takes requests from the ranks' own connections only, and its memory is what the ranks write (their
    heartbeats). Before that, from the verdicts until rank 0 has built its gloo/NCCL group (it seals before its
    warm-up, so before any rank it serves returns from ``init``; well under a second on one host, at most the
    rendezvous' ``timeout_s``), a stranger who reaches the port can still connect and write, and what it
    wrote stays until the group ends. A rank whose connection to the store passes through address
    translation cannot be recognised: formation then fails, naming it (gloo and NCCL need direct addresses
    anyway). Linux only (``/proc``, ``SO_ATTACH_FILTER``); elsewhere the store stays open, with a warning.

Messages
    A message is an ``int64`` header (``wire``) with tag ``TAG_HEADER``; on gloo a payload of up to
    ``inline_bytes`` travels inside the same message (the receiver posts ``HEADER_BYTES + inline_bytes``;
    gloo accepts a shorter message), larger ones and every NCCL payload follow with tag ``TAG_PAYLOAD``.

Waits
    gloo waits block with a timeout; a wait can be interrupted only by closing the connection to that
    peer (``_break_pair``: a 1 ms receive on ``TAG_BREAK``, which is never sent, times out and closes the
    pair). NCCL waits poll ``is_completed()`` with a backoff and check the deadline and interrupts between
    polls. A failed gloo wait that came before its bound, without an interrupt, is ``LinkClosed``; one at
    its bound is ``LinkTimeout``; on NCCL an exception of the operation is ``BackendError``. ``first`` (the
    first of several peers' headers, for both schedules) hands each posted receive to an ``Arrivals`` thread
    on gloo and polls them all on NCCL.

Drops
    A rank dropped from a batched step (``drop``) is posted a ``KIND_DROP`` header and ignored from then on;
    its pair stays, since a torch process group takes no new member: the rank re-joins with the next group.

Limits
    The tensor traffic itself is not authenticated or encrypted (gloo and NCCL have no such option); NCCL's
    group timeout is at least ``idle_timeout_s`` (torch's watchdog would abort an idle FFN otherwise). The
    NCCL paths are exercised by ``scripts/gpu_check`` on a GPU; the CPU suite runs them with stand-ins.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import struct
import sys
import threading
import time
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from afd_patches import LOGGER
from afd_patches.connectors import wire
from afd_patches.connectors.arrivals import Arrivals
from afd_patches.connectors.base import ConnectorError
from afd_patches.connectors.transport import (
    BackendError,
    Handle,
    LinkClosed,
    LinkError,
    LinkInterrupted,
    LinkTimeout,
    Transport,
)

TAG_HEADER, TAG_PAYLOAD, TAG_WARMUP, TAG_BREAK = 1, 2, 3, 4
POLL_MIN_S, POLL_MAX_S, POLL_IDLE_S = 2e-5, 1e-3, 1e-2  # NCCL polling backoff (POLL_IDLE_S after 1 s)
MAC_BYTES = 32
SO_ATTACH_FILTER = 26  # Linux (asm-generic numbering); the socket module does not export it
_DROP_EVERY_PACKET = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0), 8)  # BPF: ret #0
TCP_ESTABLISHED, TCP_LISTEN = 0x01, 0x0A  # states as /proc/net/tcp writes them
DRAIN_S = 2.0  # how long seal_store waits for the store to take the connections it had queued

logger = logging.getLogger(LOGGER)


def device_identity(device: torch.device) -> str:
    """Where tensors on ``device`` live, as two ranks of a group must tell apart: ``"host/GPU-<uuid>"`` for a
    CUDA device (the UUID does not depend on ``CUDA_VISIBLE_DEVICES``), ``""`` for host memory."""
    if device.type != "cuda":
        return ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    where = f"GPU-{uuid}" if uuid else f"PCI {props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}"
    return f"{socket.gethostname()}/{where}"


class StoreTampered(RuntimeError):
    """A record of the group's store failed authentication (written by someone without the group's key)."""


class MacStore(dist.Store):
    """A store whose ``set`` appends an HMAC of (name, value) under ``key`` and whose ``get`` verifies it.

    ``tampered`` holds the name of the first record that failed. Everything else is delegated.
    ``pair_address``: where this rank's gloo pairs listen (``group_store`` sets it; ``None``: torch's choice)."""

    def __init__(self, inner: Any, key: bytes) -> None:
        super().__init__()
        self.inner, self.key = inner, key
        self.tampered: str | None = None
        self.pair_address: str | None = None

    def _mac(self, name: str, value: bytes) -> bytes:
        return hmac.new(self.key, name.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: Any) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, data + self._mac(key, data))

    def get(self, key: str) -> bytes:
        raw = bytes(self.inner.get(key))
        data, mac = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
        if len(raw) < MAC_BYTES or not hmac.compare_digest(self._mac(key, data), mac):
            self.tampered = self.tampered or key
            raise StoreTampered(f"AFD: the record {key!r} in the group's store failed authentication")
        return data

    def add(self, key: str, value: int) -> int:
        return int(self.inner.add(key, value))

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self.inner.compare_set(key, expected, desired))

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


def group_store(host: str, port: int, rank: int, group: str, key: bytes, timeout_s: float,
                listen_fd: int | None) -> tuple[Any, MacStore]:
    """(the raw ``TCPStore``, the ``MacStore`` over this group's prefix of it). Rank 0 serves the store on
    ``listen_fd`` (the rendezvous' listening socket); the others connect to ``host:port``. Every rank then
    writes its ``client_key`` record (for ``seal_store``) and learns its ``pair_address``."""
    timeout = timedelta(seconds=timeout_s)
    if listen_fd is not None:
        raw = dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False, master_listen_fd=listen_fd)
    else:
        raw = dist.TCPStore(host, port, None, False, timeout, wait_for_workers=False)
    store = MacStore(dist.PrefixStore(f"afd/{group}", raw), key)
    store.pair_address = pair_address(host)
    store.set(client_key(rank), "\n".join(f"{ip} {p}" for ip, p in store_connections(port)).encode())
    return raw, store


def build_group(store: MacStore, backend: str, rank: int, world_size: int, timeout_s: float) -> Any:
    """The gloo or NCCL backend object for this rank, over ``store``; gloo's pairs listen on
    ``store.pair_address`` (``GLOO_SOCKET_IFNAME`` applies only where that is ``None``)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        if store.pair_address is None:
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        gloo = dist.ProcessGroupGloo._Options()
        gloo._timeout = timeout
        gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=store.pair_address)]
        return dist.ProcessGroupGloo(store, rank, world_size, gloo)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


# ------------------------------------------------------------------ addresses and the store's connections
def local_address(host: str) -> str:
    """The local IP this machine uses to reach ``host`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


def pair_address(host: str) -> str | None:
    """Where this rank's gloo pairs listen in a group hosted at ``host`` (an IP address): ``host`` where this
    machine can bind it, else ``local_address(host)``; ``None`` (torch's choice) for a wildcard ``host``."""
    try:
        if ipaddress.ip_address(host).is_unspecified:
            return None
    except ValueError:
        pass
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, 0))
            return host
        except OSError:
            return local_address(host)


class TcpSocket(NamedTuple):
    """One TCP socket a process holds, as ``/proc/<pid>/net/tcp`` and ``tcp6`` show it (IPv4-mapped addresses
    as IPv4). ``fd``: one descriptor of it in that process; ``queue``: its receive queue, which for a
    listening socket is the number of connections waiting to be accepted."""

    local: tuple[str, int]
    remote: tuple[str, int]
    state: int
    queue: int
    inode: int
    fd: int


def tcp_sockets(pid: int | str = "self") -> list[TcpSocket]:
    """The TCP sockets process ``pid`` holds open (Linux; ``OSError`` where ``/proc`` does not show them)."""
    fds: dict[int, int] = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            fds.setdefault(int(link[8:-1]), int(name))
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue  # a kernel without IPv6
        for row in rows:
            cols = row.split()
            if int(cols[9]) in fds:
                found.append(TcpSocket(_endpoint(cols[1]), _endpoint(cols[2]), int(cols[3], 16),
                                       int(cols[4].split(":")[1], 16), int(cols[9]), fds[int(cols[9])]))
    return found


def _endpoint(text: str) -> tuple[str, int]:
    """``0100007F:1F90`` (/proc/net/tcp: 32-bit words in host byte order, hex port) -> ``("127.0.0.1", 8080)``."""
    words, port = text.split(":")
    packed = b"".join(bytes.fromhex(words[i : i + 8])[:: -1 if sys.byteorder == "little" else 1]
                      for i in range(0, len(words), 8))
    ip = ipaddress.ip_address(packed)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def client_key(rank: int) -> str:
    """The store record in which ``rank`` names the local addresses of its connections to the store."""
    return f"store-client/{rank}"


def store_connections(port: int) -> list[tuple[str, int]]:
    """The local addresses of this process's open connections to a store on ``port`` (``[]`` off Linux)."""
    if not sys.platform.startswith("linux"):
        return []
    return [s.local for s in tcp_sockets() if s.state == TCP_ESTABLISHED and s.remote[1] == port != s.local[1]]


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


class _Sends(Handle):
    """The works of one message, and the tensors they read (kept alive until done)."""

    def __init__(self, transport: TorchGroupTransport, peer: int, works: list[Any], keep: list[torch.Tensor]) -> None:
        self.transport, self.peer, self.works, self.keep = transport, peer, works, keep

    def wait(self, timeout_s: float | None = None) -> None:
        bound = self.transport.timeout_s if timeout_s is None else timeout_s
        for work in self.works:
            self.transport.wait(work, self.peer, bound)
        self.works, self.keep = [], []


class TorchGroupTransport(Transport):
    """A gloo or NCCL group as a ``Transport`` (see the module docstring)."""

    def __init__(self, pg: Any, backend: str, device: torch.device, timeout_s: float, inline_bytes: int,
                 store: Any = None) -> None:
        self.pg, self.backend, self.device = pg, backend, device
        self.store = store  # the raw TCPStore: kept alive with the group (FFN rank 0's process serves it)
        self.device_type = device.type
        self.timeout_s, self.inline_bytes = timeout_s, inline_bytes
        self._posted: dict[int, tuple[torch.Tensor, Any]] = {}  # peer -> its posted header receive
        self._arrived: set[int] = set()  # peers whose posted header receive completed in first()
        self._message: dict[int, torch.Tensor] = {}  # peer -> the last header message (inline payload)
        self._interrupted: set[int] = set()
        self._dropped: set[int] = set()  # peers dropped from the group's steps (``drop``)
        self._farewells: list[Handle] = []  # their DROP headers' sends, kept alive until the group ends
        self._stop = threading.Event()
        self._arrivals = Arrivals("afd-arrivals")

    # ------------------------------------------------------------------ sending
    def send(self, peer: int, words: list[int], tensor: torch.Tensor | None) -> Handle:
        nbytes = tensor.numel() * tensor.element_size() if tensor is not None else 0
        inline = 0 < nbytes <= self.inline_bytes
        header = wire.encode([*words[:7], int(inline), *words[8:]], self.device).view(torch.uint8)
        if inline:
            assert tensor is not None
            message = torch.empty(wire.HEADER_BYTES + nbytes, dtype=torch.uint8, device=self.device)
            message[: wire.HEADER_BYTES] = header
            message[wire.HEADER_BYTES :] = tensor.reshape(-1).view(torch.uint8)
            return _Sends(self, peer, [self._post(self.pg.send, message, peer, TAG_HEADER)], [message])
        works, keep = [self._post(self.pg.send, header, peer, TAG_HEADER)], [header]
        if nbytes:
            assert tensor is not None
            works.append(self._post(self.pg.send, tensor, peer, TAG_PAYLOAD))
            keep.append(tensor)
        return _Sends(self, peer, works, keep)

    def warm_up(self, peers: list[int], is_sender: bool, timeout_s: float) -> None:
        """One small message per FFN/attention pair, so NCCL builds its communicators here, bounded."""
        flag = torch.zeros(1, dtype=torch.int64, device=self.device)
        for peer in peers:
            self.wait(self._post(self.pg.send if is_sender else self.pg.recv, flag, peer, TAG_WARMUP), peer,
                      timeout_s)

    def _post(self, op: Any, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        """``op([tensor], peer, tag)``, the group's send or receive (every post of this transport goes through here);
        gloo raises at once when it already knows the pair closed, which becomes the typed ``LinkClosed``
        (``_error``) as in ``wait``."""
        try:
            return op([tensor], peer, tag)
        except RuntimeError as e:
            raise self._error(e, peer, 0.0, 0.0) from e

    # ---------------------------------------------------------------- receiving
    def _post_header(self, peer: int) -> tuple[torch.Tensor, Any]:
        if peer not in self._posted:
            buf = torch.empty(wire.HEADER_BYTES + self.inline_bytes, dtype=torch.uint8, device=self.device)
            self._posted[peer] = (buf, self._post(self.pg.recv, buf, peer, TAG_HEADER))
        return self._posted[peer]

    def next_header(self, peer: int, timeout_s: float) -> wire.Header:
        buf, work = self._post_header(peer)
        if peer in self._arrived:
            self._arrived.discard(peer)
        else:
            self.wait(work, peer, timeout_s)
        del self._posted[peer]
        self._message[peer] = buf
        return wire.decode(buf)

    def payload(self, peer: int, header: wire.Header, nbytes: int, timeout_s: float) -> torch.Tensor:
        dtype = getattr(torch, header.dtype)
        if header.inline:
            message = self._message.pop(peer)
            return message[wire.HEADER_BYTES : wire.HEADER_BYTES + nbytes].view(dtype).view(header.shape)
        out = torch.empty(header.shape, dtype=dtype, device=self.device)
        if nbytes:
            self.wait(self._post(self.pg.recv, out, peer, TAG_PAYLOAD), peer, timeout_s)
        return out

    def first(self, peers: list[int], timeout_s: float) -> int | None:
        """gloo: one waiter thread per peer reports completions in order (``Arrivals``); a dropped peer's
        completion is ignored. NCCL: the posted receives are polled (``poll`` over ``_AnyOf``)."""
        for peer in peers:
            if peer in self._arrived:
                return peer
        if self.backend == "nccl":
            return self._first_polled(peers, timeout_s)
        for peer in peers:
            if peer not in self._posted:
                _, work = self._post_header(peer)
                self._arrivals.watch(peer, work, timeout_s)
        deadline = time.monotonic() + timeout_s
        while (got := self._arrivals.next(max(deadline - time.monotonic(), 0.0))) is not None:
            peer, err = got
            if peer in self._dropped:
                continue  # a rank dropped from the group woke up: nothing of it is taken any more
            if err is not None:
                self._posted.pop(peer, None)
                raise self._error(err, peer, 0.0, timeout_s)
            self._arrived.add(peer)
            return peer
        return None

    def _first_polled(self, peers: list[int], timeout_s: float) -> int | None:
        start = time.monotonic()
        any_of = _AnyOf({peer: self._post_header(peer)[1] for peer in peers})
        stopped = lambda: self._stop.is_set() or any(p in self._interrupted for p in peers)  # noqa: E731
        try:
            if not poll(any_of, start + timeout_s, stopped):
                if stopped():
                    peer = next((p for p in peers if p in self._interrupted), peers[0])
                    raise LinkInterrupted(peer, f"the wait on global rank {peer} was interrupted by this side")
                return None
        except RuntimeError as e:
            peer = any_of.done if any_of.done is not None else peers[0]
            raise self._error(e, peer, time.monotonic() - start, timeout_s) from e
        assert any_of.done is not None
        self._arrived.add(any_of.done)
        return any_of.done

    def wait(self, work: Any, peer: int, timeout_s: float) -> None:
        """Wait for ``work`` at most ``timeout_s``: blocking on gloo, polling on NCCL (see "Waits")."""
        start = time.monotonic()
        try:
            if self.backend == "gloo":
                work.wait(timeout=timedelta(seconds=timeout_s))
                return
            if not poll(work, start + timeout_s, lambda: self._stop.is_set() or peer in self._interrupted):
                if self._stop.is_set() or peer in self._interrupted:
                    raise LinkInterrupted(peer, f"the wait on global rank {peer} was interrupted by this side")
                raise LinkTimeout(peer, f"nothing from global rank {peer} within {timeout_s:g}s")
        except RuntimeError as e:
            raise self._error(e, peer, time.monotonic() - start, timeout_s) from e

    def _error(self, err: BaseException, peer: int, elapsed: float, bound: float) -> Exception:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        if self._stop.is_set() or peer in self._interrupted:
            return LinkInterrupted(peer, f"the link to global rank {peer} was interrupted by this side")
        if self.backend == "nccl":
            return BackendError(peer, f"NCCL reported an error with global rank {peer} ({type(err).__name__}: "
                                      f"{text})")
        if bound and elapsed >= bound * 0.95:
            return LinkTimeout(peer, f"nothing from global rank {peer} within {bound:g}s ({text})")
        return LinkClosed(peer, f"the connection to global rank {peer} closed ({type(err).__name__}: {text})")

    # ------------------------------------------------------------------ ending
    def interrupt(self, peer: int) -> None:
        self._interrupted.add(peer)
        if self.backend == "gloo":
            _break_pair(self.pg, peer)

    def drop(self, peer: int, words: list[int]) -> None:
        """Post the ``KIND_DROP`` header ``words`` to ``peer`` (never waited for: the rank takes it when it wakes)
        and ignore its arrivals from now on. The pair stays: a torch group takes no new member, so the rank
        re-joins with the next group (see ``afd_patches.connectors.torch_dist``)."""
        self._dropped.add(peer)
        self._arrived.discard(peer)
        try:
            self._farewells.append(self.send(peer, words, None))
        except LinkError:
            pass  # its pair is gone: it finds that instead

    def close(self, clean: bool) -> None:
        self._stop.set()
        self._arrivals.stop()
        if self.backend == "gloo":
            for peer in list(self._posted):
                _break_pair(self.pg, peer)
        try:
            if not clean and self.backend != "gloo" and hasattr(self.pg, "abort"):
                self.pg.abort()
            else:
                self.pg.shutdown()
        except RuntimeError:
            pass


class _AnyOf:
    """Several NCCL works as one for ``poll``: completed once any is (``done``: its peer, the first in order)."""

    def __init__(self, works: dict[int, Any]) -> None:
        self.works = works
        self.done: int | None = None

    def is_completed(self) -> bool:
        self.done = next((peer for peer, work in self.works.items() if work.is_completed()), None)
        return self.done is not None

    def wait(self) -> None:
        assert self.done is not None
        self.works[self.done].wait()


def poll(work: Any, deadline: float, stop: Any) -> bool:
    """Wait for ``work`` by polling ``is_completed()`` with a backoff; False at ``deadline`` or when ``stop()``.

    On NCCL ``is_completed()`` queries the operation's CUDA event and never blocks; ``work.wait()`` then only
    orders the current stream after it (or raises NCCL's error)."""
    start = time.monotonic()
    delay = 0.0
    while not work.is_completed():
        now = time.monotonic()
        if now >= deadline or stop():
            return False
        time.sleep(delay)
        delay = min(delay * 2 or POLL_MIN_S, POLL_MAX_S if now - start < 1.0 else POLL_IDLE_S)
    work.wait()
    return True


def _break_pair(pg: Any, peer: int) -> None:
    """Close the gloo connection to ``peer`` for good, so a wait blocked on it raises at once."""
    try:
        pg.recv([torch.empty(1, dtype=torch.uint8)], peer, TAG_BREAK).wait(timeout=timedelta(milliseconds=1))
    except RuntimeError:
        pass  # the expected timeout, or the pair was already closed
