"""Where an AFD rank's gloo pairs listen, and which TCP sockets a process holds (for sealing the group's store).

Where gloo listens (``pair_address``)
    gloo's pair listener binds ``pair_address(host)`` only: ``host`` itself where it is an address of this
    machine (FFN rank 0, and every rank of a group on one host), else the address this machine reaches
    ``host`` from (``local_address``). Left to torch, gloo would bind whatever the machine's name resolves to
    (127.0.0.1, or the LAN address) whatever ``host`` says. A wildcard ``host`` (``0.0.0.0``, ``::``) keeps
    torch's choice.

A process's sockets (``tcp_sockets``; ``tcp_table``: its network namespace's, whoever holds them)
    Read from ``/proc/<pid>/fd`` and ``/proc/<pid>/net/tcp``/``tcp6`` (Linux only): what
    ``afd_patches.connectors.store`` and ``afd_patches.connectors.sealing`` use to name and cut the
    connections to the group's store.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from typing import NamedTuple

TCP_ESTABLISHED, TCP_LISTEN = 0x01, 0x0A  # states as /proc/net/tcp writes them


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


def tcp_table(pid: int | str = "self") -> list[TcpSocket]:
    """Every TCP socket of the network namespace process ``pid`` is in, whoever holds it, as
    ``/proc/<pid>/net/tcp`` and ``tcp6`` show them; ``fd`` is -1 (not looked up). Linux only."""
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue  # a kernel without IPv6
        for cols in (row.split() for row in rows):
            found.append(TcpSocket(_endpoint(cols[1]), _endpoint(cols[2]), int(cols[3], 16),
                                   int(cols[4].split(":")[1], 16), int(cols[9]), -1))
    return found


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
    return [s._replace(fd=fds[s.inode]) for s in tcp_table(pid) if s.inode in fds]


def _endpoint(text: str) -> tuple[str, int]:
    """``0100007F:1F90`` (/proc/net/tcp: 32-bit words in host byte order, hex port) -> ``("127.0.0.1", 8080)``."""
    words, port = text.split(":")
    packed = b"".join(bytes.fromhex(words[i : i + 8])[:: -1 if sys.byteorder == "little" else 1]
                      for i in range(0, len(words), 8))
    ip = ipaddress.ip_address(packed)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)
