"""Name resolution over a ``SourceTree``: targets, re-exports, class hierarchies.

``Resolver`` answers "what does ``module:qualname`` name in this tree?" the way
the import system and ``patchkit.runtime.targets.Slot`` would at run time, but from the
syntax trees alone:

- module-level names come from ``def``/``class``/assignments and from imports,
  which are followed (``from .x import f`` in a package ``__init__`` is a
  re-export: the definition found is the one in ``x``); a missing name that is a
  submodule resolves to that module; ``from m import *`` is followed last;
- class members come from the class body only (``Slot`` refuses inherited
  attributes as well); annotated assignments count, so dataclass and pydantic
  fields resolve;
- base classes are resolved through the same rules, so subclass questions work
  across modules.

Straight-line order decides between two bindings of one name (the later wins,
as when the module runs); bindings under ``if TYPE_CHECKING:`` and in ``except``
handlers are used only when no other binding exists.

Limits (best effort, stated so a reader can judge a verdict): no control-flow
or value analysis (``globals()[...] =``, ``setattr``, names built at run time,
module ``__getattr__`` hooks are not seen); a class base that is a call or
``type(...)`` is not followed; nested classes see module-level names only.
Every lookup parses at most the modules it needs, each once per tree.

The values it returns (``Definition``, ``ModuleRef``, ``Resolution``, ``Override``) are defined in
``patchkit.static.definitions`` and stay importable from here.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from patchkit.static.definitions import (
    Binding,
    Definition,
    ModuleRef,
    Override,
    Resolution,
    Scope,
    dotted,
    is_type_checking,
)
from patchkit.static.tree import SourceTree

_MAX_DEPTH = 40
_CLASS_DECL = re.compile(rb"class[ \t]+(\w+)[ \t]*\(([^)]*)\)")
_IDENT = re.compile(rb"[A-Za-z_]\w*")


def _assigned_names(target: ast.expr) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, ast.Tuple | ast.List):
        for elt in target.elts:
            yield from _assigned_names(elt)
    elif isinstance(target, ast.Starred):
        yield from _assigned_names(target.value)


class Resolver:
    """Resolves names in one ``SourceTree``; caches scopes and answers per tree."""

    def __init__(self, tree: SourceTree) -> None:
        self.tree = tree
        self._scopes: dict[int, Scope] = {}
        self._bases: dict[tuple[str, str], list[Definition]] = {}
        self._class_index: dict[bytes, set[tuple[str, bytes, int, int]]] | None = None
        self.extras: dict[str, object] = {}  # per-tree caches of collaborators (e.g. the import index)

    # -- scopes --------------------------------------------------------------------
    def absolute(self, module: str, level: int, name: str | None) -> str | None:
        """The absolute module an ``ImportFrom`` in ``module`` names (None when it climbs too far)."""
        if level == 0:
            return name
        package = module if self.tree.is_package(module) else module.rpartition(".")[0]
        parts = package.split(".") if package else []
        if level - 1 > len(parts):
            return None
        parts = parts[: len(parts) - (level - 1)]
        base = ".".join(parts)
        if name:
            return f"{base}.{name}" if base else name
        return base or None

    def module_scope(self, module: str) -> Scope:
        tree = self.tree.parse(module)
        return self._scope(module, tree)

    def class_scope(self, module: str, node: ast.ClassDef) -> Scope:
        return self._scope(module, node)

    def _scope(self, module: str, owner: ast.Module | ast.ClassDef) -> Scope:
        scope = self._scopes.get(id(owner))
        if scope is None:
            scope = Scope({}, {}, [])
            self._collect(module, owner.body, scope, fallback=False)
            self._scopes[id(owner)] = scope
        return scope

    def _collect(self, module: str, body: list[ast.stmt], scope: Scope, fallback: bool) -> None:
        def put(name: str, binding: Binding) -> None:
            (scope.fallback if fallback else scope.main)[name] = binding

        for stmt in body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                put(stmt.name, Binding("def", stmt))
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    for name in _assigned_names(target):
                        put(name, Binding("assign", stmt))
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                put(stmt.target.id, Binding("assign", stmt))
            elif isinstance(stmt, ast.ImportFrom):
                source = self.absolute(module, stmt.level, stmt.module)
                if source is None:
                    continue
                for alias in stmt.names:
                    if alias.name == "*":
                        if not fallback:
                            scope.stars.append(source)
                        continue
                    put(alias.asname or alias.name, Binding("from", stmt, source, alias.name))
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname:
                        put(alias.asname, Binding("import", stmt, alias.name))
                    else:
                        top = alias.name.split(".")[0]
                        put(top, Binding("import", stmt, top))
            elif isinstance(stmt, ast.If):
                self._collect(module, stmt.body, scope, fallback or is_type_checking(stmt.test))
                self._collect(module, stmt.orelse, scope, fallback)
            elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
                self._collect(module, stmt.body, scope, fallback)  # type: ignore[attr-defined]
                for handler in stmt.handlers:  # type: ignore[attr-defined]
                    self._collect(module, handler.body, scope, True)
                self._collect(module, stmt.orelse, scope, fallback)  # type: ignore[attr-defined]
                self._collect(module, stmt.finalbody, scope, fallback)  # type: ignore[attr-defined]
            elif isinstance(stmt, ast.With | ast.AsyncWith):
                self._collect(module, stmt.body, scope, fallback)

    # -- resolution ----------------------------------------------------------------
    def resolve(self, module: str, parts: list[str], depth: int = 0) -> Definition | ModuleRef | None:
        """What ``module.parts[0].parts[1]…`` names in the tree; None when it is not (statically) there."""
        if depth > _MAX_DEPTH or not self.tree.has_module(module):
            return None
        if not parts:
            return ModuleRef(module)
        head, rest = parts[0], parts[1:]
        scope = self.module_scope(module)
        binding = scope.get(head)
        if binding is None:
            submodule = f"{module}.{head}"
            if self.tree.has_module(submodule):
                return self.resolve(submodule, rest, depth + 1)
            if not head.startswith("_"):
                for star in scope.stars:
                    found = self.resolve(star, parts, depth + 1)
                    if found is not None:
                        return found
            return None
        if binding.kind in ("def", "assign"):
            return self.descend(Definition(module, head, binding.node), rest, depth)  # type: ignore[arg-type]
        if binding.kind == "from":
            assert binding.module is not None and binding.name is not None
            return self.resolve(binding.module, [binding.name, *rest], depth + 1)
        assert binding.module is not None
        return self.resolve(binding.module, rest, depth + 1)

    def descend(self, definition: Definition, rest: list[str], depth: int = 0) -> Definition | ModuleRef | None:
        """Walk ``rest`` through class bodies, starting at ``definition``."""
        current: Definition | ModuleRef = definition
        for i, part in enumerate(rest):
            if isinstance(current, ModuleRef):
                return self.resolve(current.module, rest[i:], depth + 1)
            if not isinstance(current.node, ast.ClassDef):
                return None
            binding = self.class_scope(current.module, current.node).get(part)
            if binding is None:
                return None
            if binding.kind in ("def", "assign"):
                current = Definition(current.module, f"{current.qualname}.{part}", binding.node)  # type: ignore[arg-type]
            elif binding.kind == "from":
                assert binding.module is not None and binding.name is not None
                return self.resolve(binding.module, [binding.name, *rest[i + 1:]], depth + 1)
            else:
                assert binding.module is not None
                return self.resolve(binding.module, rest[i + 1:], depth + 1)
        return current

    def resolve_target(self, target: str) -> Resolution:
        """A manifest target ``module:qualname`` → its ``Resolution`` in this tree."""
        module, _, qualname = target.partition(":")
        parts = qualname.split(".")
        if not self.tree.has_module(module):
            return Resolution(None, reason=f"module {module} is not in the tree")
        if len(parts) == 1:
            found = self.resolve(module, parts)
            if isinstance(found, Definition):
                return Resolution(found, ModuleRef(module))
            if isinstance(found, ModuleRef):
                return Resolution(None, ModuleRef(module), reason=f"{qualname} is a module, not a definition")
            return Resolution(None, ModuleRef(module), reason=f"{module} defines no {qualname!r}")
        owner = self.resolve(module, parts[:-1])
        leaf = parts[-1]
        if isinstance(owner, ModuleRef):
            found = self.resolve(owner.module, [leaf])
            if isinstance(found, Definition):
                return Resolution(found, owner)
            return Resolution(None, owner, reason=f"{owner.module} defines no {leaf!r}")
        if owner is None:
            return Resolution(None, reason=f"{module} has no {'.'.join(parts[:-1])!r}")
        if not isinstance(owner.node, ast.ClassDef):
            return Resolution(None, owner, reason=f"{owner.ref} is not a class")
        found = self.descend(owner, [leaf])
        if isinstance(found, Definition):
            return Resolution(found, owner)
        inherited = self.inherited(owner, leaf)
        reason = f"{owner.ref} does not define {leaf!r} itself"
        if inherited is not None:
            reason += f" (inherits it from {inherited.ref})"
        return Resolution(None, owner, inherited=inherited, reason=reason)

    # -- classes -------------------------------------------------------------------
    def bases(self, cls: Definition) -> list[Definition]:
        """The base classes of ``cls`` that resolve to classes in the tree (others are skipped)."""
        key = (cls.module, cls.qualname)
        cached = self._bases.get(key)
        if cached is None:
            cached = []
            assert isinstance(cls.node, ast.ClassDef)
            for expr in cls.node.bases:
                parts = dotted(expr)
                found = self.resolve(cls.module, parts) if parts else None
                if isinstance(found, Definition) and isinstance(found.node, ast.ClassDef):
                    cached.append(found)
            self._bases[key] = cached
        return cached

    def inherits(self, cls: Definition, ancestor: tuple[str, str]) -> bool:
        """True when ``ancestor`` (module, qualname) is a proper base of ``cls``, directly or not."""
        seen: set[tuple[str, str]] = set()
        todo = list(self.bases(cls))
        while todo:
            base = todo.pop()
            key = (base.module, base.qualname)
            if key == ancestor:
                return True
            if key not in seen and len(seen) < 500:
                seen.add(key)
                todo.extend(self.bases(base))
        return False

    def inherited(self, cls: Definition, name: str) -> Definition | None:
        """The first base class (depth-first, best effort MRO) that defines ``name``."""
        seen: set[tuple[str, str]] = set()
        todo = list(self.bases(cls))
        while todo:
            base = todo.pop(0)
            key = (base.module, base.qualname)
            if key in seen:
                continue
            seen.add(key)
            found = self.descend(base, [name])
            if isinstance(found, Definition):
                return found
            todo.extend(self.bases(base))
        return None

    def iter_classes(self, module: str, with_locals: bool = False) -> Iterator[tuple[str, ast.ClassDef]]:
        """Every class of ``module`` with its qualname (nested classes too; function-local ones on request)."""

        def walk(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, ast.ClassDef]]:
            for stmt in body:
                if isinstance(stmt, ast.ClassDef):
                    qual = f"{prefix}{stmt.name}"
                    yield qual, stmt
                    yield from walk(stmt.body, qual + ".")
                elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                    if with_locals:
                        yield from walk(stmt.body, f"{prefix}{stmt.name}.<locals>.")
                else:
                    for field in ("body", "orelse", "finalbody"):
                        inner = getattr(stmt, field, None)
                        if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                            yield from walk(inner, prefix)
                    for handler in getattr(stmt, "handlers", []) or []:
                        yield from walk(handler.body, prefix)

        yield from walk(self.tree.parse(module).body, "")

    def class_index(self) -> dict[bytes, set[tuple[str, bytes, int, int]]]:
        """Text index, base identifier → {(module, class name, body offset, column)}: a cheap
        over-approximation of subclassing.

        Built once per tree with one regular expression over every file; classes whose base list
        contains a ')' (a call) are missed. The body offset and the column of ``class`` let
        ``overrides`` look into one class's body without parsing its file.
        """
        if self._class_index is None:
            index: dict[bytes, set[tuple[str, bytes, int, int]]] = {}
            for module, data in self.tree.all_data():
                if b"class" not in data:
                    continue
                for match in _CLASS_DECL.finditer(data):
                    start = match.start()
                    column = start - (data.rfind(b"\n", 0, start) + 1)
                    entry = (module, match.group(1), match.end(), column)
                    for ident in set(_IDENT.findall(match.group(2))):
                        index.setdefault(ident, set()).add(entry)
            self._class_index = index
        return self._class_index

    def overrides(self, owner: Definition, name: str) -> list[Override]:
        """Subclasses (anywhere in the tree) of class ``owner`` that define ``name`` themselves.

        Candidates come from the text index (transitively by class name); a file is parsed only
        when the text of one of its candidate classes defines ``name``, and candidates are then
        confirmed by resolving their bases. Limits: a base imported under another name (``import
        Worker as W``) breaks the textual chain; a class's text is taken to end at the next
        ``def``/``class`` line indented no deeper than its own ``class``, so a string inside the
        class with such a line hides what follows it.
        """
        if not isinstance(owner.node, ast.ClassDef):
            return []
        index = self.class_index()
        names = {owner.node.name.encode()}
        todo = list(names)
        bodies: dict[str, set[tuple[int, int]]] = {}
        while todo:
            for module, cls, body, column in index.get(todo.pop(), ()):
                bodies.setdefault(module, set()).add((body, column))
                if cls not in names:
                    names.add(cls)
                    todo.append(cls)
        defines = re.compile(rb"def[ \t]+" + re.escape(name.encode()) + rb"\b|\b" + re.escape(name.encode())
                             + rb"[ \t]*(?::[^=\n]*)?=[^=]")
        ancestor = (owner.module, owner.qualname)
        found: list[Override] = []
        for module in sorted(bodies):
            data = self.tree.data(module)
            if not any(defines.search(data, body, _class_end(data, body, column))
                       for body, column in bodies[module]):
                continue
            for qual, node in self.iter_classes(module, with_locals=True):
                binding = self.class_scope(module, node).main.get(name)
                if binding is None or binding.kind not in ("def", "assign"):
                    continue
                cls = Definition(module, qual, node)
                if (module, qual) != ancestor and self.inherits(cls, ancestor):
                    sub = Definition(module, f"{qual}.{name}", binding.node)  # type: ignore[arg-type]
                    found.append(Override(sub, self.tree.modules[module], _calls_super(binding.node, name)))
        return found

    # -- search --------------------------------------------------------------------
    def find_definitions(self, qualname: str, exclude_module: str | None = None) -> list[Definition]:
        """Definitions anywhere in the tree whose qualname is ``qualname`` or ends with ``.qualname``.

        Exact matches come first. Imports (re-exports) are not definitions and are not returned;
        function-local definitions are not searched.
        """
        parts = qualname.split(".")
        head = parts[0].encode()
        decl = re.compile(rb"(?:def|class)[ \t]+" + re.escape(head) + rb"\b")
        assign = re.compile(rb"(?m)^[ \t]*" + re.escape(head) + rb"[ \t]*(?::[^=\n]*)?=[^=]")
        exact: list[Definition] = []
        suffix: list[Definition] = []
        for module, data in list(self.tree.all_data()):
            if head not in data or not (decl.search(data) or assign.search(data)):
                continue
            starts: list[Definition] = []
            binding = self.module_scope(module).main.get(parts[0])
            if binding is not None and binding.kind in ("def", "assign"):
                starts.append(Definition(module, parts[0], binding.node))  # type: ignore[arg-type]
            for qual, node in self.iter_classes(module):
                binding = self.class_scope(module, node).main.get(parts[0])
                if binding is not None and binding.kind in ("def", "assign"):
                    starts.append(Definition(module, f"{qual}.{parts[0]}", binding.node))  # type: ignore[arg-type]
            for start in starts:
                found = self.descend(start, parts[1:])
                if not isinstance(found, Definition):
                    continue
                if found.module == exclude_module and found.qualname == qualname:
                    continue
                (exact if found.qualname == qualname else suffix).append(found)
        return exact + suffix


def _class_end(data: bytes, body: int, column: int) -> int:
    """Where the text of a class whose body starts at ``body`` (``class`` at ``column``) ends."""
    end = re.compile(rb"\n[ \t]{0,%d}(?:class|def|async[ \t]+def)[ \t]" % column).search(data, body)
    return end.start() if end else len(data)


def _calls_super(node: ast.AST, name: str) -> bool:
    """Whether a method body calls ``super().name(...)`` or ``Base.name(self, ...)``."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == name:
            value = sub.func.value
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                return True
            if sub.args and isinstance(sub.args[0], ast.Name) and sub.args[0].id in ("self", "cls"):
                return True
    return False


def source_segment(tree: SourceTree, definition: Definition) -> str:
    """The definition's source lines (decorators included), dedented, for diffs."""
    import textwrap

    lines = tree.text(definition.module).splitlines(keepends=True)
    return textwrap.dedent("".join(lines[definition.first_line - 1: definition.last_line]))
