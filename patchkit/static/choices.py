"""Where one module binds one local name more than once, and under which arms: the scanning half of
``patchkit.static.callpaths``.

- ``IndentedImports(resolver)``: the text of every indented import statement of the tree in one blob
  (a choice between two imports always has one indented import: an arm's or a function's), so a name is
  looked up in a few hundred kilobytes instead of the whole tree; built once per tree (about 0.1 s for
  vLLM 0.34's 3,600 modules). Limit: imports indented with tabs are not in it.
- ``candidates(indented, index, head, module_tokens)``: the modules worth a closer look, by text;
- ``names_bound_twice(index, module, head, module_tokens)``: by the text of the import statements alone
  (``sites.ImportIndex``), the local names two import statements of ``module`` bind, one of them ``head``
  or a module alias whose last component is one of ``module_tokens``;
- ``Collector(resolver, module, names)``: the full parse of such a module, each import binding of ``names``
  (``Bind``) with its scope (module body or function qualname; class bodies are attributes and skipped) and
  the arms it lies in (``Arm``: ``if``/``elif``/``else`` chains, ``try`` body against each handler;
  ``if TYPE_CHECKING`` bodies never run and are skipped). An arm's condition is put in words (``Text``: the
  source of the tests, whitespace folded) only when it is reported.
"""

from __future__ import annotations

import ast
import bisect
import re
from dataclasses import dataclass, field

from patchkit.static.resolve import Definition, ModuleRef, Resolver, is_type_checking
from patchkit.static.sites import ImportIndex, _statement_end

_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class Arm:
    """One arm of an ``if`` chain or a ``try``; its condition is put in words only when it is reported."""

    chain: int  # id of the chain's first ``if`` or of the ``try``
    index: int
    line: int
    kind: str  # if-branch | try-except
    negated: tuple[ast.expr, ...] = field(default=(), compare=False)  # tests of the arms before it
    test: ast.expr | None = field(default=None, compare=False)  # its own test; for a handler, the type
    handler: bool = False

    def condition(self, text: Text) -> str:
        if self.kind == "try-except":
            if not self.handler:
                return "no exception"
            return f"except {text(self.test)}" if self.test is not None else "except"
        words = [f"not ({text(t)})" for t in self.negated]
        return " and ".join([*words, text(self.test)] if self.test is not None else words)


@dataclass(frozen=True)
class Bind:
    name: str
    scope: str  # "" for the module body, else the function's qualname
    arms: tuple[Arm, ...]
    line: int
    found: Definition | ModuleRef | None
    written: str  # module:name as imported, or the module of a module alias (for a sibling outside the tree)
    via: str


class Text:
    """The source text of an expression, whitespace folded (offsets are UTF-8 bytes, as ``ast`` gives them)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._lines: list[bytes] | None = None

    def __call__(self, node: ast.expr | None) -> str:
        if node is None:
            return ""
        if self._lines is None:
            self._lines = self.data.split(b"\n")
        end_line, end_col = node.end_lineno or node.lineno, node.end_col_offset or 0
        chunk = self._lines[node.lineno - 1:end_line]
        if len(chunk) == end_line - node.lineno + 1 and chunk:
            chunk[-1] = chunk[-1][:end_col]
            chunk[0] = chunk[0][node.col_offset:]
            return _SPACE.sub(" ", b"\n".join(chunk).decode("utf-8", errors="replace")).strip()
        return ast.unparse(node)


def if_chain(stmt: ast.If) -> list[tuple[Arm, list[ast.stmt]]]:
    """An ``if``/``elif``/``else`` chain as arms (each with the tests before it), with their bodies."""
    arms: list[tuple[Arm, list[ast.stmt]]] = []
    tests: list[ast.expr] = []
    node: ast.If | None = stmt
    while node is not None:
        arms.append((Arm(id(stmt), len(arms), stmt.lineno, "if-branch", tuple(tests), node.test), node.body))
        tests.append(node.test)
        if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
            node = node.orelse[0]
        else:
            if node.orelse:
                arms.append((Arm(id(stmt), len(arms), stmt.lineno, "if-branch", tuple(tests)), node.orelse))
            node = None
    return arms


class Collector:
    """Every import binding of ``names`` in one module, with its scope and the arms it lies in."""

    def __init__(self, resolver: Resolver, module: str, names: set[str]) -> None:
        self.resolver, self.module, self.names = resolver, module, names
        self.text = Text(resolver.tree.data(module))
        self.binds: list[Bind] = []

    def body(self, stmts: list[ast.stmt], scope: str, arms: tuple[Arm, ...]) -> None:
        for stmt in stmts:
            self.stmt(stmt, scope, arms)

    def stmt(self, stmt: ast.stmt, scope: str, arms: tuple[Arm, ...]) -> None:
        if isinstance(stmt, ast.ImportFrom | ast.Import):
            self.imported(stmt, scope, arms)
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            self.body(stmt.body, f"{scope}.{stmt.name}" if scope else stmt.name, ())
        elif isinstance(stmt, ast.ClassDef):  # class-level imports are attributes: only methods are looked at
            qual = f"{scope}.{stmt.name}" if scope else stmt.name
            for inner in stmt.body:
                if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    self.stmt(inner, qual, ())
        elif isinstance(stmt, ast.If):
            if is_type_checking(stmt.test):
                self.body(stmt.orelse, scope, arms)
                return
            for arm, arm_body in if_chain(stmt):
                self.body(arm_body, scope, (*arms, arm))
        elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            tried = Arm(id(stmt), 0, stmt.lineno, "try-except")
            self.body([*stmt.body, *stmt.orelse], scope, (*arms, tried))  # type: ignore[attr-defined]
            for i, handler in enumerate(stmt.handlers, 1):  # type: ignore[attr-defined]
                caught = Arm(id(stmt), i, stmt.lineno, "try-except", test=handler.type, handler=True)
                self.body(handler.body, scope, (*arms, caught))
            self.body(stmt.finalbody, scope, arms)  # type: ignore[attr-defined]
        else:
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    self.body(inner, scope, arms)
            for case in getattr(stmt, "cases", []) or []:
                self.body(case.body, scope, arms)

    def imported(self, stmt: ast.Import | ast.ImportFrom, scope: str, arms: tuple[Arm, ...]) -> None:
        resolver, tree = self.resolver, self.resolver.tree
        if isinstance(stmt, ast.ImportFrom):
            source = resolver.absolute(self.module, stmt.level, stmt.module)
            if source is None:
                return
            for alias in stmt.names:
                bound = alias.asname or alias.name
                if bound in self.names and alias.name != "*":
                    found = resolver.resolve(source, [alias.name])
                    via = "module-alias" if isinstance(found, ModuleRef) else "from-import"
                    self.binds.append(Bind(bound, scope, arms, stmt.lineno, found, f"{source}:{alias.name}", via))
            return
        for alias in stmt.names:
            if alias.asname in self.names:
                found = ModuleRef(alias.name) if tree.has_module(alias.name) else None
                self.binds.append(Bind(alias.asname, scope, arms, stmt.lineno, found, alias.name, "module-alias"))


class IndentedImports:
    """The text of every indented import statement of the tree (a choice always has one: an arm's or a
    function's), one blob per tree, so a name is looked up in a few hundred kilobytes, not the whole tree."""

    def __init__(self, resolver: Resolver) -> None:
        chunks: list[bytes] = []
        self.starts: list[int] = []
        self.modules: list[str] = []
        size = 0
        for module, data in resolver.tree.all_data():
            found = []
            for keyword in (b"    from ", b"    import "):
                pos = data.find(keyword)
                while pos >= 0:
                    end = _statement_end(data, pos + len(keyword))
                    found.append(data[pos:end])
                    pos = data.find(keyword, end)
            if found:
                text = b"\n".join(found) + b"\n\0\n"
                self.starts.append(size)
                self.modules.append(module)
                chunks.append(text)
                size += len(text)
        self.blob = b"".join(chunks)

    def containing(self, needle: bytes) -> set[str]:
        """Modules with an indented import statement whose text contains ``needle``."""
        found: set[str] = set()
        pos = self.blob.find(needle)
        while pos >= 0:
            i = bisect.bisect_right(self.starts, pos) - 1
            found.add(self.modules[i])
            nxt = self.starts[i + 1] if i + 1 < len(self.starts) else len(self.blob)
            pos = self.blob.find(needle, nxt)
        return found


def candidates(indented: IndentedImports, index: ImportIndex, head: str, module_tokens: set[str]) -> list[str]:
    """Modules that may choose ``head`` (by name, which such a module writes twice) or a module whose last
    component is in ``module_tokens`` (imported as an alias in an indented statement), by text alone."""
    by_name = {m for m in indented.containing(head.encode()) if index.tree.data(m).count(head.encode()) >= 2}
    by_alias = set().union(*(indented.containing(needle) for t in module_tokens
                             for needle in (b"import " + t.encode(), t.encode() + b" as ")))
    return sorted(by_name | by_alias)


def names_bound_twice(index: ImportIndex, module: str, head: str, module_tokens: set[str]) -> set[str]:
    """Local names that two import statements of ``module`` bind, one of them ``head`` (by name) or a module
    whose last component is in ``module_tokens`` (cheap, by text; see the module docstring)."""
    names: set[str] = set()
    for stmt, context in index.statements(module, [head.encode(), *(t.encode() for t in module_tokens)]):
        if context == "class":
            continue
        for alias in stmt.names:
            if isinstance(stmt, ast.ImportFrom) and alias.name == head:
                names.add(alias.asname or alias.name)
            elif alias.asname and alias.name.rpartition(".")[2] in module_tokens:
                names.add(alias.asname)
            elif isinstance(stmt, ast.ImportFrom) and alias.name in module_tokens:
                names.add(alias.asname or alias.name)
    if not names:
        return set()
    counts: dict[str, int] = {}
    for stmt, _context in index.statements(module, [n.encode() for n in names]):
        for alias in stmt.names:
            bound = alias.asname or alias.name
            if bound in names:
                counts[bound] = counts.get(bound, 0) + 1
    return {n for n, c in counts.items() if c >= 2}
