"""harness.env.vllm_env: one vLLM cache per release, and a tree put in front on PYTHONPATH keeps its own."""

from __future__ import annotations

import os
from pathlib import Path

from harness.env import vllm_cache_root, vllm_env


def test_the_release_cache_by_default_and_a_drifted_tree_its_own(tmp_path: Path) -> None:
    assert vllm_env()["VLLM_CACHE_ROOT"] == str(vllm_cache_root())
    drifted = vllm_env(PYTHONPATH=os.pathsep.join([str(tmp_path), "/elsewhere"]))
    assert drifted["VLLM_CACHE_ROOT"] == str(tmp_path / ".vllm-cache") != str(vllm_cache_root())
    assert vllm_env(PYTHONPATH=str(tmp_path), VLLM_CACHE_ROOT="/c")["VLLM_CACHE_ROOT"] == "/c"
