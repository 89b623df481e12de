"""A frozen or trickling attention rank is treated like a stalled one: its sibling is served on (issue 51).

2A1F on loopback, ``backend: tcp``, ``timeout_s: 2``, real processes (``test_connector``'s forkserver, no vLLM).

- Frozen (finding 2, 7): one attention rank stops itself with ``SIGSTOP`` between the send and the receive of a
  layer (its keep-alive thread stops with it), the test sends ``SIGCONT`` after ``FREEZE_S``. The sibling's
  longest wait for an answer stays within ``2 * timeout_s``, the group goes on, the FFN drops the frozen rank,
  naming it (not its sibling), and the frozen rank, resumed, gets ``ConnectorDropped`` and re-joins.
- Trickling (finding 6): under ``pingpong`` the rank whose header the FFN reads sends it one byte a second; the
  header must be complete ``timeout_s`` after its first byte, and the sibling is served meanwhile.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch

from afd_patches.config import AfdConfig
from afd_patches.connectors import wire
from afd_patches.connectors.base import ConnectorDropped, ConnectorError
from afd_patches.connectors.torch_dist import TorchDistConnector
from harness.env import free_port
from tests.afd.test_batched_progress import LAYERS, _step
from tests.afd.test_connector import _CTX, FORM_S, _error_fields, _join_all, attn_input, collect, make_config, start
from tests.afd.test_rendezvous import logged_ffn_worker

TIMEOUT_S = 2.0
FREEZE_S = 3 * TIMEOUT_S  # the frozen rank's freeze: well past the bound
TRICKLE_BYTES = 8  # seconds of trickling, one header byte each: four times timeout_s
RUN_S = 60.0


def sibling(cfg: AfdConfig, done: Any, queue: Any) -> None:
    """Step until ``done`` is set (at most ``RUN_S``); the longest wait for an answer, the failing one included."""
    torch.set_num_threads(1)
    conn = TorchDistConnector(cfg)
    result: dict[str, Any] = {"error": None, "mismatches": 0, "longest_wait": 0.0, "steps": 0}
    last = time.monotonic()
    try:
        conn.init(FORM_S)
        end = time.monotonic() + RUN_S
        while not done.is_set() and time.monotonic() < end:
            last = time.monotonic()
            bad, longest = _step(conn, cfg.rank, result["steps"], 2)
            result["mismatches"] += bad
            result["longest_wait"] = max(result["longest_wait"], longest)
            result["steps"] += 1
            time.sleep(0.01)
    except ConnectorError as e:
        result["longest_wait"] = max(result["longest_wait"], time.monotonic() - last)
        result.update(_error_fields(e))
    conn.close()
    queue.put((f"attention{cfg.rank}", result))


def freezing(cfg: AfdConfig, freeze_at: int, after: int, frozen: Any, done: Any, queue: Any) -> None:
    """``freeze_at`` steps, the send of layer 0 of the next, ``SIGSTOP`` to itself (the test continues it), then
    steps on until ``after`` more were served; a ``ConnectorDropped`` is recorded and a new connector re-joins, as
    the attention worker's ``AttentionGroup`` does (steps keep their own numbering)."""
    torch.set_num_threads(1)
    conn = TorchDistConnector(cfg)
    result: dict[str, Any] = {"error": None, "mismatches": 0, "dropped": None, "served_after": 0}
    try:
        conn.init(FORM_S)
        for step in range(freeze_at):
            result["mismatches"] += _step(conn, cfg.rank, step, 3)[0]
        conn.send_attn_output(attn_input(cfg.rank, 0, freeze_at, 3), 0, freeze_at)
        frozen.set()  # an event, not the queue: its feeder thread would stop with this process
        os.kill(os.getpid(), signal.SIGSTOP)
        step, end = freeze_at, time.monotonic() + RUN_S
        try:
            conn.recv_ffn_output(0, freeze_at)
            for layer in range(1, LAYERS):
                conn.send_attn_output(attn_input(cfg.rank, layer, freeze_at, 3), layer, freeze_at)
                conn.recv_ffn_output(layer, freeze_at)
        except ConnectorDropped as e:
            result["dropped"] = str(e)
        while result["served_after"] < after and time.monotonic() < end:
            step += 1
            if result["dropped"] is not None and result.get("rejoined_group") is None:
                conn.close()
                conn = TorchDistConnector(cfg)
                conn.init(FORM_S)
                result["rejoined_group"] = conn.group
            result["mismatches"] += _step(conn, cfg.rank, step, 3)[0]
            result["served_after"] += 1
    except ConnectorError as e:
        result.update(_error_fields(e))
    done.set()
    conn.close()
    queue.put((f"attention{cfg.rank}", result))


def _configs(port: int, schedule: str) -> dict[tuple[str, int], AfdConfig]:
    return {(role, r): make_config(role, r, port, a=2, timeout_s=TIMEOUT_S, schedule=schedule)
            for role, r in (("ffn", 0), ("attention", 0), ("attention", 1))}


@pytest.mark.parametrize("frozen", [0, 1])
@pytest.mark.parametrize("schedule", ["batched", "pingpong"])
def test_a_frozen_rank_is_dropped_and_its_sibling_served_on(schedule: str, frozen: int) -> None:
    """Finding 2 (the sibling's longest wait <= 2 * timeout_s, the group goes on, the frozen rank is dropped and
    re-joins) and finding 7 (the FFN names the frozen rank, not its sibling)."""
    port, other = free_port(), 1 - frozen
    queue, done, stopped = _CTX.Queue(), _CTX.Event(), _CTX.Event()
    cfgs = _configs(port, schedule)
    procs = [start(logged_ffn_worker, cfgs["ffn", 0], queue, None, None, FORM_S),
             start(freezing, cfgs["attention", frozen], 3, 3, stopped, done, queue),
             start(sibling, cfgs["attention", other], done, queue)]
    try:
        assert stopped.wait(RUN_S), "the rank to freeze never got there"
        time.sleep(FREEZE_S)  # the fault itself: how long the rank stays frozen
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
    got = collect(queue, {"ffn0", "attention0", "attention1"}, RUN_S + 30)
    _join_all(procs, 10)
    for name, res in sorted(got.items()):
        print(name, res)
    r, s, f = got[f"attention{frozen}"], got[f"attention{other}"], got["ffn0"]
    assert s["error"] is None and s["mismatches"] == 0, s
    assert s["longest_wait"] <= 2 * TIMEOUT_S, s
    assert s["steps"] > FREEZE_S / (2 * TIMEOUT_S), s  # it stepped through the freeze
    assert r["dropped"] is not None and "dropped this rank" in r["dropped"], r
    assert r["error"] is None and r["mismatches"] == 0 and r["served_after"] == 3, r
    assert f["error"] == "ConnectorClosed", f
    drops = [line for line in f["log"] if "dropped attention rank" in line]
    assert len(drops) == 1 and f"dropped attention rank {frozen} " in drops[0], f["log"]
    assert not any(f"attention rank {other} " in line for line in f["log"]), f["log"]


def dying(cfg: AfdConfig, die_at: int, died: Any) -> None:
    """``die_at`` steps, the send of layer 0 of the next, then the process exits at once (its sockets close
    without a ``CLOSE``: a crash or a SIGKILL, as the FFN sees it)."""
    torch.set_num_threads(1)
    conn = TorchDistConnector(cfg)
    conn.init(FORM_S)
    for step in range(die_at):
        _step(conn, cfg.rank, step, 3)
    conn.send_attn_output(attn_input(cfg.rank, 0, die_at, 3), 0, die_at)
    died.set()
    os._exit(1)


@pytest.mark.parametrize("schedule", ["batched", "pingpong"])
def test_a_dead_rank_is_dropped_and_its_sibling_served_on(schedule: str) -> None:
    """On tcp a rank whose process died (its link closed without a CLOSE) costs its sibling nothing: the FFN drops
    it, naming it, and serves the sibling on (the group used to end, and the sibling's exchange with it)."""
    port = free_port()
    queue, done, died = _CTX.Queue(), _CTX.Event(), _CTX.Event()
    cfgs = _configs(port, schedule)
    procs = [start(logged_ffn_worker, cfgs["ffn", 0], queue, None, None, FORM_S),
             start(dying, cfgs["attention", 1], 3, died),
             start(sibling, cfgs["attention", 0], done, queue)]
    try:
        assert died.wait(RUN_S), "the rank to kill never got there"
        time.sleep(2 * TIMEOUT_S)  # the sibling steps on meanwhile
    finally:
        done.set()
    got = collect(queue, {"ffn0", "attention0"}, RUN_S + 30)
    _join_all(procs, 10)
    s, f = got["attention0"], got["ffn0"]
    assert s["error"] is None and s["mismatches"] == 0 and s["longest_wait"] <= 2 * TIMEOUT_S, s
    drops = [line for line in f["log"] if "dropped attention rank" in line]
    assert len(drops) == 1 and "dropped attention rank 1 " in drops[0], f["log"]
    assert not any("attention rank 0 " in line for line in f["log"]), f["log"]


def trickling(cfg: AfdConfig, done: Any, queue: Any) -> None:
    """Two steps, then the header of the next one byte a second, ``TRICKLE_BYTES`` of it (no keep-alive between:
    the link's send lock is held), then a wait for the answer."""
    torch.set_num_threads(1)
    conn = TorchDistConnector(cfg)
    result: dict[str, Any] = {"error": None}
    try:
        conn.init(FORM_S)
        for step in range(2):
            _step(conn, cfg.rank, step, 3)
        transport = conn._transport
        x = attn_input(cfg.rank, 0, 2, 3)
        raw = wire.HEADER.pack(*wire.words(wire.KIND_DATA, 0, 2, x, microbatch=0))
        t0 = time.monotonic()
        with transport._locks[0]:  # type: ignore[union-attr]
            for byte in raw[:TRICKLE_BYTES]:
                try:
                    transport._tx[0].send(bytes([byte]))  # type: ignore[union-attr]
                except OSError:
                    break  # the FFN closed the link (it dropped this rank)
                time.sleep(1.0)
        result["trickled_s"] = time.monotonic() - t0
        conn.recv_ffn_output(0, 2)
    except ConnectorError as e:
        result.update(_error_fields(e))
    done.set()
    conn.close()
    queue.put((f"attention{cfg.rank}", result))


def test_a_trickled_header_is_bounded_and_the_sibling_served_meanwhile() -> None:
    """Finding 6: ``pingpong``, the token holder trickles a header at 1 byte/s: the sibling's longest wait stays
    within ``2 * timeout_s`` (served meanwhile), the trickler is dropped once ``timeout_s`` passed since its
    header's first byte, and the FFN serves on until both closed."""
    port = free_port()
    queue, done = _CTX.Queue(), _CTX.Event()
    cfgs = _configs(port, "pingpong")
    procs = [start(logged_ffn_worker, cfgs["ffn", 0], queue, None, None, FORM_S),
             start(trickling, cfgs["attention", 0], done, queue),
             start(sibling, cfgs["attention", 1], done, queue)]
    got = collect(queue, {"ffn0", "attention0", "attention1"}, RUN_S + 30)
    _join_all(procs, 10)
    for name, res in sorted(got.items()):
        print(name, res)
    t, s, f = got["attention0"], got["attention1"], got["ffn0"]
    assert s["error"] is None and s["mismatches"] == 0 and s["longest_wait"] <= 2 * TIMEOUT_S, s
    assert s["steps"] > TRICKLE_BYTES / (2 * TIMEOUT_S), s
    assert t["error"] == "ConnectorError" and t["type"] == "ConnectorDropped", t
    assert f["error"] == "ConnectorClosed", f
    drops = [line for line in f["log"] if "dropped attention rank 0 " in line]
    assert len(drops) == 1 and f"timeout_s={TIMEOUT_S:g}s" in drops[0], f["log"]
