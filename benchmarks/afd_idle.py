"""Idle CPU of AFD pairs against plain servers, per process and per thread, from ``/proc``.

Starts ``--plain`` plain API servers and one 1A1F AFD deployment per schedule in
``--schedules`` (the servers of ``afd_server_load.py``), sends each side a short
warm-up, waits ``--settle-s``, then reads every thread of every server process
twice, ``--idle-s`` seconds apart: CPU time from ``/proc/<pid>/task/<tid>/schedstat``
(nanoseconds on a CPU, load-independent, unlike wall-clock rates) and voluntary
context switches from ``.../status`` (each is one wake-up after a block or sleep).
``--rounds`` repeats the window, rotating nothing (all sides idle at once).

Prints, per server: CPU as % of one core and wake-ups per second, per process
(front end, engine core, worker); per deployment: the sum over its servers next
to ``plain x 2``; and the ``--top`` threads by wake-ups. With ``--py-spy PATH``
the worker threads are named by their Python thread (``py-spy dump``), since
Python 3.11 does not give its threads OS names.

    python -m benchmarks.afd_idle [--schedules batched,pingpong] [--idle-s 30] [--rounds 2] [--py-spy PATH]
        [--baseline DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks import record
from benchmarks.afd_server_load import Deployment, Server, bring_up, load
from harness.env import REPO, vllm_env
from harness.tiny_model import build
from harness.tiny_tokenizer import build_tokenizer

Sample = dict[tuple[int, int], tuple[str, int, int]]  # (pid, tid) -> (comm, cpu ns, voluntary switches)


def kind_of(proc: psutil.Process, root: int) -> str:
    if proc.pid == root:
        return "front"
    name = proc.name()
    return next((k for k in ("EngineCor", "Worker") if k in name), name)


def processes(server: Server) -> list[tuple[str, psutil.Process]]:
    """(kind, process) for the server and every process below it."""
    try:
        root = psutil.Process(server.proc.pid)
        return [(kind_of(p, root.pid), p) for p in [root, *root.children(recursive=True)]]
    except psutil.Error:
        return []


def sample(pid: int) -> Sample:
    """Per thread of ``pid``: its name, CPU nanoseconds so far, voluntary context switches so far."""
    out: Sample = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/schedstat") as fh:
                ns = int(fh.read().split()[0])
            with open(f"{base}/status") as fh:
                status = fh.read()
        except OSError:
            continue
        comm = re.search(r"^Name:\s*(.*)$", status, re.M)
        vol = re.search(r"^voluntary_ctxt_switches:\s*(\d+)", status, re.M)
        out[(pid, int(tid))] = (comm.group(1) if comm else "?", ns, int(vol.group(1)) if vol else 0)
    return out


def thread_names(pid: int, py_spy: str | None) -> dict[int, str]:
    """tid -> Python thread name (and its innermost frame) from ``py-spy dump``; {} without py-spy."""
    if not py_spy:
        return {}
    try:
        text = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    names: dict[int, str] = {}
    for block in text.split("\nThread ")[1:]:
        head, _, rest = block.partition("\n")
        m = re.match(r"(0x[0-9A-Fa-f]+|\d+)\s*(?:\(([^)]*)\))?\s*:\s*\"([^\"]*)\"", head)
        if not m:
            continue
        tid = int(m.group(1), 0)
        frame = rest.strip().splitlines()[0].strip() if rest.strip() else ""
        names[tid] = f"{m.group(3)} [{frame[:70]}]"
    return names


def main() -> None:
    parser = record.parser(__doc__, rounds=2,
                           baseline="another afd-plugin checkout: one more 1A1F pair (first schedule) runs it")
    parser.add_argument("--schedules", default="batched,pingpong")
    parser.add_argument("--plain", type=int, default=2)
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--py-spy", default=None, help="path of a py-spy binary, to name threads")
    args = parser.parse_args()
    env = vllm_env(PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)  # this checkout
    ns = argparse.Namespace(ffn_bind=None, pin=False)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tokenizer(build(work / "tiny-llama", "llama"), vocab_size=512)
        servers: list[Server] = []
        try:
            plains = [Server(f"plain{i}", model, work, [], env, None) for i in range(args.plain)]
            servers += plains
            schedules = args.schedules.split(",")
            deps = [Deployment(s, s, 1, model, work, env, ns) for s in schedules]
            if args.baseline:
                base_env = {**env, "PYTHONPATH": os.pathsep.join(
                    p for p in (str(Path(args.baseline).resolve()), env.get("PYTHONPATH", "")) if p)}
                deps.append(Deployment(f"base-{schedules[0]}", schedules[0], 1, model, work, base_env, ns))
            servers += [d.ffn for d in deps]
            bring_up(servers, deps)
            for ports in [[p.port] for p in plains] + [[a.port for a in d.attns] for d in deps]:
                load(ports, model, 4, 8)
            time.sleep(args.settle_s)
            procs = {s.name: processes(s) for s in servers}
            names: dict[int, str] = {}
            for plist in procs.values():
                for kind, p in plist:
                    if kind == "Worker" or kind == "EngineCor":
                        names.update(thread_names(p.pid, args.py_spy))
            for r in range(args.rounds):
                before = {p.pid: sample(p.pid) for plist in procs.values() for _, p in plist}
                t0 = time.monotonic()
                time.sleep(args.idle_s)
                after = {p.pid: sample(p.pid) for plist in procs.values() for _, p in plist}
                wall = time.monotonic() - t0
                report(r, wall, procs, before, after, names, args.top, os.getloadavg()[0])
        finally:
            for s in reversed(servers):
                s.stop()


def report(r: int, wall: float, procs: dict[str, list[tuple[str, psutil.Process]]], before: dict[int, Sample],
           after: dict[int, Sample], names: dict[int, str], top: int, loadavg: float) -> None:
    """Print one idle window (see the module docstring)."""
    print(f"--- idle window {r}: {wall:.1f} s, load average (1 min) at its end {loadavg:.1f}")
    per_server: dict[str, tuple[float, float]] = {}
    rows = []
    for server, plist in procs.items():
        cpu_total = wake_total = 0.0
        parts = []
        for kind, p in plist:
            b, a = before.get(p.pid, {}), after.get(p.pid, {})
            cpu = sum(v[1] - b.get(k, (None, v[1], v[2]))[1] for k, v in a.items()) / 1e9
            wake = sum(v[2] - b.get(k, (None, v[1], v[2]))[2] for k, v in a.items())
            cpu_total += cpu
            wake_total += wake
            parts.append(f"{kind} {100 * cpu / wall:.2f}%/{wake / wall:.0f}/s")
            for key, (comm, ns_, vol) in a.items():
                _, ns0, vol0 = b.get(key, (comm, ns_, vol))
                rows.append((vol - vol0, ns_ - ns0, server, kind, key[1], names.get(key[1], comm)))
        per_server[server] = (100 * cpu_total / wall, wake_total / wall)
        print(f"  {server:20s} {100 * cpu_total / wall:5.2f}% of a core, {wake_total / wall:6.0f} wake-ups/s  "
              f"({', '.join(parts)})")
    plain = [v for k, v in per_server.items() if k.startswith("plain")]
    if plain:
        mean_cpu = sum(c for c, _ in plain) / len(plain)
        mean_wake = sum(w for _, w in plain) / len(plain)
        print(f"  two plain servers (2 x mean): {2 * mean_cpu:.2f}% , {2 * mean_wake:.0f} wake-ups/s")
    for label in sorted({k.rsplit('-', 1)[0] for k in per_server if not k.startswith("plain")}):
        cpu = sum(c for k, (c, _) in per_server.items() if k.startswith(label + "-"))
        wake = sum(w for k, (_, w) in per_server.items() if k.startswith(label + "-"))
        print(f"  AFD pair {label}: {cpu:.2f}% , {wake:.0f} wake-ups/s")
    print(f"  top {top} threads by wake-ups (per s, CPU ms over the window):")
    for vol, ns_, server, kind, tid, name in sorted(rows, reverse=True)[:top]:
        print(f"    {vol / wall:7.1f}/s {ns_ / 1e6:8.1f} ms  {server} {kind} tid {tid} {name}")


if __name__ == "__main__":
    main()
