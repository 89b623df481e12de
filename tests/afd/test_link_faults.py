"""The link's remaining faults (issue 37): a hostile line, an idle peer, a crowd of strangers, online guessing.

Real processes on loopback addresses only: the FFN rank hosts the group on 127.0.0.2 (``test_rendezvous``'s
``FFN_HOST``), strangers connect from other 127.0.x.y addresses. Ranks run in ``test_connector``'s forkserver.
The parsers of every byte that crosses the network are fuzzed in-process with hypothesis.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afd_patches.config import AfdConfig
from afd_patches.connectors import admission, auth, handshake, liveness, session, wire
from afd_patches.connectors.base import ConnectorError
from afd_patches.connectors.store import MacStore, StoreTampered
from afd_patches.connectors.torch_dist import TorchDistConnector
from afd_patches.connectors.torch_group import TorchGroupTransport
from afd_patches.connectors.transport import LinkClosed
from harness.crowd import CROWD, flood
from harness.env import free_port
from tests.afd.test_connector import (
    _CTX,
    FORM_S,
    SLACK_S,
    _join_all,
    attn_input,
    collect,
    ffn,
    ffn_worker,
    make_config,
    start,
)
from tests.afd.test_rendezvous import FFN_HOST, TOKEN, host_config, init_only, logged_ffn_worker
from tests.support import afd_probe

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30)
_LINES = st.one_of(st.binary(max_size=600), _JSON.map(lambda v: json.dumps(v).encode()),
                   st.integers(1, 3000).map(lambda n: b'{"hello":' + b"[" * n + b"]" * n + b',"proof":"00"}'))


# ------------------------------------------------------------------ 1. no input ends a service
def _stranger_line(port: int, second: bytes, source: str) -> bytes:
    """A stranger's valid step 1, then ``second`` as its step 3; whatever the host answered."""
    with socket.create_connection((FFN_HOST, port), timeout=5, source_address=(source, 0)) as s:
        s.sendall(json.dumps({"afd": handshake.PROTOCOL, "nonce": auth.nonce().hex()}).encode() + b"\n")
        afd_probe.read_line(s)
        s.sendall(second + b"\n")
        return afd_probe.read_line(s)


HOSTILE_STEP3 = {
    "nested hello": b'{"hello": ' + b"[" * 1000 + b"]" * 1000 + b', "proof": "' + b"00" * 32 + b'"}',
    "nested hello text": json.dumps({"hello": "[" * 1000 + "]" * 1000, "proof": "00" * 32}).encode(),
    "hello not text": json.dumps({"hello": {"role": "attention", "rank": 0, "fields": {}},
                                  "proof": "00" * 32}).encode(),
    "proof not hex": json.dumps({"hello": "{}", "proof": "zz" * 32}).encode(),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_STEP3))
def test_a_hostile_hello_drops_that_connection_only(name: str) -> None:
    """A stranger's step 3 nested 1,000 deep (or otherwise malformed) is dropped with one log line; the
    admission thread lives on and the real attention rank joins and is served exactly."""
    port = free_port()
    queue = _CTX.Queue()
    ffn_proc = start(logged_ffn_worker, host_config("ffn", port, timeout_s=30.0), queue, TOKEN)
    afd_probe.wait_listening(FFN_HOST, port, 30)
    answer = _stranger_line(port, HOSTILE_STEP3[name], "127.0.0.5")
    attn = start(init_only, host_config("attention", port, timeout_s=10.0), TOKEN, queue, "attention0")
    got = res = collect(queue, {"attention0", "ffn0"}, 40)
    _join_all([ffn_proc, attn], 10)
    assert answer in (b'{"afd_refused":"busy"}', b'{"afd_refused":"proof"}'), answer
    assert got["attention0"]["error"] is None, got
    assert got["attention0"]["elapsed"] < SLACK_S, got
    reasons = afd_probe.refusals(res["ffn0"]["log"])
    assert sum(n for why, n in reasons.items() if "127.0.0.5" in str(why) or "hello" in why or "token" in why) >= 1
    assert not [line for line in res["ffn0"]["log"] if "admission error" in line], res["ffn0"]["log"]


@settings(max_examples=400, deadline=None, database=None)
@given(line=_LINES)
def test_the_line_parser_raises_value_error_only(line: bytes) -> None:
    try:
        obj = handshake.parse_line(line)
    except ValueError:
        return
    assert isinstance(obj, dict) and handshake.nesting_depth(line.decode()) <= handshake.MAX_DEPTH


@settings(max_examples=400, deadline=None, database=None)
@given(obj=_JSON)
def test_the_hello_parser_raises_value_error_only(obj: Any) -> None:
    try:
        hello = handshake.Hello.parse(obj)
    except ValueError:
        return
    assert isinstance(hello.role, str) and isinstance(hello.rank, int) and isinstance(hello.fields, dict)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.lists(_LINES, min_size=1, max_size=3))
def test_a_session_message_raises_session_error_only(data: list[bytes]) -> None:
    """What a verdict or any later session message may be: anything else than a MAC'd message under the
    session's key is ``SessionError`` (or ``TimeoutError`` when no line ends), never another exception."""
    a, b = socket.socketpair()
    try:
        a.sendall(b"\n".join(data) + b"\n")
        reader = session.Session(b, auth.nonce(), "stranger")
        with pytest.raises((session.SessionError, TimeoutError)):
            reader.recv(time.monotonic() + 0.05)
    finally:
        a.close()
        b.close()


def test_a_session_message_round_trips_and_its_mac_covers_the_raw_body() -> None:
    a, b = socket.socketpair()
    key = auth.nonce()
    try:
        session.Session(a, key, "a").send({"verdict": "ok", "group": "g", "ffn": ""})
        assert session.Session(b, key, "b").recv(time.monotonic() + 1) == {"verdict": "ok", "group": "g", "ffn": ""}
        sender = session.Session(a, key, "a")
        sender._sent = 1  # a body sent under another counter: replayed or reordered
        sender.send({"verdict": "ok"})
        with pytest.raises(session.SessionError, match="failed authentication"):
            session.Session(b, key, "b").recv(time.monotonic() + 1)
    finally:
        a.close()
        b.close()


@settings(max_examples=300, deadline=None, database=None)
@given(words=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=wire.HEADER_LEN, max_size=wire.HEADER_LEN),
       magic=st.booleans(), kind=st.sampled_from([wire.KIND_DATA, wire.KIND_CLOSE, wire.KIND_PING, 0, 7]))
def test_a_tensor_header_raises_bad_message_only(words: list[int], magic: bool, kind: int) -> None:
    if magic:
        words[0], words[1] = wire.MAGIC, kind
    limits = wire.Limits(2, 16, "float32", 64, 1, 0)
    try:
        header = wire.decode(wire.HEADER.pack(*words))
        if header.kind == wire.KIND_DATA:
            nbytes = limits.check(header)
            assert 0 <= nbytes <= 64 * 16 * 4
    except wire.BadMessage:
        pass


class _DictStore:
    """A stand-in for the group's ``TCPStore`` holding whatever a stranger wrote (the parser under test is
    ``MacStore``'s and the heartbeat's, not torch's)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = bytes(value)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


@settings(max_examples=300, deadline=None, database=None)
@given(raw=st.binary(max_size=200))
def test_a_store_record_and_a_heartbeat_raise_store_tampered_only(raw: bytes) -> None:
    """A record a stranger wrote into the group's store: ``StoreTampered`` on read; a heartbeat that reads
    it counts no beat and raises nothing."""
    inner = _DictStore()
    store = MacStore(inner, b"k" * 32)
    inner.set(liveness.key(1), raw)
    with pytest.raises(StoreTampered):
        store.get(liveness.key(1))
    lost: list[int] = []
    beat = liveness.Heartbeat(store, 0, [1], 10.0, 1.0, lambda peer, why: lost.append(peer), "test", 0)
    beat._check()
    assert lost == []


def test_a_forged_closed_marker_in_the_store_does_not_hide_a_frozen_peer(
        afd_caplog: pytest.LogCaptureFixture) -> None:
    """Records written into the group's store without its key ("closed", a fresh count: what a stranger could
    write before ``sealing.seal_store`` shut it out) count as no beat: the frozen peer is still lost at
    ``timeout_s``, and the forgery is logged once."""
    inner = _DictStore()
    lost: list[tuple[int, str]] = []
    beat = liveness.Heartbeat(MacStore(inner, b"k" * 32), 0, [1], 0.3, 0.075, lambda p, why: lost.append((p, why)),
                              "test", 0)
    t0 = time.monotonic()
    while not lost and time.monotonic() - t0 < 2.0:
        for value in (b"closed", str(time.monotonic()).encode()):
            inner.set(liveness.key(1), value)
            beat._check()
        time.sleep(0.05)
    assert [p for p, _ in lost] == [1] and "no heartbeat" in lost[0][1], lost
    assert 0.3 <= time.monotonic() - t0 < 1.0
    forged = [r for r in afd_caplog.records if "written without the group's key" in r.getMessage()]
    assert len(forged) == 1, forged


# ------------------------------------------------------------------ 2. an idle attention rank
def idling_attention(cfg: AfdConfig, idle_s: float, layers: int, queue: Any) -> None:
    """One step through every layer, ``idle_s`` without reading anything, one more step; each result exact."""
    torch.set_num_threads(1)
    conn = TorchDistConnector(cfg)
    report: dict[str, Any] = {"error": None, "exact": []}
    try:
        conn.init(FORM_S)
        for step in range(2):
            if step:
                time.sleep(idle_s)
            for layer in range(layers):
                x = attn_input(cfg.rank, layer, step, 3)
                conn.send_attn_output(x, layer, step)
                report["exact"].append(bool(torch.equal(conn.recv_ffn_output(layer, step), ffn(x))))
    except ConnectorError as e:
        report.update(error=type(e).__name__, message=str(e))
    conn.close()
    queue.put((f"attention{cfg.rank}", report))


@pytest.mark.parametrize("schedule,a", [("batched", 1), ("pingpong", 2)])
def test_an_idle_attention_rank_finds_the_keepalives_and_goes_on(schedule: str, a: int) -> None:
    """An attention rank reads only inside an exchange; after idling three times ``timeout_s`` its next step
    is exact: the FFN's keep-alives waiting in its socket count, the group stays the same."""
    port, timeout_s, idle_s = free_port(), 2.0, 6.0
    queue = _CTX.Queue()
    procs = [start(ffn_worker, make_config("ffn", 0, port, a=a, timeout_s=timeout_s, schedule=schedule), queue,
                   0.0, 0.0, FORM_S)]  # a slow start of a process is not what this tests
    procs += [start(idling_attention, make_config("attention", r, port, a=a, timeout_s=timeout_s,
                                                  schedule=schedule), idle_s, 2, queue) for r in range(a)]
    got = collect(queue, {"ffn0", *(f"attention{r}" for r in range(a))}, idle_s + 30)
    _join_all(procs, 10)
    for r in range(a):
        assert got[f"attention{r}"] == {"error": None, "exact": [True] * 4}, got
    assert got["ffn0"]["error"] == "ConnectorClosed", got["ffn0"]  # one group, closed at the end
    assert got["ffn0"]["calls"] == 4 * (a if schedule == "pingpong" else 1), got["ffn0"]


# ------------------------------------------------------------------ 4. a crowd of strangers
def test_a_real_rank_joins_while_240_addresses_connect_at_full_rate() -> None:
    """240 loopback addresses connect as fast as four threads can; the real attention rank joins within 2 s
    (plus scheduling slack here), and the FFN's log gets summary lines, not one line per refusal."""
    port = free_port()
    queue = _CTX.Queue()
    ffn_proc = start(logged_ffn_worker, host_config("ffn", port, timeout_s=60.0), queue, TOKEN)
    afd_probe.wait_listening(FFN_HOST, port, 30)
    until, made, done = time.monotonic() + 8.0, [], threading.Event()
    # the crowd stops at ``until`` or once both ranks reported (the FFN's log, counted below, ends there)
    threads = [threading.Thread(target=flood, daemon=True,
                                args=(FFN_HOST, port, CROWD[i::4], until, made, handshake.PROTOCOL, done))
               for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the crowd is at full rate
    attn = start(init_only, host_config("attention", port, timeout_s=20.0), TOKEN, queue, "attention0")
    got = res = collect(queue, {"attention0", "ffn0"}, 40)
    done.set()
    for t in threads:
        t.join(15)
    _join_all([ffn_proc, attn], 10)
    refused = sum(afd_probe.refusals(res["ffn0"]["log"]).values())
    lines = [line for line in res["ffn0"]["log"] if "refused" in line]
    print(f"crowd: {sum(made)} connections, {refused} refused in {len(lines)} log lines; the real rank joined "
          f"after {got['attention0']['elapsed']:.2f}s")
    assert got["attention0"]["error"] is None, got
    assert got["attention0"]["elapsed"] < 2.0 + SLACK_S, got
    assert sum(made) >= 1000 and refused >= 1000, (made, refused)
    assert len(lines) <= 40, lines[:50]


# ------------------------------------------------------------------ 5. online guessing
def _guess(port: int, source: str, until: float) -> int:
    """Proofs under wrong tokens from ``source``, one after another, until ``until``; how many were answered."""
    answered = 0
    while time.monotonic() < until:
        hello = {"role": "attention", "rank": 0, "fields": {}}
        try:
            if afd_probe.authenticated(FFN_HOST, port, auth.nonce().hex(), hello, source).startswith(b'{"afd_refused"'):
                answered += 1
        except (OSError, ValueError):
            pass
    return answered


def test_failed_proofs_back_off_per_address() -> None:
    """A guesser gets a handful of answers in 4 s (it got about 750 a second before); a real rank from
    another address joins at once meanwhile."""
    port = free_port()
    queue = _CTX.Queue()
    ffn_proc = start(logged_ffn_worker, host_config("ffn", port, timeout_s=60.0), queue, TOKEN)
    afd_probe.wait_listening(FFN_HOST, port, 30)
    result: list[int] = []
    guesser = threading.Thread(target=lambda: result.append(_guess(port, "127.0.0.7", time.monotonic() + 4.0)))
    guesser.start()
    time.sleep(1.0)
    os.environ.pop(auth.TOKEN_ENV, None)
    attn = start(init_only, host_config("attention", port, timeout_s=10.0), TOKEN, queue, "attention0")
    got = collect(queue, {"attention0", "ffn0"}, 40)
    guesser.join(30)
    _join_all([ffn_proc, attn], 10)
    print(f"guesses answered in 4 s: {result}; the real rank joined after {got['attention0']['elapsed']:.2f}s")
    assert result and 1 <= result[0] <= 12, result
    assert any("wrong token" in line and "127.0.0.7" in line for line in got["ffn0"]["log"]), got["ffn0"]["log"]
    assert got["attention0"]["error"] is None and got["attention0"]["elapsed"] < SLACK_S, got


# ------------------------------------------------------------------ 8. a tokenless group says so
def test_a_tokenless_group_warns_once(monkeypatch: pytest.MonkeyPatch, afd_caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    afd_caplog.set_level(logging.WARNING)
    port = free_port()
    for _ in range(3):  # the token is read at each formation attempt; a tokenless group warns at the first
        conn = TorchDistConnector(make_config("ffn", 0, port))
        with pytest.raises(ConnectorError, match="heard from 0 of 1"):
            conn.init(0.2)
        conn.close()
    warned = [r.getMessage() for r in afd_caplog.records if "no token" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "any local user" in warned[0] and f"127.0.0.1:{port}" in warned[0], warned


def test_the_gate_remembers_a_bounded_number_of_addresses() -> None:
    """More addresses than ``MAX_SOURCES`` connect once each: the gate's per-address memory stays bounded."""
    port = free_port()
    listener = admission.listen(FFN_HOST, port, "a test gate")
    gate = admission.Gate(listener, handshake.Hello("ffn", 0), None, f"{FFN_HOST}:{port}")
    try:
        sources = [f"127.0.{2 + i // 250}.{1 + i % 250}" for i in range(admission.MAX_SOURCES + 200)]
        for source in sources:
            try:
                socket.create_connection((FFN_HOST, port), timeout=1, source_address=(source, 0)).close()
            except OSError:
                pass
        deadline = time.monotonic() + 20
        while sum(gate.refused.values()) < len(sources) - 50 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sum(gate.refused.values()) >= len(sources) - 50, gate.refused
        assert len(gate._sources) <= admission.MAX_SOURCES, len(gate._sources)
    finally:
        gate.close()
        listener.close()


class _ClosedPairs:
    """A gloo group whose pair to every peer is known closed: posting a send or receive raises at once."""

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")

    send = recv


def test_posting_on_a_pair_gloo_knows_closed_is_a_typed_link_closed() -> None:
    """Seen in a loaded run: the FFN killed, the attention rank's farewell check posted a header receive and gloo
    raised its RuntimeError there, which ended the rank untyped (the keeper re-forms on ConnectorError only)."""
    transport = TorchGroupTransport(_ClosedPairs(), "gloo", torch.device("cpu"), 1.0, 0)
    for post in (lambda: transport.next_header(3, 0.0), lambda: transport.warm_up([3], False, 1.0),
                 lambda: transport.first([3], 0.0)):
        with pytest.raises(LinkClosed, match="connection to global rank 3 closed"):
            post()
