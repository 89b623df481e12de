"""The shared memory a test session's vLLM processes leave in ``/dev/shm``, found and unlinked at the session's end.

Two kinds are left. vLLM's message queues (Python's ``multiprocessing.shared_memory``, ``psm_*``, 160-240 MiB
sparse each) and Python's named semaphores (``sem.mp-*``) are unlinked by the process that made them, or by Python's
resource tracker when it crashed; a test that SIGKILLs an engine's whole process group on purpose kills both. And
vLLM's CPU tensor-parallel all-reduce (``vllm_dist_*-cpushm_*``, 4 MiB each, one per TP rank) is never unlinked by
vLLM, however its engine ends. On a fresh CI machine none of it matters; on a developer's host it collects, run
after run.

``sweep(since)`` unlinks the files of those three kinds that this user owns, that changed status at or after
``since`` (the session's start) and at least ``min_age_s`` ago, and that no live process maps or holds open. A file
that a running engine uses is always held (mapped by it), whoever started it, so engines of other sessions running
beside this one keep theirs. Limits: Linux only (``/proc``); a process of another user is not seen, but these files
are mode 0600, so no other user can hold them; a program of the same user that makes such a file, lets go of it and
expects to find it again later (a pattern vLLM does not use) would lose it if it made it during the session.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

SHM = Path("/dev/shm")


def kind_of(name: str) -> str | None:
    """Which of the kinds vLLM's processes leave (see above) ``name`` (a file in ``/dev/shm``) is, by its prefix
    (``psm_``, ``sem.mp-``, ``vllm_dist_``); None for any other file."""
    for prefix in ("psm_", "sem.mp-"):
        if name.startswith(prefix):
            return prefix
    if name.startswith("vllm_dist_") and "-cpushm" in name:
        return "vllm_dist_"
    return None


def held() -> set[str]:
    """Paths under ``/dev/shm`` that some live process (one this user may inspect) maps or holds open."""
    found: set[str] = set()
    prefix = f"{SHM}/"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):  # a process that ends meanwhile, or one not ours
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(prefix):
                    found.add(fields[5].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if (target := os.readlink(fd.path)).startswith(prefix):
                        found.add(target)
    return found


def sweep(since: float, min_age_s: float = 5.0) -> list[str]:
    """Unlink the leftovers made since ``since`` (a ``time.time()``) as described above; returns their names."""
    uid, newest = os.getuid(), time.time() - min_age_s
    candidates = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(SHM):
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if (kind_of(entry.name) and entry.is_file(follow_symlinks=False) and st.st_uid == uid
                        and since <= st.st_ctime <= newest):
                    candidates.append(entry)
    if not candidates:
        return []
    in_use = held()
    unlinked = []
    for entry in candidates:
        if entry.path not in in_use:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                unlinked.append(entry.name)
    return sorted(unlinked)
