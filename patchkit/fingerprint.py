"""Normalized-AST fingerprints of Python definitions.

A fingerprint pins the code a manifest entry was written against. It is computed
from the *syntax tree* of one definition, so it ignores what does not change
behaviour: line numbers, indentation, comments, and the docstring. It does not
ignore renamed locals or reordered statements: those are changes a reviewer must
see.

Format: ``ast1:<signature hash>:<body hash>`` (16 hex digits each). The two halves
let a reader tell a signature change (arguments, decorators, bases) from a body
change without the old source at hand. ``ast1`` names the algorithm; a future
normalization gets a new prefix, and old prefixes stay readable.

The same functions serve the runtime (from ``inspect.getsource``) and the static
checker (from a parsed file), so the two can never disagree.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap

PREFIX = "ast1"

_DefNode = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _strip_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    if body and isinstance(body[0], ast.Expr):
        value = body[0].value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            return body[1:]
    return body


_MISSING = object()
_SHAPES: dict[type, tuple[str, tuple[tuple[str, bool], ...]]] = {}


def _shape(cls: type) -> tuple[str, tuple[tuple[str, bool], ...]]:
    """A node class's name and its fields, each with whether ``None`` there is its default."""
    shape = _SHAPES[cls] = (cls.__name__, tuple((f, getattr(cls, f, ...) is None) for f in cls._fields))
    return shape


def _format(node: object) -> str:
    """``ast.dump(node, include_attributes=False)`` as CPython 3.11 writes it, without its indent
    bookkeeping (1.3× faster; ``tests/patchkit/test_static.py`` holds the two equal on vLLM's files).
    Every field is written, also empty ones, which ``ast.dump`` leaves out from 3.13 on."""
    shape = _SHAPES.get(type(node))
    if shape is None:
        if isinstance(node, list):
            return "[" + ", ".join([_format(item) for item in node]) + "]"
        if not isinstance(node, ast.AST):
            return repr(node)
        shape = _shape(type(node))
    parts = []
    for name, none_is_default in shape[1]:
        value = getattr(node, name, _MISSING)
        if value is _MISSING or (value is None and none_is_default):
            continue
        parts.append(name + "=" + _format(value))
    return shape[0] + "(" + ", ".join(parts) + ")"


def _dump(nodes: list[ast.AST] | ast.AST | None) -> str:
    if nodes is None:
        return ""
    if isinstance(nodes, list):
        return "[" + ",".join(_format(n) for n in nodes) + "]"
    return _format(nodes)


def split_parts(node: ast.AST) -> tuple[str, str]:
    """The (signature, body) texts that a fingerprint hashes, for one node."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        signature = "|".join(
            (type(node).__name__, _dump(node.args), _dump(node.returns), _dump(node.decorator_list))
        )
        return signature, _dump(_strip_docstring(node.body))
    if isinstance(node, ast.ClassDef):
        signature = "|".join(
            ("class", _dump(node.bases), _dump(node.keywords), _dump(node.decorator_list))
        )
        return signature, _dump(_strip_docstring(node.body))
    if isinstance(node, ast.Assign):
        return "assign", _dump(node.value)
    if isinstance(node, ast.AnnAssign):
        return "annassign:" + _dump(node.annotation), _dump(node.value)
    return type(node).__name__, _dump(node)


def of_node(node: ast.AST) -> str:
    """Fingerprint of one parsed definition or assignment."""
    signature, body = split_parts(node)
    return f"{PREFIX}:{_digest(signature)}:{_digest(body)}"


def of_source(source: str) -> str:
    """Fingerprint of the first statement in ``source`` (indentation is ignored)."""
    tree = ast.parse(textwrap.dedent(source))
    if not tree.body:
        raise ValueError("no statement to fingerprint")
    return of_node(tree.body[0])


def of_object(obj: object) -> str | None:
    """Fingerprint of a live function or class, or None when its source is unavailable.

    Limits: objects built at run time (lambdas assigned in loops, ``exec``), C
    functions and attributes that are plain values have no source of their own;
    for those the caller gets None and decides by policy.
    """
    target = inspect.unwrap(obj) if callable(obj) else obj
    target = getattr(target, "__func__", target)  # classmethod / staticmethod / bound
    if not (inspect.isfunction(target) or inspect.isclass(target)):
        return None
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        return None
    try:
        return of_source(source)
    except SyntaxError:
        return None


def compare(expected: str, actual: str | None) -> str:
    """``match``, ``unverifiable`` (no source), ``drifted:signature`` or ``drifted:body``."""
    if actual is None:
        return "unverifiable"
    if expected == actual:
        return "match"
    exp = expected.split(":")
    act = actual.split(":")
    if len(exp) != 3 or len(act) != 3 or exp[0] != act[0]:
        return "drifted:signature"
    return "drifted:signature" if exp[1] != act[1] else "drifted:body"


def compare_pinned(pin: str, expected: str | None, actual: str | None) -> str:
    """``compare`` for a requirement's ``pin``: ``exists`` ignores fingerprints, ``signature``
    compares only their signature halves, ``full`` is ``compare``. No fingerprint pinned: ``match``."""
    if pin == "exists" or expected is None:
        return "match"
    if pin == "signature" and actual is not None:
        return "match" if expected.split(":")[:2] == actual.split(":")[:2] else "drifted:signature"
    return compare(expected, actual)
