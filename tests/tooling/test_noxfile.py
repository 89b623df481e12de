"""The release smoke's test ids (``noxfile.SMOKE``) name tests that exist: a renamed or
re-parametrized test would otherwise make every release smoke fail with "not found"."""

from __future__ import annotations

import ast
import subprocess
import sys

from harness.env import REPO


def smoke_ids() -> list[str]:
    tree = ast.parse((REPO / "noxfile.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SMOKE" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("noxfile.py defines no SMOKE list")


def test_every_smoke_test_id_is_collected():
    ids = smoke_ids()
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "vllm", *ids], capture_output=True, text=True, cwd=REPO, timeout=300)
    collected = {line.strip() for line in out.stdout.splitlines() if "::" in line}
    assert out.returncode == 0 and collected == set(ids), out.stdout[-2000:] + out.stderr[-2000:]
