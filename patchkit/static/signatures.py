"""Whether the plugin's callables fit the vLLM targets they are called for (``patchkit check``).

As pluggy checks a hook implementation against its hook specification at registration, ``check``
compares every callable a manifest entry hands patchkit with the signature of the target it is
called for, both read as written (vLLM's tree and the plugin's packages are parsed, never imported),
so a wrapper that no longer fits fails before a release instead of raising ``TypeError`` in vLLM.

What is compared, per kind of entry:

- ``op: wrap``: ``with`` is called as ``with(original, *args, **kwargs)`` for each call of the
  target; less its first parameter (the original) it must accept every call the target accepts;
- ``op: replace``, and ``op: set`` with ``with``: the object takes the target's place, so it must
  accept every call the target accepts;
- ``op: scoped-rebind``: ``active_if(*args, **kwargs)`` gets each call of the target: the same rule;
- the ``workers`` section: ``role_of(config)`` must accept one positional argument.

A target's signature is a function's parameters (a method's ``self`` or ``cls``, always passed by
position, counts as positional-only; not under ``staticmethod``) or a class's ``__init__`` less
``self`` (its own or the first base in the tree that defines one). A plugin callable's signature is
what the import of its reference yields: a function's parameters (a ``classmethod`` less ``cls``),
a class's ``__init__`` less ``self``.

"Accepts every call" (``unfit``): for each parameter of the target, a call may pass it by position,
and by keyword unless it is positional-only. The callable fits when every such call binds:

- each of the target's positional parameters has a positional parameter at the same place, or the
  callable has ``*args``; one the target also takes by keyword has the same name there, and is not
  positional-only (past the callable's positional parameters: ``*args`` and ``**kwargs`` or a
  keyword-only parameter of that name take it);
- each keyword-only parameter of the target has a parameter of that name that no positional
  argument fills, or the callable has ``**kwargs``;
- the target's ``*args`` / ``**kwargs`` need the callable's;
- no parameter the callable requires can be left out: one the target makes optional, or has not
  at all, must have a default in the callable.

The rule is what any forwarding of the caller's arguments needs (``functools.wraps``-style
``*args, **kwargs`` wrappers, wrapt); patchkit's generated wrapper, which passes positional
parameters by position, needs less. Limits: signatures as written — a decorator that changes a
signature, a default computed at run time, ``__new__`` and metaclass ``__call__`` are not seen;
a callable or target built at run time (an assignment such as ``P = proxy_type(C)``, a dataclass's
generated ``__init__``) or a class whose ``__init__`` comes from outside the parsed tree is reported
as not compared, not as a failure, and so is a reference whose package is not found. ``bind``
replacements of ``op: scoped-rebind`` are not compared.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from patchkit.plan import Entry, Patch, ScopedRebind, WorkerOverride
from patchkit.static import Definition, Resolver
from patchkit.static.analyze import decorator_names
from patchkit.static.tree import DirTree

P = inspect.Parameter
_POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)


class _Default:
    """What a signature shows for a default value: the check needs only that there is one."""

    def __repr__(self) -> str:
        return "…"


DEFAULT = _Default()
ROLE_OF_CALL = inspect.Signature([P("config", P.POSITIONAL_ONLY)])  # how the workers wrapper calls role_of


@dataclass
class Fit:
    """One callable against its target: ``fits`` is True, False, or None (not compared: ``note`` says why)."""

    role: str  # with | active_if | role_of
    ref: str
    fits: bool | None
    callable_signature: str | None = None
    target_signature: str | None = None
    problems: list[tuple[str, str]] = field(default_factory=list)  # (parameter, what is wrong)
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "callable": self.ref, "fits": self.fits,
                "callable_signature": self.callable_signature, "target_signature": self.target_signature,
                "problems": [{"parameter": p, "message": m} for p, m in self.problems], "note": self.note}


def signature(node: ast.FunctionDef | ast.AsyncFunctionDef, bound: str | None = None) -> inspect.Signature:
    """``node``'s parameters as an ``inspect.Signature`` (defaults shown as ``…``, no annotations).

    ``bound="self"``: the first parameter is passed by position only (a method reached through an
    instance or class); ``bound="drop"``: it is not passed at all (``cls`` of a classmethod, ``self``
    of ``__init__`` called through its class)."""
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = [P(arg.arg, P.POSITIONAL_ONLY if arg in a.posonlyargs else P.POSITIONAL_OR_KEYWORD,
                default=P.empty if d is None else DEFAULT) for arg, d in zip(positional, defaults, strict=True)]
    if bound == "self" and params:
        params[0] = params[0].replace(kind=P.POSITIONAL_ONLY)
    elif bound == "drop" and params:
        params.pop(0)
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    params += [P(arg.arg, P.KEYWORD_ONLY, default=P.empty if d is None else DEFAULT)
               for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def unfit(callee: inspect.Signature, target: inspect.Signature) -> list[tuple[str, str]]:
    """What keeps ``callee`` from accepting every call ``target`` accepts (the rule in the module
    docstring): ``(parameter, problem)`` pairs, empty when it fits."""
    every = list(callee.parameters.values())
    c_pos = [p for p in every if p.kind in _POSITIONAL]
    c_star = any(p.kind is P.VAR_POSITIONAL for p in every)
    c_kw = any(p.kind is P.VAR_KEYWORD for p in every)
    c_named = {p.name: p for p in every if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)}
    wanted = list(target.parameters.values())
    t_pos = [p for p in wanted if p.kind in _POSITIONAL]
    t_star = next((p for p in wanted if p.kind is P.VAR_POSITIONAL), None)
    t_kwonly = [p for p in wanted if p.kind is P.KEYWORD_ONLY]
    t_kw = next((p for p in wanted if p.kind is P.VAR_KEYWORD), None)
    out: list[tuple[str, str]] = []

    for i, t in enumerate(t_pos):
        c = c_pos[i] if i < len(c_pos) else None
        if c is None and not c_star:
            out.append((t.name, f"the target takes it as positional argument {i + 1}; the callable takes "
                                f"{len(c_pos)} positional argument{'s' if len(c_pos) != 1 else ''} and no *args"))
            continue
        if t.kind is P.POSITIONAL_OR_KEYWORD:
            if c is not None and c.name != t.name:
                out.append((t.name, f"renamed {c.name!r} in the callable: a call passing {t.name}= does not bind"))
            elif c is not None and c.kind is P.POSITIONAL_ONLY:
                out.append((t.name, f"positional-only in the callable: a call passing {t.name}= does not bind"))
            elif c is None and not ((c_kw and t.name not in c_named)
                                    or getattr(c_named.get(t.name), "kind", None) is P.KEYWORD_ONLY):
                out.append((t.name, f"a call passing {t.name}= does not bind: past the callable's positional "
                                    "parameters, it has no keyword-only parameter of that name and no **kwargs"))
        if c is not None and c.default is P.empty and t.default is not P.empty:
            out.append((c.name, "optional in the target, required in the callable"))
    if t_star is not None and not c_star:
        out.append((f"*{t_star.name}", "the target takes extra positional arguments; the callable has no *args"))
    required_kwonly = {t.name for t in t_kwonly if t.default is P.empty}
    for t in t_kwonly:
        c = c_named.get(t.name)
        if c is None:
            if not c_kw:
                out.append((t.name, "keyword-only in the target; the callable has no such parameter and no **kwargs"))
            continue
        if c.kind is P.POSITIONAL_ONLY:
            out.append((t.name, "keyword-only in the target, positional-only in the callable"))
        elif c.kind is P.POSITIONAL_OR_KEYWORD and (c_pos.index(c) < len(t_pos) or t_star is not None):
            out.append((t.name, "keyword-only in the target, but a positional argument fills it in the callable "
                                "too (multiple values)"))
        elif c.default is P.empty and t.default is not P.empty:
            out.append((t.name, "optional in the target, required in the callable"))
    if t_kw is not None and not c_kw:
        out.append((f"**{t_kw.name}", "the target takes extra keyword arguments; the callable has no **kwargs"))
    for c in [*c_pos[len(t_pos):], *(p for p in every if p.kind is P.KEYWORD_ONLY)]:
        if c.default is P.empty and c.name not in required_kwonly:
            out.append((c.name, "required by the callable; the target's callers do not pass it"))
    return out


def call_signature(resolver: Resolver, definition: Definition, target: bool) -> inspect.Signature | str:
    """How a call of ``definition`` binds (see the module docstring), or why that cannot be told.

    ``target``: the definition is a vLLM target, reached as an attribute of its owner (a method's first
    parameter is then bound); otherwise a plugin reference, reached by ``getattr`` on its class (a plain
    function: nothing bound, a classmethod: ``cls`` bound)."""
    node = definition.node
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        decorators = decorator_names(node)
        if "." not in definition.qualname or "staticmethod" in decorators:
            return signature(node)
        if "classmethod" in decorators:
            return signature(node, "self" if target else "drop")
        return signature(node, "self" if target else None)
    if isinstance(node, ast.ClassDef):
        init = resolver.descend(definition, ["__init__"])
        if not isinstance(init, Definition):
            init = resolver.inherited(definition, "__init__")
        if init is None or not isinstance(init.node, ast.FunctionDef | ast.AsyncFunctionDef):
            return f"a class whose __init__ is not in the tree ({definition.ref}): not compared"
        return signature(init.node, "drop")
    return f"{definition.ref} is an assignment (built at run time): not compared"


def plugin_tree(package: str) -> DirTree | None:
    """The folder of the plugin's top-level ``package`` as a tree, located with ``importlib.util.find_spec``
    (which does not import a top-level package); None when it has none."""
    spec = importlib.util.find_spec(package)
    folder = Path(next(iter(spec.submodule_search_locations or []), "")) if spec else None
    return DirTree(folder, str(folder)) if folder is not None and (folder / "__init__.py").is_file() else None


class Checker:
    """Compares entries' callables with their targets in one tree; the plugin's packages are located
    (``importlib.util.find_spec``, which does not import a top-level package) and parsed on first use."""

    def __init__(self, resolver: Resolver) -> None:
        self.resolver = resolver
        self._plugin: dict[str, Resolver | None] = {}
        self._callables: dict[str, inspect.Signature | str] = {}

    def inputs(self) -> tuple[tuple[str, int, int], ...]:
        """What was read of the plugin's packages (``SourceTree.inputs``): a stored verdict re-stats these
        too, so an edited plugin callable is judged again."""
        return tuple(i for r in self._plugin.values() if r is not None for i in (r.tree.inputs() or ()))

    def _plugin_resolver(self, package: str) -> Resolver | None:
        """The plugin package's tree (the manifest allows references into its ``packages`` only), or None."""
        if package not in self._plugin:
            tree = plugin_tree(package)
            self._plugin[package] = Resolver(tree) if tree is not None else None
        return self._plugin[package]

    def _callable(self, ref: str) -> inspect.Signature | str:
        """How a call of the plugin's ``ref`` binds, or why it is not compared (kept per reference)."""
        if ref not in self._callables:
            package = ref.partition(":")[0].split(".")[0]
            plugin = self._plugin_resolver(package)
            found = plugin.resolve_target(ref).definition if plugin is not None else None
            if plugin is None:
                self._callables[ref] = f"package {package!r} not found: not compared"
            elif found is None:
                self._callables[ref] = f"{ref} is not in {package} as written: not compared"
            else:
                self._callables[ref] = call_signature(plugin, found, target=False)
        return self._callables[ref]

    def check(self, entry: Entry, definition: Definition | None) -> list[Fit]:
        """The ``Fit`` of the callable ``entry`` hands patchkit, if any, against ``definition`` (its
        target in the tree; None when the target is missing: nothing is compared)."""
        call = _callable_of(entry)
        if definition is None or call is None:
            return []
        role, ref, drops_original = call
        fit = Fit(role, ref, None)
        if isinstance(entry, WorkerOverride):
            wanted: inspect.Signature | str = ROLE_OF_CALL
            fit.target_signature = f"role_of{ROLE_OF_CALL} (the call of the workers wrapper)"
        else:
            wanted = call_signature(self.resolver, definition, target=True)
            fit.target_signature = None if isinstance(wanted, str) else f"{definition.ref}{wanted}"
        got = self._callable(ref)
        if isinstance(wanted, str) or isinstance(got, str):
            fit.note = f"target {wanted}" if isinstance(wanted, str) else str(got)
            return [fit]
        fit.callable_signature = f"{ref}{got}"
        if drops_original:
            params = list(got.parameters.values())
            if params and params[0].kind in _POSITIONAL:
                got = got.replace(parameters=params[1:])
            elif not any(p.kind is P.VAR_POSITIONAL for p in params):
                fit.problems = [("original", "a wrap's callable takes the original as its first positional "
                                             "argument; this one takes none")]
        fit.problems = fit.problems or unfit(got, wanted)
        fit.fits = not fit.problems
        return [fit]


def _callable_of(entry: Entry) -> tuple[str, str, bool] | None:
    """(role, reference, whether the original comes first) of the callable the entry hands patchkit."""
    if isinstance(entry, Patch) and entry.with_:
        return "with", entry.with_, entry.op == "wrap"
    if isinstance(entry, ScopedRebind):
        return "active_if", entry.active_if, False
    if isinstance(entry, WorkerOverride):
        return "role_of", entry.role_of, False
    return None
