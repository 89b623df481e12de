"""Two ways to list a file's import statements with their context, for comparing them in tests.

``imports_from_ast`` is the reference: it walks a full parse. ``imports_from_text`` is the way
``patchkit.static.sites.ImportIndex`` reads a vLLM tree: each statement is located by
a regular expression, parsed alone, and placed by the indentation of the headers above it
(``def`` → function, ``class`` → class, ``if TYPE_CHECKING`` → type-checking); imports inside
triple-quoted strings are skipped. The tests compare both on synthetic edge cases and on
real vLLM files. Context is one of ``module``, ``class``, ``function``, ``type-checking``.
"""

from __future__ import annotations

import ast

from patchkit.static.resolve import is_type_checking
from patchkit.static.sites import _parse_raw, _raw_imports

Imports = list[tuple[ast.Import | ast.ImportFrom, str]]


def imports_from_ast(body: list[ast.stmt], context: str, out: Imports) -> None:
    """Append every import statement under ``body`` to ``out`` with its context (needs a full parse)."""
    for stmt in body:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            out.append((stmt, context))
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            imports_from_ast(stmt.body, "function", out)
        elif isinstance(stmt, ast.ClassDef):
            imports_from_ast(stmt.body, "class" if context in ("module", "type-checking") else context, out)
        elif isinstance(stmt, ast.If) and is_type_checking(stmt.test):
            imports_from_ast(stmt.body, "type-checking" if context == "module" else context, out)
            imports_from_ast(stmt.orelse, context, out)
        else:
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    imports_from_ast(inner, context, out)
            for handler in getattr(stmt, "handlers", []) or []:
                imports_from_ast(handler.body, context, out)
            for case in getattr(stmt, "cases", []) or []:
                imports_from_ast(case.body, context, out)


def imports_from_text(data: bytes) -> Imports:
    """Every import statement of a file with its context, found the way ``ImportIndex`` finds them."""
    lines = data.split(b"\n")
    return [found for raw in _raw_imports(data) for found in _parse_raw(data, raw, lines)]
