"""``patchkit deps``: which symbols of the target package (vLLM) a plugin's code relies on, and are they declared?

``scan(package_dirs, resolver)`` reads the plugin's packages as syntax trees
(never imports them) and finds every vLLM symbol they

- import (``from vllm.x import A as B``, ``import vllm.x as m``; at module level
  or inside functions);
- subclass (a class statement's bases);
- call or construct (``A(...)``, ``m.f(...)``, ``A.method(...)``);
- reach through an attribute of an imported name (``A.b`` where the static
  model resolves ``b`` in ``A``);
- inherit and use on ``self`` / ``super()`` inside a subclass of a vLLM class
  (``self.load_weights``, ``super().forward``), when no class of the plugin
  defines that name and the vLLM base (or one of its bases) defines it.

Each symbol is resolved in the vLLM tree through re-exports and aliases
(``patchkit.static.Resolver``), so ``from vllm import LLM`` and
``from vllm.entrypoints.llm import LLM`` are one symbol. ``compare(symbols,
manifest, resolver)`` matches them against the manifest's ``requires:``: a
symbol is covered by a requirement on itself, on a member of it
(``LlamaMLP`` by ``LlamaMLP.__init__``) or, with pin ``full``, on the class
that defines it (``LlamaForCausalLM.forward`` by ``LlamaForCausalLM``); a requirement no symbol matches is
"no longer used" unless it says ``indirect: true``, or it belongs to a feature and the tree lacks it (the
verdict refuses that feature there; the plugin's uses of it cannot resolve).

``run_deps`` is the command: exit 0 complete, 1 a symbol is undeclared or a
requirement unused, 2 bad input. ``--suggest`` prints YAML for the undeclared
ones with the pin their use calls for (subclassed: ``full`` on the class;
constructed: ``signature`` on ``__init__``; called: ``signature``; otherwise
``exists``) and the tree's fingerprint.

Limits: no value or type analysis — a vLLM object reached through a parameter
or a return value (``vllm_config.model_config``, ``self.model_runner`` set in
vLLM's ``__init__``) is not seen, nor are names built at run time; an import
inside a function counts for the whole module.
"""

from __future__ import annotations

import ast
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from patchkit.plan import Entry, Manifest
from patchkit.static import Definition, Resolver
from patchkit.static.tree import in_package

KINDS = ("subclass", "construct", "call", "member", "inherited", "import")  # strongest use first
_PIN = {"subclass": "full", "construct": "signature", "call": "signature"}


@dataclass
class Symbol:
    """One vLLM symbol the plugin uses: where it is defined, how and where it is used."""

    ref: str  # canonical 'module:qualname' of the definition
    named_as: str  # how the plugin's code first names it ('module:qualname' as imported)
    definition: Definition
    kinds: set[str] = field(default_factory=set)
    sites: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if k in self.kinds)

    def suggestion(self, resolver: Resolver) -> dict[str, Any]:
        """The requirement this use calls for (target, pin, fingerprint)."""
        from patchkit import fingerprint

        target, node = self.named_as, self.definition.node
        pin = _PIN.get(self.kind, "exists")
        if self.kind == "construct":
            init = resolver.resolve_target(f"{self.ref}.__init__")
            found = init.definition or init.inherited
            if found is not None:
                target, node = f"{self.named_as}.__init__", found.node
            else:  # fields (a dataclass, a NamedTuple) are the constructor: the body counts
                pin = "full"
        out: dict[str, Any] = {"target": target, "pin": pin}
        if pin != "exists":
            out["fingerprint"] = fingerprint.of_node(node)
        out["why"] = f"{self.kind}: {', '.join(self.sites[:3])}"
        return out


class _ModuleScan(ast.NodeVisitor):
    """One plugin module: its vLLM aliases, then every use of them."""

    def __init__(self, module: str, path: str, resolver: Resolver, found: dict[str, Symbol],
                 vllm_classes: list[tuple[ast.ClassDef, list[Definition], str]]) -> None:
        self.module, self.path, self.resolver, self.found = module, path, resolver, found
        self.vllm_classes = vllm_classes
        self.aliases: dict[str, tuple[str, str | None]] = {}  # local name -> (module, name or None for a module)

    def collect_imports(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and in_package(node.module):
                for a in node.names:
                    if a.name != "*":
                        self.aliases[a.asname or a.name] = (node.module, a.name)
                        self.add(node.module, [a.name], "import", node.lineno)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if in_package(a.name):
                        bound = a.asname or a.name.split(".")[0]
                        self.aliases[bound] = (a.name if a.asname else a.name.split(".")[0], None)

    def add(self, module: str, parts: list[str], kind: str, line: int) -> Definition | None:
        """Record the longest prefix of ``module:parts`` that resolves to a definition; return it."""
        for n in range(len(parts), 0, -1):
            named = f"{module}:{'.'.join(parts[:n])}"
            res = self.resolver.resolve_target(named)
            definition = res.definition or res.inherited
            if definition is None:
                continue
            sym = self.found.setdefault(definition.ref, Symbol(definition.ref, named, definition))
            sym.kinds.add(kind if n == len(parts) else "member" if kind != "import" else "import")
            site = f"{self.path}:{line}"
            if site not in sym.sites:
                sym.sites.append(site)
            return definition
        return None

    def chain(self, expr: ast.expr) -> tuple[str, list[str]] | None:
        """``alias.a.b`` → (module, [name, a, b]) for a vLLM alias; else None."""
        attrs: list[str] = []
        while isinstance(expr, ast.Attribute):
            attrs.insert(0, expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name) or expr.id not in self.aliases:
            return None
        module, name = self.aliases[expr.id]
        if name is None:  # a module alias: leading attributes may be submodules
            while attrs and self.resolver.tree.has_module(f"{module}.{attrs[0]}"):
                module = f"{module}.{attrs.pop(0)}"
            return (module, attrs) if attrs else None
        return module, [name, *attrs]

    def use(self, expr: ast.expr, kind: str) -> Definition | None:
        target = self.chain(expr)
        if target is None:
            return None
        definition = self.add(target[0], target[1], kind, expr.lineno)
        if kind == "call" and definition is not None and definition.kind == "class" and len(target[1]) == \
                len(definition.qualname.split(".")):
            self.found[definition.ref].kinds.add("construct")
        return definition

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = [d for d in (self.use(b, "subclass") for b in node.bases) if d is not None]
        if bases:
            self.vllm_classes.append((node, bases, self.path))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        self.use(node.func, "call")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self.use(node, "member") is None:
            self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.use(node, "import")


def _self_members(cls: ast.ClassDef) -> set[tuple[str, int, bool, bool]]:
    """(name, line, called, through super()) of ``self.X`` / ``super().X`` reads in the class's methods."""
    out = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            v = node.value
            is_self = isinstance(v, ast.Name) and v.id == "self"
            is_super = isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super"
            if is_self or is_super:
                out.add((node.attr, node.lineno, is_super))
    calls = {(n.func.attr, n.func.lineno) for n in ast.walk(cls)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    return {(name, line, (name, line) in calls, is_super) for name, line, is_super in out}


def _defined_names(trees: list[ast.Module]) -> set[str]:
    """Every name a class of the plugin defines or assigns on ``self`` (inherited lookups skip them)."""
    names: set[str] = set()
    for tree in trees:
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for stmt in cls.body:
                if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(stmt.name)
                elif isinstance(stmt, ast.Assign | ast.AnnAssign):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
            for n in ast.walk(cls):
                if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                        and isinstance(n.value, ast.Name) and n.value.id == "self"):
                    names.add(n.attr)
    return names


def plugin_files(package_dirs: list[Path]) -> list[tuple[str, Path, str]]:
    """(module name, file, path shown) of every ``.py`` file under the given package folders, sorted."""
    out = []
    for pkg in package_dirs:
        for root, dirs, files in os.walk(pkg):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
            for f in sorted(files):
                if f.endswith(".py"):
                    rel = Path(root, f).relative_to(pkg.parent).with_suffix("")
                    parts = list(rel.parts)
                    if parts[-1] == "__init__":
                        parts.pop()
                    out.append((".".join(parts), Path(root, f), str(Path(root, f).relative_to(pkg.parent))))
    return out


def scan(package_dirs: list[Path], resolver: Resolver) -> dict[str, Symbol]:
    """Every vLLM symbol the packages use, by canonical ref (see the module docstring)."""
    found: dict[str, Symbol] = {}
    vllm_classes: list[tuple[ast.ClassDef, list[Definition], str]] = []
    trees_with_paths = []
    for module, path, rel in plugin_files(package_dirs):
        tree = ast.parse(path.read_bytes(), str(path))
        trees_with_paths.append((tree, rel))
        visitor = _ModuleScan(module, rel, resolver, found, vllm_classes)
        visitor.collect_imports(tree)
        visitor.visit(tree)
    own = _defined_names([t for t, _ in trees_with_paths])
    plugin_classes = {n.name: (n, rel) for tree, rel in trees_with_paths for n in ast.walk(tree)
                      if isinstance(n, ast.ClassDef)}
    for cls, bases, path in vllm_classes:
        for name, line, called, through_super, site_path in sorted(_members_with_mixins(cls, path, plugin_classes)):
            if (name in own and not through_super) or name.startswith("__"):
                continue
            for base in bases:
                definition = _member(resolver, base, name)
                if definition is not None:
                    sym = found.setdefault(definition.ref, Symbol(definition.ref, definition.ref, definition))
                    sym.kinds.add("call" if called else "inherited")
                    site = f"{site_path}:{line}"
                    if site not in sym.sites:
                        sym.sites.append(site)
                    break
    return found


def _members_with_mixins(cls: ast.ClassDef, path: str, plugin_classes: dict[str, tuple[ast.ClassDef, str]]
                         ) -> set[tuple[str, int, bool, bool, str]]:
    """``_self_members`` of ``cls`` and of the plugin's classes among its bases (mixins, by name), recursively."""
    out: set[tuple[str, int, bool, bool, str]] = set()
    todo, seen = [(cls, path)], set()
    while todo:
        node, where = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        out.update((name, line, called, sup, where) for name, line, called, sup in _self_members(node))
        todo.extend(plugin_classes[b.id] for b in node.bases if isinstance(b, ast.Name) and b.id in plugin_classes)
    return out


def _member(resolver: Resolver, cls: Definition, name: str) -> Definition | None:
    if not isinstance(cls.node, ast.ClassDef):
        return None
    found = resolver.descend(cls, [name])
    if isinstance(found, Definition):
        return found
    return resolver.inherited(cls, name)


def _canonical(resolver: Resolver, target: str) -> str:
    res = resolver.resolve_target(target)
    definition = res.definition or res.inherited
    if definition is not None:
        return definition.ref
    if isinstance(res.owner, Definition):  # e.g. a member vLLM's class no longer has: keep the owner's path
        return f"{res.owner.ref}.{target.rpartition('.')[2]}"
    return target


@dataclass
class Coverage:
    """``deps`` against ``requires:``."""

    symbols: dict[str, Symbol]
    declared: dict[str, Entry]  # canonical ref -> requirement
    missing: list[Symbol]
    unused: list[Entry]

    @property
    def covered(self) -> int:
        return len(self.symbols) - len(self.missing)

    def to_json(self, resolver: Resolver) -> dict[str, Any]:
        return {
            "symbols": len(self.symbols), "covered": self.covered, "requirements": len(self.declared),
            "coverage": round(self.covered / len(self.symbols), 4) if self.symbols else 1.0,
            "missing": [{"ref": s.ref, "named_as": s.named_as, "kind": s.kind, "sites": s.sites,
                         "suggest": s.suggestion(resolver)} for s in self.missing],
            "unused": [e.target for e in self.unused],
            "used": [{"ref": s.ref, "kinds": sorted(s.kinds), "sites": s.sites} for s in self.symbols.values()],
        }


def compare(symbols: dict[str, Symbol], manifest: Manifest, resolver: Resolver) -> Coverage:
    """Which used symbols no requirement covers, and which requirements no symbol needs."""
    declared = {_canonical(resolver, r.target): r for r in manifest.requires}

    def covers(req: str, sym: str) -> bool:
        return (req == sym or req.startswith(sym + ".")
                or (declared[req].pin == "full" and sym.startswith(req + ".")))

    def refused_here(r: Entry) -> bool:
        """A feature's requirement this tree lacks: the verdict refuses that feature here, and the plugin's uses
        of the symbol cannot resolve in a tree without it, so it is not "unused"."""
        found = resolver.resolve_target(r.target)
        return r.feature is not None and found.definition is None and found.inherited is None

    missing = [s for ref, s in sorted(symbols.items()) if not any(covers(d, ref) for d in declared)]
    unused = [r for d, r in declared.items()
              if not r.indirect and not any(covers(d, s) for s in symbols) and not refused_here(r)]
    return Coverage(symbols, declared, missing, unused)


def _text(cov: Coverage, manifest: Manifest, resolver: Resolver, suggest: bool) -> str:
    n = len(cov.symbols)
    out = [f"patchkit deps {manifest.file}: {n} vLLM symbols used by {', '.join(manifest.packages)}; "
           f"{cov.covered} declared ({100 * cov.covered / n if n else 100:.0f} %), "
           f"{len(manifest.requires)} requirements"]
    for s in cov.missing:
        out.append(f"  UNDECLARED {s.ref} ({s.kind}; named as {s.named_as}) at {', '.join(s.sites[:4])}")
    for r in cov.unused:
        out.append(f"  UNUSED     {r.target} (no code of the plugin uses it; 'indirect: true' if that is meant)")
    if suggest and cov.missing:
        import yaml

        out.append("requires:  # suggested; check each 'why' and pin before committing")
        text = yaml.safe_dump([s.suggestion(resolver) for s in cov.missing], sort_keys=False, width=110)
        out.extend("  " + line for line in text.rstrip("\n").split("\n"))
    return "\n".join(out) + "\n"


def run_deps(manifest_path: str, vllm_src: str, src: str | None = None, fmt: str = "text",
             suggest: bool = False) -> tuple[int, str]:
    """The command: ``(exit_code, output)``; ``src`` is a folder holding the packages (default: where
    they are importable from, found without importing them)."""
    import importlib.util

    from patchkit import manifest as manifest_mod
    from patchkit.plan import ManifestError
    from patchkit.static import TreeError, open_tree

    try:
        loaded = manifest_mod.load(manifest_path)
    except ManifestError as exc:
        return 2, str(exc)
    dirs = []
    for pkg in loaded.packages:
        if src is not None:
            where = Path(src, pkg)
        else:
            spec = importlib.util.find_spec(pkg)
            locations = list(spec.submodule_search_locations or []) if spec else []
            where = Path(locations[0]) if locations else Path("/nonexistent")
        if not (where / "__init__.py").is_file():
            return 2, f"patchkit deps: package {pkg!r} not found{' in ' + src if src else ''}"
        dirs.append(where)
    try:
        resolver = Resolver(open_tree(vllm_src))
        symbols = scan(dirs, resolver)
    except TreeError as exc:
        return 2, f"patchkit deps: {exc}"
    except (SyntaxError, UnicodeDecodeError) as exc:
        return 2, f"patchkit deps: a plugin file does not parse: {exc}"
    cov = compare(symbols, loaded, resolver)
    code = 1 if cov.missing or cov.unused else 0
    if fmt == "json":
        return code, json.dumps({**cov.to_json(resolver), "exit_code": code}, indent=2)
    return code, _text(cov, loaded, resolver, suggest)


