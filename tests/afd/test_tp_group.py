"""``afd_patches.workers.tp_group`` over a real vLLM TP group of two processes (no engine, no model).

Two spawned processes initialise vLLM's distributed environment (gloo, TP 2) as vLLM's CPU worker
does, and use the channel from a background thread, as the FFN serve loop does. Checks: a follower's
timed-out poll returns None and leaves the queue usable; a published tensor arrives bit-identical
(float32 and bfloat16, empty and non-empty); an attention leader's answer reaches the follower, and a
leader's failure (the AFD group down) makes the follower raise ``AfdGroupDown`` instead of waiting;
``follow_ffn`` runs every published call and returns on the leader's ``stop``. Marked ``vllm``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import traceback
from typing import Any

import pytest
import torch

from harness.env import free_port

pytestmark = pytest.mark.vllm


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(5, 64, generator=g), torch.randn(3, 64, generator=g).to(torch.bfloat16),
            torch.empty(0, 64)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.numel() else t


class _Link:
    """An attention link stand-in: answers 2*x, or fails as a lost group does."""

    def __init__(self) -> None:
        self.fail: BaseException | None = None

    def exchange(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        if self.fail is not None:
            raise self.fail
        return hidden * 2


class _Model:
    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.Tensor]] = []

    def afd_ffn(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append((layer, hidden.clone()))
        return hidden


def _leader(channel: Any) -> dict[str, Any]:
    from afd_patches.models.link import AfdGroupDown
    from afd_patches.workers import tp_group

    threading.Event().wait(1.5)  # the follower's first poll (0.5 s) times out
    for i, t in enumerate(_tensors()):
        channel.publish({"op": "ffn", "layer": i}, t)
    link = _Link()
    att = tp_group.AttentionLeader(link, channel)
    att.exchange(torch.ones(2, 8), 4)
    link.fail = AfdGroupDown("lost the FFN role at 127.0.0.1:1")
    with pytest.raises(AfdGroupDown):
        att.exchange(torch.ones(2, 8), 5)
    model = _Model()
    leader = tp_group.FfnLeader(model, channel)
    leader.afd_ffn(1, torch.full((2, 64), 3.0))
    leader.group_ended(RuntimeError("peer lost"))
    leader.stopped(None)
    return {"ok": True}


def _follower(channel: Any) -> dict[str, Any]:
    from afd_patches.models.link import AfdGroupDown
    from afd_patches.workers import tp_group

    out: dict[str, Any] = {"first_poll": channel.take(0.5)}
    got = [channel.take(30.0) for _ in _tensors()]
    out["bit_equal"] = [h["layer"] == i and t is not None and t.dtype == e.dtype and t.shape == e.shape
                        and torch.equal(_bits(t), _bits(e)) for i, ((h, t), e) in enumerate(zip(got, _tensors(),
                                                                                                 strict=True))]
    follower = tp_group.AttentionFollower(channel)
    out["answer"] = torch.equal(follower.exchange(torch.zeros(2, 8), 4), torch.full((2, 8), 2.0))
    try:
        follower.exchange(torch.zeros(2, 8), 5)
        out["down"] = None
    except AfdGroupDown as e:
        out["down"] = str(e)
    model, ends, calls = _Model(), [], []
    out["stopped"] = tp_group.follow_ffn(channel, model, threading.Event(), ends.append, lambda: calls.append(1))
    out["ends"], out["calls"] = ends, len(calls)
    out["ffn_call"] = [(layer, x.tolist()) for layer, x in model.calls] == [(1, [[3.0] * 64] * 2)]
    return out


def _rank(rank: int, port: int, results: Any) -> None:
    try:
        os.environ["VLLM_DIST_IDENT"] = f"afd-tp-test-{port}"
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

        from afd_patches.workers.tp_group import TpChannel

        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(2, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
            initialize_model_parallel(tensor_model_parallel_size=2, backend="gloo")
            channel = TpChannel.of_worker()
            assert channel is not None and channel.rank == rank and channel.leader == (rank == 0)
            box: dict[str, Any] = {}
            thread = threading.Thread(target=lambda: box.update(r=(_leader if rank == 0 else _follower)(channel)))
            thread.start()  # a background thread, as the FFN serve loop
            thread.join(120)
            results.put((rank, box.get("r", {"error": "no result"})))
    except BaseException:  # noqa: BLE001 -- reported to the parent, which fails the test with it
        results.put((rank, {"error": traceback.format_exc()}))


def test_channel_over_a_real_vllm_tp_group() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert got[0] == {"ok": True}, got[0]
    f = got[1]
    assert "error" not in f, f["error"]
    assert f["first_poll"] is None  # a timed-out poll, and the queue still delivered everything after it
    assert f["bit_equal"] == [True, True, True]
    assert f["answer"] is True
    assert f["down"] and "lost the FFN role at 127.0.0.1:1" in f["down"]
    assert f["ffn_call"] is True and f["calls"] == 1
    assert f["ends"] == ["peer lost"] and f["stopped"] is None
