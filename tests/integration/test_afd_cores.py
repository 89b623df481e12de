"""Roles on their own cores, with real engines: an AFD 1A1F pair on the tiny Llama, vLLM's own process
split (front end, engine core, ``VLLM::Worker``), and the affinity each role's worker ends up with.

1. Default placement: ``VLLM_CPU_OMP_THREADS_BIND`` left at vLLM's ``auto`` (under which both workers
   would be bound to the same first core) and a loopback host: the FFN worker and the attention worker
   run on different CPUs, the ones ``afd_patches.cores.derive`` gives for this machine's allowed CPUs,
   read from ``/proc/<pid>/status`` (``Cpus_allowed_list``) of each ``VLLM::Worker`` while the pair is up;
   each engine logs its choice once.
2. ``cpu_cores`` per engine, the opposite of the default (attention on the first CPU, FFN on the last),
   with the harness's ``nobind`` in the environment: the key wins, and the workers are where it says.

Needs at least two allowed CPUs. Marked ``vllm``: two engines of three processes each.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from afd_patches.cores import derive, format_cores, parse_core_lists
from afd_patches.patches.cpu_binding import _allowed_cpus
from harness.engine import ARCH, ENGINE_TIMEOUT_S, kill, start, tail
from harness.env import free_port

pytestmark = pytest.mark.vllm

# vLLM starts (harness.starts; tests/conftest.py holds the module to them): two pairs.
ENGINE_BUDGET = 4

PROMPTS = [[1, 2, 3, 4, 5], [17, 99, 4]]


def _workers(pgid: int) -> list[int]:
    """Pids of the ``VLLM::Worker`` processes in process group ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
        if cmdline.startswith(b"VLLM::Worker"):
            found.append(int(entry))
    return found


def _allowed_list(pid: int) -> list[int]:
    """The CPUs of ``/proc/<pid>/status`` ``Cpus_allowed_list`` (the main thread's affinity)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_core_lists(line.split(":", 1)[1].strip())[0]
    raise AssertionError(f"no Cpus_allowed_list in /proc/{pid}/status")


def _run_pair(model: Path, workdir: Path, env: dict[str, str], cores: dict[str, str | None]
              ) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Start FFN then attention; once the attention engine has generated, read each role's worker affinity;
    let both finish. Returns (role -> CPUs of its worker, role -> log)."""
    release, done = workdir / "release", workdir / "done"
    for flag in (release, done):
        flag.unlink(missing_ok=True)
    afd = {"port": free_port(), "timeout_s": 120.0}
    specs = []
    for role in ("ffn", "attention"):
        spec: dict[str, Any] = {
            "name": f"cores-{role}", "mode": role, "model": str(model), "arch": ARCH["llama"],
            "afd": {**afd, "role": role, **({"cpu_cores": cores[role]} if cores[role] else {})},
            "prompts": PROMPTS, "max_tokens": 4, "logprobs": 1, "multiprocessing": True, "env": env}
        if role == "attention":
            spec.update(done_flag=str(done), wait_for=[str(release)])
        specs.append(spec)
    engines = []
    try:
        for spec in specs:
            engines.append(start(spec, workdir))
            time.sleep(1.0)
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while not done.exists():
            for proc, log, _ in engines:
                assert proc.poll() is None, f"engine exited {proc.returncode} early:\n{tail(log)}"
            assert time.monotonic() < deadline, "the attention engine did not finish generating in time"
            time.sleep(0.5)
        placed = {}
        for role, (proc, _, _) in zip(("ffn", "attention"), engines, strict=True):
            workers = _workers(proc.pid)
            assert len(workers) == 1, f"{role}: expected one VLLM::Worker in its group, found {workers}"
            placed[role] = _allowed_list(workers[0])
        release.write_text("go")
        for proc, log, _ in engines:
            assert proc.wait(ENGINE_TIMEOUT_S) == 0, tail(log)
        return placed, {role: log.read_text(errors="replace") for role, (_, log, _) in zip(("ffn", "attention"),
                                                                                             engines, strict=True)}
    finally:
        kill(proc for proc, _, _ in engines)


@pytest.fixture(scope="module")
def allowed() -> list[int]:
    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, f"this test needs two allowed CPUs to tell the roles apart, has {cpus}"
    return cpus


def test_default_placement_puts_the_roles_on_different_cores(tiny_llama: Path, tmp_path: Path,
                                                             allowed: list[int]) -> None:
    placed, logs = _run_pair(tiny_llama, tmp_path, {"VLLM_CPU_OMP_THREADS_BIND": "auto"},
                             {"ffn": None, "attention": None})
    cpus = _allowed_cpus()
    expected = {role: derive(cpus, role, 0, 1, 1)[0] for role in ("ffn", "attention")}
    assert placed == expected, (placed, expected)
    assert not set(placed["ffn"]) & set(placed["attention"])
    for role in ("ffn", "attention"):
        line = f"AFD: {role} rank 0 worker(s) on cores {format_cores(expected[role])} (derived: {len(cpus)} allowed"
        assert logs[role].count(line) == 1, f"{role}: no single log line {line!r}:\n{logs[role][-3000:]}"


def test_cpu_cores_wins_over_the_environment(tiny_llama: Path, tmp_path: Path, allowed: list[int]) -> None:
    first, last = allowed[0], allowed[-1]
    placed, logs = _run_pair(tiny_llama, tmp_path, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
                             {"ffn": str(last), "attention": str(first)})
    assert placed == {"ffn": [last], "attention": [first]}
    assert f"AFD: attention rank 0 worker(s) on cores {first} (cpu_cores of the AFD config)" in logs["attention"]
    assert f"AFD: ffn rank 0 worker(s) on cores {last} (cpu_cores of the AFD config)" in logs["ffn"]
