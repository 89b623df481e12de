"""One authenticated session between two AFD ranks (``Session``), and the joiner's side of opening one.

The protocol and its lines are ``afd_patches.connectors.handshake``; the host's side of steps 1–4, with its
admission, is ``afd_patches.connectors.admission``. After step 4 both sides hold a ``Session``: every message is
``{"m": "<body>", "mac": HMAC(K, "msg" ‖ counter ‖ body)}`` with a counter per direction, so nothing can be
injected, replayed or reordered on it without the token, and a body is parsed only after its MAC verified.

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

import hmac
import socket
import time
from collections.abc import Callable
from typing import Any

from afd_patches.connectors import auth
from afd_patches.connectors.base import ConnectorAuthError, ConnectorError, ConnectorTimeout
from afd_patches.connectors.handshake import (
    MAX_LINE,
    PROTOCOL,
    Hello,
    as_line,
    canonical,
    hex_field,
    host_proof,
    join_proof,
    mac,
    parse_line,
    text_field,
)

RETRY_S = 0.05  # pause between connection attempts of a joiner


class SessionError(ConnectorError):
    """A session broke: closed, garbage, or a message whose MAC does not verify."""


class Session:
    """An authenticated connection (after step 4). ``send``/``recv`` carry MAC'd JSON messages;
    ``detach`` hands the socket and any bytes read past the last message to a data link."""

    def __init__(self, conn: socket.socket, key: bytes, peer: str, buf: bytes = b"") -> None:
        self.conn, self.key, self.peer, self._buf = conn, key, peer, buf
        self._sent = self._received = 0

    def send(self, body: dict[str, Any], timeout_s: float = 5.0) -> None:
        text = canonical(body)
        tag = mac(self.key, b"msg", str(self._sent).encode(), text)
        self._sent += 1
        self.conn.settimeout(timeout_s)
        self.conn.sendall(as_line({"m": text.decode(), "mac": tag.hex()}))

    def recv(self, deadline: float) -> dict[str, Any]:
        """The next message; ``TimeoutError`` at ``deadline``, ``SessionError`` if closed, malformed or not
        authentic (its body is parsed only after its MAC verified)."""
        try:
            obj = parse_line(self._read_line(deadline))
            text, tag = text_field(obj, "m"), hex_field(obj, "mac", 32)
        except ValueError as e:
            raise SessionError(f"{self.peer} sent a malformed message ({e})") from None
        want = mac(self.key, b"msg", str(self._received).encode(), text)
        if not hmac.compare_digest(want, tag):
            raise SessionError(f"a message from {self.peer} failed authentication (altered or injected)")
        self._received += 1
        try:
            return parse_line(text)
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
        conn.sendall(as_line({"afd": PROTOCOL, "nonce": joiner_nonce.hex()}))
        challenge = parse_line(reader._read_line(deadline))
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
        host_nonce = hex_field(challenge, "nonce", auth.NONCE_BYTES)
    except ValueError as e:
        raise ConnectorError(f"AFD session for {own.who}: {address} sent a malformed challenge ({e})") from None
    key = auth.session_key(token, joiner_nonce, host_nonce)
    mine = canonical(own.as_dict())
    proof = join_proof(key, mine)
    try:
        conn.settimeout(max(deadline - time.monotonic(), 0.01))
        conn.sendall(as_line({"hello": mine.decode(), "proof": proof.hex()}))
        reply = parse_line(reader._read_line(deadline))
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
        host_hello, their_proof = text_field(reply, "hello"), hex_field(reply, "proof", 32)
    except ValueError as e:
        raise ConnectorError(f"AFD session for {own.who}: {address} sent a malformed answer ({e})") from None
    if not hmac.compare_digest(host_proof(key, host_hello, proof), their_proof):
        raise ConnectorAuthError(f"AFD session for {own.who}: {address} did not prove the group's token; it is not "
                                 f"this group's FFN rank; {auth.HOW_TO_SET}")
    try:
        parsed = Hello.parse(parse_line(host_hello))
    except ValueError as e:
        raise ConnectorError(f"AFD session for {own.who}: {address} sent a malformed hello ({e})") from None
    return Session(conn, key, address, reader._buf), parsed
