"""Admission under a crowd (issue 37): how long a real attention rank takes to join FFN rank 0, alone and
while 240 loopback addresses connect at full rate.

Both measurements use ``backend: tcp`` with a token (``handshake_time.TOKEN``), FFN rank 0 on 127.0.0.2 in a
process of its own (a fresh port each time), and a fresh attention process that times its own
``TorchDistConnector.init()`` once FFN rank 0 listens (``wait_listening``'s probe is one refused stranger).

- formation: ``--reps`` groups per round, nobody else connecting; median per round.
- crowd: one group per round; ``harness.crowd.flood`` from four threads of this process over
  ``harness.crowd.CROWD`` (127.0.1.1–127.0.1.240) starts ``--warm-s`` before the attention process and
  goes on until it reported (at most its ``--join-timeout-s`` plus 5 s). Printed per round: the join time,
  the connection attempts, the refusals the FFN logged (``afd_probe.refusals``) and its log lines.

``--baseline DIR`` runs every measurement of a round with ``afd_patches`` from DIR (another checkout, e.g.
``git worktree add /tmp/afd-base <commit>``) first, then with this checkout, so both come from the same run.

    .venv/bin/python -m benchmarks.link_crowd [--rounds 3] [--reps 10] [--baseline DIR]

Ranks run in forkserver children that preload only ``torch`` and import ``afd_patches`` after
``connector_latency._use``; this module imports ``afd_patches`` (through ``tests.support.afd_probe``) only in
the parent's functions. Loopback only; every wait is bounded. The flood and the three processes share the
host's cores, so the load average is printed with every round.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import queue as queue_mod
import statistics
import threading
import time
from typing import Any

from benchmarks import record
from benchmarks.connector_latency import _use
from benchmarks.handshake_time import TOKEN
from harness.crowd import CROWD, flood
from harness.env import free_port

FFN_HOST = "127.0.0.2"
FLOOD_THREADS = 4
MAX_LOG_LINES = 500_000  # the FFN ships at most this many log lines (and counts all of them)

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch"])


def _config(role: str, port: int, timeout_s: float) -> Any:
    from afd_patches.config import parse  # what every checkout has (a baseline's config may be shaped otherwise)

    return parse({"role": role, "host": FFN_HOST, "port": port, "timeout_s": timeout_s,
                  "connector_extra_config": {"backend": "tcp"}})


class _Lines(logging.Handler):
    """Keeps the first ``MAX_LOG_LINES`` messages of the AFD logger (``afd_patches.LOGGER``) and counts all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if len(self.lines) < MAX_LOG_LINES:
            self.lines.append(record.getMessage())


def _ffn(src: str | None, port: int, out: Any) -> None:
    """FFN rank 0 with ``afd_patches`` from ``src``: reports its session protocol, forms one group and
    serves it until the attention side closes; then its error (``ConnectorClosed`` at a clean end) and log."""
    _use(src)
    os.environ["AFD_TOKEN"] = TOKEN
    import torch

    from afd_patches import LOGGER
    from afd_patches.connectors import handshake
    from afd_patches.connectors.base import ConnectorError
    from afd_patches.connectors.torch_dist import TorchDistConnector

    torch.set_num_threads(1)
    handler = _Lines()
    logging.getLogger(LOGGER).addHandler(handler)  # also keeps logging's last resort off stderr
    out.put(("protocol", handshake.PROTOCOL))
    conn = TorchDistConnector(_config("ffn", port, 60.0))
    error = None
    try:
        conn.init()
        while True:
            meta, xs = conn.recv_attn_output()
            conn.send_ffn_output(xs, meta)
    except ConnectorError as e:
        error = type(e).__name__
    finally:
        conn.close()
    out.put(("ffn", {"error": error, "log": handler.lines, "log_lines": handler.count}))


def _attention(src: str | None, port: int, timeout_s: float, out: Any) -> None:
    """An attention rank with ``afd_patches`` from ``src``: the seconds its ``init()`` took, or its error."""
    _use(src)
    os.environ["AFD_TOKEN"] = TOKEN
    import torch

    from afd_patches.connectors.base import ConnectorError
    from afd_patches.connectors.torch_dist import TorchDistConnector

    torch.set_num_threads(1)
    conn = TorchDistConnector(_config("attention", port, timeout_s))
    t0 = time.perf_counter()
    try:
        conn.init()
        result: dict[str, Any] = {"error": None}
    except ConnectorError as e:
        result = {"error": f"{type(e).__name__}: {e}"}
    result["elapsed"] = time.perf_counter() - t0
    conn.close()
    out.put(("attention", result))


def _get(out: Any, got: dict[str, Any], name: str, deadline: float) -> Any:
    """Message ``name`` from ``out`` (or kept in ``got`` from an earlier call) before ``deadline``
    (``time.monotonic()``); ``None`` if it did not come. Other messages are kept in ``got``."""
    while name not in got and (left := deadline - time.monotonic()) > 0:
        try:
            key, value = out.get(timeout=left)
        except queue_mod.Empty:
            break
        got[key] = value
    return got.pop(name, None)


def _reap(procs: list[mp.process.BaseProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
        if p.is_alive():
            p.kill()
            p.join(5)


def join_once(src: str | None, timeout_s: float, crowd: argparse.Namespace | None = None) -> dict[str, Any]:
    """One group with ``afd_patches`` from ``src`` (None: this checkout): ``elapsed`` (the attention's
    ``init()``, seconds) and ``error``; with ``crowd`` (``warm_s``) also ``made`` (the crowd's connection
    attempts), ``flood_s``, ``refused`` (refusals in the FFN's log) and ``log_lines`` (-1: the FFN did not
    report within 10 s of the attention rank, e.g. after a failed join)."""
    from tests.support import afd_probe

    port, out = free_port(), _CTX.Queue()
    ffn = _CTX.Process(target=_ffn, args=(src, port, out), daemon=True)
    ffn.start()
    procs = [ffn]
    stop, made, threads, got = threading.Event(), [], [], {}
    try:
        protocol = _get(out, got, "protocol", time.monotonic() + 60)
        if protocol is None:
            raise RuntimeError(f"FFN rank 0 did not start (exit code {ffn.exitcode})")
        afd_probe.wait_listening(FFN_HOST, port, 30, lambda: None if ffn.is_alive() else f"exit {ffn.exitcode}")
        t_flood = time.monotonic()
        if crowd is not None:
            until = t_flood + crowd.warm_s + timeout_s + 5
            threads = [threading.Thread(target=flood, args=(FFN_HOST, port, CROWD[i::FLOOD_THREADS], until, made,
                                                            protocol, stop), daemon=True)
                       for i in range(FLOOD_THREADS)]
            for t in threads:
                t.start()
            time.sleep(crowd.warm_s)  # the crowd is at full rate
        attn = _CTX.Process(target=_attention, args=(src, port, timeout_s, out), daemon=True)
        attn.start()
        procs.append(attn)
        result = _get(out, got, "attention", time.monotonic() + timeout_s + 30)
        if result is None:
            raise RuntimeError(f"the attention rank reported nothing (exit code {attn.exitcode})")
        stop.set()
        for t in threads:
            t.join(5)
        result["flood_s"] = time.monotonic() - t_flood
        ffn_result = _get(out, got, "ffn", time.monotonic() + 10) or {"log": [], "log_lines": -1}
    finally:
        stop.set()
        _reap(procs, 10)
    if crowd is not None:
        result |= {"made": sum(made), "log_lines": ffn_result["log_lines"],
                   "refused": sum(afd_probe.refusals(ffn_result["log"]).values())}
    return result


def _load() -> str:
    return f"load average {os.getloadavg()[0]:.1f}"


def main() -> None:
    parser = record.parser(__doc__, rounds=3, baseline="a checkout whose afd_patches to compare against")
    parser.add_argument("--reps", type=int, default=10, help="groups formed per round and tree, nobody else there")
    parser.add_argument("--warm-s", type=float, default=2.0, help="the crowd runs this long before the rank starts")
    parser.add_argument("--join-timeout-s", type=float, default=20.0, help="the attention rank's timeout_s")
    args = parser.parse_args()
    trees = [("baseline", args.baseline), ("current", None)] if args.baseline else [("current", None)]
    formation: dict[str, list[float]] = {name: [] for name, _ in trees}
    crowd: dict[str, list[float]] = {name: [] for name, _ in trees}
    for r in range(args.rounds):
        for name, src in trees:
            ms = []
            for _ in range(args.reps):
                res = join_once(src, 10.0)
                if res["error"]:
                    raise RuntimeError(f"{name}: formation failed: {res['error']}")
                ms.append(res["elapsed"] * 1e3)
            formation[name].append(statistics.median(ms))
            print(f"round {r + 1} {name} formation: median {statistics.median(ms):.1f} ms, min {min(ms):.1f} ms, "
                  f"max {max(ms):.1f} ms ({args.reps} groups, {_load()})", flush=True)
        for name, src in trees:
            res = join_once(src, args.join_timeout_s, args)
            joined = "joined" if res["error"] is None else f"did not join ({res['error'][:120]})"
            crowd[name].append(res["elapsed"] if res["error"] is None else float("inf"))
            print(f"round {r + 1} {name} crowd: {joined} after {res['elapsed']:.2f} s; {res['made']} connection "
                  f"attempts from {len(CROWD)} addresses in {res['flood_s']:.1f} s "
                  f"({res['made'] / res['flood_s']:.0f}/s), {res['refused']} refusals in {res['log_lines']} FFN log "
                  f"lines ({_load()})", flush=True)
    print("1A1F tcp group on 127.0.0.2 with a token, median of round medians: formation " +
          ", ".join(f"{name} {statistics.median(m):.1f} ms" for name, m in formation.items()))
    print(f"join under a {len(CROWD)}-address crowd, median over rounds (inf: no join): " +
          ", ".join(f"{name} {statistics.median(m):.2f} s" for name, m in crowd.items()))


if __name__ == "__main__":
    main()
