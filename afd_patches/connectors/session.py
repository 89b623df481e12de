"""One authenticated session per pair of AFD ranks: the only protocol of the rendezvous and of the data links.

Protocol (one JSON object per line, at most ``MAX_LINE`` bytes)
    1. joiner → host ``{"afd": PROTOCOL, "nonce": Nj}``
    2. host → joiner ``{"afd": PROTOCOL, "nonce": Nh}`` (nothing that depends on the token)
    3. joiner → host ``{"hello": "<H_j>", "proof": P_j}``, ``P_j = HMAC(K, "join" ‖ H_j)``
    4. the host checks ``P_j`` (constant time) and only then parses ``H_j`` and answers
       ``{"hello": "<H_h>", "proof": P_h}``, ``P_h = HMAC(K, "host" ‖ H_h ‖ P_j)``; the joiner checks it.
    ``K = HMAC(token, "afd-session" ‖ Nj ‖ Nh)`` is the session key (``auth.session_key``). From here on
    every message is ``{"m": "<body>", "mac": HMAC(K, "msg" ‖ counter ‖ body)}`` with a counter per
    direction, so nothing can be injected, replayed or reordered on the session without the token.
    ``H_j``, ``H_h`` and ``body`` are JSON texts carried as strings: every MAC covers the bytes as they came
    over the wire, and nothing inside them is parsed before its MAC verified (no re-serialisation).

    The joiner proves first, so a caller without the token learns nothing it could test offline: all it ever
    sees is a random nonce. The hellos (role, rank, the settings both sides compare, where the rank's
    tensors live, the data address an FFN rank advertises) are inside the proofs; whatever a rank later acts
    on arrives as a MAC'd message of the session (``afd_patches.connectors.rendezvous``).

Admission (host side, ``Gate``)
    One thread accepts and runs every pending connection's steps 1–4 on non-blocking sockets under one
    ``selectors`` loop: a connection has ``HELLO_S`` for the whole exchange, whatever its byte pace.
    Accepting is budgeted: each address may open ``SOURCE_RATE`` connections a second (bursts of
    ``SOURCE_BURST``), all addresses together ``TOTAL_RATE`` (bursts of ``TOTAL_BURST``); a connection over
    budget is closed at once, unread. At most ``MAX_PENDING`` connections are pending and at most
    ``MAX_PER_SOURCE`` from one address; a new one beyond either bound evicts a pending one: first one that
    has not yet said a valid step 1, then one of the address that holds the most, the oldest first. A real
    peer finishes in a few round trips, so strangers that park or rotate connections, from one address or
    from hundreds, do not keep it out.
    A failed proof makes its address wait before its next proof is checked: ``BACKOFF_S`` doubled per
    failure in a row, at most ``BACKOFF_MAX_S``, one check per wait; a proof that verifies ends the wait.
    At most ``MAX_SOURCES`` addresses' budgets and waits are remembered: past that, those that ran out go
    first, then the oldest half (an address forgotten that way starts with a full budget: a limit).
    Anything malformed, unauthenticated or late drops that connection only and is counted; whatever a
    connection sends, nothing it causes ends the admission thread. A dropped connection is told
    ``{"afd_refused": "proof"}`` (its proof failed) or ``{"afd_refused": "busy"}`` (evicted or late) first:
    neither says anything about the token or the group. The log gets the first refusal of each reason in a
    ``LOG_INTERVAL_S`` window as its own line and the rest of the window as one summary line.

Parsing
    A line is at most ``MAX_LINE`` bytes and nests at most ``MAX_DEPTH`` arrays/objects, both checked
    before it is parsed; anything else is ``ValueError`` (that connection is dropped).

Joining side (``open_session``)
    Connects, retrying while nothing listens, or the host closed or refused the connection as ``busy``
    before its proof was answered (an evicted attempt), until its deadline. ``{"afd_refused": "proof"}``
    after its proof is a different token: ``ConnectorAuthError``.

Limits
    Nothing is encrypted: a party on the network path can read the traffic and cut it; it cannot change or
    inject a session message without the token. The raw tensor stream of ``backend: tcp`` that follows a
    session on the same connection is not MAC'd (see SECURITY.md).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import queue
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from afd_patches import LOGGER
from afd_patches.connectors import auth
from afd_patches.connectors.base import ConnectorAuthError, ConnectorError, ConnectorTimeout
from afd_patches.metrics import METRICS

logger = logging.getLogger(LOGGER)

PROTOCOL = 4
MAX_LINE = 16 * 1024
MAX_DEPTH = 8  # nesting of arrays/objects in one line (a hello needs 3)
HELLO_S = 5.0  # the whole of steps 1-4 for one connection, whatever its pace
MAX_PENDING = 64
MAX_PER_SOURCE = 16
BACKLOG = 256
POLL_S = 0.1
RETRY_S = 0.05  # pause between connection attempts of a joiner
SOURCE_RATE, SOURCE_BURST = 50.0, 64.0  # accepted connections a second from one address
TOTAL_RATE, TOTAL_BURST = 1000.0, 200.0  # accepted connections a second from all addresses
BACKOFF_S, BACKOFF_MAX_S = 0.05, 2.0  # wait before an address's next proof check, after failed proofs
LOG_INTERVAL_S = 10.0
MAX_SOURCES = 4 * BACKLOG  # addresses whose rate budget or backoff is remembered (the oldest half goes first)


class SessionError(ConnectorError):
    """A session broke: closed, garbage, or a message whose MAC does not verify."""


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Hello:
    """What one rank says about itself inside the proofs.

    ``fields`` are compared between peers (a field both have must be equal); ``device`` says where the
    rank's tensors live; ``purpose`` is ``group`` (the rendezvous at FFN rank 0) or ``data`` (an attention
    rank's link to an FFN rank other than 0), ``group`` the id of the group a ``data`` session belongs to,
    ``address`` the ``host:port`` an FFN rank other than 0 takes data sessions at.
    """

    role: str
    rank: int
    fields: dict[str, Any] = field(default_factory=dict)
    device: str = ""
    purpose: str = "group"
    group: str = ""
    address: str = ""

    @property
    def who(self) -> str:
        return f"{self.role} rank {self.rank}"

    def as_dict(self) -> dict[str, Any]:
        return {"role": self.role, "rank": self.rank, "fields": self.fields, "device": self.device,
                "purpose": self.purpose, "group": self.group, "address": self.address}

    @classmethod
    def parse(cls, obj: Any) -> Hello:
        """``ValueError`` unless ``obj`` is a well-formed hello."""
        if not isinstance(obj, dict):
            raise ValueError("hello is not an object")
        role, rank, fields = obj.get("role"), obj.get("rank"), obj.get("fields")
        if not isinstance(role, str) or isinstance(rank, bool) or not isinstance(rank, int) or not isinstance(
                fields, dict):
            raise ValueError("malformed role/rank/fields")
        texts = [obj.get(k, default) for k, default in (("device", ""), ("purpose", "group"), ("group", ""),
                                                         ("address", ""))]
        if not all(isinstance(t, str) and len(t) <= 256 for t in texts):
            raise ValueError("malformed device/purpose/group/address")
        return cls(role, rank, fields, *texts)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def join_proof(key: bytes, hello: bytes) -> bytes:
    """The joiner's proof (step 3) of the hello text ``hello`` under the session ``key`` (``auth.session_key``)."""
    return _mac(key, b"join", hello)


def _depth(line: bytes) -> int:
    """How deeply arrays/objects nest in the JSON text ``line`` (brackets inside strings do not count)."""
    if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:
        return MAX_DEPTH  # cannot nest deeper: no scan
    depth = deepest = 0
    in_string = escaped = False
    for byte in line:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest


def _parse_line(line: bytes | str) -> dict[str, Any]:
    """One protocol line as a JSON object; ``ValueError`` for anything else (size and depth judged first)."""
    raw = line.encode() if isinstance(line, str) else line
    if len(raw) > MAX_LINE:
        raise ValueError(f"line longer than {MAX_LINE} bytes")
    if not raw.lstrip().startswith(b"{"):
        raise ValueError("not JSON (not an object)")
    if _depth(raw) > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH}")
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError, UnicodeError) as e:
        raise ValueError(f"not JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise ValueError("not JSON (not an object)")
    return obj


def _text(obj: dict[str, Any], key: str) -> bytes:
    """The JSON text carried as the string ``obj[key]``, as bytes (what a MAC covers); ``ValueError`` if none."""
    value = obj.get(key)
    if not isinstance(value, str):
        raise ValueError(f"no valid {key!r}")
    try:
        return value.encode()
    except UnicodeError:
        raise ValueError(f"no valid {key!r}") from None


def _hex(obj: dict[str, Any], key: str, size: int) -> bytes:
    value = obj.get(key)
    if not isinstance(value, str) or len(value) != 2 * size:
        raise ValueError(f"no valid {key!r}")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"no valid {key!r}") from None


def _line(obj: dict[str, Any]) -> bytes:
    return canonical(obj) + b"\n"


class Session:
    """An authenticated connection (after step 4). ``send``/``recv`` carry MAC'd JSON messages;
    ``detach`` hands the socket and any bytes read past the last message to a data link."""

    def __init__(self, conn: socket.socket, key: bytes, peer: str, buf: bytes = b"") -> None:
        self.conn, self.key, self.peer, self._buf = conn, key, peer, buf
        self._sent = self._received = 0

    def send(self, body: dict[str, Any], timeout_s: float = 5.0) -> None:
        text = canonical(body)
        mac = _mac(self.key, b"msg", str(self._sent).encode(), text)
        self._sent += 1
        self.conn.settimeout(timeout_s)
        self.conn.sendall(_line({"m": text.decode(), "mac": mac.hex()}))

    def recv(self, deadline: float) -> dict[str, Any]:
        """The next message; ``TimeoutError`` at ``deadline``, ``SessionError`` if closed, malformed or not
        authentic (its body is parsed only after its MAC verified)."""
        try:
            obj = _parse_line(self._read_line(deadline))
            text, mac = _text(obj, "m"), _hex(obj, "mac", 32)
        except ValueError as e:
            raise SessionError(f"{self.peer} sent a malformed message ({e})") from None
        want = _mac(self.key, b"msg", str(self._received).encode(), text)
        if not hmac.compare_digest(want, mac):
            raise SessionError(f"a message from {self.peer} failed authentication (altered or injected)")
        self._received += 1
        try:
            return _parse_line(text)
        except ValueError as e:
            raise SessionError(f"{self.peer} sent a malformed message body ({e})") from None

    def _read_line(self, deadline: float) -> bytes:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no message in time")
            self.conn.settimeout(left)
            try:
                chunk = self.conn.recv(4096)
            except TimeoutError:
                raise
            except OSError as e:
                raise SessionError(f"the session with {self.peer} broke ({e})") from None
            if not chunk:
                raise SessionError(f"{self.peer} closed the session")
            self._buf += chunk
            if len(self._buf) > MAX_LINE:
                raise SessionError(f"{self.peer} sent a line longer than {MAX_LINE} bytes")
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def detach(self) -> tuple[socket.socket, bytes]:
        conn, buf, self._buf = self.conn, self._buf, b""
        return conn, buf

    def close(self) -> None:
        self.conn.close()


# ------------------------------------------------------------------ host side
def listen(address: str, port: int, what: str) -> socket.socket:
    """Listen on ``address:port`` only (every interface only for ``0.0.0.0`` / ``::``); fail at once if taken."""
    shown = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    try:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        return socket.create_server((address, port), family=family, backlog=BACKLOG)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConnectorError(f"AFD: cannot host {what} at {shown}: port {port} is already in use by another "
                                 "program (EADDRINUSE); stop it or give every engine of the group another port") from e
        raise ConnectorError(f"AFD: cannot host {what} at {shown}: {e}") from e


@dataclass
class Joined:
    session: Session
    hello: Hello


@dataclass
class _Pending:
    conn: socket.socket
    source: str
    peer: str
    deadline: float
    buf: bytes = b""
    joiner_nonce: bytes = b""
    host_nonce: bytes = b""
    proof: dict[str, Any] | None = None  # a step 3 held while its address backs off


class _Bucket:
    """A token bucket: ``take()`` is True while fewer than ``burst`` were taken recently at ``rate`` a second."""

    __slots__ = ("burst", "level", "rate", "stamp")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst, self.level, self.stamp = rate, burst, burst, time.monotonic()

    def take(self, now: float) -> bool:
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.level < 1.0:
            return False
        self.level -= 1.0
        return True


@dataclass
class _Backoff:
    """One address's failed proofs in a row and when its next proof may be checked."""

    failures: int = 0
    next_check: float = 0.0


class _Refusals:
    """Counts refused connections; logs the first of each reason in a ``LOG_INTERVAL_S`` window as its own
    line, the rest of the window as one summary line (at the next refusal after the window, or ``flush``)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.total: Counter[str] = Counter()
        self.last: dict[str, str] = {}
        self._shown: set[str] = set()
        self._held: Counter[str] = Counter()
        self._window = time.monotonic()

    def note(self, peer: str, why: str) -> None:
        self.total[why] += 1
        self.last[why] = peer
        METRICS.add("handshakes_refused")
        now = time.monotonic()
        if now - self._window >= LOG_INTERVAL_S:
            self.flush()
        if why in self._shown:
            self._held[why] += 1
            return
        self._shown.add(why)
        logger.warning("AFD rendezvous at %s: refused the connection from %s: %s", self.address, peer, why)

    def flush(self) -> None:
        """Log the window's held refusals as one line (if any); start a new window."""
        if self._held:
            parts = " | ".join(f"{n}x {why} [last from {self.last[why]}]" for why, n in self._held.most_common())
            logger.warning("AFD rendezvous at %s: refused %d more connection(s) in %.0fs: %s", self.address,
                           sum(self._held.values()), time.monotonic() - self._window, parts)
        self._held.clear()
        self._shown.clear()
        self._window = time.monotonic()


class Gate:
    """Admission and steps 1–4 for every connection to ``listener`` (see "Admission"); authenticated
    hellos arrive on ``joined``. ``own`` is this side's hello, ``token`` the group's secret."""

    def __init__(self, listener: socket.socket, own: Hello, token: bytes | None, address: str) -> None:
        self.own, self.token, self.address = own, token, address
        self._own_text = canonical(own.as_dict())
        self.joined: queue.Queue[Joined] = queue.Queue()
        self._refusals = _Refusals(address)
        self._listener = listener
        self._pending: dict[socket.socket, _Pending] = {}
        self._sources: dict[str, _Bucket] = {}
        self._total = _Bucket(TOTAL_RATE, TOTAL_BURST)
        self._backoff: dict[str, _Backoff] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name="afd-gate", daemon=True)
        self._thread.start()

    @property
    def refused(self) -> Counter[str]:
        """Refused connections by reason, since the gate opened."""
        return self._refusals.total

    def note(self, peer: str, why: str) -> None:
        """Log (rate-limited, see "Admission") and count one refused connection."""
        self._refusals.note(peer, why)

    def summary(self) -> str:
        """``""`` or ``"; refused N connection(s) meanwhile: 2x wrong token (last from …), …"``."""
        refused = Counter(self._refusals.total)
        if not refused:
            return ""
        parts = [f"{n}x {why} (last from {self._refusals.last[why]})" for why, n in refused.most_common()]
        return f"; refused {sum(refused.values())} connection(s) meanwhile: " + ", ".join(parts)

    def close(self) -> None:
        """Stop admitting; pending connections are dropped (logged). Sessions handed over stay open."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join()
        self._wake_r.close()
        self._wake_w.close()
        self._refusals.flush()

    # -- the loop
    def _run(self) -> None:
        self._listener.setblocking(False)
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ, "accept")
            sel.register(self._wake_r, selectors.EVENT_READ, "wake")
            while True:
                now = time.monotonic()
                soonest = min((p.deadline for p in self._pending.values()), default=now + POLL_S)
                events = sel.select(max(0.0, min(soonest - now, POLL_S)))
                if any(key.data == "wake" for key, _ in events):
                    break
                for key, _ in events:
                    if key.data == "accept":
                        self._guarded(sel, None, self._accept)
                    elif (pending := self._pending.get(key.fileobj)) is not None:  # type: ignore[call-overload]
                        self._guarded(sel, pending, self._step)
                now = time.monotonic()
                for pending in [p for p in self._pending.values() if p.proof is not None]:
                    self._guarded(sel, pending, self._check_held)
                for pending in [p for p in self._pending.values() if p.deadline <= now]:
                    self._drop(sel, pending, f"no complete AFD hello within {HELLO_S:g}s")
            for pending in list(self._pending.values()):
                self._drop(sel, pending, "no AFD hello before the rendezvous ended")

    def _guarded(self, sel: selectors.BaseSelector, pending: _Pending | None,
                 work: Callable[..., None]) -> None:
        """Run one piece of the loop's work; whatever it raises drops that connection only (never the loop)."""
        try:
            work(sel) if pending is None else work(sel, pending)
        except Exception as e:  # noqa: BLE001 - any input: the admission thread must outlive it
            if pending is not None and pending.conn in self._pending:
                self._drop(sel, pending, f"dropped on an unexpected error ({type(e).__name__}: {e})")
            else:
                logger.warning("AFD rendezvous at %s: admission error (%s: %s); admission goes on", self.address,
                               type(e).__name__, e)

    def _accept(self, sel: selectors.BaseSelector) -> None:
        for _ in range(BACKLOG):
            try:
                conn, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, say: try again at the next event
                logger.warning("AFD rendezvous at %s: accept failed (%s)", self.address, e)
                return
            source = str(addr[0])
            peer = f"[{source}]:{addr[1]}" if ":" in source else f"{source}:{addr[1]}"
            now = time.monotonic()
            bucket = self._sources.get(source)
            if bucket is None:
                if len(self._sources) >= MAX_SOURCES:  # forget addresses whose bucket refilled, else the oldest half
                    kept = [(s, b) for s, b in self._sources.items()
                            if b.level + (now - b.stamp) * b.rate < b.burst]
                    self._sources = dict(kept[-MAX_SOURCES // 2:])
                bucket = self._sources[source] = _Bucket(SOURCE_RATE, SOURCE_BURST)
            if not bucket.take(now) or not self._total.take(now):
                conn.close()  # over budget: unread, unanswered
                self.note(peer, "over the connection rate budget")
                continue
            self._admit(sel, source)
            conn.setblocking(False)
            self._pending[conn] = _Pending(conn, source, peer, now + HELLO_S)
            sel.register(conn, selectors.EVENT_READ)

    def _admit(self, sel: selectors.BaseSelector, source: str) -> None:
        """Make room for one more connection from ``source`` (see "Admission")."""
        by_source = Counter(p.source for p in self._pending.values())
        if by_source[source] >= MAX_PER_SOURCE:
            candidates = [p for p in self._pending.values() if p.source == source]
        elif len(self._pending) >= MAX_PENDING:
            candidates = list(self._pending.values())
        else:
            return
        victim = min(candidates, key=lambda p: (bool(p.host_nonce), -by_source[p.source], p.deadline))
        self._drop(sel, victim, f"evicted: too many pending connections (at most {MAX_PENDING}, "
                                f"{MAX_PER_SOURCE} per address)")

    def _drop(self, sel: selectors.BaseSelector, pending: _Pending, why: str, refusal: str = "busy") -> None:
        self._pending.pop(pending.conn, None)
        try:
            sel.unregister(pending.conn)
        except (KeyError, ValueError):
            pass  # never registered, or already closed
        try:
            pending.conn.send(_line({"afd_refused": refusal}))  # a few bytes; never waits
        except OSError:
            pass
        pending.conn.close()
        self.note(pending.peer, why)

    def _step(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        try:
            chunk = p.conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._drop(sel, p, f"connection failed ({e})")
            return
        if not chunk:
            self._drop(sel, p, "closed before a complete AFD hello")
            return
        p.buf += chunk
        try:
            while b"\n" in p.buf and p.proof is None:
                line, p.buf = p.buf.split(b"\n", 1)
                if self._advance(sel, p, _parse_line(line)):
                    return
            if len(p.buf) > MAX_LINE:
                raise ValueError(f"line longer than {MAX_LINE} bytes")
        except ValueError as e:
            self._drop(sel, p, f"no valid AFD hello ({e})")

    def _advance(self, sel: selectors.BaseSelector, p: _Pending, obj: dict[str, Any]) -> bool:
        """One protocol step of ``p``; True once it was handed over (or dropped)."""
        if not p.host_nonce:
            if obj.get("afd") != PROTOCOL:
                raise ValueError(f"not an AFD protocol {PROTOCOL} hello")
            p.joiner_nonce, p.host_nonce = _hex(obj, "nonce", auth.NONCE_BYTES), auth.nonce()
            p.conn.send(_line({"afd": PROTOCOL, "nonce": p.host_nonce.hex()}))  # a few bytes into an empty buffer
            return False
        _text(obj, "hello"), _hex(obj, "proof", 32)  # well-formed before it waits for its check
        p.proof = obj
        return self._check_held(sel, p)

    def _check_held(self, sel: selectors.BaseSelector, p: _Pending) -> bool:
        """Check ``p``'s step 3 unless its address backs off (then it waits, one check per wait); True once
        handed over or dropped."""
        now = time.monotonic()
        backoff = self._backoff.get(p.source)
        if backoff is not None and now < backoff.next_check:
            return False
        obj, p.proof = p.proof, None
        assert obj is not None
        key = auth.session_key(self.token, p.joiner_nonce, p.host_nonce)
        text, proof = _text(obj, "hello"), _hex(obj, "proof", 32)
        if not hmac.compare_digest(join_proof(key, text), proof):
            backoff = self._backoff.setdefault(p.source, _Backoff())
            backoff.failures += 1
            backoff.next_check = now + min(BACKOFF_S * 2 ** (backoff.failures - 1), BACKOFF_MAX_S)
            if len(self._backoff) > MAX_SOURCES:  # forget addresses whose wait is over, else the oldest half
                kept = [(s, b) for s, b in self._backoff.items() if b.next_check > now]
                self._backoff = dict(kept[-MAX_SOURCES // 2:])
            self._drop(sel, p, "wrong token: a different token (authentication failed)", refusal="proof")
            return True
        self._backoff.pop(p.source, None)
        try:
            parsed = Hello.parse(_parse_line(text))
        except ValueError as e:
            self._drop(sel, p, f"no valid AFD hello ({e})")
            return True
        self._pending.pop(p.conn)
        sel.unregister(p.conn)
        p.conn.setblocking(True)
        p.conn.settimeout(1.0)
        try:
            p.conn.sendall(_line({"hello": self._own_text.decode(),
                                  "proof": _mac(key, b"host", self._own_text, proof).hex()}))
        except OSError as e:
            p.conn.close()
            self.note(p.peer, f"closed after authenticating ({e})")
            return True
        self.joined.put(Joined(Session(p.conn, key, p.peer, p.buf), parsed))
        p.buf = b""
        return True


# ------------------------------------------------------------------ joining side
def open_session(host: str, port: int, own: Hello, token: bytes | None, deadline: float, timeout_s: float,
                 cancelled: Callable[[], bool] = lambda: False) -> tuple[Session, Hello]:
    """Steps 1–4 as the joiner; the session and the host's hello.

    ``ConnectorAuthError`` when the host holds another token (nothing but a proof under this side's
    token was sent), ``ConnectorTimeout`` when no session could be opened by ``deadline``,
    ``ConnectorError`` when whatever listens at ``host:port`` does not speak this protocol.
    """
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    last = "nothing tried yet"
    while True:
        if cancelled():
            raise ConnectorError(f"AFD session for {own.who} with {address}: cancelled (engine shutting down)")
        if time.monotonic() >= deadline:
            raise ConnectorTimeout(f"AFD session for {own.who}: could not open one with {address} within "
                                   f"{timeout_s:g}s; is the FFN rank running there? (last: {last})")
        try:
            conn = socket.create_connection((host, port), timeout=max(min(deadline - time.monotonic(), 1.0), 0.01))
        except OSError as e:
            last = f"connect: {e}"
            time.sleep(RETRY_S)
            continue
        try:
            got = _client_steps(conn, address, own, token, deadline, timeout_s)
        except _Retry as e:
            conn.close()
            last = str(e)
            time.sleep(RETRY_S)
            continue
        except BaseException:
            conn.close()
            raise
        return got


class _Retry(Exception):
    """The attempt ended before a session opened (closed, evicted, refused as busy): try a new connection."""


def _client_steps(conn: socket.socket, address: str, own: Hello, token: bytes | None, deadline: float,
                  timeout_s: float) -> tuple[Session, Hello]:
    joiner_nonce = auth.nonce()
    reader = Session(conn, b"", address)
    try:
        conn.settimeout(max(deadline - time.monotonic(), 0.01))
        conn.sendall(_line({"afd": PROTOCOL, "nonce": joiner_nonce.hex()}))
        challenge = _parse_line(reader._read_line(deadline))
    except TimeoutError:
        raise ConnectorTimeout(f"AFD session for {own.who}: {address} accepted a connection but sent no AFD "
                               f"answer within {timeout_s:g}s; is another program listening there?") from None
    except (OSError, SessionError) as e:
        raise _Retry(f"closed before the challenge ({e})") from None
    except ValueError as e:
        raise ConnectorError(f"AFD session for {own.who}: {address} is not an AFD rank ({e}); another program is "
                             "listening there, or a different AFD version") from None
    if "afd_refused" in challenge:
        raise _Retry(f"refused as {challenge['afd_refused']!r} before the challenge")
    if challenge.get("afd") != PROTOCOL:
        raise ConnectorError(f"AFD session for {own.who}: {address} speaks no AFD protocol {PROTOCOL} (another "
                             "program, or a different AFD version)")
    try:
        host_nonce = _hex(challenge, "nonce", auth.NONCE_BYTES)
    except ValueError as e:
        raise ConnectorError(f"AFD session for {own.who}: {address} sent a malformed challenge ({e})") from None
    key = auth.session_key(token, joiner_nonce, host_nonce)
    mine = canonical(own.as_dict())
    proof = join_proof(key, mine)
    try:
        conn.settimeout(max(deadline - time.monotonic(), 0.01))
        conn.sendall(_line({"hello": mine.decode(), "proof": proof.hex()}))
        reply = _parse_line(reader._read_line(deadline))
    except TimeoutError:
        raise ConnectorTimeout(f"AFD session for {own.who}: {address} did not answer this side's proof within "
                               f"{timeout_s:g}s") from None
    except (OSError, SessionError, ValueError) as e:
        raise _Retry(f"closed after the proof ({e})") from None
    if reply.get("afd_refused") == "proof":
        side = "a token" if token else "no token"
        raise ConnectorAuthError(
            f"AFD session for {own.who}: {address} refused this side's proof: it holds a different token (this "
            f"side has {side}); {auth.HOW_TO_SET}")
    if "afd_refused" in reply:
        raise _Retry(f"refused as {reply['afd_refused']!r}")
    try:
        host_hello, host_proof = _text(reply, "hello"), _hex(reply, "proof", 32)
    except ValueError as e:
        raise ConnectorError(f"AFD session for {own.who}: {address} sent a malformed answer ({e})") from None
    if not hmac.compare_digest(_mac(key, b"host", host_hello, proof), host_proof):
        raise ConnectorAuthError(f"AFD session for {own.who}: {address} did not prove the group's token; it is not "
                                 f"this group's FFN rank; {auth.HOW_TO_SET}")
    try:
        parsed = Hello.parse(_parse_line(host_hello))
    except ValueError as e:
        raise ConnectorError(f"AFD session for {own.who}: {address} sent a malformed hello ({e})") from None
    return Session(conn, key, address, reader._buf), parsed
