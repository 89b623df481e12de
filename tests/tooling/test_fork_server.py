"""Which engines the fork server may start (``harness.fork_server.forkable``): only those whose environment differs
from the server's in variables read when used. The forked engines themselves are checked by every real-vLLM test."""

from __future__ import annotations

from harness.fork_server import RUNTIME_ENV, forkable, server_env

BASE = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "VLLM_CACHE_ROOT": "/c"}


def test_a_runtime_variable_may_differ() -> None:
    assert "PATCHKIT_REPORT_DIR" in RUNTIME_ENV
    assert forkable({**BASE, "PATCHKIT_REPORT_DIR": "/r", "VLLM_PLUGINS": ""}, BASE)


def test_a_variable_read_at_import_may_not() -> None:
    assert not forkable({**BASE, "PYTHONPATH": "/drifted"}, BASE)
    assert not forkable({**BASE, "TRITON_INTERPRET": "1"}, BASE)
    assert not forkable({**BASE, "OMP_NUM_THREADS": "2"}, BASE)
    assert not forkable({k: v for k, v in BASE.items() if k != "PATH"}, BASE)


def test_the_server_starts_without_the_runtime_variables() -> None:
    env = {**BASE, "PYTEST_CURRENT_TEST": "t.py::x (call)", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert server_env(env) == BASE
    assert forkable(env, server_env(env))
