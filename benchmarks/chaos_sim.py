"""The chaos benchmark at scale, by simulation: the ``torch_dist`` connector alone, 16 attention ranks on 2 FFN ranks.

No vLLM engines: every rank is a process (``fork`` from this one, one torch thread each) on 127.0.0.1 with
``backend: tcp``, ``schedule: batched``, ``timeout_s`` ``--timeout-s``. An attention rank sends ``--layers`` hidden
states of a real layer's shape (``--tokens`` x ``--hidden``, float32; 4 x 4096 = 64 KiB) per step and waits for
each answer (the FFN ranks compute ``2x + 1``; every answer is checked), ``--pause-s`` between steps so that
18 processes fit on 2 cores. Runs:

``1A1F``      the reference: one attention rank, one FFN rank, the same messages.
``16A2F``     no fault.
``kill``      16A2F, attention rank 5 SIGKILLed 2 s into the run.
``freeze``    16A2F, attention rank 9 SIGSTOPped 2 s into the run for 3 x ``timeout_s``, then SIGCONTed.

Per run: formation (the slowest rank's ``init``), the median exchange (send to answer) over the ranks that were not
hit, its ratio to 1A1F's, the longest wait of any of those ranks (goal: at most 2 x ``timeout_s``), and what was
lost: exchanges of ranks not hit that failed or answered wrong (goal 0). Nothing leaves the machine.

    python -m benchmarks.chaos_sim [--run-s 10] [--timeout-s 2] [--record]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import statistics
import time
from typing import Any

from benchmarks import record
from harness.env import free_port

HIT = {"kill": 5, "freeze": 9}


def _config(role: str, rank: int, a: int, f: int, port: int, timeout_s: float) -> Any:
    from afd_patches.config import AfdConfig

    return AfdConfig(role=role, host="127.0.0.1", port=port, rank=rank, num_attention_ranks=a, num_ffn_ranks=f,
                     timeout_s=timeout_s, connector_extra_config={"backend": "tcp", "schedule": "batched"})


def _ffn(cfg: Any, done: Any) -> None:
    import torch

    from afd_patches.connectors.base import ConnectorError
    from afd_patches.connectors.torch_dist import TorchDistConnector

    torch.set_num_threads(1)
    conn = TorchDistConnector(cfg)
    try:
        conn.init(120.0)
        while not done.is_set():
            meta, inputs = conn.recv_attn_output()
            conn.send_ffn_output([x * 2 + 1 for x in inputs], meta)
    except ConnectorError:
        pass
    finally:
        conn.close()


def _attention(cfg: Any, shape: tuple[int, int], layers: int, pause_s: float, go: Any, run_s: float,
               out: Any) -> None:
    import torch

    from afd_patches.connectors.base import ConnectorError
    from afd_patches.connectors.torch_dist import TorchDistConnector

    torch.set_num_threads(1)
    conn = TorchDistConnector(cfg)
    r: dict[str, Any] = {"rank": cfg.rank, "waits": [], "wrong": 0, "error": None, "init_s": 0.0}
    try:
        t0 = time.monotonic()
        conn.init(120.0)
        r["init_s"] = time.monotonic() - t0
        go.wait(120)
        end, step = time.monotonic() + run_s, 0
        while time.monotonic() < end:
            for layer in range(layers):
                x = torch.full(shape, float(cfg.rank * 1000 + step % 100 + layer))
                t = time.monotonic()
                conn.send_attn_output(x, layer, step)
                y = conn.recv_ffn_output(layer, step)
                r["waits"].append(time.monotonic() - t)
                r["wrong"] += int(not torch.equal(y, x * 2 + 1))
            step += 1
            time.sleep(pause_s)
    except ConnectorError as e:
        r["error"] = f"{type(e).__name__}: {e}"[:200]
    conn.close()
    out.put(r)


def run(name: str, a: int, f: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run (see the module docstring); its figures."""
    ctx = mp.get_context("fork")
    port, done, go, out = free_port(), ctx.Event(), ctx.Event(), ctx.Queue()
    shape = (args.tokens, args.hidden)
    ffns = [ctx.Process(target=_ffn, args=(_config("ffn", r, a, f, port, args.timeout_s), done), daemon=True)
            for r in range(f)]
    attns = [ctx.Process(target=_attention, args=(_config("attention", r, a, f, port, args.timeout_s), shape,
                                                  args.layers, args.pause_s, go, args.run_s, out), daemon=True)
             for r in range(a)]
    results: dict[int, dict[str, Any]] = {}
    try:
        for p in [*ffns, *attns]:
            p.start()
        time.sleep(1.0)
        go.set()
        hit = HIT.get(name)
        time.sleep(2.0)
        if name == "kill" and hit is not None:
            os.kill(attns[hit].pid, signal.SIGKILL)
        elif name == "freeze" and hit is not None:
            os.kill(attns[hit].pid, signal.SIGSTOP)
            time.sleep(3 * args.timeout_s)
            os.kill(attns[hit].pid, signal.SIGCONT)
        deadline = time.monotonic() + args.run_s + 180
        expected = a - (1 if name == "kill" else 0)
        while len(results) < expected and time.monotonic() < deadline:
            try:
                r = out.get(timeout=5)
                results[r["rank"]] = r
            except Exception:  # noqa: BLE001 -- queue.Empty: wait on
                continue
    finally:
        done.set()
        for p in [*attns, *ffns]:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    spared = [r for rank, r in results.items() if rank != HIT.get(name)]
    waits = [w for r in spared for w in r["waits"]]
    return {"run": name, "formation_s": max((r["init_s"] for r in results.values()), default=float("nan")),
            "median_ms": 1e3 * statistics.median(waits) if waits else float("nan"),
            "longest_s": max(waits, default=float("nan")), "exchanges": len(waits),
            "lost": sum(r["wrong"] + (1 if r["error"] else 0) for r in spared) + (a - len(results) - (name == "kill")),
            "errors": sorted({r["error"] for r in spared if r["error"]})[:2],
            "hit": results.get(HIT.get(name, -1), {}).get("error")}


def main() -> None:
    parser = record.parser(__doc__, recorded=True, tokens=4, hidden=4096, layers=2)
    parser.add_argument("--run-s", type=float, default=10.0)
    parser.add_argument("--timeout-s", type=float, default=2.0)
    parser.add_argument("--pause-s", type=float, default=0.05)
    args = parser.parse_args()
    import torch  # once, before forking

    torch.set_num_threads(1)
    rows = [run("1A1F", 1, 1, args), *(run(name, 16, 2, args) for name in ("16A2F", "kill", "freeze"))]
    base = rows[0]["median_ms"]
    print(f"connector alone, tcp, batched, {args.tokens}x{args.hidden} float32 x {args.layers} layers per step, "
          f"timeout_s {args.timeout_s:g}; goals: longest <= {2 * args.timeout_s:g}s, lost 0")
    print(f"{'run':8s}{'formation':>11s}{'median':>10s}{'vs 1A1F':>9s}{'longest':>9s}{'exchanges':>11s}{'lost':>6s}")
    for r in rows:
        print(f"{r['run']:8s}{r['formation_s']:10.2f}s{r['median_ms']:8.2f}ms{r['median_ms'] / base:8.1f}x"
              f"{r['longest_s']:8.2f}s{r['exchanges']:11d}{r['lost']:6d}"
              + (f"  errors: {r['errors']}" if r["errors"] else "") + (f"  hit rank: {r['hit']}" if r["hit"] else ""))
    if args.record:
        record.write("chaos_sim", [fig for r in rows for fig in (
            record.Figure(f"{r['run']}_formation_s", f"{r['run']}: formation, slowest rank", r["formation_s"], "s"),
            record.Figure(f"{r['run']}_exchange_ms", f"{r['run']}: median exchange of the ranks not hit",
                          r["median_ms"], "ms", 2, f"{r['median_ms'] / base:.1f}x 1A1F"),
            record.Figure(f"{r['run']}_lost", f"{r['run']}: exchanges of the ranks not hit lost or wrong", r["lost"],
                          "exchanges", 0, f"longest wait {r['longest_s']:.2f}s"))])


if __name__ == "__main__":
    main()
