"""The AFD rendezvous: ranks authenticate and compare settings before any torch group forms.

Why
    torch's rendezvous cannot tell a misconfigured peer from a slow one, its
    store has no authentication, and a ``TCPStore`` client that reaches some
    other program waits forever. So every rank first talks to the rank that
    hosts the group (FFN rank 0) over a plain TCP socket bound to the configured
    ``host`` only, where every wait is ours and bounded.

Protocol (one JSON object per line, at most ``MAX_LINE`` bytes)
    1. joiner → host ``{"afd_hello": PROTOCOL, "nonce": Nj}``
    2. host → joiner ``{"afd_challenge": PROTOCOL, "nonce": Nh, "proof": P_host}``
    3. the joiner checks ``P_host`` (constant time); on a mismatch it says
       ``{"afd_auth": "fail"}`` and stops. Otherwise it sends
       ``{"proof": P_join, "role", "rank", "fields"}``.
    4. the host checks ``P_join`` first (constant time), then answers with its
       own ``{"afd_hello", "role", "rank", "fields"}`` and, once every expected
       rank is in, one verdict line ``{"afd_verdict": "ok"}`` or
       ``{"afd_verdict": "fail", "kind", "message"}``.
    The proofs are HMACs under the group's token over both nonces
    (``afd_patches.connectors.auth``), so neither side reveals its settings to
    a party that does not hold the token, and a recorded exchange cannot be
    replayed (fresh nonces on both sides).

Rules
    ``fields`` maps names to JSON values (counts, backend, ``model.*``
    identity). A field present on both sides must be equal; a field only one
    side has is not compared. A difference between authenticated peers fails
    the group on both sides with ``ConnectorMismatch`` naming every differing
    field and both values (a configuration mistake of the operator).
    ``device`` says where a rank's tensors live (``host/GPU-<uuid>``, or ``""``
    for host memory) and is not compared for equality: when ``fields
    ["backend"]`` is ``nccl``, two ranks naming the same device fail the group
    with ``ConnectorMismatch`` saying how to fix it (NCCL refuses two ranks of
    one communicator on one GPU, and would say so only at the first exchange).

Hostile input never ends the group
    The host serves each accepted connection on its own thread
    (at most ``MAX_PENDING`` at once; more are closed at once), with its own
    deadline ``HELLO_READ_S`` and line limit. Anything that is not a valid,
    authenticated hello — random bytes, an over-long or deeply nested line
    (every parse error is caught), a wrong token, a silent connection, an
    unknown role, a rank outside the topology, a rank already taken — drops
    that connection only, is logged once (``AFD rendezvous at …: refused …``)
    and is counted; the real peers' handshake goes on. An authenticated hello
    for a rank already taken gets a ``ConnectorMismatch`` verdict (that process
    fails naming the rank). A timeout of the group names what was refused.

Limits
    After the handshake the host hands its listening socket to torch's
    ``TCPStore``; connections after that reach the store (unauthenticated, as
    torch's store is), not this protocol. The tensor traffic (gloo/NCCL) is not
    authenticated or encrypted either: see SECURITY.md (on ``backend: tcp`` both
    ends of each data connection prove the token, see ``sockets``; nothing is
    encrypted).
"""

from __future__ import annotations

import errno
import json
import logging
import queue
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from afd_patches.connectors import auth
from afd_patches.connectors.base import ConnectorAuthError, ConnectorError, ConnectorMismatch, ConnectorTimeout
from afd_patches.connectors.metrics import METRICS

logger = logging.getLogger("afd")

PROTOCOL = 2
MAX_LINE = 16 * 1024
HELLO_READ_S = 5.0  # how long the host gives one connection to authenticate and say hello
MAX_PENDING = 64  # connections in authentication at once; more are closed at once
BACKLOG = 256
POLL_S = 0.1  # how often waiting loops look at their deadline and cancel event
_KINDS: dict[str, type[ConnectorError]] = {
    "mismatch": ConnectorMismatch,
    "timeout": ConnectorTimeout,
    "auth": ConnectorAuthError,
    "error": ConnectorError,
}


@dataclass(frozen=True)
class Hello:
    """What one rank says about itself (after authentication)."""

    role: str
    rank: int
    fields: dict[str, Any] = field(default_factory=dict)
    device: str = ""

    @property
    def who(self) -> str:
        return f"{self.role} rank {self.rank}"

    def as_dict(self) -> dict[str, Any]:
        return {"role": self.role, "rank": self.rank, "fields": self.fields, "device": self.device}


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


def device_clash(a: Hello, b: Hello) -> str:
    """``""`` unless ``a`` and ``b`` would be two ranks of one NCCL group on one GPU; else what to do about it."""
    if not a.device or a.device != b.device or "nccl" not in (a.fields.get("backend"), b.fields.get("backend")):
        return ""
    return (f"{a.who} and {b.who} both use GPU {a.device}, and NCCL cannot put two ranks of one group on one "
            "GPU; give each engine its own GPU (CUDA_VISIBLE_DEVICES per engine, or connector_extra_config "
            "device), or set connector_extra_config backend: gloo on a single-GPU test box")


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True).encode() + b"\n"


class _Lines:
    """Newline-terminated reads from a socket; bytes after a line are kept for the next one."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buf = b""

    def read(self, deadline: float) -> bytes:
        """One line (without the newline); ``TimeoutError`` at ``deadline``, ``EOFError`` when closed first,
        ``ValueError`` past ``MAX_LINE`` bytes."""
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no complete line in time")
            self.conn.settimeout(left)
            chunk = self.conn.recv(4096)
            if not chunk:
                raise EOFError("connection closed")
            self.buf += chunk
            if len(self.buf) > MAX_LINE:
                raise ValueError(f"line longer than {MAX_LINE} bytes")
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def read_object(self, deadline: float) -> dict[str, Any]:
        """One line parsed as a JSON object; ``ValueError`` for anything else (deep nesting included)."""
        line = self.read(deadline)
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError, UnicodeError) as e:
            raise ValueError(f"not JSON ({type(e).__name__})") from None
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        return obj


def _hex(obj: dict[str, Any], key: str, size: int) -> bytes:
    value = obj.get(key)
    if not isinstance(value, str) or len(value) != 2 * size:
        raise ValueError(f"no valid {key!r}")
    return bytes.fromhex(value)


def _parse_hello(obj: dict[str, Any]) -> Hello:
    """``ValueError`` unless ``obj`` carries a well-formed role, rank and fields."""
    role, rank, fields, device = obj.get("role"), obj.get("rank"), obj.get("fields"), obj.get("device", "")
    if not isinstance(role, str) or isinstance(rank, bool) or not isinstance(rank, int) or not isinstance(fields, dict):
        raise ValueError("malformed role/rank/fields")
    if not isinstance(device, str):
        raise ValueError("malformed device")
    return Hello(role, rank, fields, device)


def _send_quietly(conn: socket.socket, data: bytes) -> None:
    try:
        conn.settimeout(1.0)
        conn.sendall(data)
    except OSError:
        pass  # that peer is gone; it fails on its own


def _peer(addr: Any) -> str:
    try:
        host, port = addr[0], addr[1]
    except (TypeError, IndexError):
        return str(addr)
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


# ------------------------------------------------------------------ host side
def listen(host: str, port: int) -> socket.socket:
    """Listen on ``host:port`` only (all interfaces only for ``0.0.0.0`` / ``::``); fail at once if taken.

    ``SO_REUSEADDR`` is set, so only a socket that is really in use makes this
    fail: ``ConnectorError`` naming ``host:port`` and saying it is in use.
    """
    address = f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        family, _, _, _, sockaddr = infos[0]
        return socket.create_server(sockaddr, family=family, backlog=BACKLOG)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConnectorError(
                f"AFD: cannot host the group at {address}: port {port} is already in use by another program "
                f"(EADDRINUSE); stop it or give every engine of the group another port"
            ) from e
        raise ConnectorError(f"AFD: cannot host the group at {address}: {e}") from e


@dataclass
class _Joined:
    conn: socket.socket
    hello: Hello
    peer: str


class _Gate:
    """The host's handshake threads: each authenticates one connection and hands over its hello."""

    def __init__(self, own: Hello, token: bytes | None, address: str) -> None:
        self.own = own
        self.token = token
        self.address = address
        self.joined: queue.Queue[_Joined] = queue.Queue()
        self.lock = threading.Lock()
        self.open: set[socket.socket] = set()
        self.closed = False
        self.refused: Counter[str] = Counter()
        self.last_refused: dict[str, str] = {}

    def note(self, peer: str, why: str) -> None:
        """Log one refused connection and count it."""
        logger.warning("AFD rendezvous at %s: refused the connection from %s: %s", self.address, peer, why)
        with self.lock:
            self.refused[why] += 1
            self.last_refused[why] = peer
        METRICS.add("handshakes_refused")

    def drop(self, conn: socket.socket, peer: str, why: str, verdict: tuple[str, str] | None = None) -> None:
        """Refuse ``conn`` once: log, count, optionally send a failing verdict, close.

        Only the first call for a connection still in authentication acts, so a
        handler thread that fails because ``finish()`` closed its socket logs nothing more.
        """
        with self.lock:
            if conn not in self.open:
                return
            self.open.discard(conn)
        self.note(peer, why)
        if verdict is not None:
            kind, message = verdict
            _send_quietly(conn, _line({"afd_verdict": "fail", "kind": kind, "message": message}))
        conn.close()

    def summary(self) -> str:
        """``""`` or ``"; refused N connection(s): 2x wrong token (last from …), …"``."""
        with self.lock:
            if not self.refused:
                return ""
            parts = [f"{n}x {why} (last from {self.last_refused[why]})" for why, n in self.refused.most_common()]
            return f"; refused {sum(self.refused.values())} connection(s) meanwhile: " + ", ".join(parts)

    def start(self, conn: socket.socket, addr: Any) -> None:
        peer = _peer(addr)
        with self.lock:
            full = len(self.open) >= MAX_PENDING
            if not full:
                self.open.add(conn)
        if full:
            self.note(peer, f"more than {MAX_PENDING} connections in authentication")
            conn.close()
            return
        threading.Thread(target=self._serve, args=(conn, peer), name="afd-hello", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        """Authenticate one connection within ``HELLO_READ_S``; hand a valid hello to the collecting thread."""
        deadline = time.monotonic() + HELLO_READ_S
        try:
            lines = _Lines(conn)
            first = lines.read_object(deadline)
            if first.get("afd_hello") != PROTOCOL:
                raise ValueError(f"not an AFD protocol {PROTOCOL} hello")
            joiner_nonce = _hex(first, "nonce", auth.NONCE_BYTES)
            host_nonce = auth.nonce()
            conn.settimeout(max(deadline - time.monotonic(), 0.01))
            conn.sendall(_line({"afd_challenge": PROTOCOL, "nonce": host_nonce.hex(),
                                "proof": auth.proof(self.token, auth.HOST_LABEL, joiner_nonce, host_nonce).hex()}))
            second = lines.read_object(deadline)
            if second.get("afd_auth") == "fail":
                self.drop(conn, peer, "different token (the joining rank rejected this side's proof)")
                return
            given = _hex(second, "proof", 32)
            if not auth.verify(self.token, auth.JOIN_LABEL, joiner_nonce, host_nonce, given):
                self.drop(conn, peer, "wrong token (authentication failed)",
                          ("auth", f"AFD rendezvous at {self.address}: authentication failed (different token)"))
                return
            hello = _parse_hello(second)
            conn.settimeout(max(deadline - time.monotonic(), 0.01))
            conn.sendall(_line({"afd_hello": PROTOCOL, **self.own.as_dict()}))
        except (OSError, EOFError, ValueError, RecursionError) as e:  # a stranger's bytes end that connection only
            why = "no AFD hello in time" if isinstance(e, TimeoutError) else f"no valid AFD hello ({e})"
            self.drop(conn, peer, why)
            return
        with self.lock:
            late = self.closed
            self.open.discard(conn)  # from here on the collecting thread owns it
            if not late:
                self.joined.put(_Joined(conn, hello, peer))
        if late:
            conn.close()

    def accept_from(self, listener: socket.socket) -> None:
        """Accept on ``listener`` in a thread until ``finish()``; each connection gets its own handler."""
        self._wake_r, self._wake_w = socket.socketpair()
        self._acceptor = threading.Thread(target=self._accept_loop, args=(listener,), name="afd-accept",
                                          daemon=True)
        self._acceptor.start()

    def _accept_loop(self, listener: socket.socket) -> None:
        listener.settimeout(POLL_S)  # accept() never blocks longer, even after a connection vanished
        with selectors.DefaultSelector() as sel:
            sel.register(listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                if any(key.fileobj is self._wake_r for key, _ in sel.select()):
                    return
                try:
                    conn, addr = listener.accept()
                except TimeoutError:
                    continue
                except OSError as e:  # out of descriptors, say: wait instead of spinning
                    logger.warning("AFD rendezvous at %s: accept failed (%s)", self.address, e)
                    time.sleep(POLL_S)
                    continue
                self.start(conn, addr)

    def finish(self) -> None:
        """Stop accepting and handing over hellos; refuse (and log) every connection still in authentication."""
        self._wake_w.send(b"x")
        self._acceptor.join()
        self._wake_r.close()
        self._wake_w.close()
        with self.lock:
            self.closed = True
            pending = list(self.open)
        for conn in pending:
            try:
                peer = _peer(conn.getpeername())
            except OSError:
                peer = "a closed connection"
            self.drop(conn, peer, "no AFD hello before the handshake ended")


def collect(listener: socket.socket, own: Hello, expected: set[tuple[str, int]], deadline: float,
            address: str, timeout_s: float, token: bytes | None = None,
            cancelled: Callable[[], bool] = lambda: False) -> list[socket.socket]:
    """Accept authenticated hellos until every ``(role, rank)`` of ``expected`` said one; their open connections.

    Refused connections (see "Hostile input") do not end the wait. On a settings
    mismatch of an authenticated peer, at ``deadline`` or when ``cancelled()``,
    every waiting joiner is sent a failing verdict, the connections are closed
    and ``ConnectorMismatch``/``ConnectorTimeout``/``ConnectorError`` is raised.
    """
    gate = _Gate(own, token, address)
    gate.accept_from(listener)
    waiting: dict[tuple[str, int], _Joined] = {}
    current: _Joined | None = None
    try:
        while set(waiting) != expected:
            if cancelled():
                raise ConnectorError(f"AFD handshake at {address}: cancelled (engine shutting down)")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = ", ".join(f"{r} rank {i}" for r, i in sorted(expected - set(waiting)))
                raise ConnectorTimeout(
                    f"AFD handshake at {address}: {own.who} heard from {len(waiting)} of {len(expected)} expected "
                    f"rank(s) within {timeout_s:g}s; missing: {missing}{gate.summary()}"
                )
            try:
                current = gate.joined.get(timeout=min(left, POLL_S))
            except queue.Empty:
                continue
            diff = differences(own, current.hello)
            if diff:
                raise ConnectorMismatch(f"AFD handshake at {address} failed: {own.who} and {current.hello.who} "
                                        f"disagree on {diff}")
            key = (current.hello.role, current.hello.rank)
            if key in waiting or key == (own.role, own.rank):
                why = f"{current.hello.who} is already taken"
                gate.note(current.peer, why)
                refuse([current.conn], "mismatch",
                       f"AFD handshake at {address} failed: two processes claim to be {current.hello.who}; {why}")
            elif key not in expected:
                why = f"{current.hello.who} is not part of the topology {own.who} hosts"
                gate.note(current.peer, why)
                refuse([current.conn], "mismatch", f"AFD handshake at {address} failed: {why}")
            else:
                for other in [own, *(j.hello for j in waiting.values())]:
                    clash = device_clash(other, current.hello)
                    if clash:
                        raise ConnectorMismatch(f"AFD handshake at {address} failed: {clash}")
                waiting[key] = current
            current = None
    except ConnectorError as e:
        kind = next(name for name, cls in _KINDS.items() if isinstance(e, cls))  # "error" matches last
        refuse([j.conn for j in [*waiting.values(), *([current] if current else [])]], kind, str(e))
        raise
    finally:
        gate.finish()
        while True:  # hellos handed over after the last look
            try:
                gate.joined.get_nowait().conn.close()
            except queue.Empty:
                break
    return [j.conn for j in waiting.values()]


def accept_all(conns: list[socket.socket]) -> None:
    """Send the ``ok`` verdict to every joiner and close the connections."""
    for conn in conns:
        _send_quietly(conn, _line({"afd_verdict": "ok"}))
        conn.close()


def refuse(conns: list[socket.socket], kind: str, message: str) -> None:
    """Send a failing verdict (``kind`` in ``mismatch``/``timeout``/``auth``/``error``) and close the connections."""
    for conn in conns:
        _send_quietly(conn, _line({"afd_verdict": "fail", "kind": kind, "message": message}))
        conn.close()


# ------------------------------------------------------------------ joining side
def _connect(host: str, port: int, deadline: float, who: str, timeout_s: float,
             cancelled: Callable[[], bool]) -> socket.socket:
    """Connect, retrying while nothing listens; ``ConnectorTimeout`` at ``deadline``."""
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if cancelled():
            raise ConnectorError(f"AFD connector init for {who}: cancelled (engine shutting down)")
        if left <= 0:
            raise ConnectorTimeout(
                f"AFD connector init failed for {who}: nothing accepted a connection at {host}:{port} "
                f"within {timeout_s:g}s; is FFN rank 0 (which hosts the group) running there? (last error: {last})"
            )
        try:
            return socket.create_connection((host, port), timeout=min(left, 1.0))
        except OSError as e:
            last = e
            time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0)))


def join(host: str, port: int, own: Hello, deadline: float, timeout_s: float, token: bytes | None = None,
         cancelled: Callable[[], bool] = lambda: False) -> None:
    """Authenticate to the host, say hello and wait for its verdict; return on ``ok``.

    Raises ``ConnectorAuthError`` when the host holds another token (nothing of
    this side's settings was sent), ``ConnectorMismatch`` when the settings
    differ (naming each field and both values) or the host refused the group,
    ``ConnectorTimeout`` when no answer came by ``deadline``, and
    ``ConnectorError`` when whatever listens at ``host:port`` does not speak
    this protocol.
    """
    address = f"{host}:{port}"
    with _connect(host, port, deadline, own.who, timeout_s, cancelled) as conn:
        lines = _Lines(conn)
        joiner_nonce = auth.nonce()
        try:
            conn.settimeout(max(deadline - time.monotonic(), 0.1))
            conn.sendall(_line({"afd_hello": PROTOCOL, "nonce": joiner_nonce.hex()}))
            challenge = lines.read_object(deadline)
            if challenge.get("afd_challenge") != PROTOCOL:
                raise ValueError(f"not an AFD protocol {PROTOCOL} challenge")
            host_nonce = _hex(challenge, "nonce", auth.NONCE_BYTES)
            host_proof = _hex(challenge, "proof", 32)
        except TimeoutError:
            raise ConnectorTimeout(
                f"AFD handshake for {own.who}: {address} accepted a connection but sent no AFD handshake answer "
                f"within {timeout_s:g}s; is another program listening there?"
            ) from None
        except (OSError, EOFError) as e:
            raise ConnectorError(
                f"AFD handshake for {own.who}: {address} closed or broke the connection without an AFD handshake "
                f"answer ({e!r}); another program is listening there, or that group has already formed"
            ) from e
        except ValueError as e:
            raise ConnectorError(
                f"AFD handshake for {own.who}: {address} is not an AFD FFN rank 0 ({e}); another program is "
                f"listening there, or a different AFD version"
            ) from e
        if not auth.verify(token, auth.HOST_LABEL, joiner_nonce, host_nonce, host_proof):
            _send_quietly(conn, _line({"afd_auth": "fail"}))
            mine = "a token" if token else "no token"
            raise ConnectorAuthError(
                f"AFD handshake for {own.who}: authentication with {address} failed: the host holds a different "
                f"token (this side has {mine}); {auth.HOW_TO_SET}. Nothing of this side's settings was sent"
            )
        hello = {"proof": auth.proof(token, auth.JOIN_LABEL, joiner_nonce, host_nonce).hex(), **own.as_dict()}
        _send_quietly(conn, _line(hello))
        host_hello = _read_host_reply(lines, deadline, own, address, timeout_s)
        diff = differences(own, host_hello)
        if diff:
            raise ConnectorMismatch(f"AFD handshake at {address} failed: {own.who} and {host_hello.who} disagree "
                                    f"on {diff}")
        clash = device_clash(own, host_hello)
        if clash:
            raise ConnectorMismatch(f"AFD handshake at {address} failed: {clash}")
        try:
            verdict = lines.read_object(deadline)
        except TimeoutError:
            raise ConnectorTimeout(
                f"AFD handshake for {own.who}: {host_hello.who} at {address} did not complete the group within "
                f"{timeout_s:g}s (waiting for the other ranks to say hello)"
            ) from None
        except (OSError, EOFError, ValueError) as e:
            raise ConnectorError(f"AFD handshake for {own.who}: lost {host_hello.who} at {address} ({e!r})") from e
        _check_verdict(verdict, f"{host_hello.who} at {address}", own)


def _read_host_reply(lines: _Lines, deadline: float, own: Hello, address: str, timeout_s: float) -> Hello:
    """The host's hello after our proof, or the error its failing verdict names."""
    try:
        reply = lines.read_object(deadline)
    except TimeoutError:
        raise ConnectorTimeout(f"AFD handshake for {own.who}: {address} did not answer this side's hello within "
                               f"{timeout_s:g}s") from None
    except (OSError, EOFError, ValueError) as e:
        raise ConnectorError(f"AFD handshake for {own.who}: {address} broke the connection after "
                             f"authentication ({e!r})") from e
    if "afd_verdict" in reply:
        _check_verdict(reply, address, own)
    try:
        return _parse_hello(reply)
    except ValueError as e:
        raise ConnectorError(f"AFD handshake for {own.who}: {address} sent a malformed hello ({e})") from e


def _check_verdict(verdict: dict[str, Any], source: str, own: Hello) -> None:
    """Return on ``ok``; raise the error class the verdict's ``kind`` names otherwise."""
    if verdict.get("afd_verdict") == "ok":
        return
    cls = _KINDS.get(str(verdict.get("kind")), ConnectorError)
    raise cls(f"{source} refused the group for {own.who}: {verdict.get('message', verdict)}")
