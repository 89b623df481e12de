"""Every vLLM process tree the tests start, counted in one place: engines, API servers, front ends.

Three kinds (``KINDS``): an ``engine`` is one ``python -m harness.engine`` process (one ``LLM``, plain or an
AFD role, its own process split included); an ``API server`` is one OpenAI server tree (``vllm serve``/
``api_server``, a headless data-parallel node included); a ``front end`` is a vLLM entry point run to its end
without serving (a refusal, ``--help``). ``spawn`` starts a tree in the background and ``run`` runs a front end
to its end; ``harness.engine.start`` goes through ``spawn``. Each start appends one JSON line (``kind``, the
test it ran for, what was started) to ``starts.jsonl`` in the folder named by ``$HARNESS_STARTS_DIR``, from
whichever process starts it (a subprocess of a test inherits the variable and ``PYTEST_CURRENT_TEST``, so its
starts count for that test). Without the variable nothing is recorded (the demo, the benchmarks).

The test session (``tests/conftest.py``) sets the folder, holds each test module to its ``ENGINE_BUDGET``
(every kind counts; a module without one may start none) and prints the figures at its end. Lines are
appended with ``O_APPEND`` and stay well under ``PIPE_BUF``, so processes started side by side may record at
once.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path
from typing import Literal

from harness import fork_server
from harness.env import REPO

ENV = "HARNESS_STARTS_DIR"
Kind = Literal["engine", "API server", "front end"]
KINDS: tuple[Kind, ...] = ("engine", "API server", "front end")
_FILE = "starts.jsonl"


def record(kind: Kind, what: str) -> None:
    """Append one start of ``kind`` (``what``: a short description) for the current test; no-op without ``ENV``."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    line = json.dumps({"kind": kind, "test": os.environ.get("PYTEST_CURRENT_TEST", ""), "what": what[:200]})
    fd = os.open(Path(folder) / _FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def read(folder: str | Path) -> list[dict[str, str]]:
    """Every start recorded in ``folder``, in order ([] when none)."""
    path = Path(folder) / _FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def module_of(test: str) -> str:
    """The module node id (``tests/x/test_y.py``) of a ``PYTEST_CURRENT_TEST`` value ("" outside a test)."""
    return test.split("::", 1)[0] if "::" in test else ""


def per_module(starts: list[dict[str, str]]) -> dict[str, Counter[str]]:
    """``{module node id: Counter(kind -> starts)}`` of ``starts``."""
    out: dict[str, Counter[str]] = {}
    for s in starts:
        out.setdefault(module_of(s["test"]), Counter())[s["kind"]] += 1
    return out


def spawn(kind: Kind, args: list[str], log: Path, env: dict[str, str],
          what: str = "") -> fork_server.Process:
    """Start ``args`` (a vLLM process tree) in its own session, ``cwd`` the repository root, stdout and stderr
    into ``log``; recorded as one start of ``kind`` (``what``, default the log's name; `` (forked)`` added when
    it was forked: ``harness.fork_server``). The caller ends it (e.g. ``os.killpg``)."""
    forked = fork_server.maybe_spawn(args, log, env)
    record(kind, (what or log.name) + (" (forked)" if forked else ""))
    if forked is not None:
        return forked
    with log.open("wb") as fh:
        return subprocess.Popen(args, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=REPO)


def run(args: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run a vLLM front end (``args``) to its end, ``cwd`` the repository root, its output captured as text;
    recorded as one ``front end`` start. Raises ``subprocess.TimeoutExpired`` past ``timeout_s``."""
    record("front end", " ".join(args[1:4]))
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
