"""Which environments one fork server serves (``harness.fork_server``): its own, but for variables read when used.
The forked processes themselves are checked by every real-vLLM test."""

from __future__ import annotations

from harness import triton_cpu
from harness.fork_server import read_when_used, server_env

BASE = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "VLLM_CACHE_ROOT": "/c"}


def test_variables_read_when_used_do_not_change_the_server() -> None:
    env = {**BASE, "PYTEST_CURRENT_TEST": "t.py::x (call)", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PATCHKIT_REPORT_DIR": "/r", "AFD_TOKEN": "t", "VLLM_PLUGINS": ""}
    assert server_env(env) == BASE


def test_variables_read_at_import_get_their_own_server() -> None:
    for name, value in (("PYTHONPATH", "/drifted"), ("TRITON_INTERPRET", "1"), ("OMP_NUM_THREADS", "2"),
                        ("VLLM_USE_V2_MODEL_RUNNER", "1"), (triton_cpu.ENV, "1"), ("PYTHONUNBUFFERED", "1")):
        assert not read_when_used(name)
        assert server_env({**BASE, name: value}) != BASE
