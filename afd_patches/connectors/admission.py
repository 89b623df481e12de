"""The host's side of the AFD protocol (``Gate``): who gets to run steps 1–4, how fast, and what a refusal says.

Admission
    One thread accepts and runs every pending connection's steps 1–4 (``afd_patches.connectors.handshake``) on
    non-blocking sockets under one ``selectors`` loop: a connection has ``HELLO_S`` for the whole exchange,
    whatever its byte pace. Accepting is budgeted: each address may open ``SOURCE_RATE`` connections a second
    (bursts of ``SOURCE_BURST``), all addresses together ``TOTAL_RATE`` (bursts of ``TOTAL_BURST``); a
    connection over budget is closed at once, unread. At most ``MAX_PENDING`` connections are pending and at
    most ``MAX_PER_SOURCE`` from one address; a new one beyond either bound evicts a pending one: first one that
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
    A connection that completes step 4 is handed over as a ``Session`` (``afd_patches.connectors.session``)
    with the joiner's ``Hello`` on ``Gate.joined``.
"""

from __future__ import annotations

import errno
import hmac
import logging
import queue
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from afd_patches import LOGGER
from afd_patches.connectors import auth
from afd_patches.connectors.base import ConnectorError
from afd_patches.connectors.handshake import (
    MAX_LINE,
    PROTOCOL,
    Hello,
    as_line,
    canonical,
    hex_field,
    host_proof,
    join_proof,
    parse_line,
    text_field,
)
from afd_patches.connectors.session import Session
from afd_patches.metrics import METRICS

logger = logging.getLogger(LOGGER)

HELLO_S = 5.0  # the whole of steps 1-4 for one connection, whatever its pace
MAX_PENDING = 64
MAX_PER_SOURCE = 16
BACKLOG = 256
POLL_S = 0.1
SOURCE_RATE, SOURCE_BURST = 50.0, 64.0  # accepted connections a second from one address
TOTAL_RATE, TOTAL_BURST = 1000.0, 200.0  # accepted connections a second from all addresses
BACKOFF_S, BACKOFF_MAX_S = 0.05, 2.0  # wait before an address's next proof check, after failed proofs
LOG_INTERVAL_S = 10.0
MAX_SOURCES = 4 * BACKLOG  # addresses whose rate budget or backoff is remembered (the oldest half goes first)


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
    """A joiner that completed step 4: its session and its (authenticated) hello."""

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
            pending.conn.send(as_line({"afd_refused": refusal}))  # a few bytes; never waits
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
                if self._advance(sel, p, parse_line(line)):
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
            p.joiner_nonce, p.host_nonce = hex_field(obj, "nonce", auth.NONCE_BYTES), auth.nonce()
            p.conn.send(as_line({"afd": PROTOCOL, "nonce": p.host_nonce.hex()}))  # a few bytes into an empty buffer
            return False
        text_field(obj, "hello"), hex_field(obj, "proof", 32)  # well-formed before it waits for its check
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
        text, proof = text_field(obj, "hello"), hex_field(obj, "proof", 32)
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
            parsed = Hello.parse(parse_line(text))
        except ValueError as e:
            self._drop(sel, p, f"no valid AFD hello ({e})")
            return True
        self._pending.pop(p.conn)
        sel.unregister(p.conn)
        p.conn.setblocking(True)
        p.conn.settimeout(1.0)
        try:
            p.conn.sendall(as_line({"hello": self._own_text.decode(),
                                  "proof": host_proof(key, self._own_text, proof).hex()}))
        except OSError as e:
            p.conn.close()
            self.note(p.peer, f"closed after authenticating ({e})")
            return True
        self.joined.put(Joined(Session(p.conn, key, p.peer, p.buf), parsed))
        p.buf = b""
        return True
