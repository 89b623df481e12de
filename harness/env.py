"""The environment every real-vLLM subprocess of the tests, the demo and the benchmarks runs in.

One policy: offline (no usage stats, no hub), one OpenMP thread, and one vLLM cache inside
the checkout (``.cache/vllm``; vLLM writes its model-inspection cache atomically, so engines
started side by side may share it). Variables that would steer patchkit or switch plugins off
(``PATCHKIT_*``, ``VLLM_PLUGINS``) are dropped from the inherited environment; a caller that
wants them passes them in ``extra``. Thread binding is left to vLLM (``auto``) here; the
engine driver (``harness.engine``) switches it off for its engines.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BASE_ENV = {
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1", "VLLM_CACHE_ROOT": str(REPO / ".cache" / "vllm"),
}


def vllm_env(**extra: str) -> dict[str, str]:
    """The inherited environment without ``PATCHKIT_*``/``VLLM_PLUGINS``, plus ``BASE_ENV``, plus ``extra``.

    Drivers run as ``python -m harness.NAME`` with ``cwd=REPO`` (``-m`` puts the
    working directory first on ``sys.path``), so nothing here edits ``PYTHONPATH``.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PATCHKIT_", "VLLM_PLUGINS"))}
    return {**env, **BASE_ENV, **extra}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the usual race: another process may take it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
