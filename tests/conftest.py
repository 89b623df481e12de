"""Shared fixtures: throwaway packages and manifests written to a temp dir.

``sandbox`` writes a test file's throwaway packages (a victim to patch, a plugin package
with the replacements) on a fresh ``sys.path`` entry; ``manifest_dir`` writes one manifest,
usually ``tests.support.manifests.header(...)`` plus entries; ``runtime`` says "vLLM 0.32.0
on cpu" without importing vLLM. Code shared beyond fixtures lives in ``tests/support/``.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import patchkit
from patchkit.plan import Runtime


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
