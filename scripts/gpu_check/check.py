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

Files
    check.py (this: the command line), checks.py (the checks and their verdicts), processes.py (the FFN and
    attention processes and the driver's ``Pair``), piecewise.py (the CUDA-graph experiment's attention side),
    microbatch_step.py (the ``microbatch`` call's attention side).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's afd_patches
sys.path.insert(0, str(Path(__file__).resolve().parent))  # processes, piecewise, checks, microbatch_step

import torch
from checks import RESULTS, check_exchange, check_idle, check_microbatch, check_piecewise, check_same_gpu


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
