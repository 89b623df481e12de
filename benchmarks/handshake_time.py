"""Time to form one AFD group (1 attention rank joins FFN rank 0 on ``backend: tcp``), with a token.

Each repetition starts both ranks' ``TorchDistConnector.init()`` in two threads of one process on a free
loopback port and times from the start until both returned, then closes both. On the current checkout that
is the authenticated session (``session``), the comparison of settings and the verdict; the data link is
the session's own socket. ``--baseline DIR`` runs the same in a second process that imports
``afd_patches`` from DIR (another checkout, e.g. ``git worktree add /tmp/afd-before <commit>``),
alternating per round, so both are measured in the same run.

    .venv/bin/python -m benchmarks.handshake_time [--reps 100] [--baseline DIR] [--rounds 3]

Nothing leaves the machine.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time

from benchmarks import record
from harness.env import free_port

TOKEN = "17927d585f38cb601edd180a641ca41b12e3076ad696109ff2bd56a3e6b52a90"  # secrets.token_hex(32)


def once() -> float:
    """Seconds from the start of both ``init()`` calls until both returned."""
    from afd_patches.config import parse  # what every checkout has (a baseline's config may be shaped otherwise)
    from afd_patches.connectors.base import ConnectorError
    from afd_patches.connectors.torch_dist import TorchDistConnector

    port = free_port()
    conns = {role: TorchDistConnector(parse({"role": role, "host": "127.0.0.1", "port": port, "timeout_s": 10.0,
                                             "connector_extra_config": {"backend": "tcp"}})) for role in
             ("ffn", "attention")}
    errors: list[Exception] = []

    def run(role: str) -> None:
        try:
            conns[role].init()
        except ConnectorError as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(role,)) for role in conns]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for conn in conns.values():
        conn.close()
    if errors:
        raise errors[0]
    return elapsed


def _child(reps: int) -> None:
    os.environ["AFD_TOKEN"] = TOKEN
    times = [once() for _ in range(reps)]
    print(" ".join(f"{t:.6f}" for t in times))


def run_tree(src: str | None, reps: int) -> list[float]:
    """``reps`` formations in a fresh process importing ``afd_patches`` from ``src`` (None: this checkout)."""
    code = ("import sys; from benchmarks.handshake_time import _child; "  # this file, then afd_patches from src
            "sys.path.insert(0, sys.argv[1]) if sys.argv[1] else None; _child(int(sys.argv[2]))")
    out = subprocess.run([sys.executable, "-c", code, src or "", str(reps)], capture_output=True, text=True,
                         check=True, timeout=600)
    return [float(x) for x in out.stdout.split()]


def main() -> None:
    parser = record.parser(__doc__, reps=100, rounds=3, baseline="a checkout whose afd_patches to compare against")
    args = parser.parse_args()
    trees = [("baseline", args.baseline), ("current", None)] if args.baseline else [("current", None)]
    medians: dict[str, list[float]] = {name: [] for name, _ in trees}
    for r in range(args.rounds):
        for name, src in trees:
            ms = sorted(t * 1e3 for t in run_tree(src, args.reps))
            medians[name].append(statistics.median(ms))
            print(f"round {r + 1} {name}: median {statistics.median(ms):.2f} ms, p90 {ms[int(0.9 * len(ms))]:.2f} ms "
                  f"({args.reps} groups, load average {os.getloadavg()[0]:.1f})", flush=True)
    print("1A1F tcp group formation with a token, median of round medians: " +
          ", ".join(f"{name} {statistics.median(m):.2f} ms" for name, m in medians.items()))


if __name__ == "__main__":
    main()
