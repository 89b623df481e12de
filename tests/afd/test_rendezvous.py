"""The AFD rendezvous against strangers: binding, the token, hostile hellos, bounded tensor headers.

The FFN rank hosts the group on 127.0.0.2 and the attention rank joins from
127.0.0.1 (both loopback, "two hosts" simulated), with a token. Ranks run in
processes of ``test_connector``'s forkserver; the scanner and the fuzzer run in
the test process and speak raw TCP to the FFN rank's port.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from typing import Any

import pytest
import torch

from afd_patches import LOGGER
from afd_patches.config import AfdConfig, LinkConfig, restore
from afd_patches.connectors import admission, auth, wire
from afd_patches.connectors.base import ConnectorError
from afd_patches.connectors.torch_dist import TorchDistConnector
from harness.env import free_port
from tests.afd.test_connector import (
    _CTX,
    HIDDEN,
    SLACK_S,
    _join_all,
    attention_worker,
    collect,
    make_config,
    start,
)
from tests.support import afd_probe

FFN_HOST = "127.0.0.2"
# secrets.token_hex(32), a constant: forkserver children re-import this module
TOKEN = "05b2f307b95fec80a9a2d165a33951419e47a830ef17017033714fc3eed05cf5"
IDENTITY = {"hidden_size": HIDDEN, "dtype": "float32", "max_num_batched_tokens": 64}


def host_config(role: str, port: int, timeout_s: float = 15.0, **extra: Any) -> AfdConfig:
    cfg = make_config(role, 0, port, timeout_s=timeout_s, **extra)
    return restore({**cfg.to_dict(), "host": FFN_HOST})


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def logged_ffn_worker(cfg: AfdConfig, queue: Any, token: str | None, identity: dict[str, Any] | None = None,
                      form_s: float | None = None) -> None:
    """Serve until the attention side closes; report calls, the error and every AFD log line. ``form_s``: the
    bound on forming the group (``timeout_s`` when None)."""
    torch.set_num_threads(1)
    if token is not None:
        os.environ[auth.TOKEN_ENV] = token
    records = _Records()
    logging.getLogger(LOGGER).addHandler(records)
    calls, error, message = _serve_one_group(TorchDistConnector(cfg, identity=identity), form_s)
    queue.put(("ffn0", {"calls": calls, "error": error, "message": message, "log": records.lines}))


def _serve_one_group(conn: TorchDistConnector, form_s: float | None = None) -> tuple[int, str, str]:
    """Form the group, answer x*2+1 until a connector error (``ConnectorClosed`` at a clean end), close;
    (calls, error class, message). The exception itself is not returned: its traceback would keep the
    group's store, and so the port, alive."""
    calls = 0
    try:
        conn.init(form_s)
        while True:
            meta, xs = conn.recv_attn_output()
            conn.send_ffn_output([x * 2 + 1 for x in xs], meta)
            calls += 1
    except ConnectorError as e:
        conn.close()
        return calls, type(e).__name__, str(e)


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


def hostile_header_worker(cfg: AfdConfig, shape: list[int], queue: Any, release: Any) -> None:
    """Join with the right token, then send one header announcing ``shape`` (float32) and no payload; stay
    connected until ``release`` (a multiprocessing ``Event``, set once the FFN side has reported) or at most
    ``3 * SLACK_S``."""
    os.environ[auth.TOKEN_ENV] = TOKEN
    conn = TorchDistConnector(cfg)
    conn.init()
    words = [wire.MAGIC, wire.KIND_DATA, 0, 0, 0, wire.DTYPE_CODES["float32"], len(shape), 0, *shape]
    words += [0] * (wire.HEADER_LEN - len(words))
    assert conn._transport is not None
    conn._transport.send(0, words, None)
    release.wait(3 * SLACK_S)  # stay connected: the FFN must fail on the header, not on a closed peer
    conn.close()


# --------------------------------------------------------------------------- tests
def test_listener_binds_the_configured_host_only() -> None:
    port = free_port()
    listener = admission.listen(FFN_HOST, port, "the group")
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
    conn = TorchDistConnector(AfdConfig(role="ffn", host="10.1.2.3", connector_extra_config={"backend": "gloo"}))
    with pytest.raises(ConnectorError) as e:
        conn.init()  # the token is read, and the policy judged, at each formation attempt
    assert time.monotonic() - t0 < 1.0
    assert "AFD_TOKEN" in str(e.value) and "token_file" in str(e.value)
    TorchDistConnector(AfdConfig(role="ffn", host="10.1.2.3", allow_unauthenticated=True,
                                 connector_extra_config=LinkConfig(backend="gloo")))


def test_header_bounds_before_allocation() -> None:
    """Every header field is judged before anything is allocated (``wire.Limits``), each problem named."""
    limits = wire.Limits(num_layers=2, hidden_size=HIDDEN, dtype="float32", max_tokens=64)

    def header(shape: tuple[int, ...], dtype: str = "float32", layer: int = 0, inline: bool = False,
               step: int = 0, microbatch: int = 0) -> wire.Header:
        return wire.Header(wire.KIND_DATA, layer, step, microbatch, shape, dtype, inline)

    assert limits.check(header((64, HIDDEN))) == 64 * HIDDEN * 4
    for bad, words in [(header((1 << 40, HIDDEN)), "max_num_batched_tokens=64"),
                       (header((4, HIDDEN + 1)), f"is not (tokens, {HIDDEN})"),
                       (header((4, HIDDEN), "float64"), "dtype float64, expected float32"),
                       (header((4, HIDDEN, 2)), "is not (tokens"),
                       (header((-4, HIDDEN)), "negative"),
                       (header((4, HIDDEN), layer=-1), "layer -1 outside 0..1"),
                       (header((4, HIDDEN), layer=2), "layer 2 outside 0..1"),
                       (header((4, HIDDEN), microbatch=1), "micro-batch 1 outside 0..0"),
                       (header((4, HIDDEN), step=-3), "step -3 is negative")]:
        with pytest.raises(wire.BadMessage, match="refused before anything was allocated") as e:
            limits.check(bad)
        assert words in str(e.value), e.value
    bare = wire.Limits()  # no identity: only the size bound
    with pytest.raises(wire.BadMessage, match="more than 1073741824"):
        bare.check(header((1 << 20, 1 << 20)))
    with pytest.raises(wire.BadMessage, match="inline bytes"):
        bare.check(header((1 << 20, 4), inline=True))


def test_hostile_tensor_header_fails_the_group_without_allocating() -> None:
    """An authenticated peer announcing a 2**40-row tensor: the FFN fails at once, naming the bound."""
    port = free_port()
    queue, release = _CTX.Queue(), _CTX.Event()
    procs = [start(logged_ffn_worker, host_config("ffn", port), queue, TOKEN, IDENTITY),
             start(hostile_header_worker, host_config("attention", port), [1 << 40, HIDDEN], queue, release)]
    res = collect(queue, {"ffn0"}, 30)["ffn0"]
    release.set()
    _join_all(procs, 20)
    assert res["error"] == "BadMessage" and "max_num_batched_tokens=64" in res["message"], res
    assert "refused before anything was allocated" in res["message"]


def test_scanner_then_the_real_peer_is_served_exactly() -> None:
    """Every probe is refused and logged once, reveals nothing, and the real attention rank joins at once."""
    port = free_port()
    queue = _CTX.Queue()
    ffn = start(logged_ffn_worker, host_config("ffn", port, timeout_s=60.0), queue, TOKEN)
    afd_probe.wait_listening(FFN_HOST, port, 30)
    got, idle = afd_probe.scan(FFN_HOST, port, TOKEN)
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
    print("\n".join(line for line in res["ffn0"]["log"] if "refused" in line))
    afd_probe.check_scan(got, res["ffn0"]["log"])
    assert sum(afd_probe.refusals(res["ffn0"]["log"]).values()) == (
        afd_probe.SCAN_PROBES + afd_probe.IDLE_CONNECTIONS + 1)  # + wait_listening's probe


@pytest.mark.parametrize("attention_token", ["other", None], ids=["wrong", "none"])
def test_wrong_token_fails_both_sides_naming_the_cause(attention_token: str | None) -> None:
    """The attention side fails at once, the FFN side at ``timeout_s``; neither learns the other's settings.

    The attention side starts once the FFN side listens, so its time is its own handshake, not the FFN process's
    start (which on a loaded machine took longer than ``SLACK_S``); ``timeout_s`` leaves it room to start."""
    port, timeout_s = free_port(), 8.0
    queue = _CTX.Queue()
    other = None if attention_token is None else secrets.token_hex(32)
    # 127.0.0.2 is loopback, so the tokenless side is allowed to start: the mismatch shows in the handshake
    procs = [start(init_only, host_config("ffn", port, timeout_s=timeout_s), TOKEN, queue, "ffn0")]
    afd_probe.wait_listening(FFN_HOST, port, timeout_s, lambda: None if procs[0].is_alive() else "exited")
    procs.append(start(init_only, host_config("attention", port, timeout_s=timeout_s), other, queue, "attention0"))
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


def test_fuzzed_rendezvous_then_the_real_peer_is_served(tmp_path: Any) -> None:
    """Up to 2,000 hypothesis-made connections for at most ``FUZZ_S`` s; the FFN rank then still serves."""
    port = free_port()
    queue = _CTX.Queue()
    ffn = start(logged_ffn_worker, host_config("ffn", port, timeout_s=FUZZ_S + 60), queue, TOKEN)
    afd_probe.wait_listening(FFN_HOST, port, 30)
    t0 = time.monotonic()
    connections = afd_probe.fuzz(FFN_HOST, port, FUZZ_S)
    spent = time.monotonic() - t0
    attn = start(token_attention_worker, host_config("attention", port), TOKEN, [2, 1], queue)
    res = collect(queue, {"attention0", "ffn0"}, 60)
    _join_all([ffn, attn], 10)
    print(f"fuzz: {connections} connections in {spent:.1f}s; the FFN then served the real peer")
    assert 0 < connections <= 2000 and spent < FUZZ_S + 10
    assert res["attention0"] == {"error": None, "mismatches": 0, "sent": 4, "received": 4}, res
    assert res["ffn0"]["error"] == "ConnectorClosed" and res["ffn0"]["calls"] == 4, res["ffn0"]


def reforming_ffn_worker(cfg: AfdConfig, queue: Any, groups: int) -> None:
    """Serve ``groups`` groups one after the other on the same host:port, as the FFN role worker does."""
    os.environ[auth.TOKEN_ENV] = TOKEN
    calls = []
    for _ in range(groups):
        n, error, _ = _serve_one_group(TorchDistConnector(cfg))
        calls.append((n, error))
    queue.put(("ffn0", {"groups": calls}))


def test_a_new_group_forms_on_the_same_port_after_a_clean_close() -> None:
    """Attention closes; the same FFN process forms a second group at the same host:port for a new one."""
    port = free_port()
    queue = _CTX.Queue()
    ffn = start(reforming_ffn_worker, host_config("ffn", port), queue, 2)
    first = start(token_attention_worker, host_config("attention", port), TOKEN, [2, 1], queue)
    assert collect(queue, {"attention0"}, 60)["attention0"]["error"] is None
    _join_all([first], 10)
    queue.get(timeout=5)  # attention0-elapsed
    second = start(token_attention_worker, host_config("attention", port), TOKEN, [1, 3, 0], queue)
    got = collect(queue, {"attention0", "ffn0"}, 60)
    _join_all([ffn, second], 10)
    assert got["attention0"] == {"error": None, "mismatches": 0, "sent": 6, "received": 6}, got
    assert got["ffn0"]["groups"] == [(4, "ConnectorClosed"), (6, "ConnectorClosed")], got
