"""The count of vLLM starts and each module's budget of them (``harness.starts``, ``tests/conftest.py``).

An inner pytest session runs throwaway test modules with this suite's ``tests/conftest.py`` as its plugin;
their "vLLM starts" are ``harness.starts.spawn`` of a trivial Python process, from the test process and from a
subprocess of it. Checks: a module over its ``ENGINE_BUDGET`` errors naming the count and the budget, one within
it passes; a start made in a subprocess counts for the test that ran it; the session's end prints the starts per
kind and module and its slowest tests.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from harness.env import REPO

START = """
import os, sys
from pathlib import Path
from harness import starts


def start(kind, tmp_path, name):
    starts.spawn(kind, [sys.executable, "-c", "pass"], tmp_path / f"{name}.log", dict(os.environ)).wait()
"""

MODULES = {
    "test_over.py": START + """
ENGINE_BUDGET = 2


def test_three_starts(tmp_path):
    for i in range(2):
        start("engine", tmp_path, i)
    starts.run([sys.executable, "-c", "pass"], dict(os.environ), 60)
""",
    "test_within.py": START + """
import subprocess

ENGINE_BUDGET = 2


def test_one_here_one_in_a_subprocess(tmp_path):
    start("API server", tmp_path, "here")
    code = "from harness import starts; starts.record('engine', 'from a subprocess')"
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))
""",
}


def _session(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    for name, text in MODULES.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})


def test_a_module_over_its_budget_fails_and_the_session_prints_the_counts(tmp_path: Path) -> None:
    run = _session(tmp_path, "test_over.py", "test_within.py")
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "1 error" in out and "2 passed" in out, out
    assert ("test_over.py started 3 vLLM process trees (2 engine, 1 front end), over its ENGINE_BUDGET of 2"
            in out), out
    assert "vLLM starts: 5 (3 engines, 1 API server, 1 front end; 0 forked)" in out, out
    assert "    3  test_over.py  (2 engine, 1 front end; budget 2)" in out, out
    assert "    2  test_within.py  (1 API server, 1 engine; budget 2)" in out, out  # the subprocess's start
    assert "2 slowest tests (setup + call + teardown)" in out and "test_within.py::test_one_here" in out, out
