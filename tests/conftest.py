"""Shared fixtures: throwaway packages and manifests written to a temp dir.

``sandbox`` writes a test file's throwaway packages (a victim to patch, a plugin package
with the replacements) on a fresh ``sys.path`` entry; ``manifest_dir`` writes one manifest,
usually ``tests.support.manifests.header(...)`` plus entries; ``runtime`` says "vLLM 0.32.0
on cpu" without importing vLLM. Code shared beyond fixtures lives in ``tests/support/``.

The session also counts the vLLM process trees it starts (``harness.starts``: engines, API servers, front
ends): each test module may start at most its ``ENGINE_BUDGET`` (a module-level int; none declared: 0), or its
last test errors at teardown, naming the count. At its end the session prints the starts per module and kind and
its ten slowest tests (setup + call + teardown). vLLM processes are forked from a server that imported vLLM once
(``harness.fork_server``; ``HARNESS_FORK_SERVER=0`` starts each fresh), and plain vLLM's results are cached by
content under ``.cache/plain`` (``harness.plain_cache``; ``HARNESS_PLAIN_CACHE=0`` runs every plain engine). Under
pytest-xdist the workers record into their controller's folder, and a module whose tests are spread over workers
is checked against what was recorded by the time its teardown runs on each.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import patchkit
from harness import fork_server, plain_cache, starts, xdist_groups
from patchkit.plan import Runtime

_STARTS_DIR = pytest.StashKey[str]()
_PREVIOUS_DIR = pytest.StashKey["str | None"]()
_BUDGETS = pytest.StashKey[dict[str, int]]()
SLOWEST = 10


def _worker(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker (its controller owns the session's start records)."""
    return hasattr(config, "workerinput") and bool(os.environ.get(starts.ENV))


def pytest_configure(config: pytest.Config) -> None:
    """A fresh folder for this session's start records, named to every process it starts (``HARNESS_STARTS_DIR``);
    a pytest-xdist worker records into its controller's."""
    config.stash[_PREVIOUS_DIR] = os.environ.get(starts.ENV)
    config.stash[_STARTS_DIR] = os.environ[starts.ENV] if _worker(config) else tempfile.mkdtemp(prefix="afd-starts-")
    config.stash[_BUDGETS] = {}
    os.environ[starts.ENV] = config.stash[_STARTS_DIR]
    os.environ.setdefault(fork_server.ENV, "1")
    os.environ.setdefault(plain_cache.ENV, "1")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist loadfile``, modules that declare the same ``XDIST_GROUP`` run on one worker
    (``harness.xdist_groups``)."""
    return xdist_groups.make_scheduler(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _STARTS_DIR not in config.stash or _worker(config):
        return
    shutil.rmtree(config.stash[_STARTS_DIR], ignore_errors=True)
    previous = config.stash[_PREVIOUS_DIR]
    if previous is None:
        os.environ.pop(starts.ENV, None)
    else:
        os.environ[starts.ENV] = previous


@pytest.fixture(scope="module", autouse=True)
def engine_budget(request: pytest.FixtureRequest) -> Iterator[int]:
    """The module's budget of vLLM starts (its ``ENGINE_BUDGET``; none declared: 0); after its last test, fails when
    the module started more vLLM process trees (every kind of ``harness.starts``, made for any of its tests) than
    that."""
    module = request.node.nodeid
    budget = int(getattr(request.module, "ENGINE_BUDGET", 0))
    request.config.stash[_BUDGETS][module] = budget
    yield budget
    counts = starts.per_module(starts.read(request.config.stash[_STARTS_DIR])).get(module, Counter())
    if sum(counts.values()) > budget:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        pytest.fail(f"{module} started {sum(counts.values())} vLLM process trees ({kinds}), over its "
                    f"ENGINE_BUDGET of {budget}: share an engine (a module- or session-scoped fixture) before "
                    "raising the budget", pytrace=False)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """The session's vLLM starts (per kind, and per module against its budget) and its slowest tests."""
    if _STARTS_DIR not in config.stash:
        return
    rows = starts.read(config.stash[_STARTS_DIR])
    kinds = Counter(row["kind"] for row in rows)
    forked = sum(row["what"].endswith(" (forked)") for row in rows)
    terminalreporter.write_sep("=", f"vLLM starts: {len(rows)} (" + ", ".join(
        f"{kinds[kind]} {kind}{'s' if kinds[kind] != 1 else ''}" for kind in starts.KINDS) + f"; {forked} forked)")
    budgets = config.stash[_BUDGETS]
    for module, counts in sorted(starts.per_module(rows).items()):
        detail = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        budget = budgets.get(module)
        if budget is None:  # a pytest-xdist controller: its workers ran the module
            budget = int(xdist_groups.declared(config.rootpath / module, "ENGINE_BUDGET", 0))
        terminalreporter.write_line(f"{sum(counts.values()):5d}  {module or '(outside a test)'}  ({detail}; "
                                    f"budget {budget})")
    per_test: Counter[str] = Counter()
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                per_test[report.nodeid] += report.duration
    durations = per_test.most_common(SLOWEST)
    if durations:
        terminalreporter.write_sep("=", f"{len(durations)} slowest tests (setup + call + teardown)")
    for nodeid, seconds in durations:
        terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}")


@pytest.fixture
def runtime() -> Runtime:
    """A runtime that says 'vLLM 0.32.0 on cpu' without importing vLLM."""
    return Runtime("0.32.0", None, _platform="cpu")


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """``write(files)``: write ``{relative path: source}`` under a fresh sys.path entry.

    Modules created here are forgotten and every plan is reverted afterwards.
    """
    root = tmp_path / "src"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PATCHKIT_DISABLE", raising=False)
    monkeypatch.delenv("PATCHKIT_REPORT_DIR", raising=False)
    before = set(sys.modules)

    def write(files: dict[str, str]) -> Path:
        for rel, text in files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text))
        return root

    yield write
    patchkit.revert()
    for name in set(sys.modules) - before:
        # only the throwaway packages: patchkit's own lazily imported modules stay, as in a real process
        if not name.startswith("patchkit"):
            del sys.modules[name]


@pytest.fixture
def manifest_dir(tmp_path: Path) -> Callable[[str], Path]:
    """``make(yaml_text)``: a folder holding one manifest file ``m.yaml``."""

    def make(text: str) -> Path:
        d = tmp_path / "manifests"
        d.mkdir(exist_ok=True)
        (d / "m.yaml").write_text(textwrap.dedent(text))
        return d

    return make


@pytest.fixture
def afd_caplog(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    """``caplog`` that sees AFD's records (``afd_patches.LOGGER``, under vLLM's ``vllm`` logger) also where vLLM
    configured its logging in this process: that sets ``vllm`` not to propagate to the root logger, where
    ``caplog`` listens. ``propagate`` is restored after the test."""
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
    return caplog
