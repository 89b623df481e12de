"""The session's warmed model-inspection cache (``harness.model_infos``) answers every tiny family's architecture,
plain and AFD, the way vLLM reads it: in a fresh process where inspecting in a subprocess would raise
(``--cached-only``), vLLM's registry inspects each of them from the cache alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.env import REPO, vllm_cache_root, vllm_env
from harness.model_infos import ARCHITECTURES

pytestmark = pytest.mark.vllm


def test_every_tiny_architecture_is_answered_from_the_cache() -> None:
    assert (vllm_cache_root() / "modelinfos").is_dir()
    run = subprocess.run([sys.executable, "-m", "harness.model_infos", "--cached-only"], capture_output=True,
                         text=True, env=vllm_env(), cwd=REPO, timeout=300)
    # stderr's last line (the exit line: each miss and its cache file's state) first, where pytest's one-line
    # summary of a failure shows it
    last = (run.stderr.strip().splitlines() or [""])[-1]
    assert run.returncode == 0, f"exit {run.returncode}: {last}\n{run.stderr[-4000:]}{run.stdout[-2000:]}"
    assert f"{len(ARCHITECTURES)} architectures answered from the cache (0 not registered" in run.stdout, run.stdout
