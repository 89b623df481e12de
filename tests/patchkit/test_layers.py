"""patchkit's layers: imports go one way and never in a circle.

Layers, lowest first: the shared basics (``plan``, with the error types, and ``fingerprint``),
``runtime`` (runs in every vLLM process), ``manifest`` (YAML, validation,
selection), ``review`` (reads a vLLM tree without importing it), and on top the
CLI and the package root (the public API). A module may import its own
layer or a lower one. Every import counts, also one inside a function or under
``TYPE_CHECKING``: a lazy import is still a dependency. The one exception is the
root's ``__version__`` (metadata, not code).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from patchkit.manifest.validate import _find_cycle
from tests.support.manifests import header

PACKAGE = Path(__file__).resolve().parents[2] / "patchkit"
BASICS = {"patchkit.plan", "patchkit.fingerprint"}
LAYERS = ["basics", "runtime", "manifest", "review", "top"]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    if module in BASICS:
        return 0
    second = module.split(".")[1] if "." in module else ""
    return LAYERS.index(second) if second in LAYERS[1:4] else LAYERS.index("top")


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The patchkit modules ``path`` imports anywhere in its source."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("patchkit"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("patchkit"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif not (node.module == "patchkit" and alias.name == "__version__"):
                    out.add(node.module)  # type: ignore[arg-type]
    return out


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(path, set(found)) - {name} for name, path in found.items()}


def test_every_import_goes_to_the_same_or_a_lower_layer():
    upward = [f"{mod} ({LAYERS[layer(mod)]}) imports {dep} ({LAYERS[layer(dep)]})"
              for mod, deps in graph().items() for dep in sorted(deps) if layer(dep) > layer(mod)]
    assert not upward, "\n".join(upward)


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """A cycle in ``g`` as ``[a, b, ..., a]``, or None (the manifest loader's cycle finder, on sorted edges)."""
    return _find_cycle({node: sorted(deps) for node, deps in sorted(g.items())})


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize("g, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": set()}, None),
])
def test_the_cycle_finder_finds_cycles(g, expected):
    assert find_cycle(g) == expected


def test_an_upward_import_is_caught(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from patchkit.cli import main\n")
    deps = imports_of(bad, set(modules()))
    assert deps == {"patchkit.cli"} and layer("patchkit.cli") > layer("patchkit.runtime.engine")


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
