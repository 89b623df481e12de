"""The AFD rendezvous against strangers: binding, the token, hostile hellos, bounded tensor headers.

The FFN rank hosts the group on 127.0.0.2 and the attention rank joins from
127.0.0.1 (both loopback, "two hosts" simulated), with a token. Ranks run in
processes of ``test_connector``'s forkserver; the scanner and the fuzzer run in
the test process and speak raw TCP to the FFN rank's port.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_connector import (
    _CTX,
    HIDDEN,
    SLACK_S,
    _join_all,
    attention_worker,
    collect,
    free_port,
    make_config,
    start,
)

from afd_patches.config import AfdConfig
from afd_patches.connectors import auth, handshake
from afd_patches.connectors.base import ConnectorError
from afd_patches.connectors.torch_dist import DTYPE_CODES, HEADER_LEN, KIND_DATA, MAGIC, Header, TorchDistConnector

FFN_HOST = "127.0.0.2"
TOKEN = "test-only-rendezvous-token-0123456789abcdef"  # a constant: forkserver children re-import this module
IDENTITY = {"hidden_size": HIDDEN, "dtype": "float32", "max_num_batched_tokens": 64}


def host_config(role: str, port: int, timeout_s: float = 15.0, **extra: Any) -> AfdConfig:
    cfg = make_config(role, 0, port, timeout_s=timeout_s, **extra)
    return AfdConfig(**{**cfg.to_dict(), "host": FFN_HOST})


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def logged_ffn_worker(cfg: AfdConfig, queue: Any, token: str | None, identity: dict[str, Any] | None = None) -> None:
    """Serve until the attention side closes; report calls, the error and every ``afd`` log line."""
    torch.set_num_threads(1)
    if token is not None:
        os.environ[auth.TOKEN_ENV] = token
    records = _Records()
    logging.getLogger("afd").addHandler(records)
    conn = TorchDistConnector(cfg, identity=identity)
    calls = 0
    try:
        conn.init()
        queue.put(("ffn0-formed", {}))
        while True:
            meta, xs = conn.recv_attn_output()
            conn.send_ffn_output([x * 2 + 1 for x in xs], meta)
            calls += 1
    except ConnectorError as e:
        conn.close()
        queue.put(("ffn0", {"calls": calls, "error": type(e).__name__, "message": str(e), "log": records.lines}))


def token_attention_worker(cfg: AfdConfig, token: str | None, plan: list[int], queue: Any) -> None:
    if token is not None:
        os.environ[auth.TOKEN_ENV] = token
    t0 = time.monotonic()
    attention_worker(cfg, plan, 2, queue)
    queue.put(("attention0-elapsed", {"elapsed": time.monotonic() - t0}))


def init_only(cfg: AfdConfig, token: str | None, queue: Any, name: str) -> None:
    if token is not None:
        os.environ[auth.TOKEN_ENV] = token
    conn = TorchDistConnector(cfg)
    t0 = time.monotonic()
    try:
        conn.init()
        result: dict[str, Any] = {"error": None}
    except ConnectorError as e:
        result = {"error": type(e).__name__, "message": str(e)}
    result["elapsed"] = time.monotonic() - t0
    conn.close()
    queue.put((name, result))


def hostile_header_worker(cfg: AfdConfig, shape: list[int], queue: Any) -> None:
    """Join with the right token, then send one header announcing ``shape`` (float32) and no payload."""
    os.environ[auth.TOKEN_ENV] = TOKEN
    conn = TorchDistConnector(cfg)
    conn.init()
    words = [MAGIC, KIND_DATA, 0, 0, DTYPE_CODES["float32"], len(shape), 0, *shape]
    words += [0] * (HEADER_LEN - len(words))
    conn._pg.send([torch.tensor(words, dtype=torch.int64).view(torch.uint8)], 0, 1).wait()
    time.sleep(3 * SLACK_S)  # stay connected: the FFN must fail on the header, not on a closed peer
    conn.close()


# --------------------------------------------------------------------------- raw clients
def _connect(port: int, host: str = FFN_HOST) -> socket.socket:
    return socket.create_connection((host, port), timeout=5)


def _read_line(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    buf = b""
    while b"\n" not in buf:
        chunk = sock.recv(4096)
        if not chunk:
            return buf
        buf += chunk
    return buf.split(b"\n", 1)[0]


def _authenticated(port: int, token: str | None, hello: dict[str, Any]) -> tuple[bytes, bytes]:
    """Run the protocol with ``token``; return (challenge line, what came after our proof and hello)."""
    with _connect(port) as s:
        nj = auth.nonce()
        s.sendall(json.dumps({"afd_hello": handshake.PROTOCOL, "nonce": nj.hex()}).encode() + b"\n")
        challenge = _read_line(s)
        nh = bytes.fromhex(json.loads(challenge)["nonce"])
        key = token.encode() if token else None
        proof = auth.proof(key, auth.JOIN_LABEL, nj, nh).hex()
        s.sendall(json.dumps({"proof": proof, **hello}).encode() + b"\n")
        rest = b""
        s.settimeout(5)
        try:
            while chunk := s.recv(4096):
                rest += chunk
        except OSError:
            pass
        return challenge, rest


def scan(port: int) -> tuple[dict[str, bytes], list[socket.socket]]:
    """What a scanner gets from each probe; the 20 idle connections it leaves open."""
    idle = [_connect(port) for _ in range(20)]
    got: dict[str, bytes] = {}
    for name, data in [("random bytes", b"\x00\xff" + secrets.token_bytes(3000) + b"\n"),
                       ("60 KB line", b"[" * 60_000 + b"\n"),
                       ("deep nesting", b"[" * 15_000 + b"\n"),
                       ("empty-fields hello", b'{"afd_hello": 1, "role": "attention", "rank": 0, "fields": {}}\n')]:
        with _connect(port) as s:
            try:
                s.sendall(data)
                got[name] = _read_line(s)
            except OSError:
                got[name] = b""
    _, got["wrong token"] = _authenticated(port, "w" * 32, {"role": "attention", "rank": 0, "fields": {}})
    _, got["unknown role"] = _authenticated(port, TOKEN, {"role": "router", "rank": 0, "fields": {}})
    _, got["duplicate rank"] = _authenticated(port, TOKEN, {"role": "ffn", "rank": 0, "fields": {}})
    return got, idle


# --------------------------------------------------------------------------- tests
def test_listener_binds_the_configured_host_only() -> None:
    port = free_port()
    listener = handshake.listen(FFN_HOST, port)
    try:
        assert listener.getsockname()[:2] == (FFN_HOST, port)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.3", port), timeout=2)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
        socket.create_connection((FFN_HOST, port), timeout=2).close()
    finally:
        listener.close()


def test_non_loopback_host_without_token_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    t0 = time.monotonic()
    with pytest.raises(ConnectorError) as e:
        TorchDistConnector(AfdConfig(role="ffn", host="10.1.2.3", connector_extra_config={"backend": "gloo"}))
    assert time.monotonic() - t0 < 1.0
    assert "AFD_TOKEN" in str(e.value) and "token_file" in str(e.value)
    TorchDistConnector(AfdConfig(role="ffn", host="10.1.2.3", allow_unauthenticated=True,
                                 connector_extra_config={"backend": "gloo"}))


def test_header_bounds_before_allocation() -> None:
    conn = TorchDistConnector(make_config("ffn", 0, 1), identity=IDENTITY)
    ok = Header(KIND_DATA, 0, 0, (64, HIDDEN), "float32", False)
    assert conn._check_header(ok, 1, "x") == 64 * HIDDEN * 4
    for shape, dtype, words in [((1 << 40, HIDDEN), "float32", "max_num_batched_tokens=64"),
                                ((4, HIDDEN + 1), "float32", f"not (tokens, {HIDDEN})"),
                                ((4, HIDDEN), "float64", "dtype float64, expected float32"),
                                ((4, HIDDEN, 2), "float32", "not (tokens"),
                                ((-4, HIDDEN), "float32", "negative")]:
        conn._broken = None
        with pytest.raises(ConnectorError, match="nothing was allocated") as e:
            conn._check_header(Header(KIND_DATA, 0, 0, shape, dtype, False), 1, "x")
        assert words in str(e.value), e.value
    bare = TorchDistConnector(make_config("ffn", 0, 1))  # no identity: only the size bound
    with pytest.raises(ConnectorError, match="more than 1073741824"):
        bare._check_header(Header(KIND_DATA, 0, 0, (1 << 20, 1 << 20), "float32", False), 1, "x")
    with pytest.raises(ConnectorError, match="inline bytes"):
        bare._broken = None
        bare._check_header(Header(KIND_DATA, 0, 0, (1 << 20, 4), "float32", True), 1, "x")


def test_hostile_tensor_header_fails_the_group_without_allocating() -> None:
    """An authenticated peer announcing a 2**40-row tensor: the FFN fails at once, naming the bound."""
    port = free_port()
    queue = _CTX.Queue()
    procs = [start(logged_ffn_worker, host_config("ffn", port), queue, TOKEN, IDENTITY),
             start(hostile_header_worker, host_config("attention", port), [1 << 40, HIDDEN], queue)]
    res = collect(queue, {"ffn0"}, 30)["ffn0"]
    _join_all(procs, 20)
    assert res["error"] == "ConnectorError" and "max_num_batched_tokens=64" in res["message"], res
    assert "nothing was allocated" in res["message"]


def test_scanner_then_the_real_peer_is_served_exactly() -> None:
    """Every probe is refused and logged once, reveals nothing, and the real attention rank joins at once."""
    port = free_port()
    queue = _CTX.Queue()
    ffn = start(logged_ffn_worker, host_config("ffn", port, timeout_s=60.0), queue, TOKEN)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((FFN_HOST, port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "FFN rank never listened"
            time.sleep(0.1)
    got, idle = scan(port)
    try:
        plan = [3, 0, 5]
        attn = start(token_attention_worker, host_config("attention", port), TOKEN, plan, queue)
        res = collect(queue, {"attention0", "attention0-elapsed", "ffn0"}, 60)
    finally:
        for s in idle:
            s.close()
    _join_all([ffn, attn], 10)
    assert res["attention0"] == {"error": None, "mismatches": 0, "sent": 6, "received": 6}, res
    assert res["attention0-elapsed"]["elapsed"] < SLACK_S + 2, res  # idle connections delayed nothing
    assert res["ffn0"]["error"] == "ConnectorClosed" and res["ffn0"]["calls"] == 6, res["ffn0"]
    for name, answer in got.items():  # without the token nothing but a challenge comes back
        if name in ("unknown role", "duplicate rank"):
            continue
        assert b"num_attention_ranks" not in answer and b"inline_bytes" not in answer, (name, answer)
    assert got["wrong token"].count(b"authentication failed") == 1
    assert b"not part of the topology" in got["unknown role"] and b"already taken" in got["duplicate rank"]
    refused = [line for line in res["ffn0"]["log"] if "refused the connection" in line]
    print("\n".join(refused))
    reasons = {"line longer": 1, "not JSON": 2, "not JSON (RecursionError)": 1, "not an AFD protocol 2 hello": 1,
               "wrong token": 1, "not part of the topology": 1, "ffn rank 0 is already taken": 1,
               "(connection closed)": 1}  # the last one: this test's probe for the listening port
    for words, n in reasons.items():
        assert sum(words in line for line in refused) == n, (words, refused)
    silent = sum("no AFD hello in time" in line or "before the handshake ended" in line for line in refused)
    assert silent == 20, refused
    assert len(refused) == 8 + 20, refused


@pytest.mark.parametrize("attention_token", ["other", None], ids=["wrong", "none"])
def test_wrong_token_fails_both_sides_naming_the_cause(attention_token: str | None) -> None:
    """The attention side fails at once, the FFN side at ``timeout_s``; neither learns the other's settings."""
    port, timeout_s = free_port(), 4.0
    queue = _CTX.Queue()
    other = None if attention_token is None else secrets.token_hex(32)
    # 127.0.0.2 is loopback, so the tokenless side is allowed to start: the mismatch shows in the handshake
    procs = [start(init_only, host_config("ffn", port, timeout_s=timeout_s), TOKEN, queue, "ffn0"),
             start(init_only, host_config("attention", port, timeout_s=timeout_s), other, queue, "attention0")]
    got = collect(queue, {"ffn0", "attention0"}, timeout_s + 4 * SLACK_S)
    _join_all(procs, 10)
    a, f = got["attention0"], got["ffn0"]
    print(a, f, sep="\n")
    assert a["error"] == "ConnectorAuthError" and "different token" in a["message"], a
    assert ("has no token" if attention_token is None else "has a token") in a["message"]
    assert a["elapsed"] < SLACK_S, a
    assert f["error"] == "ConnectorTimeout" and "different token" in f["message"], f
    assert f["elapsed"] < timeout_s + SLACK_S, f
    for res in (a, f):
        assert "num_attention_ranks" not in res["message"] and TOKEN not in res["message"], res


FUZZ_S = 30.0
_fuzz = {"connections": 0, "t0": 0.0}

_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=4), max_leaves=20)
_first_lines = st.one_of(
    st.binary(max_size=4096),
    _json_values.map(lambda v: json.dumps(v).encode() + b"\n"),
    st.fixed_dictionaries({"afd_hello": st.sampled_from([2, 1, "2", None]),
                           "nonce": st.one_of(st.text(max_size=70), st.just("ab" * 32))}).map(
        lambda d: json.dumps(d).encode() + b"\n"),
)


def _fuzz_once(port: int, first: bytes, second: bytes, wait_answer: bool) -> None:
    _fuzz["connections"] += 1
    try:
        with _connect(port) as s:
            s.sendall(first)
            if wait_answer:
                _read_line(s, 0.2)
                s.sendall(second)
    except OSError:
        pass


def test_fuzzed_rendezvous_then_the_real_peer_is_served(tmp_path: Any) -> None:
    """Up to 2,000 hypothesis-made connections for at most ``FUZZ_S`` s; the FFN rank then still serves."""
    port = free_port()
    queue = _CTX.Queue()
    ffn = start(logged_ffn_worker, host_config("ffn", port, timeout_s=FUZZ_S + 60), queue, TOKEN)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection((FFN_HOST, port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "FFN rank never listened"
            time.sleep(0.1)
    _fuzz.update(connections=0, t0=time.monotonic())

    @settings(max_examples=1500, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(first=_first_lines, second=st.one_of(st.binary(max_size=2048), _json_values.map(
        lambda v: json.dumps(v).encode() + b"\n")), wait_answer=st.booleans())
    def fuzz(first: bytes, second: bytes, wait_answer: bool) -> None:
        if time.monotonic() - _fuzz["t0"] < FUZZ_S:
            _fuzz_once(port, first, second, wait_answer)

    fuzz()
    spent = time.monotonic() - _fuzz["t0"]
    attn = start(token_attention_worker, host_config("attention", port), TOKEN, [2, 1], queue)
    res = collect(queue, {"attention0", "ffn0"}, 60)
    _join_all([ffn, attn], 10)
    print(f"fuzz: {_fuzz['connections']} connections in {spent:.1f}s; the FFN then served the real peer")
    assert 0 < _fuzz["connections"] <= 2000 and spent < FUZZ_S + 10
    assert res["attention0"] == {"error": None, "mismatches": 0, "sent": 4, "received": 4}, res
    assert res["ffn0"]["error"] == "ConnectorClosed" and res["ffn0"]["calls"] == 4, res["ffn0"]
