"""Which CPU cores an AFD engine's workers run on: the ``cpu_cores`` syntax and the default placement.

Pure functions (no vLLM, no torch); ``afd_patches.patches.cpu_binding`` applies the result through
vLLM's own knob, ``VLLM_CPU_OMP_THREADS_BIND``.

Syntax (vLLM's, for ``cpu_cores`` and the env var alike)
    A list of CPU ids and inclusive ranges, ``"0-3,8"``; one list per worker of the engine (its
    local world size: tensor x pipeline parallel), separated by ``|``: ``"0-3|4-7"``.

Default placement (``derive``)
    Every engine of an ``A:F`` group on this host gets its own share of the allowed CPUs, in the
    group's global-rank order (``afd_patches.topology.global_rank``: FFN ranks first, then attention
    ranks), so the placement follows from the AFD config alone and is the same in every engine:

    * The allowed logical CPUs are grouped into physical cores and ordered by (NUMA node, first
      CPU id), so a contiguous share stays on one socket as long as the share fits in it: 1A1F on a
      two-socket host puts the FFN on the first socket and the attention engine on the second.
    * With at least as many physical cores as engines, the cores are cut into ``A + F`` contiguous
      shares; shares differ by at most one core and the larger ones go to the last global ranks
      (attention engines: they run everything but the FFN, and their engine core schedules). The
      worker takes one logical CPU per physical core (the last sibling, as vLLM's own ``auto``
      binding does on x86), so SMT siblings don't run two OpenMP threads of one GEMM.
    * A share of at least two cores per worker keeps one core per worker out of the workers' lists,
      for that engine's engine core and API server (vLLM's ``auto`` reserves the same), so they do
      not preempt an OpenMP thread in the middle of a parallel region.
    * With fewer physical cores than engines, engines share cores round-robin: global rank ``g``
      gets core ``g % cores``. 2 cores and 1A1F: FFN on core 0, attention on core 1; 1 core: both
      on core 0.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from afd_patches.topology import global_rank, world_size

_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


@dataclass(frozen=True, slots=True)
class Cpu:
    """One logical CPU: its id, its physical core and its NUMA node (``-1``/``0`` when unknown)."""

    id: int
    core: int
    node: int = 0


def parse_core_lists(spec: str) -> list[list[int]]:
    """``"0-3,8|4-7"`` → ``[[0, 1, 2, 3, 8], [4, 5, 6, 7]]`` (one list per worker, ids in the order given).

    Raises ``ValueError`` naming the part that is not a list of ids and ``a-b`` ranges (``a <= b``),
    or that repeats an id; whitespace is not accepted (vLLM's parser would take it as part of a number).
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{spec!r} is not a CPU list such as '0-3' or '0-1|2-3'")
    lists = []
    for part in spec.split("|"):
        if not _LIST.fullmatch(part):
            raise ValueError(f"{part!r} in {spec!r} is not a list of CPU ids and ranges such as '0-3,8'")
        ids: list[int] = []
        for token in part.split(","):
            first, _, last = token.partition("-")
            lo, hi = int(first), int(last or first)
            if lo > hi:
                raise ValueError(f"range {token!r} in {spec!r} runs backwards")
            ids.extend(range(lo, hi + 1))
        if len(set(ids)) != len(ids):
            raise ValueError(f"{part!r} in {spec!r} names a CPU twice")
        lists.append(ids)
    return lists


def format_cores(ids: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"`` (sorted, runs folded into ranges); the inverse of one part of
    ``parse_core_lists``."""
    out: list[str] = []
    run: list[int] = []
    for cpu in sorted(set(ids)):
        if run and cpu == run[-1] + 1:
            run.append(cpu)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [cpu]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def format_core_lists(lists: Sequence[Iterable[int]]) -> str:
    """One ``format_cores`` per worker, joined by ``|``: what ``VLLM_CPU_OMP_THREADS_BIND`` takes."""
    return "|".join(format_cores(ids) for ids in lists)


def physical_cores(cpus: Iterable[Cpu]) -> list[list[int]]:
    """The logical CPU ids of each physical core (ascending), cores ordered by (NUMA node, first id)."""
    by_core: dict[tuple[int, int], list[int]] = {}
    for cpu in cpus:
        by_core.setdefault((cpu.node, cpu.core), []).append(cpu.id)
    return [sorted(ids) for _, ids in sorted(by_core.items(), key=lambda item: (item[0][0], min(item[1])))]


def _split(items: Sequence[list[int]], parts: int) -> list[Sequence[list[int]]]:
    """``items`` cut into ``parts`` contiguous runs whose sizes differ by at most one, the larger last."""
    q, r = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        size = q + (1 if i >= parts - r else 0)
        out.append(items[start:start + size])
        start += size
    return out


def derive(cpus: Sequence[Cpu], role: str, rank: int, num_attention: int, num_ffn: int,
           workers: int = 1) -> list[list[int]]:
    """The CPU ids of each of this engine's ``workers`` workers under the default placement (module
    docstring). ``cpus``: the logical CPUs this process may run on. Raises ``ValueError`` for an
    invalid topology or rank (``afd_patches.topology``) or an empty ``cpus``."""
    if not cpus:
        raise ValueError("no CPUs to place the AFD engines on")
    if workers < 1:
        raise ValueError(f"an engine has at least one worker, got {workers}")
    engines = world_size(num_attention, num_ffn)
    slot = global_rank(role, rank, num_attention, num_ffn)
    cores = physical_cores(cpus)
    if len(cores) < engines:
        core = cores[slot % len(cores)]
        return [[core[-1]] for _ in range(workers)]
    share = list(_split(cores, engines)[slot])
    if len(share) >= 2 * workers:
        share = share[:-workers]
    if len(share) < workers:
        return [[share[w % len(share)][-1]] for w in range(workers)]
    return [[core[-1] for core in part] for part in _split(share, workers)]
