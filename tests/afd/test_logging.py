"""AFD logs under vLLM's logger: every logger in afd_patches is ``afd_patches.LOGGER`` (``vllm.afd``), so
vLLM's logging configuration (handler, format, level INFO) applies to AFD's lines. A real run's log is checked
in tests/integration/test_afd_e2e.py (``test_afd_compiled_matches_plain_vllm_compiled``)."""

from __future__ import annotations

import ast
from pathlib import Path

import afd_patches
from afd_patches import LOGGER

PACKAGE = Path(afd_patches.__file__).resolve().parent


def test_every_afd_logger_is_the_one_under_vllms() -> None:
    assert LOGGER.startswith("vllm.")
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getLogger":
                calls.append((path.relative_to(PACKAGE.parent).as_posix(), ast.unparse(node)))
    assert calls, "no logger found: the scan is broken"
    assert [c for c in calls if c[1] != "logging.getLogger(LOGGER)"] == []

