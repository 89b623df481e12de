"""patchkit's layers: imports go one way and never in a circle; the hook loads only its warm path.

The import rules are import-linter contracts in ``pyproject.toml`` (``[tool.importlinter]``):
layers, lowest first, the shared basics (``plan``, with the error types, and ``fingerprint``),
``runtime`` (runs in every vLLM process), ``manifest`` (YAML, validation, selection), ``review``
(reads a vLLM tree without importing it), and on top the CLI and the package root (the public
API); no cycles between patchkit's packages or modules; only the top imports the root (the one
exception: ``runtime.cache`` reads the root's ``__version__``); afd_patches imports only the
root. Every import counts, also one inside a function or under ``TYPE_CHECKING``. This file runs
``lint-imports`` on the tree, and on a copy with one deliberate violation of each contract.
What a contract cannot say stays here: the modules the hook loads, and the plan records' behaviour.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.manifests import header

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "patchkit"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` (this environment's) with ``root``'s ``pyproject.toml``, run in ``root`` so that
    its packages are the ones analysed; no cache written."""
    command = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(command), "--no-cache", "--config", "pyproject.toml"], cwd=root,
                          capture_output=True, text=True, timeout=120)


def lint_broken_copy(root: Path, violations: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``lint_imports`` on a copy of the tree under ``root`` (pyproject.toml, patchkit, afd_patches) with each of
    ``violations`` (path relative to the repository: text) appended to its file."""
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    for package in ("patchkit", "afd_patches"):
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, text in violations.items():
        with open(root / rel, "a") as fh:
            fh.write(text)
    return lint_imports(root)


def test_the_import_contracts_hold() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


VIOLATIONS = {
    # a lazy upward import: runtime reaching the CLI from inside a function
    "patchkit/runtime/engine.py": "\n\ndef _upward():\n    from patchkit.cli import run\n",
    # a cycle between two sibling modules of one layer
    "patchkit/runtime/hooks.py": "\nfrom patchkit.runtime import rebind\n",
    "patchkit/runtime/rebind.py": "\nfrom patchkit.runtime import hooks\n",
    # a lower layer using the public API it sits under
    "patchkit/manifest/inherit.py": "\nfrom patchkit import activate\n",
    # the plugin reaching past the public API, under TYPE_CHECKING
    "afd_patches/__init__.py": ("\nTYPE_CHECKING = False\nif TYPE_CHECKING:\n"
                                "    from patchkit.runtime.engine import Run\n"),
}


def test_a_violation_of_each_contract_breaks_it(tmp_path: Path) -> None:
    """A copy of the tree with one violation per contract: ``lint-imports`` exits 1 and names each."""
    result = lint_broken_copy(tmp_path, VIOLATIONS)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "Contracts: 4 kept, 4 broken." in out, out  # the four afd_patches layer contracts kept
    assert "patchkit.runtime.engine -> patchkit.cli" in out
    assert "No cycles are allowed in patchkit.runtime." in out and ".rebind -> .hooks" in out
    assert "patchkit.manifest.inherit is not allowed to import patchkit:" in out
    assert "afd_patches -> patchkit.runtime.engine" in out


WARM_PATH = {"patchkit", "patchkit.plan", "patchkit.runtime", "patchkit.runtime.cache", "patchkit.runtime.engine",
             "patchkit.runtime.hooks"}
PROBE = """
import json, sys
import patchkit
from patchkit.plan import Runtime
before = set(sys.modules)
status = patchkit.activate("lazy", sys.argv[1], Runtime("0.32.0", None, _platform="cpu"))
assert status.active, status.problem
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_the_hook_loads_only_the_warm_path(tmp_path):
    """With a warm plan cache and every target still unimported, activate() loads the warm path and
    nothing else: no manifest/review/cli layer, no YAML, JSON Schema or packaging."""
    import os
    import subprocess
    import sys

    manifests = tmp_path / "manifests"
    manifests.mkdir()
    (manifests / "m.yaml").write_text(
        header("lazy", "lazyplug") + 'patches:\n'
        '  - {id: w, target: "lazyvictim.core:f", op: wrap, with: "lazyplug.p:w", why: t}\n')
    env = {**os.environ, "PATCHKIT_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(PACKAGE.parent)}
    env.pop("PATCHKIT_DISABLE", None)
    cold = subprocess.run([sys.executable, "-c", PROBE, str(manifests)], capture_output=True, text=True, env=env)
    assert cold.returncode == 0, cold.stderr
    assert "patchkit.manifest.validate" in cold.stdout  # the first process compiles the plan
    warm = subprocess.run([sys.executable, "-c", PROBE, str(manifests)], capture_output=True, text=True, env=env)
    assert warm.returncode == 0, warm.stderr
    loaded = set(__import__("json").loads(warm.stdout))
    patchkit_modules = {m for m in loaded if m.startswith("patchkit")}
    assert patchkit_modules == WARM_PATH - {"patchkit", "patchkit.plan"}
    assert not loaded & {"yaml", "jsonschema", "packaging", "packaging.specifiers"}, loaded


def test_plan_records_behave_as_frozen_dataclasses():
    # patchkit.plan's classes generate only __init__ (hook cost); the rest comes from _Record
    import dataclasses

    from patchkit.plan import Manifest, Patch, Requirement

    patch = Patch(id="a", target="m:f", op="wrap", with_="p:w", when={"env": {"X": "1"}})
    assert dataclasses.is_dataclass(patch) and not hasattr(patch, "__dict__")
    for attempt in (lambda: setattr(patch, "id", "b"), lambda: delattr(patch, "target"),
                    lambda: setattr(patch, "new_attribute", 1)):
        with pytest.raises((dataclasses.FrozenInstanceError, AttributeError)):
            attempt()
    assert patch.id == "a"
    assert patch == Patch(id="a", target="m:f", op="wrap", with_="p:w", when={"env": {"X": "1"}})
    assert patch != dataclasses.replace(patch, id="b") and patch != Requirement(id="a", target="m:f")
    assert repr(patch).startswith("Patch(id='a', target='m:f'") and "with_='p:w'" in repr(patch)
    with pytest.raises(TypeError):
        Patch(target="m:f", op="wrap")  # id is required
    with pytest.raises(TypeError):
        Patch(id="a", target="m:f")  # so is op, which Change has as a property
    with pytest.raises(TypeError):
        hash(patch)
    manifest = Manifest(file="f", plugin="p", packages=("p",), vllm_version="==1", vllm_commit=None, fallback=False,
                        entries=(patch,), models=(), digest="d", chain=())
    assert Manifest.from_json(manifest.to_json()) == manifest
