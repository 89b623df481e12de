"""harness.shm_leftovers: what a SIGKILLed process group left in /dev/shm is unlinked; what a live process holds,
what was there before the session and other files are not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

from harness import shm_leftovers

_GROUP = textwrap.dedent("""
    import time
    from multiprocessing import shared_memory
    made = [shared_memory.SharedMemory(create=True, size=1 << 20) for _ in range(2)]
    print(" ".join(m.name for m in made), flush=True)
    time.sleep(600)
""")
_HOLDER = textwrap.dedent("""
    import mmap, sys
    with open(sys.argv[1], "r+b") as f:
        held = mmap.mmap(f.fileno(), 0)
    print("holding", flush=True)
    sys.stdin.read()
""")


def test_sweep_unlinks_what_a_killed_group_left_and_nothing_else() -> None:
    tag = uuid.uuid4().hex[:8]
    older = f"/dev/shm/psm_{tag}old"
    open(older, "w").close()  # an orphan from before the session
    time.sleep(0.05)
    since = time.time()
    time.sleep(0.05)  # file times come from the kernel's coarse clock, a few ms behind time.time()
    others = [f"/dev/shm/afdtest_{tag}", f"/dev/shm/vllm_dist_{tag}-tp:0-[0-1]-cpushm_0"]
    for path in others:
        open(path, "w").close()
    group = subprocess.Popen([sys.executable, "-c", _GROUP], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    holder, made = None, []
    try:
        made = [f"/dev/shm/{name}" for name in (group.stdout.readline().split() if group.stdout else [])]
        assert len(made) == 2, made
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER, made[1]], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        # the group's segments are held while it lives; the vLLM-named file nobody holds goes
        assert shm_leftovers.sweep(since, min_age_s=0) == [os.path.basename(others[1])]
        os.killpg(group.pid, signal.SIGKILL)  # its resource tracker dies with it: nothing unlinks its segments
        group.wait(10)
        assert all(os.path.exists(p) for p in made)
        assert shm_leftovers.sweep(since, min_age_s=0) == [os.path.basename(made[0])]  # made[1]: still held
        assert os.path.exists(made[1]) and os.path.exists(older) and os.path.exists(others[0])
        assert shm_leftovers.sweep(since, min_age_s=3600) == []  # nothing that young is touched
    finally:
        if group.poll() is None:
            group.kill()
        if holder is not None:
            holder.communicate("")
        for path in [older, *others, *made]:
            if os.path.exists(path):
                os.unlink(path)


def test_kinds() -> None:
    assert shm_leftovers.kind_of("psm_1bf5abba") == "psm_"
    assert shm_leftovers.kind_of("sem.mp-6eq15l_k") == "sem.mp-"
    assert shm_leftovers.kind_of("vllm_dist_03112c6e-tp:0-[0-1]-cpushm_1") == "vllm_dist_"
    assert shm_leftovers.kind_of("vllm_dist_03112c6e") is None and shm_leftovers.kind_of("torch_123") is None
