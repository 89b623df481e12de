"""An AFD group through transient faults: how long until it serves again, and what a frozen rank costs its sibling.

Two scenarios, on loopback with real ``torch_dist`` connectors (``backend: tcp``, ``timeout_s`` 2), no vLLM engines
(the FFN computes ``2x + 1``; every answer is checked):

``dns``
    1A1F. The attention side is the worker's own group object (``AttentionGroup``; on an older checkout its
    ``GroupKeeper``) and reaches the FFN by a host *name*, which this process's resolver (``socket.getaddrinfo``,
    replaced for that one name only) maps to 127.0.0.1. The FFN stops; from that moment the name does not resolve
    for ``--outage-s`` (2 s); the FFN is back 1 s after it stopped (during the outage), on the same port. Figure:
    seconds from the FFN being back to the first exact exchange (goal: at most 2 x ``timeout_s``); "never" when
    none came within 30 s.
``frozen``
    2A1F, ``batched`` and ``pingpong``, three processes. Attention rank 1's process is SIGSTOPped for 3 x
    ``timeout_s`` while both ranks step. Figure: rank 0's longest wait for an answer (goal: at most 2 x
    ``timeout_s``) and whether its group lived on.

``--baseline DIR`` runs the same scenarios in processes that import ``afd_patches`` from DIR (another checkout,
e.g. ``git worktree add /tmp/afd-before <commit>``), so before and after are measured in one run.

    .venv/bin/python -m benchmarks.group_faults [--baseline DIR] [--record]

Nothing leaves the machine.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

TIMEOUT_S = 2.0
NAME = "afd-ffn.benchmark.internal"  # resolved by this process's stand-in resolver only
NEVER_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ffn(x: Any) -> Any:
    return x * 2 + 1


def _serve(cfg: Any, stop: threading.Event, formed: threading.Event | None = None) -> None:
    """An FFN rank through the connector API alone (the same on every checkout): one group, served until it ends or
    ``stop``; the connector is closed on ``stop``."""
    from afd_patches.connectors.base import ConnectorError
    from afd_patches.connectors.torch_dist import TorchDistConnector

    conn = TorchDistConnector(cfg)
    watcher = threading.Thread(target=lambda: (stop.wait(), conn.close()), daemon=True)
    watcher.start()
    try:
        conn.init(60.0)
        if formed is not None:
            formed.set()
        while not stop.is_set():
            meta, inputs = conn.recv_attn_output()
            conn.send_ffn_output([_ffn(x) for x in inputs], meta)
    except ConnectorError:
        pass
    finally:
        conn.close()


def _exchange(conn: Any, step: int, rank: int = 0) -> float:
    """One step of two layers; the longest wait for an answer. ``AssertionError`` on a wrong answer."""
    import torch

    longest = 0.0
    for layer in range(2):
        x = torch.full((3, 8), float(rank * 1000 + step * 10 + layer))
        t0 = time.monotonic()
        conn.send_attn_output(x, layer, step)
        y = conn.recv_ffn_output(layer, step)
        longest = max(longest, time.monotonic() - t0)
        assert torch.equal(y, _ffn(x)), (layer, step)
    return longest


# ------------------------------------------------------------------ dns
def _resolver(outage: threading.Event) -> None:
    """``socket.getaddrinfo`` answers ``NAME`` with 127.0.0.1, or fails as a missing DNS entry does while
    ``outage`` is set; every other name as before."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == NAME:
            if outage.is_set():
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo  # type: ignore[assignment]


def _attention_group(cfg: Any, link: Any) -> Any:
    """The attention worker's group object of the checkout imported: formed and bound to ``link``."""
    from afd_patches.workers import regroup
    from afd_patches.workers.connection import build_connector

    build = lambda: build_connector(cfg, None)  # noqa: E731
    if hasattr(regroup, "AttentionGroup"):
        group = regroup.AttentionGroup(0, f"{cfg.host}:{cfg.port}", build, link, 60.0, cfg.timeout_s, tick=False)
        group.start()
        return group
    conn = build()
    conn.init()
    return regroup.GroupKeeper(cfg, build, link, conn, 60.0)


def dns(outage_s: float) -> dict[str, Any]:
    """The ``dns`` scenario in this process (see the module docstring)."""
    from afd_patches.config import AfdConfig
    from afd_patches.connectors.base import ConnectorError
    from afd_patches.models.link import AfdLink

    outage = threading.Event()
    _resolver(outage)
    port = _free_port()
    extra = {"connector_extra_config": {"backend": "tcp"}}
    ffn_cfg = AfdConfig(role="ffn", host="127.0.0.1", port=port, timeout_s=TIMEOUT_S, **extra)
    attn_cfg = AfdConfig(role="attention", host=NAME, port=port, timeout_s=TIMEOUT_S, **extra)
    stop = threading.Event()
    ffn = threading.Thread(target=_serve, args=(ffn_cfg, stop), daemon=True)
    ffn.start()
    link = AfdLink(2, 8)
    group = _attention_group(attn_cfg, link)
    _exchange(link.connector, 0)
    stop.set()  # the FFN goes away ...
    ffn.join(10)
    outage.set()  # ... and its name stops resolving
    stopped = time.monotonic()
    try:
        _exchange(link.connector, 1)
    except ConnectorError as e:
        group.lost(e)
    time.sleep(max(0.0, stopped + 1.0 - time.monotonic()))
    stop2 = threading.Event()
    ffn2 = threading.Thread(target=_serve, args=(ffn_cfg, stop2), daemon=True)
    ffn2.start()  # back 1 s after it went away, during the outage
    back = time.monotonic()
    threading.Timer(max(0.0, stopped + outage_s - time.monotonic()), outage.clear).start()
    recovered: float | None = None
    step = 2
    while time.monotonic() - back < NEVER_S:
        conn = link.connector
        if conn is not None:
            try:
                _exchange(conn, step)
                recovered = time.monotonic() - back
                break
            except ConnectorError:
                step += 1
        time.sleep(0.01)
    group.stop()
    stop2.set()
    return {"recovery_s": recovered, "outage_s": outage_s, "ffn_back_after_s": 1.0}


# ------------------------------------------------------------------ frozen
def _frozen_ffn(cfg: Any) -> None:
    """The FFN process: one group, served until it ends (the parent terminates it at the end of the run)."""
    _serve(cfg, threading.Event())


def _frozen_attention(cfg: Any, run_s: float, go: Any, out: Any) -> None:
    """Step for ``run_s`` once ``go`` is set; report the longest wait and the error that ended the group, if any."""
    import torch

    from afd_patches.connectors.base import ConnectorError
    from afd_patches.connectors.torch_dist import TorchDistConnector

    torch.set_num_threads(1)
    conn = TorchDistConnector(cfg)
    result: dict[str, Any] = {"rank": cfg.rank, "longest_s": 0.0, "steps": 0, "error": None}
    try:
        conn.init(60.0)
        out.put({"ready": cfg.rank})
        go.wait(60)
        end = time.monotonic() + run_s
        while time.monotonic() < end:
            result["longest_s"] = max(result["longest_s"], _exchange(conn, result["steps"], cfg.rank))
            result["steps"] += 1
            time.sleep(0.005)
    except ConnectorError as e:
        result["error"] = f"{type(e).__name__}: {e}"[:300]
    conn.close()
    out.put(result)


def frozen(schedule: str) -> dict[str, Any]:
    """The ``frozen`` scenario (see the module docstring); processes spawned from this one."""
    from afd_patches.config import AfdConfig

    ctx = mp.get_context("spawn")
    port = _free_port()
    extra = {"backend": "tcp", "schedule": schedule}

    def cfg(role: str, rank: int) -> Any:
        return AfdConfig(role=role, host="127.0.0.1", port=port, rank=rank, num_attention_ranks=2, timeout_s=TIMEOUT_S,
                         connector_extra_config=extra)

    go, out = ctx.Event(), ctx.Queue()
    freeze_s = 3 * TIMEOUT_S
    run_s = freeze_s + 4 * TIMEOUT_S
    procs = [ctx.Process(target=_frozen_ffn, args=(cfg("ffn", 0),), daemon=True)]
    procs += [ctx.Process(target=_frozen_attention, args=(cfg("attention", r), run_s, go, out), daemon=True)
              for r in range(2)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        for _ in range(2):  # both ranks formed the group (spawned processes import torch first)
            r = out.get(timeout=120)
            if "ready" not in r:
                results[r["rank"]] = r  # failed before it was ready
        go.set()
        time.sleep(1.0)
        os.kill(procs[2].pid, signal.SIGSTOP)
        time.sleep(freeze_s)
        os.kill(procs[2].pid, signal.SIGCONT)
        while len(results) < 2:
            r = out.get(timeout=run_s + 60)
            results[r["rank"]] = r
    finally:  # no event to end the FFN: an mp.Event's set() hangs on a waiter whose process has exited
        for p in procs[1:]:
            p.join(10)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    return {"schedule": schedule, "freeze_s": freeze_s, "rank0_longest_s": results[0]["longest_s"],
            "rank0_steps": results[0]["steps"], "rank0_error": results[0]["error"], "rank1_error": results[1]["error"]}


# ------------------------------------------------------------------ driver
def _child(scenario: str, arg: str) -> None:
    result = dns(float(arg)) if scenario == "dns" else frozen(arg)
    print("RESULT " + json.dumps(result), flush=True)


def run_tree(src: str | None, scenario: str, arg: str) -> dict[str, Any]:
    """One scenario in a fresh process that imports ``afd_patches`` from ``src`` (None: this checkout): this file
    runs by its path there, so nothing of this checkout but the file itself is on its path."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": src or repo}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", scenario, arg], capture_output=True,
                          text=True, env=env, timeout=300, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"failed": (proc.stderr or proc.stdout)[-600:]}
    return json.loads(lines[-1][7:])  # type: ignore[no-any-return]


def _show(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2], sys.argv[3])
        return
    from benchmarks import record

    parser = record.parser(__doc__, recorded=True, baseline="another checkout to measure in the same run")
    parser.add_argument("--outage-s", type=float, default=2.0)
    args = parser.parse_args()
    trees = [("before", args.baseline), ("after", None)] if args.baseline else [("current", None)]
    figures = []
    before: dict[str, str] = {}  # the baseline's outcome per figure, kept as the figure's detail
    for name, src in trees:
        d = run_tree(src, "dns", str(args.outage_s))
        print(f"{name}: FFN restart with a {args.outage_s:g} s name-resolution outage: first exact exchange "
              f"{_show(d.get('recovery_s'))} after the FFN was back (goal <= {2 * TIMEOUT_S:g} s) "
              f"{d.get('failed', '')}", flush=True)
        if name == "before":
            before["dns_recovery_s"] = f"before ({args.baseline}): {_show(d.get('recovery_s'))}"
        else:
            figures.append(record.Figure("dns_recovery_s", "FFN restart with a 2 s name-resolution outage: FFN back "
                                         "to the first exact exchange (timeout_s 2)",
                                         d.get("recovery_s") or NEVER_S, "s", detail=before.get("dns_recovery_s", "")))
        for schedule in ("batched", "pingpong"):
            f = run_tree(src, "frozen", schedule)
            ended = f.get("rank0_error")
            outcome = (f"the group ended under rank 0 ({str(ended)[:60]}...)" if ended else
                       f"rank 0's longest wait {_show(f.get('rank0_longest_s'))}, group lived on")
            print(f"{name}: 2A1F {schedule}, rank 1 frozen {3 * TIMEOUT_S:g} s: {outcome} (goal: lives on, wait <= "
                  f"{2 * TIMEOUT_S:g} s), {f.get('rank0_steps')} steps; rank 1 on thaw: "
                  f"{str(f.get('rank1_error'))[:90]} {f.get('failed', '')}", flush=True)
            key = f"frozen_{schedule}_longest_s"
            if name == "before":
                before[key] = f"before ({args.baseline}): {'the group ended' if ended else outcome}"
            else:
                figures.append(record.Figure(key, f"2A1F {schedule}: the busy rank's longest wait while its sibling "
                                             "is SIGSTOPped (timeout_s 2; the group lives on)",
                                             NEVER_S if ended else f.get("rank0_longest_s") or NEVER_S, "s",
                                             detail=before.get(key, "")))
    if args.record:
        record.write("group_faults", figures)


if __name__ == "__main__":
    main()
