"""The AFD link against someone without the token, and against a bad network (issue: "a link nobody else can
steer"). Real processes, loopback addresses only: the FFN rank on 127.0.0.2, attackers and proxies on other
127.0.0.x addresses. Ranks run in ``test_connector``'s forkserver.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from afd_patches import LOGGER
from afd_patches.config import AfdConfig, restore
from afd_patches.connectors import admission, auth, handshake, wire
from afd_patches.connectors.base import ConnectorError
from afd_patches.connectors.torch_dist import TorchDistConnector
from harness.env import free_port
from tests.afd.test_connector import (
    _CTX,
    HIDDEN,
    SLACK_S,
    _error_fields,
    _join_all,
    attention_worker,
    collect,
    start,
)
from tests.afd.test_rendezvous import FFN_HOST, TOKEN, _Records, host_config, token_attention_worker
from tests.support import afd_probe
from tests.support.faultproxy import FaultProxy

IDENTITY = {"hidden_size": HIDDEN, "dtype": "float32", "max_num_batched_tokens": 2048, "num_hidden_layers": 2}


def serving_ffn(cfg: AfdConfig, queue: Any, groups: int, identity: dict[str, Any] | None = None) -> None:
    """Serve ``groups`` groups one after another on the same address, as the FFN role does after any error:
    close the group, wait for the next. Reports each group as it ends (``ffn-group-ended``: calls, how it
    ended, the AFD log so far), then all of them (``ffn0``)."""
    os.environ[auth.TOKEN_ENV] = TOKEN
    records = _Records()
    import logging

    logging.getLogger(LOGGER).addHandler(records)
    ended = []
    for _ in range(groups):
        conn, calls = TorchDistConnector(cfg, identity=identity), 0
        try:
            conn.init()
            queue.put(("ffn-group", {"group": conn.group}))
            while True:
                meta, xs = conn.recv_attn_output()
                conn.send_ffn_output([x * 2 + 1 for x in xs], meta)
                calls += 1
        except ConnectorError as e:
            ended.append({"calls": calls, **_error_fields(e)})
        queue.put(("ffn-group-ended", {**ended[-1], "at": time.monotonic(), "log": list(records.lines)}))
        conn.close()
    queue.put(("ffn0", {"groups": ended, "log": records.lines}))


# ------------------------------------------------------------------ 1. relay through a rewritten store record
def _store_rewriter(host: str, port: int, until: float, relay: FaultProxy, seen: dict[str, int],
                    done: threading.Event) -> None:
    """A stranger's loop until ``until`` or ``done`` (both ranks reported: nothing is left to redirect):
    whenever the group's port takes a ``TCPStore`` client, point every data-address record it finds at
    ``relay`` (what worked against the store-based rendezvous)."""
    from torch.distributed import TCPStore

    while time.monotonic() < until and not done.is_set():
        seen["attempts"] += 1
        try:
            store = TCPStore(host, port, None, False, timedelta(seconds=0.5), wait_for_workers=False)
        except (RuntimeError, ValueError):
            time.sleep(0.01)
            continue
        seen["store_reached"] += 1
        for rank in range(2):
            key = f"afd/data/{rank}"
            try:
                if store.check([key]):
                    info = json.loads(store.get(key))
                    relay.target = (info["host"], int(info["port"]))
                    store.set(key, json.dumps({**info, "host": relay.address[0], "port": relay.address[1]}))
                    seen["rewrites"] += 1
            except (RuntimeError, ValueError):
                pass


def test_relay_through_a_rewritten_store_record_is_impossible() -> None:
    """A stranger hammers the group's port as a ``TCPStore`` client to redirect the data link through a
    relay that corrupts payloads. There is no store on tcp and the data link is the authenticated session's
    own socket: the stranger never reaches a store, nothing passes the relay, every result is exact."""
    port = free_port()
    queue = _CTX.Queue()
    seen = {"attempts": 0, "store_reached": 0, "rewrites": 0}
    done = threading.Event()
    with FaultProxy(("127.0.0.5", 0), (FFN_HOST, port)) as relay:
        ffn = start(serving_ffn, host_config("ffn", port), queue, 1)
        afd_probe.wait_listening(FFN_HOST, port, 30)
        attacker = threading.Thread(target=_store_rewriter, daemon=True,
                                    args=(FFN_HOST, port, time.monotonic() + 8, relay, seen, done))
        attacker.start()
        attn = start(token_attention_worker, host_config("attention", port), TOKEN, [3, 5, 1100, 2], queue)
        got = collect(queue, {"attention0", "ffn0"}, 60)
        done.set()
        attacker.join(15)
        _join_all([ffn, attn], 10)
        through = dict(relay.bytes_through)
    assert got["attention0"]["error"] is None and got["attention0"]["mismatches"] == 0, got["attention0"]
    assert seen["attempts"] > 0 and seen["store_reached"] == 0 and seen["rewrites"] == 0, seen
    assert through == {"up": 0, "down": 0}, through


# ------------------------------------------------------------------ 2. admission strangers cannot exhaust
def _park(host: str, port: int, source: str, until: float, held: list[socket.socket], done: threading.Event) -> None:
    """Open idle connections from ``source``: 80 at once, then 20 a second until ``until`` or ``done`` (the
    real ranks reported: the group they had to form under the load has come and gone)."""
    def one() -> None:
        try:
            held.append(socket.create_connection((host, port), timeout=2, source_address=(source, 0)))
        except OSError:
            pass

    for _ in range(80):
        one()
    while time.monotonic() < until and not done.is_set():
        one()
        time.sleep(0.05)


@pytest.mark.parametrize("source", ["127.0.0.3", "127.0.0.1"], ids=["other-address", "same-address"])
def test_idle_connections_do_not_lock_a_peer_out(source: str) -> None:
    """More idle connections than the rendezvous admits (64, 16 per address) keep coming; the real attention
    rank still joins within seconds, also from the strangers' own address (it is never the oldest)."""
    port = free_port()
    queue = _CTX.Queue()
    held: list[socket.socket] = []
    done = threading.Event()
    ffn = start(serving_ffn, host_config("ffn", port, timeout_s=60.0), queue, 1)
    afd_probe.wait_listening(FFN_HOST, port, 30)
    parker = threading.Thread(target=_park, daemon=True,
                              args=(FFN_HOST, port, source, time.monotonic() + 10, held, done))
    parker.start()
    time.sleep(3)  # the gate is full and evicting
    attn = start(token_attention_worker, host_config("attention", port), TOKEN, [3, 0, 5], queue)
    got = collect(queue, {"attention0", "attention0-elapsed", "ffn0"}, 60)
    done.set()
    parker.join(15)
    for s in held:
        s.close()
    _join_all([ffn, attn], 10)
    assert got["attention0"]["error"] is None and got["attention0"]["mismatches"] == 0, got["attention0"]
    assert got["attention0-elapsed"]["elapsed"] < 2 * SLACK_S, got
    evicted = afd_probe.count(afd_probe.refusals(got["ffn0"]["log"]), "evicted")
    assert len(held) >= 80 and evicted >= 16, (len(held), evicted)


# ------------------------------------------------------------------ 3. a slow hello
def test_a_slow_hello_is_dropped_at_its_deadline() -> None:
    """One byte every 0.5 s of a valid hello: dropped ``HELLO_S`` after it connected, whatever the pace (a
    per-recv timeout would let it run for minutes); the rendezvous then forms with the real attention rank."""
    port = free_port()
    queue = _CTX.Queue()
    ffn = start(serving_ffn, host_config("ffn", port, timeout_s=60.0), queue, 1)
    afd_probe.wait_listening(FFN_HOST, port, 30)
    hello = json.dumps({"afd": handshake.PROTOCOL, "nonce": "ab" * 32}).encode() + b"\n"
    slow = socket.create_connection((FFN_HOST, port), timeout=30, source_address=("127.0.0.6", 0))
    t0 = time.monotonic()
    answer = b""
    for i in range(len(hello)):
        try:
            slow.sendall(hello[i : i + 1])
        except OSError:
            break
        slow.settimeout(0.5)
        try:
            chunk = slow.recv(256)
        except TimeoutError:
            continue
        except OSError:
            break
        answer += chunk
        if not chunk or b"afd_refused" in answer:
            break
    dropped_after = time.monotonic() - t0
    slow.close()
    attn = start(token_attention_worker, host_config("attention", port), TOKEN, [2], queue)
    got = collect(queue, {"attention0", "attention0-elapsed", "ffn0"}, 60)
    _join_all([ffn, attn], 10)
    assert admission.HELLO_S - 0.5 < dropped_after < admission.HELLO_S + SLACK_S, (dropped_after, answer)
    assert answer == b'{"afd_refused":"busy"}\n', answer
    assert got["attention0"]["error"] is None and got["attention0-elapsed"]["elapsed"] < 2 * SLACK_S, got
    assert any("no complete AFD hello within" in line for line in got["ffn0"]["log"]), got["ffn0"]["log"]


# ------------------------------------------------------------------ 4. header fields checked
def bad_layer_attention(cfg: AfdConfig, layer: int, queue: Any) -> None:
    """Join with the token, then send one well-formed tensor for ``layer`` (outside the model)."""
    os.environ[auth.TOKEN_ENV] = TOKEN
    conn = TorchDistConnector(cfg)
    conn.init()
    x = torch.ones(2, HIDDEN)
    assert conn._transport is not None
    conn._transport.send(0, wire.words(wire.KIND_DATA, layer, 0, x), x)
    try:
        conn.recv_ffn_output(layer, 0)
        queue.put(("hostile", {"error": None}))
    except ConnectorError as e:
        queue.put(("hostile", _error_fields(e)))
    conn.close()


@pytest.mark.parametrize("layer", [-1, 2])
def test_layer_outside_the_model_is_refused_and_the_ffn_serves_on(layer: int) -> None:
    """A negative layer (Python indexing would run another layer's FFN) and one past the last (an
    ``IndexError`` ended the serve loop) are refused before any FFN call; the FFN serves the next group."""
    port = free_port()
    queue = _CTX.Queue()
    ffn = start(serving_ffn, host_config("ffn", port, timeout_s=5.0), queue, 2, IDENTITY)
    hostile = start(bad_layer_attention, host_config("attention", port, timeout_s=5.0), layer, queue)
    first = collect(queue, {"hostile"}, 30)["hostile"]
    _join_all([hostile], 10)
    attn = start(token_attention_worker, host_config("attention", port), TOKEN, [3, 1], queue)
    got = collect(queue, {"attention0", "ffn0"}, 60)
    _join_all([ffn, attn], 10)
    groups = got["ffn0"]["groups"]
    assert groups[0]["type"] == "BadMessage" and groups[0]["calls"] == 0, groups
    assert f"layer {layer} outside 0..1" in groups[0]["message"] and "attention rank 0" in groups[0]["message"]
    assert first["error"] is not None, first  # the hostile side got no answer
    assert got["attention0"]["error"] is None and got["attention0"]["mismatches"] == 0, got
    assert groups[1] == {**groups[1], "calls": 4, "error": "ConnectorClosed"}, groups


# ------------------------------------------------------------------ 6, 7. tokens and names
@pytest.mark.parametrize("token,ok", [("passwordpassword", False), ("ab" * 40, False), ("0123456789" * 3, False),
                                      ("8f3a" * 4 + "c0de9b1e" * 2, False), (None, True)])
def test_weak_tokens_are_refused_saying_how_to_make_one(monkeypatch: pytest.MonkeyPatch, token: str | None,
                                                       ok: bool) -> None:
    import secrets

    value = token if token is not None else secrets.token_hex(32)
    monkeypatch.setenv(auth.TOKEN_ENV, value)
    if ok:
        assert auth.load_token(None) == value.encode()
        return
    with pytest.raises(auth.TokenError, match=r"fewer than 128.*secrets\.token_hex"):
        auth.load_token(None)


def test_the_host_name_is_resolved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name that resolves to loopback for the policy check and elsewhere later (DNS rebinding) cannot move
    the group: each formation attempt resolves it once and binds, connects and judges that address (a third
    resolution in these two attempts would say 10.9.9.9); the next attempt sees the new address."""
    real = socket.getaddrinfo
    answers = iter(["127.0.0.1", "127.0.0.1"])

    def rebinding(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "afd-rebind.test":
            address = next(answers, "10.9.9.9")
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, args[0] if args else 0))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    port = free_port()
    conns = {role: TorchDistConnector(AfdConfig(role=role, host="afd-rebind.test", port=port, timeout_s=10.0))
             for role in ("ffn", "attention")}
    threads = [threading.Thread(target=c.init) for c in conns.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    x = torch.ones(2, HIDDEN)
    conns["attention"].send_attn_output(x, 0, 0)
    meta, xs = conns["ffn"].recv_attn_output()
    conns["ffn"].send_ffn_output(xs, meta)
    assert torch.equal(conns["attention"].recv_ffn_output(0, 0), x)
    for c in conns.values():
        c.close()
    with pytest.raises(ConnectorError, match="not a loopback address"):  # the name now says 10.9.9.9
        TorchDistConnector(AfdConfig(role="ffn", host="afd-rebind.test", port=port)).init()


# ------------------------------------------------------------------ network faults through a proxy
def proxied_attention(cfg: AfdConfig, plan: list[int], queue: Any, forever: bool = False) -> None:
    os.environ[auth.TOKEN_ENV] = TOKEN
    t0 = time.monotonic()
    attention_worker(cfg, plan, 2, queue, forever)
    queue.put(("attention0-elapsed", {"elapsed": time.monotonic() - t0}))


def _through(proxy: FaultProxy, port: int, timeout_s: float = 5.0) -> AfdConfig:
    cfg = host_config("attention", port, timeout_s=timeout_s)
    return restore({**cfg.to_dict(), "host": proxy.address[0], "port": proxy.address[1]})


@pytest.mark.parametrize("latency_s,rate_bps", [(0.001, None), (0.010, None), (0.0, 400_000)],
                         ids=["1ms", "10ms", "400KB/s"])
def test_exact_through_latency_and_a_bandwidth_cap(latency_s: float, rate_bps: float | None) -> None:
    """Every byte between the roles through a proxy adding latency or capping bandwidth: exact results, and
    each exchange within its bound (a 1100-token step is 70 KB each way, under 0.5 s at 400 KB/s)."""
    port = free_port()
    queue = _CTX.Queue()
    with FaultProxy(("127.0.0.7", 0), (FFN_HOST, port), latency_s=latency_s, rate_bps=rate_bps) as proxy:
        ffn = start(serving_ffn, host_config("ffn", port, timeout_s=5.0), queue, 1)
        attn = start(proxied_attention, _through(proxy, port), [3, 0, 1100, 2, 1], queue)
        got = collect(queue, {"attention0", "attention0-elapsed", "ffn0"}, 90)
        _join_all([ffn, attn], 10)
        through = dict(proxy.bytes_through)
    assert got["attention0"] == {"error": None, "mismatches": 0, "sent": 10, "received": 10}, got
    assert got["ffn0"]["groups"] == [{**got["ffn0"]["groups"][0], "calls": 10, "error": "ConnectorClosed"}], got
    assert through["up"] > 70_000 and through["down"] > 70_000, through  # the tensors went through the proxy


def test_a_reset_in_the_middle_of_an_exchange_names_the_cause_on_both_sides_in_bound() -> None:
    """A middlebox resets the connection while steps stream: the attention rank fails within timeout_s naming
    the FFN rank and the closed connection; the FFN rank ends that group naming the attention rank, and
    serves the next one through the same proxy."""
    port, timeout_s = free_port(), 3.0
    queue = _CTX.Queue()
    with FaultProxy(("127.0.0.8", 0), (FFN_HOST, port), latency_s=0.002) as proxy:
        ffn = start(serving_ffn, host_config("ffn", port, timeout_s=timeout_s), queue, 2)
        attn = start(proxied_attention, _through(proxy, port, timeout_s), [2], queue, True)
        collect(queue, {"attention0-progress"}, 30)
        t0 = time.monotonic()
        assert proxy.reset() == 1
        res = collect(queue, {"attention0"}, timeout_s + 2 * SLACK_S)["attention0"]
        elapsed = time.monotonic() - t0
        _join_all([attn], 10)
        again = start(proxied_attention, _through(proxy, port, timeout_s), [1, 2], queue)
        got = collect(queue, {"attention0", "ffn0"}, 60)
        _join_all([ffn, again], 10)
    assert res["error"] == "ConnectorError" and res["type"] == "LinkClosed", res
    assert "lost ffn rank 0" in res["message"] and "connection closed" in res["message"], res["message"]
    assert elapsed < timeout_s + SLACK_S and res["mismatches"] == 0, (elapsed, res)
    first, second = got["ffn0"]["groups"]
    assert first["type"] == "LinkClosed" and "lost attention rank 0" in first["message"], first
    assert got["attention0"]["error"] is None and got["attention0"]["mismatches"] == 0, got
    assert second["calls"] == 4 and second["error"] == "ConnectorClosed", second


def test_an_ffn_rank_behind_a_proxy_is_reached_at_its_advertised_address() -> None:
    """2A2F on tcp: FFN rank 1 binds its data port and advertises a proxy's address instead (NAT, a Kubernetes
    Service); its attention rank learns that address inside its authenticated verdict, opens its data session
    through the proxy, and is served exactly."""
    from tests.afd.test_connector import ffn_worker, make_config

    port, data_port = free_port(), free_port()
    queue = _CTX.Queue()
    with FaultProxy(("127.0.0.9", 0), ("127.0.0.1", data_port)) as proxy:
        advertise = f"{proxy.address[0]}:{proxy.address[1]}"
        extra = {1: {"data_port": data_port, "advertise": advertise}}
        procs = [start(ffn_worker, make_config("ffn", j, port, a=2, f=2, **extra.get(j, {})), queue) for j in range(2)]
        procs += [start(attention_worker, make_config("attention", r, port, a=2, f=2), [2, 1], 2, queue)
                  for r in range(2)]
        got = collect(queue, {"ffn0", "ffn1", "attention0", "attention1"}, 60)
        _join_all(procs, 10)
        through = dict(proxy.bytes_through)
    for r in range(2):
        assert got[f"attention{r}"] == {"error": None, "mismatches": 0, "sent": 4, "received": 4}, got
    assert through["up"] > 0 and through["down"] > 0, through  # attention rank 1's traffic went through it
