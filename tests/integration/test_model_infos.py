"""The session's warmed model-inspection cache (``harness.model_infos``) answers every tiny family's architecture,
plain and AFD, the way vLLM reads it: in a fresh process where inspecting in a subprocess would raise, vLLM's
registry inspects each architecture from the cache alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.env import REPO, vllm_cache_root, vllm_env
from harness.model_infos import ARCHITECTURES

pytestmark = pytest.mark.vllm

READ_ONLY = """
import sys
from vllm import ModelRegistry
from vllm.model_executor.models import registry
from vllm.plugins import load_general_plugins

load_general_plugins()

def refuse(fn):
    raise AssertionError("inspected in a subprocess: not in the cache")

registry._run_in_subprocess = refuse
known = set(ModelRegistry.get_supported_archs())
for arch in sys.argv[1:]:
    assert arch in known, arch
    ModelRegistry.models[arch].inspect_model_cls()
print("OK", len(sys.argv) - 1)
"""


def test_every_tiny_architecture_is_answered_from_the_cache() -> None:
    assert (vllm_cache_root() / "modelinfos").is_dir()
    run = subprocess.run([sys.executable, "-c", READ_ONLY, *ARCHITECTURES], capture_output=True, text=True,
                         env=vllm_env(), cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert f"OK {len(ARCHITECTURES)}" in run.stdout
