"""Every test the docs cite exists (issue 51, finding 8: docs/running.md cited a test that was gone).

README.md, SECURITY.md and docs/*.md back their claims with ``tests/<path>.py`` and
``tests/<path>.py::test_name`` references; each file must exist and each named test must be defined in it
(as a function; a parametrized test is named without its ids).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CITED = re.compile(r"tests/[A-Za-z0-9_/]+\.py(?:::[A-Za-z0-9_]+)?")


def _docs() -> list[Path]:
    return [REPO / "README.md", REPO / "SECURITY.md", *sorted((REPO / "docs").glob("*.md"))]


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_cited_test_exists() -> None:
    missing = []
    cited = 0
    for doc in _docs():
        for ref in sorted(set(CITED.findall(doc.read_text()))):
            cited += 1
            file, _, name = ref.partition("::")
            path = REPO / file
            if not path.is_file():
                missing.append(f"{doc.name}: {ref} (no such file)")
            elif name and name not in _tests_in(path):
                missing.append(f"{doc.name}: {ref} (no such test in {file})")
    assert cited > 20, f"only {cited} citations found: the pattern no longer matches how the docs cite tests"
    assert not missing, "\n".join(missing)
