"""Liveness is progress, not keep-alives: a stalled attention rank under ``schedule: batched``.

2A1F on loopback, real processes (``test_connector``'s forkserver and helpers, no vLLM). Attention rank 0
stops stepping (its process lives on, and its keep-alive thread with it) while rank 1 steps on: rank 1's
exchanges stay exact and never wait much longer than ``timeout_s``; rank 0, when it resumes, gets an error
naming the drop and re-joins. Every loop is bounded in steps and in time.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from afd_patches.config import AfdConfig
from afd_patches.connectors.base import ConnectorDropped, ConnectorError
from afd_patches.connectors.torch_dist import TorchDistConnector
from harness.env import free_port
from tests.afd.test_connector import (
    _CTX,
    FORM_S,
    SLACK_S,
    _error_fields,
    _join_all,
    attn_input,
    collect,
    ffn,
    make_config,
    start,
)
from tests.afd.test_rendezvous import logged_ffn_worker

TIMEOUT_S = 2.0
STALL_S = 3 * TIMEOUT_S  # rank 0's stall: well past the bound
LAYERS = 2
RUN_S = 60.0  # no worker steps longer than this, whatever happens


def _step(conn: TorchDistConnector, rank: int, step: int, tokens: int) -> tuple[int, float]:
    """One step through every layer; (mismatching layers, the longest wait for an answer)."""
    bad, longest = 0, 0.0
    for layer in range(LAYERS):
        x = attn_input(rank, layer, step, tokens)
        t0 = time.monotonic()
        conn.send_attn_output(x, layer, step)
        y = conn.recv_ffn_output(layer, step)
        longest = max(longest, time.monotonic() - t0)
        bad += int(y.shape != x.shape or not torch.equal(y, ffn(x)))
    return bad, longest


def steady_attention(cfg: AfdConfig, done: Any, queue: Any) -> None:
    """Rank 1: step until ``done`` is set (at most ``RUN_S``); report exactness and the longest wait."""
    torch.set_num_threads(1)
    conn = TorchDistConnector(cfg)
    result: dict[str, Any] = {"error": None, "mismatches": 0, "longest_wait": 0.0, "steps": 0}
    try:
        conn.init(FORM_S)
        end = time.monotonic() + RUN_S
        while not done.is_set() and time.monotonic() < end:
            bad, longest = _step(conn, cfg.rank, result["steps"], 2)
            result["mismatches"] += bad
            result["longest_wait"] = max(result["longest_wait"], longest)
            result["steps"] += 1
            time.sleep(0.01)
        result["group"] = conn.group
    except ConnectorError as e:
        result.update(_error_fields(e))
    conn.close()
    queue.put((f"attention{cfg.rank}", result))


def stalling_attention(cfg: AfdConfig, stall_at: int, after: int, done: Any, queue: Any) -> None:
    """Rank 0: ``stall_at`` steps, a stall of ``STALL_S`` (no step; the keep-alive thread runs on), then
    ``after`` more steps. A ``ConnectorDropped`` on resuming is recorded, and a new connector re-joins the
    group, as the attention worker's ``AttentionGroup`` does; steps keep their own numbering."""
    torch.set_num_threads(1)
    conn = TorchDistConnector(cfg)
    result: dict[str, Any] = {"error": None, "mismatches": 0, "dropped": None, "served_after": 0}
    step = 0
    try:
        conn.init(FORM_S)
        result["group"] = conn.group
        for step in range(stall_at):
            result["mismatches"] += _step(conn, cfg.rank, step, 3)[0]
        time.sleep(STALL_S)
        step = stall_at
        end = time.monotonic() + RUN_S
        while result["served_after"] < after and time.monotonic() < end:
            try:
                result["mismatches"] += _step(conn, cfg.rank, step, 3)[0]
                result["served_after"] += 1
            except ConnectorDropped as e:
                assert result["dropped"] is None, "dropped twice"
                result["dropped"] = str(e)
                conn.close()
                conn = TorchDistConnector(cfg)
                t0 = time.monotonic()
                conn.init()
                result["rejoin_s"], result["rejoined_group"] = time.monotonic() - t0, conn.group
            step += 1
    except ConnectorError as e:
        result.update(_error_fields(e))
    done.set()
    conn.close()
    queue.put((f"attention{cfg.rank}", result))


def _run(backend: str, schedule: str, after: int) -> dict[str, dict[str, Any]]:
    port = free_port()
    queue, done = _CTX.Queue(), _CTX.Event()
    cfgs = {(role, r): make_config(role, r, port, a=2, timeout_s=TIMEOUT_S, backend=backend, schedule=schedule)
            for role, r in (("ffn", 0), ("attention", 0), ("attention", 1))}
    procs = [start(logged_ffn_worker, cfgs["ffn", 0], queue, None, None, FORM_S),
             start(stalling_attention, cfgs["attention", 0], 3, after, done, queue),
             start(steady_attention, cfgs["attention", 1], done, queue)]
    got = collect(queue, {"ffn0", "attention0", "attention1"}, RUN_S + 30)
    _join_all(procs, 10)
    for name, res in sorted(got.items()):
        print(name, res)
    return got


def test_batched_tcp_drops_a_stalled_rank_and_takes_it_back() -> None:
    """Rank 1 is served on, exactly, never waiting much more than ``timeout_s``; rank 0 resumes into a
    ``ConnectorDropped`` naming the drop, re-joins the live group (same group id) and is served exactly again;
    the FFN logs the drop once and serves until both close."""
    got = _run("tcp", "batched", after=5)
    r0, r1, f = got["attention0"], got["attention1"], got["ffn0"]
    assert r1["error"] is None and r1["mismatches"] == 0, r1
    assert r1["longest_wait"] < TIMEOUT_S + 1.0, r1
    assert r1["steps"] > STALL_S / (TIMEOUT_S + 1.0), r1  # it stepped through rank 0's stall
    assert r0["error"] is None and r0["mismatches"] == 0 and r0["served_after"] == 5, r0
    assert r0["dropped"] is not None and "dropped this rank" in r0["dropped"], r0
    assert "ffn rank 0" in r0["dropped"] and "layer 0 step 3" in r0["dropped"], r0
    assert r0["rejoined_group"] == r0["group"] == r1["group"], (r0, r1)
    assert r0["rejoin_s"] < SLACK_S, r0
    assert f["error"] == "ConnectorClosed", f
    drops = [line for line in f["log"] if "dropped attention rank 0" in line]
    assert len(drops) == 1, f["log"]
    assert f"timeout_s={TIMEOUT_S:g}s" in drops[0] and "layer 0 step 3" in drops[0], drops
    assert any("attention rank 0" in line and "re-joined" in line for line in f["log"]), f["log"]


def test_batched_gloo_drops_a_stalled_rank_and_serves_the_others() -> None:
    """gloo: the same drop (rank 1 served on, exactly; rank 0 told why when it wakes). A torch group takes no
    new member, so rank 0 cannot re-join this group: its attempt fails in bound and rank 1 keeps its group."""
    got = _run("gloo", "batched", after=1)
    r0, r1, f = got["attention0"], got["attention1"], got["ffn0"]
    assert r1["error"] is None and r1["mismatches"] == 0, r1
    assert r1["longest_wait"] < TIMEOUT_S + 1.0, r1
    assert r0["dropped"] is not None and "dropped this rank" in r0["dropped"], r0
    assert r0["error"] is not None and r0["served_after"] == 0, r0  # the re-join: no group for it until the next
    assert f["error"] == "ConnectorClosed", f
    drops = [line for line in f["log"] if "dropped attention rank 0" in line]
    assert len(drops) == 1 and "with the next group" in drops[0], f["log"]


@pytest.mark.parametrize("backend", ["tcp", "gloo"])
def test_pingpong_a_stalled_rank_blocks_nobody(backend: str) -> None:
    """``pingpong`` serves each rank as it arrives: rank 1 never waits on the stalled rank 0, which is served
    on, exactly, when it resumes (no drop there). Rank 1 steps every few milliseconds, so a step held by rank 0
    would wait out the rest of its ``STALL_S`` stall (6 s); the bound, half of that, leaves room for a loaded
    host's scheduling (1.48 s seen beside the real-vLLM tests) and none for such a wait."""
    got = _run(backend, "pingpong", after=3)
    r0, r1 = got["attention0"], got["attention1"]
    assert r1["error"] is None and r1["mismatches"] == 0 and r1["longest_wait"] < STALL_S / 2, r1
    assert r0["error"] is None and r0["dropped"] is None and r0["mismatches"] == 0 and r0["served_after"] == 3, r0
    assert got["ffn0"]["error"] == "ConnectorClosed", got["ffn0"]


class _Recv:
    """An NCCL-style receive: completes ``after_s`` from now; ``wait()`` only once completed."""

    def __init__(self, after_s: float) -> None:
        self.done_at = time.monotonic() + after_s

    def is_completed(self) -> bool:
        return time.monotonic() >= self.done_at

    def wait(self, timeout: Any = None) -> bool:
        assert self.is_completed(), "waited on an incomplete NCCL work (a host block)"
        return True


class _Group:
    """A process-group stand-in whose receives from each peer complete after a set delay."""

    def __init__(self, delays: dict[int, float]) -> None:
        self.delays = delays

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Recv:
        return _Recv(self.delays[peer])


def test_nccl_first_polls_every_posted_receive() -> None:
    """``batched`` takes the first header of any member, also on NCCL (no waiter threads there: every posted
    receive is polled); ``None`` at the bound, with nothing waited on that had not completed."""
    from afd_patches.connectors.torch_group import TorchGroupTransport

    transport = TorchGroupTransport(_Group({1: 60.0, 2: 0.1}), "nccl", torch.device("cpu"), 5.0, 0)
    t0 = time.monotonic()
    assert transport.first([1, 2], 5.0) == 2 and time.monotonic() - t0 < 1.0
    assert transport.first([1, 2], 0.0) == 2  # arrived, not yet taken by next_header
    transport._arrived.clear()
    t0 = time.monotonic()
    assert transport.first([1], 0.2) is None and 0.2 <= time.monotonic() - t0 < 1.0


def counting_attention(cfg: AfdConfig, first_step: int, steps: int, queue: Any) -> None:
    """An attention rank of a new group whose step numbers go on from an earlier group (``first_step``), as an
    attention engine's do after an FFN restart: ``steps`` steps, each answer checked."""
    torch.set_num_threads(1)
    conn = TorchDistConnector(cfg)
    result: dict[str, Any] = {"error": None, "mismatches": 0, "steps": 0}
    try:
        conn.init(FORM_S)
        for step in range(first_step, first_step + steps):
            result["mismatches"] += _step(conn, cfg.rank, step, 2)[0]
            result["steps"] += 1
    except ConnectorError as e:
        result.update(_error_fields(e))
    conn.close()
    queue.put((f"attention{cfg.rank}", result))


def test_batched_serves_a_new_group_whose_ranks_count_steps_from_different_numbers() -> None:
    """After an FFN restart the attention engines re-form with their step counters where their last group left
    them, which differ between ranks (idle ticks, a failed step): the new group aligns each rank at its first
    header and serves both exactly. Before, the first batch failed "attention ranks out of step" and every
    re-formed group ended at once (the chaos benchmark, 2A1F)."""
    port = free_port()
    queue = _CTX.Queue()
    cfgs = {(role, r): make_config(role, r, port, a=2, timeout_s=TIMEOUT_S, backend="tcp", schedule="batched")
            for role, r in (("ffn", 0), ("attention", 0), ("attention", 1))}
    procs = [start(logged_ffn_worker, cfgs["ffn", 0], queue, None, None, FORM_S),
             start(counting_attention, cfgs["attention", 0], 1880, 6, queue),
             start(counting_attention, cfgs["attention", 1], 1122, 6, queue)]
    got = collect(queue, {"ffn0", "attention0", "attention1"}, RUN_S + 30)
    _join_all(procs, 10)
    for rank in (0, 1):
        r = got[f"attention{rank}"]
        assert r["error"] is None and r["mismatches"] == 0 and r["steps"] == 6, r
    assert got["ffn0"]["error"] == "ConnectorClosed", got["ffn0"]
