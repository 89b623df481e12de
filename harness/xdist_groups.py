"""pytest-xdist scheduling: a test module's tests on one worker, together with the modules that share its engines.

Under ``--dist loadfile`` (``scripts/test.sh``, the README's inner loop) pytest-xdist sends each test file whole to
one worker. A module that reuses another module's results (``test_afd_microbatch`` reads ``test_afd_e2e``'s 1A1F
pairs) declares the same ``XDIST_GROUP = "name"`` as that module; ``make_scheduler`` then sends both to one
worker, in collection order. Modules that declare none are a group of their own, as under plain ``loadfile``.
(pytest-xdist's ``--dist loadgroup`` marks would say the same, but have no effect on pytest 9: its worker renames
``item._nodeid``, which pytest 9 no longer reads.) Other ``--dist`` modes are left to pytest-xdist.

The controller collects no tests, so what a module declares is read from its source (``declared``): a literal
assigned at module level, nothing imported or evaluated.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Any


@functools.cache
def declared(path: Path, name: str, default: object) -> object:
    """The literal a module's source assigns to ``name`` at module level; ``default`` if none (or unreadable).
    ``ValueError`` naming the file and line when the value is not a literal (``5 + 4``: the session reads the
    source, it does not run it)."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return default
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                raise ValueError(f"{path}:{node.lineno}: {name} must be a literal (the test session reads it from "
                                 f"the source): {ast.unparse(node.value)}") from None
    return default


def make_scheduler(config: Any, log: Any) -> Any:
    """``pytest_xdist_make_scheduler``: under ``--dist loadfile``, pytest-xdist's file scheduler with each file's
    scope its module's ``XDIST_GROUP``; None (pytest-xdist decides) otherwise."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleGroups(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.partition("::")[0]
            return str(declared(config.rootpath / module, "XDIST_GROUP", module))

    return ModuleGroups(config, log)
