"""The ``torch_dist`` connector between real processes over gloo on loopback.

Processes come from a ``forkserver`` that preloads torch, vLLM's distributed
utilities and the connector once, so each rank starts in a fraction of a second
instead of re-importing vLLM (about 5 s each). Every test bounds its processes
(``_join_all``) and fails, killing them, if one is still alive after the bound.
Workers report through a queue: ``(name, result dict)``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import signal
import socket
import threading
import time
from typing import Any

import pytest
import torch

from afd_patches import AfdConfigError, topology
from afd_patches.config import AfdConfig, restore
from afd_patches.connectors import wire
from afd_patches.connectors.base import (
    ConnectorAuthError,
    ConnectorClosed,
    ConnectorError,
    ConnectorMismatch,
    ConnectorTimeout,
    Meta,
)
from afd_patches.connectors.spec import CLOSE_WAIT_S
from afd_patches.connectors.torch_dist import TorchDistConnector
from harness.env import free_port
from tests.support import afd_probe

HIDDEN = 16
SLACK_S = 3.0  # scheduling slack on a busy 2-core machine
FORM_S = 30.0  # forming a group where formation is not the subject: processes start slowly on a loaded host

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "vllm.distributed.utils", "afd_patches.connectors.torch_dist", __name__])


# --------------------------------------------------------------------------- helpers
def make_config(
    role: str, rank: int, port: int, a: int = 1, f: int = 1, timeout_s: float = 15.0, backend: str = "tcp",
    host: str = "127.0.0.1", **extra: Any
) -> AfdConfig:
    """A config on ``host`` (127.0.0.1); ``backend`` ``tcp`` (the CPU default) unless a test names gloo. Built as
    a worker builds it (``restore``: every rule checked, no I/O)."""
    return restore({"role": role, "host": host, "allow_unauthenticated": host == "0.0.0.0", "port": port,
                    "num_attention_ranks": a, "num_ffn_ranks": f, "rank": rank, "timeout_s": timeout_s,
                    "connector_extra_config": {"backend": backend, **extra}})


def attn_input(rank: int, layer: int, step: int, tokens: int) -> torch.Tensor:
    """Distinct, exactly representable values per (rank, layer, step, token)."""
    base = rank * 10_000 + layer * 1_000 + step * 100
    rows = torch.arange(tokens, dtype=torch.float32).unsqueeze(1) * 0.5
    return base + rows + torch.arange(HIDDEN, dtype=torch.float32) * 0.25


def ffn(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def _report(queue: Any, name: str, **result: Any) -> None:
    queue.put((name, result))


_KINDS = (ConnectorClosed, ConnectorMismatch, ConnectorAuthError, ConnectorTimeout, ConnectorError)


def _error_fields(e: BaseException) -> dict[str, Any]:
    """``error``: the contract's class the error is (``ConnectorTimeout`` for a ``PeerSilent``, ...);
    ``type``: its own class."""
    kind = next((k.__name__ for k in _KINDS if isinstance(e, k)), type(e).__name__)
    return {"error": kind, "type": type(e).__name__, "message": str(e)}


def attention_worker(cfg: AfdConfig, plan: list[int], layers: int, queue: Any, forever: bool = False) -> None:
    """Run ``plan`` (tokens per step) through every layer; check each result exactly; close."""
    torch.set_num_threads(1)
    name = f"attention{cfg.rank}"
    conn = TorchDistConnector(cfg)
    mismatches = 0
    last_ok = time.monotonic()
    try:
        conn.init()
        step = 0
        while step < len(plan) or forever:
            tokens = plan[step % len(plan)]
            for layer in range(layers):
                x = attn_input(cfg.rank, layer, step, tokens)
                conn.send_attn_output(x, layer, step)
                y = conn.recv_ffn_output(layer, step)
                if y.shape != x.shape or not torch.equal(y, ffn(x)):
                    mismatches += 1
                last_ok = time.monotonic()
            step += 1
            if forever and step == 3:
                _report(queue, name + "-progress", step=step)
            if forever:
                time.sleep(0.01)
    except ConnectorError as e:
        _report(queue, name, since_last_ok=time.monotonic() - last_ok, mismatches=mismatches, **_error_fields(e))
        conn.close()
        return
    conn.close()
    _report(
        queue,
        name,
        error=None,
        mismatches=mismatches,
        sent=conn.messages_sent,
        received=conn.messages_received,
    )


def ffn_worker(cfg: AfdConfig, queue: Any, delay_s: float = 0.0, send_delay_s: float = 0.0,
               form_s: float | None = None) -> None:
    """Serve until the attention side closes: one batched FFN call per received step, every send
    ``send_delay_s`` slower; the report includes this process's exchange count and latency sum. ``form_s``:
    the bound on forming the group (``timeout_s`` when None)."""
    from afd_patches import metrics

    torch.set_num_threads(1)
    time.sleep(delay_s)
    name = f"ffn{cfg.rank}"
    conn = TorchDistConnector(cfg)
    if send_delay_s:
        send = conn._send

        def slow_send(*args: Any) -> Any:
            time.sleep(send_delay_s)
            return send(*args)

        conn._send = slow_send  # type: ignore[method-assign]
    calls = 0
    metas: list[Meta] = []
    try:
        conn.init(form_s)
        while True:
            meta, xs = conn.recv_attn_output()
            rows = [x.shape[0] for x in xs]
            outs = list(torch.split(ffn(torch.cat(xs)), rows))
            conn.send_ffn_output(outs, meta)
            calls += 1
            metas.append(meta)
    except ConnectorError as e:
        conn.close()
        snap = metrics.METRICS.snapshot()
        _report(
            queue,
            name,
            calls=calls,
            sent=conn.messages_sent,
            received=conn.messages_received,
            metas=[(m.layer, m.step, m.shape, m.dtype) for m in metas],
            exchanges=snap["counts"].get("exchanges", 0),
            latency_sum=snap["latency_sum"],
            **_error_fields(e),
        )


def init_only_worker(
    cfg: AfdConfig, queue: Any, identity: dict[str, Any] | None = None, name: str | None = None
) -> None:
    """``init()`` alone (with the model ``identity``); report how it ended and how long it took."""
    conn = TorchDistConnector(cfg, identity=identity)
    t0 = time.monotonic()
    try:
        conn.init()
        result: dict[str, Any] = {"error": None}
    except ConnectorError as e:
        result = _error_fields(e)
    result["elapsed"] = time.monotonic() - t0
    conn.close()
    _report(queue, name or f"{cfg.role}{cfg.rank}", **result)


def silent_attention_worker(cfg: AfdConfig, queue: Any, silence_s: float) -> None:
    """Join the group, then send nothing for ``silence_s`` (a hung attention rank)."""
    conn = TorchDistConnector(cfg)
    conn.init()
    queue.put(("attention-joined", {}))
    time.sleep(silence_s)
    conn.close()


def start(target: Any, *args: Any) -> mp.process.BaseProcess:
    p = _CTX.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def collect(queue: Any, names: set[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    """Results of ``names`` from the queue, failing if any is missing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    got: dict[str, dict[str, Any]] = {}
    while names - set(got):
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"no result from {sorted(names - set(got))} within {timeout_s}s (got {got})")
        try:
            name, result = queue.get(timeout=left)
        except queue_mod.Empty:
            continue
        got[name] = result
    return got


def _join_all(procs: list[mp.process.BaseProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join(5)
    assert not alive, f"processes still alive after {timeout_s}s: {alive}"


# ------------------------------------------------------------------- pure functions
def test_topology_block_mapping() -> None:
    assert [topology.ffn_rank_of(i, 4, 2) for i in range(4)] == [0, 0, 1, 1]
    assert topology.attention_ranks_of(1, 6, 3) == [2, 3]
    assert topology.attention_ranks_of(0, 3, 1) == [0, 1, 2]
    for a, f in [(1, 1), (4, 2), (8, 4), (6, 1)]:
        served = [i for j in range(f) for i in topology.attention_ranks_of(j, a, f)]
        assert served == list(range(a))
        assert all(topology.ffn_rank_of(i, a, f) == j for j in range(f) for i in topology.attention_ranks_of(j, a, f))
    # FFN-first global ranks
    assert [topology.global_rank("ffn", j, 4, 2) for j in range(2)] == [0, 1]
    assert [topology.global_rank("attention", i, 4, 2) for i in range(4)] == [2, 3, 4, 5]
    assert topology.role_of_global(3, 4, 2) == ("attention", 1)
    assert topology.world_size(4, 2) == 6


@pytest.mark.parametrize(
    ("a", "f", "words"),
    [(1, 2, "num_attention_ranks >= num_ffn_ranks"), (3, 2, "not a multiple"), (0, 1, ">= 1")],
)
def test_topology_validate(a: int, f: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        topology.validate(a, f)
    with pytest.raises(ValueError, match="out of range"):
        topology.ffn_rank_of(4, 4, 2)


def test_header_round_trip() -> None:
    t = torch.zeros(0, HIDDEN, dtype=torch.bfloat16)
    h = wire.encode(wire.words(wire.KIND_DATA, 7, 123456, t, microbatch=2), torch.device("cpu"))
    assert h.shape == (wire.HEADER_LEN,) and h.dtype == torch.int64
    assert wire.decode(h) == (wire.KIND_DATA, 7, 123456, 2, (0, HIDDEN), "bfloat16", False)
    assert wire.decode(wire.pack(wire.KIND_DATA, 7, 123456, t, 2)) == wire.decode(h)
    message = torch.cat([wire.encode(wire.words(wire.KIND_DATA, 1, 2, t, inline=True), torch.device("cpu")).view(
                            torch.uint8),
                         torch.ones(9, dtype=torch.uint8)])
    assert wire.decode(message) == (wire.KIND_DATA, 1, 2, 0, (0, HIDDEN), "bfloat16", True)
    assert wire.decode(wire.pack(wire.KIND_CLOSE)).kind == wire.KIND_CLOSE
    with pytest.raises(wire.BadMessage, match="malformed"):
        wire.decode(torch.zeros(wire.HEADER_LEN, dtype=torch.int64))
    with pytest.raises(ConnectorError, match="dtype"):
        wire.words(wire.KIND_DATA, 0, 0, torch.zeros(2, dtype=torch.complex64))


def test_wrong_side_and_uninitialised() -> None:
    conn = TorchDistConnector(make_config("attention", 0, 1))
    with pytest.raises(ConnectorError, match="ffn-side"):
        conn.recv_attn_output()
    with pytest.raises(ConnectorError, match="not initialised"):
        conn.send_attn_output(torch.zeros(1, HIDDEN), 0, 0)
    with pytest.raises(AfdConfigError, match=r'\["connector_extra_config"\]\["bakend"\]: unknown key'):
        make_config("ffn", 0, 1, bakend="gloo")  # the config refuses it before any connector is built


def test_model_identity_and_hello_comparison() -> None:
    """Workers hand their connector vLLM's model identity; unknown values are dropped, and only
    fields both sides supplied are compared (a creator without an identity still connects)."""
    from types import SimpleNamespace

    from afd_patches.connectors.handshake import Hello
    from afd_patches.connectors.rendezvous import differences, model_fields
    from afd_patches.workers.connection import model_identity

    hf = SimpleNamespace(num_hidden_layers=2, hidden_size=64, architectures=["LlamaForCausalLM"])
    mc = SimpleNamespace(architectures=["AFDLlamaForCausalLM"], hf_text_config=hf, dtype=torch.bfloat16)
    sc = SimpleNamespace(max_num_batched_tokens=256)
    assert model_identity(SimpleNamespace(model_config=mc, scheduler_config=sc)) == {
        "architecture": "AFDLlamaForCausalLM", "num_hidden_layers": 2, "hidden_size": 64, "dtype": "bfloat16",
        "max_num_batched_tokens": 256}
    bare = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=SimpleNamespace(), dtype=torch.float32))
    assert model_fields(model_identity(bare)) == {"model.dtype": "float32"}
    ffn_hello = Hello("ffn", 0, {"num_ffn_ranks": 1, "model.hidden_size": 64})
    assert differences(ffn_hello, Hello("attention", 0, {"num_ffn_ranks": 1})) == ""
    assert differences(ffn_hello, Hello("attention", 1, {"num_ffn_ranks": 2, "model.hidden_size": 64})) == (
        "num_ffn_ranks (ffn rank 0: 1, attention rank 1: 2)")


# ----------------------------------------------------------------- multi-process
@pytest.mark.parametrize("backend", ["gloo", "tcp"])
def test_round_trip_1a1f_and_close(backend: str) -> None:
    """x*2+1 exactly for every layer and step (zero-token steps included); close ends the FFN loop.

    The FFN starts a second after the attention rank, whose init() must wait for the store.
    Step 3 (1100 tokens x 64 B) is over gloo's 64 KiB inline limit: header and payload travel apart
    (on tcp: 275 KiB in one write, more than a socket buffer, so read in several pieces).
    """
    port, layers, plan = free_port(), 3, [3, 0, 5, 1100, 0]
    queue = _CTX.Queue()
    procs = [
        start(attention_worker, make_config("attention", 0, port, backend=backend), plan, layers, queue),
        start(ffn_worker, make_config("ffn", 0, port, backend=backend), queue, 1.0),
    ]
    got = collect(queue, {"ffn0", "attention0"}, 45)
    _join_all(procs, 10)
    n = layers * len(plan)
    assert got["attention0"] == {"error": None, "mismatches": 0, "sent": n, "received": n}
    f = got["ffn0"]
    assert f["error"] == "ConnectorClosed", f
    assert (f["calls"], f["sent"], f["received"]) == (n, n, n)
    assert f["metas"][:2] == [(0, 0, (3, HIDDEN), "float32"), (1, 0, (3, HIDDEN), "float32")]
    assert f["metas"][layers] == (0, 1, (0, HIDDEN), "float32")
    assert f["metas"][3 * layers] == (0, 3, (1100, HIDDEN), "float32")


def test_ffn_exchange_latency_is_its_own_time_not_its_send() -> None:
    """The FFN's ``afd_exchange_latency_seconds`` stops when its outputs are ready to send: a send
    that takes 0.25 s longer (as one can when it hands the core to the attention rank it woke)
    adds nothing to it."""
    port, layers, plan = free_port(), 2, [3, 2]
    queue = _CTX.Queue()
    procs = [
        start(attention_worker, make_config("attention", 0, port), plan, layers, queue),
        start(ffn_worker, make_config("ffn", 0, port), queue, 0.0, 0.25),
    ]
    got = collect(queue, {"ffn0", "attention0"}, 45)
    _join_all(procs, 10)
    assert got["attention0"]["error"] is None and got["attention0"]["mismatches"] == 0, got
    f = got["ffn0"]
    assert f["exchanges"] == layers * len(plan), f
    assert f["latency_sum"] < 0.25, f  # with the sends counted: at least 4 x 0.25 s


def test_2a1f_batched_with_idle_rank() -> None:
    """One FFN call per layer-step over both ranks' tokens; each rank gets its own rows back.

    ``inline_bytes=0``: every payload is its own message (the NCCL layout).
    """
    port, layers = free_port(), 2
    plans = {0: [4, 2, 0, 3], 1: [0, 0, 5, 1]}  # rank 1 idle at first, rank 0 idle at step 2
    queue = _CTX.Queue()
    procs = [start(ffn_worker, make_config("ffn", 0, port, a=2, backend="gloo", inline_bytes=0), queue)]
    procs += [
        start(attention_worker, make_config("attention", r, port, a=2, backend="gloo", inline_bytes=0), plan,
              layers, queue)
        for r, plan in plans.items()
    ]
    got = collect(queue, {"ffn0", "attention0", "attention1"}, 45)
    _join_all(procs, 10)
    n = layers * len(plans[0])
    for r in plans:
        assert got[f"attention{r}"] == {"error": None, "mismatches": 0, "sent": n, "received": n}
    f = got["ffn0"]
    assert f["error"] == "ConnectorClosed", f
    assert (f["calls"], f["sent"], f["received"]) == (n, 2 * n, 2 * n)
    assert [m[2][0] for m in f["metas"][::layers]] == [4, 2, 5, 4]  # batched rows per step


@pytest.mark.parametrize("backend", ["gloo", "tcp"])
def test_2a1f_pingpong_serves_each_rank_as_it_arrives(backend: str) -> None:
    """``schedule: pingpong``: one FFN call per rank and layer-step, no lockstep (rank 1 closes after one
    step while rank 0 goes on; rank 1 runs zero-token steps only at its own pace); each rank gets its own
    rows back exactly, and the ranks' steps interleave freely (rank 0's step 3 may come before rank 1's 0)."""
    port, layers = free_port(), 2
    plans = {0: [4, 0, 2, 1100], 1: [5]}  # 1100 rows: header and payload travel apart
    queue = _CTX.Queue()
    procs = [start(ffn_worker, make_config("ffn", 0, port, a=2, schedule="pingpong", backend=backend), queue)]
    procs += [start(attention_worker, make_config("attention", r, port, a=2, schedule="pingpong", backend=backend),
                    plan, layers, queue) for r, plan in plans.items()]
    got = collect(queue, {"ffn0", "attention0", "attention1"}, 45)
    _join_all(procs, 10)
    total = 0
    for r, plan in plans.items():
        n = layers * len(plan)
        total += n
        assert got[f"attention{r}"] == {"error": None, "mismatches": 0, "sent": n, "received": n}
    f = got["ffn0"]
    assert f["error"] == "ConnectorClosed", f
    assert (f["calls"], f["sent"], f["received"]) == (total, total, total)
    assert sorted(m[2][0] for m in f["metas"]) == sorted(t for plan in plans.values() for t in plan
                                                       for _ in range(layers))


def test_schedule_must_be_known_and_pingpong_needs_gloo() -> None:
    with pytest.raises(AfdConfigError, match=r"\[\"schedule\"\]: 'lockstep' is not one of \['batched', 'pingpong'\]"):
        make_config("ffn", 0, 1, schedule="lockstep")
    with pytest.raises(AfdConfigError, match="'pingpong' needs backend gloo"):
        make_config("ffn", 0, 1, schedule="pingpong", backend="nccl", inline_bytes=0, device="cpu")
    conn = TorchDistConnector(make_config("attention", 0, 1, schedule="pingpong"))
    assert conn.schedule == "pingpong" and conn.hello().fields["schedule"] == "pingpong"


def test_2a1f_rank_that_closes_early_leaves_the_other_served() -> None:
    """Rank 1 finishes after one step and closes; the FFN keeps serving rank 0 until it closes too."""
    port, layers = free_port(), 2
    plans = {0: [4, 2, 1, 3], 1: [5]}
    queue = _CTX.Queue()
    procs = [start(ffn_worker, make_config("ffn", 0, port, a=2), queue)]
    procs += [start(attention_worker, make_config("attention", r, port, a=2), plan, layers, queue)
              for r, plan in plans.items()]
    got = collect(queue, {"ffn0", "attention0", "attention1"}, 45)
    _join_all(procs, 10)
    for r, plan in plans.items():
        n = layers * len(plan)
        assert got[f"attention{r}"] == {"error": None, "mismatches": 0, "sent": n, "received": n}
    f = got["ffn0"]
    assert f["error"] == "ConnectorClosed", f
    assert f["calls"] == layers * 4 and f["received"] == layers * (4 + 1)


@pytest.mark.parametrize("backend,host", [("tcp", "127.0.0.1"), ("gloo", "127.0.0.1"), ("tcp", "0.0.0.0")])
def test_2a2f_block_mapping(backend: str, host: str) -> None:
    """Two FFN ranks each serve their own attention rank in one group. On tcp, FFN rank 1's attention rank
    opens a data session at the address FFN rank 1 advertised inside its own session with FFN rank 0; with
    ``host: 0.0.0.0`` that rank listens on every interface and advertises its host name's address."""
    port, layers, plan = free_port(), 2, [2, 0, 1]
    queue = _CTX.Queue()
    cfgs = {(role, r): make_config(role, r, port, a=2, f=2, backend=backend, host=host)
            for role in ("ffn", "attention") for r in range(2)}
    procs = [start(ffn_worker, cfgs["ffn", j], queue) for j in range(2)]
    procs += [start(attention_worker, cfgs["attention", r], plan, layers, queue) for r in range(2)]
    got = collect(queue, {"ffn0", "ffn1", "attention0", "attention1"}, 45)
    _join_all(procs, 10)
    n = layers * len(plan)
    for r in range(2):
        assert got[f"attention{r}"] == {"error": None, "mismatches": 0, "sent": n, "received": n}
        assert (got[f"ffn{r}"]["error"], got[f"ffn{r}"]["calls"]) == ("ConnectorClosed", n)


@pytest.mark.parametrize("how,backend", [("killed", "gloo"), ("hung", "gloo"), ("killed", "tcp"), ("hung", "tcp")])
def test_dead_or_hung_ffn(how: str, backend: str) -> None:
    """FFN killed (socket closes) or frozen (only the timeout can tell): attention fails within timeout_s."""
    port, timeout_s = free_port(), 2.0
    queue = _CTX.Queue()
    ffn_proc = start(ffn_worker, make_config("ffn", 0, port, timeout_s=timeout_s, backend=backend), queue)
    attn_cfg = make_config("attention", 0, port, timeout_s=timeout_s, backend=backend)
    attn_proc = start(attention_worker, attn_cfg, [2], 2, queue, True)
    try:
        collect(queue, {"attention0-progress"}, 30)
        t0 = time.monotonic()
        if how == "killed":
            ffn_proc.terminate()
        else:
            os.kill(ffn_proc.pid, signal.SIGSTOP)
        res = collect(queue, {"attention0"}, timeout_s + 2 * SLACK_S)["attention0"]
        elapsed = time.monotonic() - t0
    finally:
        if ffn_proc.is_alive():
            ffn_proc.kill()
    _join_all([ffn_proc, attn_proc], 10)
    assert res["error"] in ("ConnectorTimeout", "ConnectorError"), res
    assert res["mismatches"] == 0
    print(how, f"{elapsed:.2f}s", res["message"])
    assert elapsed < timeout_s + SLACK_S, (elapsed, res)
    assert "ffn rank 0" in res["message"] and f"127.0.0.1:{port}" in res["message"], res["message"]
    if how == "hung":
        assert res["error"] == "ConnectorTimeout", res
        assert timeout_s - 0.5 < res["since_last_ok"] < timeout_s + SLACK_S, res


def test_init_fails_within_timeout_naming_host_port() -> None:
    """Attention with no FFN (store never up) and FFN with no attention (nobody joins) both give up in time."""
    timeout_s = 3.0
    port_a, port_f = free_port(), free_port()
    queue = _CTX.Queue()
    procs = [
        start(init_only_worker, make_config("attention", 0, port_a, timeout_s=timeout_s), queue),
        start(init_only_worker, make_config("ffn", 0, port_f, timeout_s=timeout_s), queue),
    ]
    got = collect(queue, {"attention0", "ffn0"}, timeout_s + 4 * SLACK_S)
    _join_all(procs, 10)
    for name, port in (("attention0", port_a), ("ffn0", port_f)):
        res = got[name]
        assert res["error"] == "ConnectorTimeout", res
        assert f"127.0.0.1:{port}" in res["message"], res["message"]
        assert res["elapsed"] < timeout_s + SLACK_S, res
        print(name, f"{res['elapsed']:.2f}s", res["message"])


def test_ffn_idle_timeout_names_silent_attention_rank() -> None:
    """An attention rank that joins but never sends: the FFN's wait ends after idle_timeout_s."""
    port, idle_s = free_port(), 1.0
    queue = _CTX.Queue()
    procs = [
        start(ffn_worker, make_config("ffn", 0, port, idle_timeout_s=idle_s), queue),
        start(silent_attention_worker, make_config("attention", 0, port), queue, idle_s + 2 * SLACK_S),
    ]
    collect(queue, {"attention-joined"}, 30)
    t0 = time.monotonic()
    res = collect(queue, {"ffn0"}, idle_s + 2 * SLACK_S)["ffn0"]
    elapsed = time.monotonic() - t0
    procs[1].terminate()  # done being silent
    _join_all(procs, 10)
    assert res["error"] == "ConnectorTimeout", res
    assert "attention rank 0" in res["message"] and f"127.0.0.1:{port}" in res["message"], res["message"]
    assert elapsed < idle_s + SLACK_S, elapsed


# ------------------------------------------------------------------------ handshake
@pytest.mark.parametrize(
    ("ffn_af", "attn_af", "field"),
    [((1, 1), (2, 1), "num_attention_ranks"), ((2, 2), (2, 1), "num_ffn_ranks")],
)
def test_handshake_rank_counts_differ_both_sides_fail_naming_both_values(
    ffn_af: tuple[int, int], attn_af: tuple[int, int], field: str
) -> None:
    """Different A/F counts (so different world sizes) fail in the handshake, at once, on both sides.

    ``timeout_s`` is long: an answer within half of it shows nothing waited for a timeout or for torch. (Each side's
    time includes the other process's start, both started at once: seconds on a loaded machine.)
    """
    port, timeout_s = free_port(), 20.0
    queue = _CTX.Queue()
    (fa, ff), (aa, af) = ffn_af, attn_af
    procs = [
        start(init_only_worker, make_config("ffn", 0, port, a=fa, f=ff, timeout_s=timeout_s), queue),
        start(init_only_worker, make_config("attention", 0, port, a=aa, f=af, timeout_s=timeout_s), queue),
    ]
    got = collect(queue, {"ffn0", "attention0"}, 30)
    _join_all(procs, 10)
    fv, av = (fa, aa) if field == "num_attention_ranks" else (ff, af)
    expected = {
        "ffn0": f"{field} (ffn rank 0: {fv}, attention rank 0: {av})",
        "attention0": f"{field} (attention rank 0: {av}, ffn rank 0: {fv})",
    }
    for name, words in expected.items():
        res = got[name]
        print(name, f"{res['elapsed']:.2f}s", res.get("message"))
        assert res["error"] == "ConnectorMismatch", res
        assert words in res["message"] and f"127.0.0.1:{port}" in res["message"], res["message"]
        assert res["elapsed"] < timeout_s / 2, res


LLAMA = {"architecture": "AFDLlamaForCausalLM", "num_hidden_layers": 2, "hidden_size": 64, "dtype": "float32"}


@pytest.mark.parametrize(
    "diffs",
    [
        {},
        {"hidden_size": 128},
        {"architecture": "AFDQwen3ForCausalLM", "dtype": "bfloat16"},
    ],
    ids=["same", "hidden_size", "arch_and_dtype"],
)
def test_handshake_model_identity(diffs: dict[str, Any]) -> None:
    """Same model: the group forms. A different model: both sides fail naming every differing field; either way
    within half of ``timeout_s`` (nothing waited for a timeout; each side's time includes the other's start)."""
    port, timeout_s = free_port(), 20.0
    queue = _CTX.Queue()
    procs = [
        start(init_only_worker, make_config("ffn", 0, port, timeout_s=timeout_s), queue, LLAMA),
        start(init_only_worker, make_config("attention", 0, port, timeout_s=timeout_s), queue, {**LLAMA, **diffs}),
    ]
    got = collect(queue, {"ffn0", "attention0"}, 30)
    _join_all(procs, 10)
    for name, res in got.items():
        print(name, f"{res['elapsed']:.2f}s", res.get("message"))
        assert res["elapsed"] < timeout_s / 2, res
        assert res["error"] == ("ConnectorMismatch" if diffs else None), res
    for key, av in diffs.items():
        fv = LLAMA[key]
        assert f"model.{key} (ffn rank 0: {fv!r}, attention rank 0: {av!r})" in got["ffn0"]["message"]
        assert f"model.{key} (attention rank 0: {av!r}, ffn rank 0: {fv!r})" in got["attention0"]["message"]


def test_handshake_rank_claimed_twice_refuses_the_second_claim_only() -> None:
    """2A1F with two processes configured as attention rank 0: the second claim is refused at once
    (``ConnectorMismatch`` naming the rank); the group does not end, and its timeout names the refusal.
    The claims start once the FFN rank listens, so "at once" is not the FFN process's start."""
    port, timeout_s = free_port(), 6.0
    queue = _CTX.Queue()
    procs = [start(init_only_worker, make_config("ffn", 0, port, a=2, timeout_s=timeout_s), queue)]
    afd_probe.wait_listening("127.0.0.1", port, timeout_s, lambda: None if procs[0].is_alive() else "exited")
    procs += [start(init_only_worker, make_config("attention", 0, port, a=2, timeout_s=timeout_s), queue, None,
                    f"attention0-{i}") for i in range(2)]
    got = collect(queue, {"ffn0", "attention0-0", "attention0-1"}, timeout_s + 4 * SLACK_S)
    _join_all(procs, 10)
    for name, res in got.items():
        print(name, f"{res['elapsed']:.2f}s", res.get("message"))
    second = [r for n, r in got.items() if n != "ffn0" and r["elapsed"] < SLACK_S]
    assert len(second) == 1, got
    assert second[0]["error"] == "ConnectorMismatch", second
    assert "attention rank 0 is already taken" in second[0]["message"], second
    assert got["ffn0"]["error"] == "ConnectorTimeout", got["ffn0"]
    assert "missing: attention rank 1" in got["ffn0"]["message"]
    assert "attention rank 0 is already taken" in got["ffn0"]["message"]
    assert timeout_s - 0.5 < got["ffn0"]["elapsed"] < timeout_s + SLACK_S


def _other_program(port: int, talks: bool) -> tuple[socket.socket, threading.Event]:
    """A plain socket listening on ``port``; if ``talks``, it answers every connection like an HTTP server."""
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", port))
    blocker.listen()
    stop = threading.Event()

    def serve() -> None:
        blocker.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = blocker.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

    if talks:
        threading.Thread(target=serve, daemon=True).start()
    return blocker, stop


@pytest.mark.parametrize("talks", [False, True], ids=["silent", "http"])
def test_port_in_use_by_another_program(talks: bool) -> None:
    """FFN rank 0 fails at once ("in use", host:port); attention does not mistake the program for its peer.

    Silent program: the attention side gets no answer and gives up after ``timeout_s`` (a torch
    TCPStore client would wait forever there). Talking program: it fails as soon as it reads the answer.
    """
    port, timeout_s = free_port(), 3.0
    blocker, stop = _other_program(port, talks)
    queue = _CTX.Queue()
    try:
        procs = [
            start(init_only_worker, make_config("ffn", 0, port, timeout_s=20.0), queue),
            start(init_only_worker, make_config("attention", 0, port, timeout_s=timeout_s), queue),
        ]
        got = collect(queue, {"ffn0", "attention0"}, timeout_s + 4 * SLACK_S)
        _join_all(procs, 10)
    finally:
        stop.set()
        blocker.close()
    for name, res in got.items():
        print(name, f"{res['elapsed']:.2f}s", res.get("message"))
        assert f"127.0.0.1:{port}" in res["message"], res
    f, a = got["ffn0"], got["attention0"]
    assert f["error"] == "ConnectorError" and "already in use" in f["message"], f
    assert f["elapsed"] < 1.0, f
    if talks:
        assert a["error"] == "ConnectorError" and "is not an AFD rank" in a["message"], a
        assert a["elapsed"] < SLACK_S, a
    else:
        assert a["error"] == "ConnectorTimeout" and "another program" in a["message"], a
        assert timeout_s - 0.5 < a["elapsed"] < timeout_s + SLACK_S, a


@pytest.mark.parametrize("schedule,a", [("batched", 1), ("pingpong", 2)])
def test_attention_killed_while_ffn_waits_idle_is_noticed_at_once(schedule: str, a: int) -> None:
    """An idle but live attention rank keeps the FFN waiting; once it is killed, the FFN's idle wait
    (a week by default) ends at once with an error naming the lost rank and the group. With two ranks
    (pingpong) the first killed is dropped (tcp) and the FFN serves on; the last one's death ends it."""
    port = free_port()
    queue = _CTX.Queue()
    procs = [start(ffn_worker, make_config("ffn", 0, port, a=a, schedule=schedule), queue)]
    procs += [start(silent_attention_worker, make_config("attention", r, port, a=a, schedule=schedule), queue, 60.0)
              for r in range(a)]
    for _ in range(a):
        collect(queue, {"attention-joined"}, 30)
    with pytest.raises(queue_mod.Empty):
        queue.get(timeout=2.0)  # alive and idle: the FFN keeps serving (nothing reported)
    for victim in procs[1:-1]:  # all but the last: each is dropped, the FFN goes on
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(queue_mod.Empty):
            queue.get(timeout=2.0)
    t0 = time.monotonic()
    os.kill(procs[-1].pid, signal.SIGKILL)
    res = collect(queue, {"ffn0"}, 2 * SLACK_S)["ffn0"]
    elapsed = time.monotonic() - t0
    _join_all(procs, 10)
    print(f"{elapsed:.2f}s", res["message"])
    assert res["error"] == "ConnectorError", res
    last = a - 1
    assert f"lost attention rank {last}" in res["message"] and f"127.0.0.1:{port}" in res["message"], res["message"]
    assert res["calls"] == 0 and elapsed < SLACK_S, (elapsed, res)


# ------------------------------------------------------------- liveness and close
@pytest.mark.parametrize("backend,words", [("tcp", "not even a keep-alive"), ("gloo", "no heartbeat")])
def test_attention_frozen_while_ffn_waits_idle_is_noticed(backend: str, words: str) -> None:
    """A frozen attention rank keeps its socket open, so the idle wait alone would last idle_timeout_s (a
    week); the keep-alives (tcp) or the MAC'd heartbeat in the group's store (gloo; on NCCL, where no socket
    closes, the only signal) end it within about timeout_s, naming the rank."""
    port, timeout_s = free_port(), 2.0
    queue = _CTX.Queue()
    procs = [
        start(ffn_worker, make_config("ffn", 0, port, timeout_s=timeout_s, backend=backend), queue),
        start(silent_attention_worker, make_config("attention", 0, port, timeout_s=timeout_s, backend=backend),
              queue, 60.0),
    ]
    try:
        collect(queue, {"attention-joined"}, 30)
        with pytest.raises(queue_mod.Empty):
            queue.get(timeout=timeout_s + 1.0)  # alive, beating and idle: the FFN keeps waiting
        t0 = time.monotonic()
        os.kill(procs[1].pid, signal.SIGSTOP)
        res = collect(queue, {"ffn0"}, timeout_s + 3 * SLACK_S)["ffn0"]
        elapsed = time.monotonic() - t0
    finally:
        procs[1].kill()
    _join_all(procs, 10)
    print(f"{elapsed:.2f}s", res["message"])
    assert res["error"] == "ConnectorTimeout", res
    assert "lost attention rank 0" in res["message"] and words in res["message"], res["message"]
    assert f"127.0.0.1:{port}" in res["message"], res["message"]
    assert res["calls"] == 0 and timeout_s - 1.0 < elapsed < timeout_s + SLACK_S, (elapsed, res)


def ffn_closed_from_another_thread(cfg: AfdConfig, queue: Any, after_s: float) -> None:
    """A thread blocks in ``recv_attn_output`` (idle peer); after ``after_s`` the main thread calls close()."""
    conn = TorchDistConnector(cfg)
    conn.init()
    ended: dict[str, Any] = {}

    def serve() -> None:
        try:
            conn.recv_attn_output()
            ended["error"] = None
        except ConnectorError as e:
            ended.update(_error_fields(e))
        ended["at"] = time.monotonic()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    time.sleep(after_s)
    t0 = time.monotonic()
    conn.close()
    close_s = time.monotonic() - t0
    thread.join(30)
    _report(queue, "ffn0", close_s=close_s, thread_alive=thread.is_alive(),
            thread_s=ended.get("at", float("inf")) - t0, **{k: v for k, v in ended.items() if k != "at"})


def test_close_from_another_thread_while_serve_loop_blocked_returns_in_bound() -> None:
    """shutdown() of an FFN engine closes the connector from the main thread while the serve thread waits
    for an idle attention rank: close() returns, and the waiting call ends with ConnectorClosed, in bound."""
    port = free_port()
    queue = _CTX.Queue()
    procs = [
        start(ffn_closed_from_another_thread, make_config("ffn", 0, port), queue, 1.0),
        start(silent_attention_worker, make_config("attention", 0, port), queue, 60.0),
    ]
    try:
        collect(queue, {"attention-joined"}, 30)
        res = collect(queue, {"ffn0"}, 40)["ffn0"]
    finally:
        procs[1].kill()
    _join_all(procs, 10)
    print(res)
    bound = CLOSE_WAIT_S + SLACK_S
    assert not res["thread_alive"] and res["error"] == "ConnectorClosed", res
    assert res["close_s"] < bound and res["thread_s"] < bound, res


def test_run_ffn_calls_the_ffn_once_on_the_busy_rows_only() -> None:
    """The FFN role's per-message work: empty inputs (idle ranks, other ranks in pingpong) are answered
    with themselves and never reach the FFN; one busy input goes in without a copy; several in one call."""
    from afd_patches.workers.ffn_server import run_ffn

    class Model:
        def __init__(self) -> None:
            self.calls: list[tuple[int, torch.Tensor]] = []

        def afd_ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
            self.calls.append((layer, x))
            return ffn(x)

    empty, a, b = torch.empty(0, HIDDEN), attn_input(0, 1, 0, 3), attn_input(1, 1, 0, 2)
    cpu_f32 = (torch.device("cpu"), torch.float32)  # already there: nothing is copied
    model = Model()
    assert run_ffn(model, 1, [empty, empty], *cpu_f32) == [empty, empty] and model.calls == []
    out = run_ffn(model, 1, [empty, a], *cpu_f32)
    assert out[0] is empty and torch.equal(out[1], ffn(a)) and model.calls[0][1] is a
    out = run_ffn(model, 1, [a, empty, b], *cpu_f32)
    assert len(model.calls) == 2 and model.calls[1][1].shape == (5, HIDDEN)
    assert torch.equal(out[0], ffn(a)) and out[1] is empty and torch.equal(out[2], ffn(b))


