"""Running real vLLM in a fresh process (scripts/generate.py) with the offline test environment.

Shared by the tests, the demo and the benchmarks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

BASE_ENV = {
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1", "VLLM_CACHE_ROOT": str(REPO / ".cache" / "vllm"),
}


@dataclass
class Generation:
    returncode: int
    result: dict | None
    output: str


def vllm_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PATCHKIT_", "VLLM_PLUGINS"))}
    return {**env, **BASE_ENV, **extra}


def run_generate(model: Path, *args: str, timeout: float = 420, **env: str) -> Generation:
    """Run scripts/generate.py in a fresh process (vLLM's multiprocessing on unless env says otherwise)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "generate.py"), str(model), *args],
        env=vllm_env(**env), capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    return Generation(proc.returncode, result, proc.stdout + proc.stderr)
