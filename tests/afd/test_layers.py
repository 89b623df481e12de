"""afd_patches' layers: the connector's layers import downward only, nothing imports in a circle, and
afd_patches reaches patchkit only through its public API.

Connector layers, lowest first (``afd_patches.connectors``): the contract and the plain data (``base``,
``options``, ``auth``, with ``afd_patches.topology`` and ``afd_patches.metrics``); the header and the
transport interface (``wire``, ``transport``, ``arrivals``); the transports and the session protocol
(``tcp``, ``torch_group``, ``session``); what builds on them (``liveness``, ``rendezvous``, ``schedule``);
``formation``; the connector (``torch_dist``). A module may import its own layer or a lower one; nothing in
``connectors`` imports the workers, the models or the compat functions. Every import counts, also a lazy
one or one under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "afd_patches"
CONNECTOR_LAYERS = [
    {"base", "options", "auth", "afd_patches.topology", "afd_patches.metrics", "afd_patches"},
    {"wire", "transport", "arrivals"},
    {"tcp", "torch_group", "session"},
    {"liveness", "rendezvous", "schedule"},
    {"formation"},
    {"torch_dist"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph() -> dict[str, set[str]]:
    """Every afd_patches module → the afd_patches and patchkit modules it imports anywhere."""
    known = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    out: dict[str, set[str]] = {}
    for name, path in known.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith(("afd_patches", "patchkit")))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith(
                    ("afd_patches", "patchkit")):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in known else node.module)
        out[name] = deps - {name}
    return out


def connector_layer(module: str) -> int | None:
    short = module.removeprefix("afd_patches.connectors.")
    for i, members in enumerate(CONNECTOR_LAYERS):
        if short in members or module in members:
            return i
    return None


def test_connector_layers_import_downward_only() -> None:
    g = graph()
    modules = [m for m in g if m.startswith("afd_patches.connectors.")]
    assert {m.removeprefix("afd_patches.connectors.") for m in modules} == set().union(*CONNECTOR_LAYERS) - {
        "afd_patches.topology", "afd_patches.metrics", "afd_patches"}, "a connector module without a layer"
    bad = []
    for module in modules:
        mine = connector_layer(module)
        assert mine is not None
        for dep in g[module]:
            if dep.startswith(("afd_patches.workers", "afd_patches.models", "afd_patches.compat")):
                bad.append(f"{module} imports {dep}")
            theirs = connector_layer(dep)
            if dep.startswith("afd_patches.connectors.") and (theirs is None or theirs > mine):
                bad.append(f"{module} (layer {mine}) imports {dep} (layer {theirs})")
    assert not bad, bad


def test_no_import_cycles() -> None:
    g = graph()
    seen: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        seen[node] = 1
        for dep in sorted(g.get(node, ())):
            if seen.get(dep) == 1:
                return [*path, node, dep]
            if dep not in seen and (cycle := visit(dep, [*path, node])):
                return cycle
        seen[node] = 2
        return None

    for start in sorted(g):
        if start not in seen:
            cycle = visit(start, [])
            assert cycle is None, " -> ".join(cycle or [])


def test_patchkit_is_reached_through_its_public_api_only() -> None:
    internal = {f"{m} imports {d}" for m, deps in graph().items() for d in deps
                if d.startswith("patchkit.") and d.count(".") >= 1}
    assert not internal, internal
