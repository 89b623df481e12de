"""Network namespaces for a fault benchmark: one per process, one bridge joining them, a hosts file each.

``Lab`` makes, on entry: a bridge in the root namespace with the first address of a free ``10.231.X.0/24``; per
``add(name)`` a namespace ``afdc<id>-<name>`` whose ``eth0`` (one end of a veth pair, the other on the bridge) holds
the next address, its loopback up, and ``/etc/netns/<namespace>/hosts`` (``ip netns exec`` bind-mounts it over
``/etc/hosts``, so names resolve per namespace). ``tmpfs(size)`` mounts a small tmpfs on a new folder. ``close()``
(also on ``__exit__``) removes everything ``Lab`` made, in reverse order, each step on its own (one failing does not
keep the rest); processes are the caller's to stop first. The root namespace reaches every namespace address through
the bridge; nothing is routed beyond it.

Limits: Linux, root (``CAP_NET_ADMIN``, ``CAP_SYS_ADMIN``) and ``ip`` (iproute2). Raises ``LabError`` when a
namespace cannot be made. Hosts files are rewritten in place (the bind mount holds the inode: a rename would not be
seen inside). No traffic shaping: netem is not in every kernel.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

NETNS_ETC = Path("/etc/netns")


class LabError(RuntimeError):
    """A namespace, link or mount could not be made (not root, no ``ip``, no netns support)."""


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise LabError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")


def _free_subnet() -> str:
    """``10.231.X`` with no address of this host in it."""
    used = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=False).stdout
    for x in range(1, 255):
        if f" 10.231.{x}." not in used:
            return f"10.231.{x}"
    raise LabError("no free 10.231.X.0/24 subnet")


class Lab:
    """See the module docstring. ``names`` maps a namespace's short name to its address once ``add``ed."""

    def __init__(self) -> None:
        self.tag = f"afdc{os.getpid() % 100000}"
        self.bridge = f"{self.tag}br"
        self.subnet = ""
        self.addresses: dict[str, str] = {}
        self._undo: list[tuple[str, ...]] = []  # commands that remove what was made, newest last

    def __enter__(self) -> Lab:
        return self.open()

    def open(self) -> Lab:
        """Make the bridge; ``self``. ``LabError`` (everything made so far removed) when it cannot be made."""
        try:
            if not NETNS_ETC.exists():
                NETNS_ETC.mkdir(parents=True)
                self._undo.append(("rmdir", str(NETNS_ETC)))  # last to go; kept while another run uses it
            self.subnet = _free_subnet()
            _ip("link", "add", self.bridge, "type", "bridge")
            self._undo.append(("ip", "link", "del", self.bridge))
            _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except (LabError, OSError) as e:
            self.close()
            raise LabError(str(e)) from e
        return self

    def __exit__(self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]) -> None:
        self.close()

    def ns(self, name: str) -> str:
        """The namespace's full name."""
        return f"{self.tag}-{name}"

    def add(self, name: str) -> str:
        """A namespace ``name`` on the bridge; its address."""
        ns, host_end = self.ns(name), f"{self.tag}{len(self.addresses)}"
        address = f"{self.subnet}.{len(self.addresses) + 2}"
        _ip("netns", "add", ns)
        self._undo.append(("ip", "netns", "del", ns))
        etc = NETNS_ETC / ns
        etc.mkdir(parents=True, exist_ok=True)
        self._undo.append(("rm", "-rf", str(etc)))
        (etc / "hosts").write_text("127.0.0.1 localhost\n")
        _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._undo.append(("ip", "link", "del", host_end))
        _ip("link", "set", host_end, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.addresses[name] = address
        return address

    def hosts(self, name: str, entries: dict[str, str]) -> None:
        """Namespace ``name``'s hosts file: localhost plus ``entries`` (host name -> address), rewritten in place."""
        text = "127.0.0.1 localhost\n" + "".join(f"{addr} {host}\n" for host, addr in entries.items())
        with (NETNS_ETC / self.ns(name) / "hosts").open("r+") as fh:
            fh.truncate(0)
            fh.write(text)

    def link(self, name: str, up: bool) -> None:
        """Namespace ``name``'s ``eth0`` up or down (from inside the namespace)."""
        _ip("-n", self.ns(name), "link", "set", "eth0", "up" if up else "down")

    def command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``name``."""
        return ["ip", "netns", "exec", self.ns(name), *argv]

    def tmpfs(self, size: str) -> Path:
        """A tmpfs of ``size`` (e.g. ``64m``) mounted on a new folder under /tmp (a short path: vLLM's IPC sockets
        under a ``TMPDIR`` there must fit ``sun_path``'s 107 bytes); the folder."""
        path = Path(tempfile.mkdtemp(prefix=f"{self.tag}-", dir="/tmp"))
        self._undo.append(("rmdir", str(path)))
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise LabError(f"mount tmpfs at {path}: {proc.stderr.strip()}")
        self._undo.append(("umount", "-l", str(path)))
        return path

    def close(self) -> None:
        """Remove everything made, newest first; each step on its own."""
        while self._undo:
            with contextlib.suppress(OSError):
                subprocess.run(self._undo.pop(), capture_output=True, check=False, timeout=30)
