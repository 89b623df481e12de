"""The values name resolution hands out, and two syntax helpers it shares with its callers.

- ``Definition`` (a ``def``/``class``/assignment found in a tree: module, qualname, node and line span),
  ``ModuleRef`` (a name that is a module of the tree), ``Resolution`` (what a manifest target names, or
  why nothing), ``Override`` (a subclass that defines the target method itself);
- ``Binding`` and ``Scope``: how names are bound in one module or class body (``Resolver``'s cache);
- ``is_type_checking(test)`` and ``dotted(expr)``: pure functions of one syntax node.

Plain frozen data and pure functions: nothing here reads a tree, parses a file or resolves a name (that is
``patchkit.static.resolve.Resolver``). Limits: ``dotted`` sees ``a.b.C`` and ``Base[T]`` only (a call or any
other expression is None); ``is_type_checking`` recognises the name ``TYPE_CHECKING``, bare or as an
attribute, not an alias of it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

DefNode = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Assign | ast.AnnAssign


@dataclass(frozen=True)
class Definition:
    """A definition found in the tree: where it lives and its node."""

    module: str
    qualname: str
    node: DefNode

    @property
    def ref(self) -> str:
        return f"{self.module}:{self.qualname}"

    @property
    def kind(self) -> str:
        if isinstance(self.node, ast.ClassDef):
            return "class"
        if isinstance(self.node, ast.FunctionDef | ast.AsyncFunctionDef):
            return "function"
        return "attribute"

    @property
    def first_line(self) -> int:
        """First line of the definition, decorators included (what ``inspect.getsource`` starts at)."""
        decorators = getattr(self.node, "decorator_list", [])
        return min([self.node.lineno, *(d.lineno for d in decorators)])

    @property
    def last_line(self) -> int:
        return self.node.end_lineno or self.node.lineno


@dataclass(frozen=True)
class ModuleRef:
    """A name that resolves to a module of the tree (``import x as y``, ``from pkg import mod``)."""

    module: str


@dataclass(frozen=True)
class Binding:
    """How one name is bound in one scope."""

    kind: str  # def | assign | from | import
    node: ast.stmt
    module: str | None = None  # absolute module for from/import
    name: str | None = None  # the imported name for 'from'


@dataclass
class Scope:
    """The bindings of one module or class body."""

    main: dict[str, Binding]
    fallback: dict[str, Binding]
    stars: list[str]

    def get(self, name: str) -> Binding | None:
        return self.main.get(name) or self.fallback.get(name)


@dataclass(frozen=True)
class Resolution:
    """What a target names: the definition, or why there is none."""

    definition: Definition | None
    owner: Definition | ModuleRef | None = None  # the class/module that should hold the last name
    inherited: Definition | None = None  # when the class only inherits the attribute
    reason: str = ""


@dataclass(frozen=True)
class Override:
    """A subclass in the tree that defines the target method itself."""

    definition: Definition
    file: str
    calls_super: bool


def is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING`` (the guarded block never runs)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def dotted(expr: ast.expr) -> list[str] | None:
    """``a.b.C`` → ``['a', 'b', 'C']``; ``Base[T]`` → its base; anything else → None."""
    if isinstance(expr, ast.Subscript):
        expr = expr.value
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    parts.append(expr.id)
    return parts[::-1]
