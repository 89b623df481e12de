"""GPU check of the AFD connector and FFN serve loop, without vLLM (torch with CUDA is enough).

What it runs
    Two processes, an FFN rank and an attention rank, on the real ``TorchDistConnector``
    (``afd_patches/connectors/torch_dist.py``) and the real FFN serve loop
    (``FfnServer`` of ``afd_patches/workers/ffn_server.py``, the FFN worker's own, serving a
    stand-in bf16 MLP). The connector builds its gloo/NCCL group from torch's own
    classes, so vLLM need not be installed.

    ``exchange`` (call 1, about 1-2 minutes on one GPU):
      - ``same_gpu_refused``: both ranks on one GPU with NCCL fail at the handshake with the
        message that says what to do (only when the ranks share a GPU);
      - ``nccl_same_gpu_forced``: the same with that check bypassed, to record what NCCL itself
        says and that the connector reports it as an NCCL error (only on one GPU);
      - ``exchange``: token counts ``--tokens`` (default 1,7,256,4096) x ``--hidden`` (4096),
        bf16, through the serve loop's MLP; each result bitwise equal to the same MLP run
        locally; microseconds per exchange (median, p90) next to the local MLP alone;
      - ``close_while_blocked``: the FFN closes its connector from its main thread while the
        serve thread waits for an idle attention rank; close and the serve thread end in bound.
    ``piecewise`` (call 3, about 1 minute): what AFD's piecewise CUDA graphs do on the attention
    role (``afd_patches/patches/compilation.py``), without vLLM's compiler: two layers of
    [piece: matmul + RMS norm] -> ``afd::exchange`` (the registered operator, through the real
    connector to the FFN process's serve loop) -> [piece: residual add]; each piece is captured
    once in a ``torch.cuda.CUDAGraph`` and replayed around the eager exchange, for every size in
    ``--tokens`` (one graph pair per size, as vLLM captures per batch size); the result must be
    bitwise equal to the same pieces run eagerly. This is what vLLM's ``splitting_ops`` produces
    (the op outside every graph); whether vLLM's own piecewise backend does it on a real model is
    for a vLLM run on a GPU. On ``--device cpu`` the pieces run without graphs (script self-test).
    Written against torch's documented CUDA-graph API (capture on a side stream after a warm-up,
    static input and output tensors, ``replay()``); it has not run on a GPU yet.
    ``idle`` (call 2, about 2 minutes): the FFN idles ``--idle-s`` (60) with ``timeout_s=10``
    (a group timeout of ``timeout_s`` would make NCCL's watchdog abort it); then one exchange
    must still work; then the attention process is killed (SIGKILL) while the FFN idles, and
    the serve loop must report the lost rank within ``timeout_s`` plus slack.
    ``microbatch`` (call 4, issue 36; expected under 2 minutes, give it 180 s): AFD's micro-batch path as vLLM's
    Model Runner V2 (MRV2) would run it on CUDA, without vLLM (the attention side is ``microbatch_step.py``). The
    attention process runs the REAL ``afd_patches.models.microbatch`` (``MicroBatchRunner``: micro-batch 0 in the
    caller's thread, the others in its threads; the baton, so one micro-batch computes at a time; the hand-over
    inside ``afd::exchange``), the real ``AfdLink`` and connector, against the FFN process's serve loop. Its toy
    model: 2 layers of [matmul + RMS norm -> KV-cache write at the context's ``slot_mapping`` -> causal attention
    over the request's KV rows (masked max) -> residual] -> RMS norm -> ``afd::exchange`` -> residual, over one step
    of ``--requests`` (new tokens per request, default 8 requests, 512 tokens; micro-batch boundaries fall inside
    requests, whose second part then reads KV the first part wrote). Variants: unsplit (1), 2 and 3 micro-batches
    in the forward context MRV2's runner makes (``attn_metadata``, ``slot_mapping`` and ``is_padding`` lists, one
    entry per micro-batch, and ``ubatch_slices``; ``afd_patches/patches/micro_batches_v2.py``), and on CUDA 2 and 3
    again with each micro-batch's compute on its own ``torch.cuda.Stream``, an event recorded at every hand-over
    and waited for by the next micro-batch's stream (what vLLM's ``UBatchRunner`` does with streams). One
    ``microbatch`` line per variant; ok when: output and KV cache bitwise equal to the unsplit step's (or, only
    where the kernels themselves give a row other bits on fewer rows, ``kernels_row_independent`` false, bitwise
    equal to the same split computed without AFD); the FFN's serve loop served exactly micro-batches x layers
    messages per step (its own count, ``ffn_exchanges_per_step``); every layer call, before and after its
    exchange, saw its own micro-batch's context (its metadata, slot mapping and padding entry, no slices) and
    rows; the layers ran in the schedule's order (per layer, micro-batch 0..N-1: ``schedule``), never two
    micro-batches computing at once (``overlaps``), each micro-batch in its own thread; ``--reps`` more steps
    bitwise equal too. Reported: µs per step and per exchange (medians) next to the same split without AFD, and
    on CUDA the current device each micro-batch's thread ran on. vLLM is absent on the device, so the attention
    process installs a stand-in for ``vllm.forward_context`` (only the names microbatch.py uses, with vLLM's
    contract; see ``microbatch_step.py``). With NCCL (two GPUs) the config's refusal of ``micro_batches`` > 1 on
    NCCL does not apply: the script builds its ``LinkConfig`` directly, not through ``parse``/``restore``
    (``nccl_micro_batches_forced``), to learn what NCCL does with it; on one GPU gloo carries the CUDA tensors,
    as in ``exchange``. It has not run on a GPU yet: only its CPU self-test has run (gloo, no streams).
    Found by that self-test (2026-12-04) and fixed in the connector: on gloo with 2 or more micro-batches, a
    payload above ``inline_bytes`` deadlocked both sides (each waited for its own earlier send before taking the
    other's payload); ``--hidden 256 --requests 100,60,140`` on CPU is that case (test_gpu_check.py runs it).

Backends and devices
    ``--backend nccl`` (default with CUDA) needs two GPUs for the data path: with two, FFN on
    cuda:0 and attention on cuda:1. NCCL cannot hold two ranks of one group on one GPU, so
    with one GPU the data-path checks run with ``--backend gloo`` and both MLPs on cuda:0
    (gloo copies through host memory; this is the documented way to put both ranks on one
    GPU, also in docs/running.md); on one GPU ``exchange`` therefore runs the two same-GPU
    NCCL checks and then the gloo data path by itself. ``--device cpu`` runs everything on
    CPU with gloo (how the script itself is tested without a GPU; use a small ``--hidden``).

How to run (repository root; a machine lent for a session takes the working tree)
    python scripts/gpu_check/check.py exchange            # call 1, give it 300 s
    python scripts/gpu_check/check.py idle                # call 2, give it 300 s
    python scripts/gpu_check/check.py piecewise           # call 3, give it 180 s
    python scripts/gpu_check/check.py microbatch          # call 4, give it 180 s
    python scripts/gpu_check/check.py exchange --device cpu --hidden 256 --reps 5   # CPU self-test
    python scripts/gpu_check/check.py microbatch --device cpu --hidden 64 --requests 7,1,12,3,9 --reps 3
        (its CPU self-test, about 10 s; tests/tooling/test_gpu_check.py runs it)
    Each prints one JSON line per check (``CHECK {...}``) and ends with ``GPU_CHECK PASS`` or
    ``GPU_CHECK FAIL``; the exit status is 0 only for PASS. Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import signal
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's afd_patches
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

SLACK_S = 5.0
_CTX = mp.get_context("spawn")


# ------------------------------------------------------------------ pieces both processes use
class Mlp(torch.nn.Module):
    """A Llama-style gated MLP; the same seed gives the same weights in every process."""

    def __init__(self, hidden: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1234)
        inter = hidden * 11 // 4
        scale = hidden ** -0.5
        self.gate_up = torch.nn.Parameter((torch.randn(2 * inter, hidden, generator=gen) * scale).to(device, dtype))
        self.down = torch.nn.Parameter((torch.randn(hidden, inter, generator=gen) * scale).to(device, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.gate_up.t()).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ self.down.t()

    def afd_ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self(x)


def make_config(role: str, port: int, opts: dict[str, Any]) -> Any:
    """The connector's config, built directly (the rules of ``parse``/``restore`` between link keys, such as
    the refusal of micro-batches on NCCL, are not applied: see ``microbatch`` in the module docstring)."""
    from afd_patches.config import AfdConfig, LinkConfig

    extra: dict[str, Any] = {"backend": opts["backend"]}
    if opts["backend"] == "nccl":
        extra["device"] = opts["devices"][role]
    if opts.get("micro_batches", 1) > 1:
        extra["micro_batches"] = opts["micro_batches"]
    if opts.get("inline_bytes") is not None:
        extra["inline_bytes"] = opts["inline_bytes"]
    return AfdConfig(role=role, port=port, timeout_s=opts["timeout_s"], connector_extra_config=LinkConfig(**extra))


def identity(opts: dict[str, Any]) -> dict[str, Any]:
    layers = {"num_hidden_layers": opts["layers"]} if opts.get("layers") else {}  # bounds a header's layer
    return {"hidden_size": opts["hidden"], "dtype": opts["dtype"], "max_num_batched_tokens": max(opts["tokens"]),
            **layers}


def setup(role: str, opts: dict[str, Any]) -> torch.device:
    """Per process: the device, and (with ``force_distinct``) a bypass of the same-GPU check."""
    torch.set_num_threads(2)
    device = torch.device(opts["devices"][role])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if opts.get("force_distinct"):
        from afd_patches.connectors import torch_group

        torch_group.device_identity = lambda d: f"forced-distinct-{role}"
    return device


def _error(e: BaseException) -> dict[str, Any]:
    return {"error": type(e).__name__, "message": str(e)[:600]}


# ------------------------------------------------------------------ the FFN process
def ffn_main(port: int, opts: dict[str, Any], inbox: Any, outbox: Any) -> None:
    """Serve as the FFN worker does (an ``FfnServer`` with the connector ``build_connector`` makes), obey ``inbox``.

    No vLLM worker: the server is given a stand-in MLP on the check's device."""
    device = setup("ffn", opts)
    from afd_patches.config import AfdConfig
    from afd_patches.workers.connection import build_connector
    from afd_patches.workers.ffn_server import FfnServer

    cfg: AfdConfig = make_config("ffn", port, opts)
    ident = identity(opts)
    dtype = getattr(torch, opts["dtype"])
    model = Mlp(opts["hidden"], device, dtype)
    server = FfnServer(cfg.rank, f"{cfg.host}:{cfg.port}", lambda: build_connector(cfg, ident), cfg.timeout_s,
                       cfg.timeout_s, model, (device, dtype), None, None)
    server.start()
    while True:
        try:
            command = inbox.get(timeout=0.5)
        except queue.Empty:
            command = None
        if command == "count":  # messages served so far (the ``microbatch`` call's exchange count)
            outbox.put(("ffn-count", {"batches": server.batches}))
        if command == "close":
            t0 = time.monotonic()
            server.stop()  # cancels the blocked receive, then joins the serve thread
            stop_s = time.monotonic() - t0
            outbox.put(("ffn-closed", {"close_s": stop_s, "thread_s": stop_s, "thread_alive": server.alive}))
            return
        if server.group_ended.is_set():
            err = server.error or server.group_error
            outbox.put(("ffn", {"at": time.monotonic(), "batches": server.batches,
                                **(_error(err) if err else {"error": None})}))
            server.stop()
            return


# ------------------------------------------------------------------ the attention process
def _time_us(fn: Any, reps: int, device: torch.device) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def piecewise_sizes(conn: Any, opts: dict[str, Any], device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Per size: two layers, pieces captured in CUDA graphs (eager on CPU), the exchange between them."""
    from afd_patches.models import exchange_op
    from afd_patches.models.link import AfdLink

    hidden = opts["hidden"]
    link = AfdLink(2, hidden, dtype)
    link.connector = conn
    gen = torch.Generator().manual_seed(11)
    weight = (torch.randn(hidden, hidden, generator=gen) * hidden ** -0.5).to(device, dtype)

    def pre(h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(h @ weight.t(), (hidden,))

    def post(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return h + y

    results = []
    for tokens in opts["tokens"]:
        x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
        with torch.inference_mode():
            link.begin_step()
            h = x
            for layer in range(2):
                h = post(h, exchange_op.exchange(pre(h), link.op_id, layer))
            reference = h.clone()
            h_in, y_in = torch.zeros_like(x), torch.zeros_like(x)
            graphs = device.type == "cuda"
            if graphs:
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        pre(h_in), post(h_in, y_in)  # warm-up before capture, as torch documents
                torch.cuda.current_stream(device).wait_stream(side)
                g_pre, g_post = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                with torch.cuda.graph(g_pre):
                    a_out = pre(h_in)
                with torch.cuda.graph(g_post):
                    h_out = post(h_in, y_in)
            link.begin_step()
            h_in.copy_(x)
            t0 = time.perf_counter()
            for layer in range(2):
                if graphs:
                    g_pre.replay()
                else:
                    a_out = pre(h_in)
                y_in.copy_(exchange_op.exchange(a_out, link.op_id, layer))
                if graphs:
                    g_post.replay()
                else:
                    h_out = post(h_in, y_in)
                h_in.copy_(h_out)
            if graphs:
                torch.cuda.synchronize(device)
            step_us = (time.perf_counter() - t0) * 1e6
        results.append({"tokens": tokens, "hidden": hidden, "dtype": opts["dtype"], "cuda_graphs": graphs,
                        "bitwise_equal": bool(torch.equal(h_in, reference)), "step_us": step_us,
                        "exchanges": link.exchanges})
    return results


def attention_main(port: int, opts: dict[str, Any], inbox: Any, outbox: Any) -> None:
    """Exchange per ``opts["plan"]``: ``sizes`` (bitwise + timing), ``idle`` (one exchange after idling)."""
    device = setup("attention", opts)
    from afd_patches.connectors.base import ConnectorError
    from afd_patches.connectors.torch_dist import TorchDistConnector

    dtype = getattr(torch, opts["dtype"])
    conn = TorchDistConnector(make_config("attention", port, opts), identity=identity(opts))
    t0 = time.monotonic()
    try:
        conn.init()
    except ConnectorError as e:
        outbox.put(("attention", {"stage": "init", "elapsed": time.monotonic() - t0, **_error(e)}))
        return
    ref = Mlp(opts["hidden"], device, dtype)
    step = [0]

    def exchange(x: torch.Tensor) -> torch.Tensor:
        conn.send_attn_output(x, 0, step[0])
        y = conn.recv_ffn_output(0, step[0])
        step[0] += 1
        return y

    try:
        if opts["plan"] == "microbatch":
            import microbatch_step

            for res in microbatch_step.variants(conn, lambda x, layer: ref(x), opts, device, dtype):
                outbox.put(("microbatch", res))
                inbox.get(timeout=120)  # the driver reads the FFN's count meanwhile
            outbox.put(("attention-idle", {}))
            inbox.get(timeout=120)
        elif opts["plan"] == "piecewise":
            for res in piecewise_sizes(conn, opts, device, dtype):
                outbox.put(("piecewise", res))
            outbox.put(("attention-idle", {}))
            inbox.get(timeout=120)
        elif opts["plan"] == "sizes":
            gen = torch.Generator().manual_seed(7)
            for tokens in opts["tokens"]:
                x = torch.randn(tokens, opts["hidden"], generator=gen).to(device, dtype)
                y = exchange(x)
                with torch.inference_mode():
                    local = ref(x)
                rt = _time_us(lambda x=x: exchange(x), opts["reps"], device)
                with torch.inference_mode():
                    mlp = _time_us(lambda x=x: ref(x), opts["reps"], device)
                outbox.put(("size", {"tokens": tokens, "hidden": opts["hidden"], "dtype": opts["dtype"],
                                     "bitwise_equal": bool(torch.equal(y, local)),
                                     "exchange_us_p50": statistics.median(rt),
                                     "exchange_us_p90": sorted(rt)[int(0.9 * (len(rt) - 1))],
                                     "local_mlp_us_p50": statistics.median(mlp)}))
            outbox.put(("attention-idle", {}))
            inbox.get(timeout=120)  # the FFN closes meanwhile
        else:
            exchange(torch.ones(1, opts["hidden"], device=device, dtype=dtype))
            outbox.put(("attention-idle", {"at": time.monotonic()}))
            inbox.get(timeout=opts["idle_s"] + 120)  # idle until told
            y = exchange(torch.ones(1, opts["hidden"], device=device, dtype=dtype))
            outbox.put(("after-idle", {"ok": y.shape == (1, opts["hidden"]), "alive": True}))
            time.sleep(3600)  # idle until killed
    except ConnectorError as e:
        outbox.put(("attention", {"stage": "exchange", **_error(e)}))
        return
    except Exception as e:  # noqa: BLE001 - reported to the driver (a check that fails), not a silent exit
        outbox.put(("attention", {"stage": opts["plan"], **_error(e)}))
        return
    conn.close()


# ------------------------------------------------------------------ driver
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pair:
    """The two processes of one check and their mailboxes."""

    def __init__(self, opts: dict[str, Any]) -> None:
        port = _port()
        self.out = _CTX.Queue()
        self.to_ffn, self.to_attn = _CTX.Queue(), _CTX.Queue()
        self.ffn = _CTX.Process(target=ffn_main, args=(port, opts, self.to_ffn, self.out), daemon=True)
        self.attn = _CTX.Process(target=attention_main, args=(port, opts, self.to_attn, self.out), daemon=True)
        self.ffn.start()
        self.attn.start()
        self.got: dict[str, list[dict[str, Any]]] = {}

    def wait_for(self, name: str, timeout_s: float) -> dict[str, Any] | None:
        """The next message called ``name``, or None after ``timeout_s``."""
        got = self.wait_any([name], timeout_s)
        return got[1] if got else None

    def wait_any(self, names: list[str], timeout_s: float) -> tuple[str, dict[str, Any]] | None:
        """The next message called one of ``names`` (first of ``names`` that has one), or None."""
        deadline = time.monotonic() + timeout_s
        while True:
            for name in names:
                if self.got.get(name):
                    return name, self.got[name].pop(0)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                key, value = self.out.get(timeout=left)
            except queue.Empty:
                return None
            self.got.setdefault(key, []).append(value)

    def end(self) -> None:
        for p in (self.ffn, self.attn):
            if p.is_alive():
                p.kill()
            p.join(10)


RESULTS: list[bool] = []


def report(name: str, ok: bool, **fields: Any) -> None:
    RESULTS.append(ok)
    print("CHECK " + json.dumps({"check": name, "ok": ok, **fields}, default=str), flush=True)


def check_same_gpu(opts: dict[str, Any]) -> None:
    """One GPU, NCCL: the handshake refuses; then, forced past it, what NCCL says."""
    nccl = {**opts, "backend": "nccl", "devices": {"ffn": "cuda:0", "attention": "cuda:0"}, "plan": "sizes"}
    pair = Pair(nccl)
    res = pair.wait_for("attention", 90)
    ffn = pair.wait_for("ffn", 30)
    pair.end()
    ok = bool(res and "both use GPU" in res.get("message", "") and ffn and "both use GPU" in ffn.get("message", ""))
    report("same_gpu_refused", ok, attention=res, ffn=ffn)
    pair = Pair({**nccl, "force_distinct": True})
    first = pair.wait_any(["attention", "size"], 60)
    res = first[1] if first else None
    ffn = pair.wait_for("ffn", 10)
    exit_codes = {"ffn": pair.ffn.exitcode, "attention": pair.attn.exitcode}  # None: still running
    pair.end()
    message = (res or {}).get("message", "") + (ffn or {}).get("message", "")
    formed = bool(first and first[0] == "size")
    ok = formed or ("NCCL reported an error" in message)
    report("nccl_same_gpu_forced", ok, group_formed=formed, attention=res, ffn=ffn, exit_codes=exit_codes,
           note="NCCL accepted two ranks on one GPU" if formed else "NCCL refused; see the messages (or the "
                "exit codes, if NCCL's watchdog ended a process first)")


def report_per_size(pair: Pair, opts: dict[str, Any], message: str, check: str) -> bool:
    """One ``check`` line per token count from the attention side's ``message`` results (bitwise equal to
    the local MLP); False, after reporting both processes' state, when one does not come."""
    for tokens in opts["tokens"]:
        res = pair.wait_for(message, 240)
        if res is None:
            report(check, False, tokens=tokens, attention=pair.wait_for("attention", 1), ffn=pair.wait_for("ffn", 1))
            return False
        report(check, res["bitwise_equal"], **res)
    return True


def check_exchange(opts: dict[str, Any]) -> None:
    pair = Pair({**opts, "plan": "sizes"})
    try:
        if not report_per_size(pair, opts, "size", "exchange"):
            return
        idle = pair.wait_for("attention-idle", 30)
        time.sleep(1.0)  # the serve thread is now blocked waiting for the idle attention rank
        pair.to_ffn.put("close")
        closed = pair.wait_for("ffn-closed", 60)
        bound = 2.0 + SLACK_S
        ok = bool(idle is not None and closed and not closed["thread_alive"] and closed["close_s"] < bound
                  and closed["thread_s"] < bound)
        report("close_while_blocked", ok, bound_s=bound, **(closed or {}))
        pair.to_attn.put("done")
    finally:
        pair.end()


def check_piecewise(opts: dict[str, Any]) -> None:
    pair = Pair({**opts, "plan": "piecewise"})
    try:
        if not report_per_size(pair, opts, "piecewise", "piecewise"):
            return
        pair.wait_for("attention-idle", 30)
        pair.to_attn.put("done")
    finally:
        pair.end()


def ffn_count(pair: Pair, at_least: int) -> int | None:
    """Messages the FFN's serve loop served so far; asked again for up to a second while below ``at_least`` (it
    counts a message after sending its answer, so the last answer can arrive before the count moves)."""
    count = None
    for _ in range(6):
        pair.to_ffn.put("count")
        got = pair.wait_for("ffn-count", 30)
        count = got["batches"] if got else None
        if count is None or count >= at_least:
            return count
        time.sleep(0.2)
    return count


def check_microbatch(opts: dict[str, Any]) -> None:
    pair = Pair({**opts, "plan": "microbatch"})
    try:
        served = 0
        for n, streams in opts["variants"]:
            got = pair.wait_any(["microbatch", "attention"], 240)
            if got is None or got[0] != "microbatch":
                report("microbatch", False, micro_batches=n, cuda_streams=streams,
                       attention=got[1] if got else None, ffn=pair.wait_for("ffn", 1))
                return
            res = got[1]
            expected = res["steps"] * res["exchanges_per_step"]
            count = ffn_count(pair, served + expected)
            exchanges = None if count is None else count - served
            served = count or served
            # a difference the kernels make on fewer rows, without AFD, is theirs: then equal to the same split
            equal = res["bitwise_equal_unsplit"] or (res["bitwise_equal_local_same_split"]
                                                     and not res["kernels_row_independent"])
            ok = bool(equal and res["timed_steps_equal"] and exchanges == expected and res["contexts_ok"]
                      and res["schedule_ok"] and res["overlaps"] == 0 and res["threads_distinct"])
            per_step = None if exchanges is None else exchanges / res["steps"]
            report("microbatch", ok, ffn_exchanges_per_step=per_step,
                   nccl_micro_batches_forced=bool(opts.get("force_micro_batches_on_nccl")), **res)
            pair.to_attn.put("next")
        pair.wait_for("attention-idle", 30)
        pair.to_attn.put("done")
    finally:
        pair.end()


def check_idle(opts: dict[str, Any]) -> None:
    pair = Pair({**opts, "plan": "idle"})
    try:
        first = pair.wait_for("attention-idle", 120)
        if first is None:
            report("idle_no_watchdog_abort", False, attention=pair.wait_for("attention", 1),
                   ffn=pair.wait_for("ffn", 1))
            return
        time.sleep(opts["idle_s"])
        ffn_alive = pair.ffn.is_alive()
        pair.to_attn.put("go")
        after = pair.wait_for("after-idle", 60)
        report("idle_no_watchdog_abort", bool(ffn_alive and after and after["ok"]), idle_s=opts["idle_s"],
               timeout_s=opts["timeout_s"], ffn_alive=ffn_alive, after=after or pair.wait_for("attention", 1))
        time.sleep(1.0)
        t0 = time.monotonic()
        os.kill(pair.attn.pid, signal.SIGKILL)
        res = pair.wait_for("ffn", opts["timeout_s"] + 3 * SLACK_S)
        elapsed = (res["at"] - t0) if res else None
        ok = bool(res and "lost attention rank 0" in res.get("message", "") and elapsed is not None
                  and elapsed < opts["timeout_s"] + SLACK_S)
        report("dead_peer_noticed_while_idle", ok, elapsed_s=elapsed, timeout_s=opts["timeout_s"], ffn=res)
    finally:
        pair.end()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["exchange", "idle", "piecewise", "microbatch"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", choices=["nccl", "gloo"])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", default="1,7,256,4096")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--idle-s", type=float, default=60.0)
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--requests", default="97,1,64,5,130,1,33,181",
                        help="microbatch: new tokens per request of the step")
    parser.add_argument("--inline-bytes", type=int,
                        help="gloo: the connector's inline_bytes (default: the connector's, 64 KiB)")
    args = parser.parse_args()
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    backend = args.backend or ("nccl" if gpus >= 2 else "gloo")
    if args.device == "cpu":
        devices = {"ffn": "cpu", "attention": "cpu"}
    else:
        devices = {"ffn": "cuda:0", "attention": "cuda:1" if gpus >= 2 else "cuda:0"}
    opts = {"backend": backend, "devices": devices, "hidden": args.hidden, "dtype": args.dtype,
            "tokens": [int(t) for t in args.tokens.split(",")], "reps": args.reps, "idle_s": args.idle_s,
            "timeout_s": args.timeout_s, "inline_bytes": args.inline_bytes}
    if args.what == "microbatch":
        from microbatch_step import LAYERS

        requests = [int(r) for r in args.requests.split(",")]
        variants = [[1, False], [2, False], [3, False]] + ([[2, True], [3, True]] if args.device == "cuda" else [])
        opts.update(requests=requests, tokens=[sum(requests)], layers=LAYERS, variants=variants,
                    micro_batches=max(n for n, _ in variants), force_micro_batches_on_nccl=backend == "nccl")
    print("GPU_CHECK " + json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": gpus,
                                     "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None,
                                     **opts}), flush=True)
    started = time.monotonic()
    if args.what == "exchange":
        if gpus == 1:
            check_same_gpu(opts)
        check_exchange(opts)
    elif args.what == "piecewise":
        check_piecewise(opts)
    elif args.what == "microbatch":
        check_microbatch(opts)
    else:
        check_idle(opts)
    verdict = "PASS" if RESULTS and all(RESULTS) else "FAIL"
    print(f"GPU_CHECK {verdict} ({sum(RESULTS)}/{len(RESULTS)} checks, {time.monotonic() - started:.0f}s)", flush=True)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
