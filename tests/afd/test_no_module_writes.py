"""No code in afd_patches changes a vLLM module behind patchkit's back: every change is a manifest entry.

A static check of afd_patches' source. It refuses, anywhere in the package:
- ``sys.modules`` (the way to reach another module's namespace by name);
- writing through ``__dict__`` or ``vars(...)``: ``x.__dict__[k] = v``, ``x.__dict__.update(...)``,
  ``vars(x)[k] = v``, ``vars(x).update(...)`` and the same with ``setdefault``/``pop``/``clear``;
- ``setattr``/``delattr`` on, or attribute assignment/deletion to, a name imported from vLLM
  (``import vllm.x as m; m.f = g``, ``from vllm.x import C; C.attr = v``) or a module imported by a
  computed name (``m = importlib.import_module(name)``, ``__import__(name)``).
Limits: a static check; a module object passed around further (into a function, a container) is not
followed.
"""

from __future__ import annotations

import ast

import pytest

from harness.env import REPO

_MUTATORS = {"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__"}


def _vllm_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name.split(".")[0]) for a in node.names if a.name.split(".")[0] == "vllm")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm" and node.level == 0:
            names.update(a.asname or a.name for a in node.names)
    return names


def _is_import_call(expr: ast.expr) -> bool:
    """``importlib.import_module(...)``, ``import_module(...)`` or ``__import__(...)``."""
    if not isinstance(expr, ast.Call):
        return False
    func = expr.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def _computed_modules(tree: ast.AST) -> set[str]:
    return {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and _is_import_call(node.value)
            for t in node.targets if isinstance(t, ast.Name)}


def _root(expr: ast.expr) -> str | None:
    while isinstance(expr, ast.Attribute | ast.Subscript):
        expr = expr.value
    if _is_import_call(expr):
        return "<imported by name>"
    return expr.id if isinstance(expr, ast.Name) else None


def _is_namespace(expr: ast.expr) -> bool:
    """``x.__dict__`` or ``vars(x)``."""
    return ((isinstance(expr, ast.Attribute) and expr.attr == "__dict__")
            or (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "vars"
                and bool(expr.args)))


def violations(source: str, name: str) -> list[str]:
    tree = ast.parse(source, name)
    vllm = _vllm_names(tree) | _computed_modules(tree) | {"<imported by name>"}
    found: list[str] = []

    def at(node: ast.AST, what: str) -> None:
        found.append(f"{name}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "modules" and _root(node) == "sys":
            at(node, "sys.modules")
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            if isinstance(target, ast.Subscript) and _is_namespace(target.value):
                at(node, "write into a namespace through __dict__/vars()")
            if isinstance(target, ast.Attribute) and _root(target) in vllm:
                at(node, f"assignment to an attribute of vLLM's {_root(target)}")
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _MUTATORS and _is_namespace(func.value):
                at(node, f"{func.attr}() on a namespace through __dict__/vars()")
            if (isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args
                    and _root(node.args[0]) in vllm):
                at(node, f"{func.id} on vLLM's {_root(node.args[0])}")
    return found


def test_afd_patches_never_writes_into_a_vllm_module():
    found = [v for path in sorted((REPO / "afd_patches").rglob("*.py"))
             for v in violations(path.read_text(), str(path.relative_to(REPO)))]
    assert not found, "afd_patches changes vLLM outside patchkit (declare it in the manifests):\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    # what afd_patches' model module did before the scoped-rebind manifest op
    "import sys\nnamespace = sys.modules['vllm.model_executor.models.llama'].__dict__\nnamespace.update(x=1)\n",
    "import vllm.model_executor.models.llama as m\nvars(m)['LlamaMLP'] = object\n",
    "import vllm.model_executor.models.llama as m\nm.__dict__.update(LlamaMLP=object)\n",
    "from vllm.model_executor.models import llama\nllama.LlamaMLP = object\n",
    "from vllm.model_executor.models.llama import LlamaMLP\nsetattr(LlamaMLP, 'forward', None)\n",
    "import importlib\nimportlib.import_module('vllm.x').f = None\n",
    "import importlib\nm = importlib.import_module(name)\nsetattr(m, 'f', None)\n",
])
def test_the_check_catches_a_write(source):
    assert violations(source, "snippet.py")


def test_the_check_allows_ordinary_code():
    assert violations("import argparse\ncopy = argparse.Namespace(**vars(args))\nself.x = 1\n", "ok.py") == []
