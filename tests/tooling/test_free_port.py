"""harness.env.free_port: ports below the kernel's ephemeral range, one slice per pytest session or xdist worker."""

from __future__ import annotations

import os
import subprocess
import sys

from harness.env import PORTS_FROM, PORTS_SLICE, REPO

PROBE = "from harness.env import free_port; print(' '.join(str(free_port()) for _ in range(50)))"


def _ports(worker: str | None) -> list[int]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    if worker:
        env["PYTEST_XDIST_WORKER"] = worker
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return [int(p) for p in out.stdout.split()]


def test_each_worker_takes_distinct_ports_from_its_own_slice() -> None:
    ephemeral_low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for slice_index, worker in enumerate([None, "gw0", "gw1"]):
        ports = _ports(worker)
        low = PORTS_FROM + slice_index * PORTS_SLICE
        assert len(set(ports)) == len(ports), ports
        assert all(low <= p < low + PORTS_SLICE < ephemeral_low for p in ports), (worker, ports)
