"""Per-layer exchange latency of the ``torch_dist`` connector: 1 attention + 1 FFN rank, loopback.

One exchange is what a decoder layer costs on the attention side:
``send_attn_output`` + ``recv_ffn_output`` while the FFN rank echoes the tensor
back (``recv_attn_output`` + ``send_ffn_output``, no compute). Prints the median
and p99 in microseconds over ``--iters`` exchanges after ``--warmup``.

    .venv/bin/python -m benchmarks.connector_latency [--iters 2000] [--tokens 8] [--hidden 64] [--inline-bytes N]
        [--baseline DIR [--rounds 3]]

``--inline-bytes -1`` selects ``backend: tcp`` (the CPU default), anything else gloo with that inline size.

``--baseline DIR``: DIR holds another version of ``afd_patches`` (e.g. from
``git worktree add /tmp/afd-main main``); each round then measures the baseline
and this checkout one after the other, in the same run, and the medians of
both are printed per round and overall.

Runs two local processes on a free loopback port; nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

from benchmarks import record
from harness.env import free_port


def _use(src: str | None) -> None:
    """Import ``afd_patches`` from ``src`` (a baseline checkout) instead of this one."""
    if src:
        sys.path.insert(0, src)


def _config(role: str, port: int, inline_bytes: int) -> Any:
    """``inline_bytes < 0`` selects ``backend: tcp`` (which has no inline payloads), else gloo."""
    from afd_patches.config import parse  # what every checkout has (a baseline's config may be shaped otherwise)

    extra = {"backend": "tcp"} if inline_bytes < 0 else {"backend": "gloo", "inline_bytes": inline_bytes}
    return parse({"role": role, "host": "127.0.0.1", "port": port, "timeout_s": 30.0, "connector_extra_config": extra})


def _ffn(port: int, inline_bytes: int, src: str | None) -> None:
    _use(src)
    import torch

    from afd_patches.connectors.base import ConnectorClosed
    from afd_patches.connectors.torch_dist import TorchDistConnector

    torch.set_num_threads(1)
    conn = TorchDistConnector(_config("ffn", port, inline_bytes))
    conn.init()
    try:
        while True:
            meta, xs = conn.recv_attn_output()
            conn.send_ffn_output(xs, meta)
    except ConnectorClosed:
        pass
    finally:
        conn.close()


def _attention(port: int, inline_bytes: int, iters: int, warmup: int, tokens: int, hidden: int, out: Any,
               src: str | None) -> None:
    _use(src)
    import torch

    from afd_patches.connectors.torch_dist import TorchDistConnector

    torch.set_num_threads(1)
    conn = TorchDistConnector(_config("attention", port, inline_bytes))
    conn.init()
    x = torch.randn(tokens, hidden)
    samples: list[float] = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        conn.send_attn_output(x, i % 32, i // 32)
        y = conn.recv_ffn_output(i % 32, i // 32)
        dt = time.perf_counter() - t0
        if i >= warmup:
            samples.append(dt)
    ok = torch.equal(x, y)
    conn.close()
    out.put((samples, ok))


def measure(args: argparse.Namespace, src: str | None) -> tuple[list[float], bool]:
    """One 1A1F run of ``args.iters`` exchanges with ``afd_patches`` from ``src`` (None: this checkout)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    out = ctx.Queue()
    ffn = ctx.Process(target=_ffn, args=(port, args.inline_bytes, src), daemon=True)
    attn = ctx.Process(
        target=_attention,
        args=(port, args.inline_bytes, args.iters, args.warmup, args.tokens, args.hidden, out, src),
    )
    ffn.start()
    attn.start()
    samples, ok = out.get(timeout=600)
    attn.join(30)
    ffn.join(30)
    for p in (attn, ffn):
        if p.is_alive():
            p.kill()
    return sorted(s * 1e6 for s in samples), ok


def _summary(us: list[float]) -> str:
    p99 = us[min(len(us) - 1, round(0.99 * (len(us) - 1)))]
    return f"median {statistics.median(us):.1f} us, p99 {p99:.1f} us, min {us[0]:.1f} us, max {us[-1]:.1f} us"


def bookkeeping_us(reps: int = 200_000) -> float:
    """In-process cost (microseconds) of what this checkout adds to one attention-side exchange:
    the header check before the receive, the metrics updates and the two clock reads."""
    import timeit

    from afd_patches.connectors import wire
    from afd_patches.metrics import METRICS

    limits = wire.Limits(num_layers=32, hidden_size=64, dtype="float32", max_tokens=256)
    header = wire.Header(wire.KIND_DATA, 0, 0, 0, (8, 64), "float32", False)

    def one() -> None:
        t0 = time.perf_counter()
        limits.check(header)
        METRICS.add("bytes_sent", 2048)
        METRICS.add("exchanges")
        METRICS.add("bytes_received", 2048)
        METRICS.observe(time.perf_counter() - t0)

    return min(timeit.repeat(one, number=reps, repeat=3)) / reps * 1e6


def compare_backends(args: argparse.Namespace) -> None:
    """``--rounds`` rounds, each measuring every backend of ``--backends`` in turn (same run, same load)."""
    names = args.backends.split(",")
    medians: dict[str, list[float]] = {n: [] for n in names}
    inline = args.inline_bytes
    for r in range(args.rounds):
        for name in names:
            args.inline_bytes = -1 if name == "tcp" else inline
            us, ok = measure(args, None)
            medians[name].append(statistics.median(us))
            print(f"round {r + 1} {name}: {_summary(us)}, echo exact: {ok}, load average {os.getloadavg()[0]:.1f}",
                  flush=True)
    print(f"1A1F loopback, {args.tokens}x{args.hidden} float32, {args.iters} exchanges: median of round medians "
          + ", ".join(f"{n} {statistics.median(m):.1f} us" for n, m in medians.items()))


def main() -> None:
    parser = record.parser(__doc__, iters=2000, warmup=200, tokens=8, hidden=64,
                           baseline="a checkout whose afd_patches to compare against")
    parser.add_argument(
        "--inline-bytes", type=int, default=64 * 1024, help="payloads up to this size ride in the header message"
    )
    parser.add_argument("--backends", default=None,
                        help="gloo,tcp: both backends of this checkout, interleaved per round (no --baseline)")
    parser.add_argument("--rounds", type=int, default=3, help="baseline/current pairs with --baseline")
    args = parser.parse_args()
    backend = "tcp" if args.inline_bytes < 0 else f"gloo, inline_bytes={args.inline_bytes}"
    what = (f"torch_dist/{backend} 1A1F loopback, {args.tokens}x{args.hidden} float32, "
            f"{args.iters} exchanges (send_attn_output+recv_ffn_output, FFN echo)")
    print(f"bookkeeping added per exchange (header check, metrics, clock reads): {bookkeeping_us():.2f} us",
          flush=True)
    if args.backends:
        compare_backends(args)
        return
    if not args.baseline:
        us, ok = measure(args, None)
        print(f"{what}: {_summary(us)}, echo exact: {ok}")
        return
    medians: dict[str, list[float]] = {"baseline": [], "current": []}
    for r in range(args.rounds):
        for name, src in (("baseline", args.baseline), ("current", None)):
            us, ok = measure(args, src)
            medians[name].append(statistics.median(us))
            print(f"round {r + 1} {name}: {_summary(us)}, echo exact: {ok}", flush=True)
    base, cur = statistics.median(medians["baseline"]), statistics.median(medians["current"])
    print(f"{what}: median of round medians: baseline {base:.1f} us, current {cur:.1f} us "
          f"({(cur - base) / base * 100:+.1f} %)")


if __name__ == "__main__":
    main()
