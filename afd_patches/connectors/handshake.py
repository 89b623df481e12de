"""The AFD "hello": ranks compare their settings before any torch group forms.

Why
    torch's rendezvous cannot tell a misconfigured peer from a slow one: two
    sides with different world sizes hang or fail with torch's own error, and a
    ``TCPStore`` client that reaches some other program at ``host:port`` waits
    forever (measured with torch 2.13, whatever its timeout). So every rank
    first talks to the rank that hosts the group (FFN rank 0) over a plain TCP
    socket, where every wait is ours and bounded.

Protocol (one JSON object per line, at most ``MAX_LINE`` bytes)
    A joining rank connects to ``host:port`` (retrying while nothing listens)
    and sends its hello ``{"afd_hello": PROTOCOL, "role", "rank", "fields"}``.
    The host answers with its own hello at once, and later with one verdict
    line ``{"afd_verdict": "ok"}`` once every expected rank has said hello, or
    ``{"afd_verdict": "fail", "kind", "message"}`` at the first problem.

Rules
    ``fields`` maps names to JSON values (counts, backend, ``model.*`` identity).
    A field present on both sides must be equal; a field only one side has (a
    creator that supplied no model identity) is not compared. Both sides
    compare, so both fail with ``ConnectorMismatch`` naming every differing
    field and both values. The host also rejects a rank claimed twice or
    outside its topology. Other ranks waiting for the verdict fail with the
    host's message. A connection that sends no valid hello within
    ``HELLO_READ_S`` (a port scanner, a probe) is dropped and does not count.

Limits
    The host handles one connection at a time, so a connection that stays
    silent delays the others by up to ``HELLO_READ_S``. After the handshake the host
    hands its listening socket to torch's ``TCPStore``; a rank that says hello
    after that reaches the store, not this protocol, and fails (closed
    connection). Nothing here is authenticated: it catches mistakes, not
    attackers.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from afd_patches.connectors.base import ConnectorError, ConnectorMismatch, ConnectorTimeout

logger = logging.getLogger("afd")

PROTOCOL = 1
MAX_LINE = 64 * 1024
HELLO_READ_S = 5.0  # how long the host waits for a hello on an accepted connection
BACKLOG = 256
_KINDS: dict[str, type[ConnectorError]] = {
    "mismatch": ConnectorMismatch,
    "timeout": ConnectorTimeout,
    "error": ConnectorError,
}


@dataclass(frozen=True)
class Hello:
    """What one rank says about itself."""

    role: str
    rank: int
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def who(self) -> str:
        return f"{self.role} rank {self.rank}"

    def encode(self) -> bytes:
        return _line({"afd_hello": PROTOCOL, "role": self.role, "rank": self.rank, "fields": self.fields})


def model_fields(identity: Mapping[str, Any] | None) -> dict[str, Any]:
    """``{"hidden_size": 64}`` → ``{"model.hidden_size": 64}``, dropping ``None`` values."""
    return {f"model.{k}": v for k, v in (identity or {}).items() if v is not None}


def differences(a: Hello, b: Hello) -> str:
    """``""`` when ``a`` and ``b`` agree, else ``"f (a: x, b: y); …"`` for every field both have."""
    parts = [
        f"{name} ({a.who}: {a.fields[name]!r}, {b.who}: {b.fields[name]!r})"
        for name in sorted(set(a.fields) & set(b.fields))
        if a.fields[name] != b.fields[name]
    ]
    return "; ".join(parts)


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True).encode() + b"\n"


class _Lines:
    """Newline-terminated reads from a socket; bytes after a line are kept for the next one."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buf = b""

    def read(self, deadline: float) -> bytes:
        """One line (without the newline); ``TimeoutError`` at ``deadline``, ``EOFError`` when closed first."""
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.conn.settimeout(left)
            chunk = self.conn.recv(4096)
            if not chunk:
                raise EOFError(self.buf[:80])
            self.buf += chunk
            if len(self.buf) > MAX_LINE:
                raise ValueError(f"line longer than {MAX_LINE} bytes: {self.buf[:80]!r}")
        line, self.buf = self.buf.split(b"\n", 1)
        return line


def _parse_hello(line: bytes) -> Hello:
    """``ValueError`` unless ``line`` is a hello of this protocol version."""
    try:
        obj = json.loads(line)
    except ValueError:
        obj = None
    if not isinstance(obj, dict) or "afd_hello" not in obj:
        raise ValueError(f"not an AFD hello: {line[:80]!r}")
    if obj["afd_hello"] != PROTOCOL:
        raise ValueError(f"AFD handshake protocol {obj['afd_hello']!r}, this side speaks {PROTOCOL}")
    role, rank, fields = obj.get("role"), obj.get("rank"), obj.get("fields")
    if not isinstance(role, str) or not isinstance(rank, int) or not isinstance(fields, dict):
        raise ValueError(f"malformed AFD hello: {line[:80]!r}")
    return Hello(role, rank, fields)


def _send_quietly(conn: socket.socket, data: bytes) -> None:
    try:
        conn.settimeout(1.0)
        conn.sendall(data)
    except OSError:
        pass  # that peer is gone; it fails on its own


# ------------------------------------------------------------------ host side
def listen(host: str, port: int) -> socket.socket:
    """Listen on ``port`` on every local address (as torch's ``TCPStore`` does); fail at once if taken.

    ``SO_REUSEADDR`` is set, so only a socket that is really in use (listening or
    bound by a live program) makes this fail: ``ConnectorError`` naming
    ``host:port`` and saying it is in use.
    """
    address = f"{host}:{port}"
    dual = socket.has_dualstack_ipv6()
    try:
        return socket.create_server(("", port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                    backlog=BACKLOG, dualstack_ipv6=dual)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConnectorError(
                f"AFD: cannot host the group at {address}: port {port} is already in use by another program "
                f"(EADDRINUSE); stop it or give every engine of the group another port"
            ) from e
        raise ConnectorError(f"AFD: cannot host the group at {address}: {e}") from e


def collect(listener: socket.socket, own: Hello, expected: set[tuple[str, int]], deadline: float,
            address: str, timeout_s: float) -> list[socket.socket]:
    """Accept hellos until every ``(role, rank)`` of ``expected`` has said one; their open connections.

    Each joiner gets ``own`` back at once. On the first mismatch, duplicate or
    unexpected rank, or at ``deadline``, every waiting joiner is sent a failing
    verdict, the connections are closed and the error is raised here too.
    """
    waiting: dict[tuple[str, int], socket.socket] = {}
    conn: socket.socket | None = None
    try:
        while set(waiting) != expected:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = ", ".join(f"{r} rank {i}" for r, i in sorted(expected - set(waiting)))
                raise ConnectorTimeout(
                    f"AFD handshake at {address}: {own.who} heard from {len(waiting)} of {len(expected)} expected "
                    f"rank(s) within {timeout_s:g}s; missing: {missing}"
                )
            listener.settimeout(left)
            try:
                conn, peer_addr = listener.accept()
            except TimeoutError:
                continue
            try:
                other = _parse_hello(_Lines(conn).read(min(deadline, time.monotonic() + HELLO_READ_S)))
            except (OSError, EOFError, ValueError) as e:  # TimeoutError is an OSError
                logger.warning("AFD handshake at %s: dropped a connection from %s that sent no AFD hello (%r)",
                               address, peer_addr, e)
                conn.close()
                conn = None
                continue
            _send_quietly(conn, own.encode())
            diff = differences(own, other)
            if diff:
                raise ConnectorMismatch(f"AFD handshake at {address} failed: {own.who} and {other.who} disagree "
                                        f"on {diff}")
            key = (other.role, other.rank)
            if key in waiting or key == (own.role, own.rank):
                raise ConnectorMismatch(f"AFD handshake at {address} failed: two processes claim to be {other.who}")
            if key not in expected:
                raise ConnectorMismatch(f"AFD handshake at {address} failed: {other.who} is not part of the "
                                        f"topology {own.who} hosts")
            waiting[key] = conn
            conn = None
    except ConnectorError as e:
        kind = next(name for name, cls in _KINDS.items() if isinstance(e, cls))  # "error" matches last
        refuse([*waiting.values(), *([conn] if conn is not None else [])], kind, str(e))
        raise
    return list(waiting.values())


def accept_all(conns: list[socket.socket]) -> None:
    """Send the ``ok`` verdict to every joiner and close the connections."""
    for conn in conns:
        _send_quietly(conn, _line({"afd_verdict": "ok"}))
        conn.close()


def refuse(conns: list[socket.socket], kind: str, message: str) -> None:
    """Send a failing verdict (``kind`` in ``mismatch``/``timeout``/``error``) and close the connections."""
    for conn in conns:
        _send_quietly(conn, _line({"afd_verdict": "fail", "kind": kind, "message": message}))
        conn.close()


# ------------------------------------------------------------------ joining side
def _connect(host: str, port: int, deadline: float, who: str, timeout_s: float) -> socket.socket:
    """Connect, retrying while nothing listens; ``ConnectorTimeout`` at ``deadline``."""
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConnectorTimeout(
                f"AFD connector init failed for {who}: nothing accepted a connection at {host}:{port} "
                f"within {timeout_s:g}s; is FFN rank 0 (which hosts the group) running there? (last error: {last})"
            )
        try:
            return socket.create_connection((host, port), timeout=min(left, 1.0))
        except OSError as e:
            last = e
            time.sleep(min(0.1, max(deadline - time.monotonic(), 0)))


def join(host: str, port: int, own: Hello, deadline: float, timeout_s: float) -> None:
    """Say hello to the host and wait for its verdict; return on ``ok``.

    Raises ``ConnectorMismatch`` when the settings differ (naming each field
    and both values) or the host refused the group, ``ConnectorTimeout`` when
    no answer came by ``deadline``, and ``ConnectorError`` when whatever listens
    at ``host:port`` does not speak this protocol.
    """
    address = f"{host}:{port}"
    with _connect(host, port, deadline, own.who, timeout_s) as conn:
        lines = _Lines(conn)
        try:
            conn.settimeout(max(deadline - time.monotonic(), 0.1))
            conn.sendall(own.encode())
            line = lines.read(deadline)
        except TimeoutError:
            raise ConnectorTimeout(
                f"AFD handshake for {own.who}: {address} accepted a connection but sent no AFD handshake answer "
                f"within {timeout_s:g}s; is another program listening there?"
            ) from None
        except (OSError, EOFError, ValueError) as e:
            raise ConnectorError(
                f"AFD handshake for {own.who}: {address} closed or broke the connection without an AFD handshake "
                f"answer ({e!r}); another program is listening there, or that group has already formed"
            ) from e
        try:
            host_hello = _parse_hello(line)
        except ValueError as e:
            raise ConnectorError(
                f"AFD handshake for {own.who}: {address} is not an AFD FFN rank 0 ({e}); another program is "
                f"listening there, or a different AFD version"
            ) from e
        diff = differences(own, host_hello)
        if diff:
            raise ConnectorMismatch(f"AFD handshake at {address} failed: {own.who} and {host_hello.who} disagree "
                                    f"on {diff}")
        try:
            verdict = json.loads(lines.read(deadline))
        except TimeoutError:
            raise ConnectorTimeout(
                f"AFD handshake for {own.who}: {host_hello.who} at {address} did not complete the group within "
                f"{timeout_s:g}s (waiting for the other ranks to say hello)"
            ) from None
        except (OSError, EOFError, ValueError) as e:
            raise ConnectorError(f"AFD handshake for {own.who}: lost {host_hello.who} at {address} ({e!r})") from e
        if not isinstance(verdict, dict) or verdict.get("afd_verdict") != "ok":
            verdict = verdict if isinstance(verdict, dict) else {}
            cls = _KINDS.get(str(verdict.get("kind")), ConnectorError)
            raise cls(f"{host_hello.who} at {address} refused the group for {own.who}: "
                      f"{verdict.get('message', verdict)}")
