"""A stranger at the AFD rendezvous port: the scanner and the fuzzer that the tests point at an FFN rank.

Shared by ``tests/afd/test_rendezvous.py`` (against a connector process) and
``tests/integration/test_afd_rendezvous_server.py`` (against a real FFN server).
Both only ever connect to loopback addresses the tests chose.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afd_patches.connectors import auth, handshake

IDLE_CONNECTIONS = 20
SCAN_PROBES = 7  # connections of ``scan`` besides the idle ones
# what the FFN rank logs for each probe of ``scan`` ("refused the connection from …: <reason>"), and how often
SCAN_REASONS = {"line longer": 1, "not JSON": 1, f"nested deeper than {handshake.MAX_DEPTH}": 1,
                f"not an AFD protocol {handshake.PROTOCOL} hello": 1, "wrong token": 1, "not part of the topology": 1,
                "ffn rank 0 is already taken": 1}
# the idle connections: evicted (more than MAX_PER_SOURCE from one address), timed out, or dropped at the end
SCAN_SILENT = ("evicted", "no complete AFD hello within", "before the rendezvous ended")


_DETAIL = re.compile(r"refused the connection from \S+: (.*)$")
_SUMMARY = re.compile(r"refused \d+ more connection\(s\) in \d+s: (.*)$")
_SUMMARY_PART = re.compile(r"^(\d+)x (.*) \[last from [^\]]*\]$")


def refusals(log_lines: list[str]) -> Counter[str]:
    """Refused connections by reason, from the FFN rank's log: its lines of one refusal each and its summary
    lines (``session`` logs the first refusal of each reason per window alone, the rest summed up)."""
    counts: Counter[str] = Counter()
    for line in log_lines:
        if detail := _DETAIL.search(line):
            counts[detail.group(1)] += 1
        elif summary := _SUMMARY.search(line):
            for part in summary.group(1).split(" | "):
                match = _SUMMARY_PART.match(part)
                assert match, (part, line)
                counts[match.group(2)] += int(match.group(1))
    return counts


def count(reasons: Counter[str], words: str) -> int:
    """How many refusals of ``reasons`` (``refusals``) have ``words`` in their reason."""
    return sum(n for why, n in reasons.items() if words in why)


def connect(host: str, port: int, source: str | None = None) -> socket.socket:
    """A connection to ``host:port``, from ``source`` (a loopback address) when given."""
    return socket.create_connection((host, port), timeout=5, source_address=(source, 0) if source else None)


def wait_listening(host: str, port: int, timeout_s: float, alive: Callable[[], str | None] = lambda: None) -> None:
    """Return once ``host:port`` accepts a connection (that probe is refused and logged once by the FFN rank).

    ``alive()`` returns ``None`` while the FFN process runs, else why it is gone (then this fails at once).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if (gone := alive()) is not None:
                raise AssertionError(f"the FFN process is gone before it listened at {host}:{port}: {gone}") from None
            if time.monotonic() > deadline:
                raise AssertionError(f"nothing listens at {host}:{port} after {timeout_s}s") from None
            time.sleep(0.1)


def read_line(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    buf = b""
    while b"\n" not in buf:
        chunk = sock.recv(4096)
        if not chunk:
            return buf
        buf += chunk
    return buf.split(b"\n", 1)[0]


def authenticated(host: str, port: int, token: str, hello: dict[str, Any], source: str | None = None) -> bytes:
    """Run the protocol with ``token`` and send ``hello`` (from ``source`` when given); everything the host sent
    after its nonce."""
    with connect(host, port, source) as s:
        nj = auth.nonce()
        s.sendall(json.dumps({"afd": handshake.PROTOCOL, "nonce": nj.hex()}).encode() + b"\n")
        nh = bytes.fromhex(json.loads(read_line(s))["nonce"])
        text = handshake.canonical(hello)
        proof = handshake.join_proof(auth.session_key(token.encode(), nj, nh), text).hex()
        s.sendall(json.dumps({"proof": proof, "hello": text.decode()}).encode() + b"\n")
        rest = b""
        s.settimeout(5)
        try:
            while chunk := s.recv(4096):
                rest += chunk
        except OSError:
            pass
        return rest


def scan(host: str, port: int, token: str) -> tuple[dict[str, bytes], list[socket.socket]]:
    """Probe once each way listed in ``SCAN_REASONS``; what came back, and the idle connections left open.

    ``token`` is the group's: the unknown-role and taken-rank hellos are an insider's mistakes.
    """
    idle = [connect(host, port) for _ in range(IDLE_CONNECTIONS)]
    got: dict[str, bytes] = {}
    for name, data in [("random bytes", b"\x00\xff" + secrets.token_bytes(3000) + b"\n"),
                       ("60 KB line", b"[" * 60_000 + b"\n"), ("deep nesting", b'{"a":' + b"[" * 15_000 + b"\n"),
                       ("empty-fields hello", b'{"afd": 1, "role": "attention", "rank": 0, "fields": {}}\n')]:
        with connect(host, port) as s:
            try:
                s.sendall(data)
                got[name] = read_line(s)
            except OSError:
                got[name] = b""
    got["wrong token"] = authenticated(host, port, "w" * 32, {"role": "attention", "rank": 0, "fields": {}})
    got["unknown role"] = authenticated(host, port, token, {"role": "router", "rank": 0, "fields": {}})
    got["duplicate rank"] = authenticated(host, port, token, {"role": "ffn", "rank": 0, "fields": {}})
    return got, idle


def check_scan(got: dict[str, bytes], log_lines: list[str]) -> None:
    """Nothing but a challenge reached a prober without the token; each probe was logged exactly once."""
    for name, answer in got.items():
        if name not in ("unknown role", "duplicate rank"):  # those two held the token
            assert b"num_attention_ranks" not in answer and b"inline_bytes" not in answer, (name, answer)
    assert got["wrong token"] == b'{"afd_refused":"proof"}\n', got["wrong token"]
    assert b"not part of the topology" in got["unknown role"] and b"already taken" in got["duplicate rank"]
    reasons = refusals(log_lines)
    for words, n in SCAN_REASONS.items():
        assert count(reasons, words) == n, (words, reasons)
    silent = sum(count(reasons, w) for w in SCAN_SILENT)
    assert IDLE_CONNECTIONS <= silent <= IDLE_CONNECTIONS + 1, reasons  # + a listening probe, when evicted


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
_lines = _json_values.map(lambda v: json.dumps(v).encode() + b"\n")
_first = st.one_of(
    st.binary(max_size=4096), _lines,
    st.fixed_dictionaries({"afd": st.sampled_from([handshake.PROTOCOL, 1, str(handshake.PROTOCOL), None]),
                           "nonce": st.one_of(st.text(max_size=70), st.just("ab" * 32))}).map(
        lambda d: json.dumps(d).encode() + b"\n"))


FUZZ_CHUNK = 50  # examples per hypothesis run: the time bound is checked between runs, so it holds to one chunk


def fuzz(host: str, port: int, seconds: float, max_connections: int = 2000) -> int:
    """Hypothesis-made first and second lines, one connection each, for at most ``seconds``; connections made.

    Hypothesis runs in chunks of ``FUZZ_CHUNK`` examples until the time or the connections are used up, so
    the examples it would still generate after the time is up cost at most one chunk."""
    state = {"n": 0, "t0": time.monotonic()}

    def over() -> bool:
        return time.monotonic() - state["t0"] >= seconds or state["n"] >= max_connections

    @settings(max_examples=FUZZ_CHUNK, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(first=_first, second=st.one_of(st.binary(max_size=2048), _lines), wait_answer=st.booleans())
    def one(first: bytes, second: bytes, wait_answer: bool) -> None:
        if over():
            return
        state["n"] += 1
        try:
            with connect(host, port) as s:
                s.sendall(first)
                if wait_answer:
                    read_line(s, 0.2)
                    s.sendall(second)
        except OSError:
            pass

    while not over():
        one()
    return state["n"]
