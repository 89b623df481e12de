"""Rebinding ``from X import name`` aliases of a patched module-level object.

``from vllm.plugins import load_general_plugins`` copies a reference into the
importing module; patching ``vllm.plugins.load_general_plugins`` afterwards
does not reach it. ``rebind`` walks the already-imported modules *in scope* —
the target's top-level package and the plugin's own packages, or an explicit
list — and replaces attributes that have the target's own name and are the
very object being replaced. It never touches other names or modules out of
scope (a blind identity scan of ``sys.modules`` breaks unrelated libraries).

``restore`` undoes it: every attribute of a scoped module that holds our object
and was or could have been bound to the target gets the original back, whenever it
was bound (a ``from X import f`` run after the patch included). For an object
patchkit made (a wrapper, marked ``__patchkit__``) that is every attribute holding
it, under any name. A ``replace`` entry's object is someone's existing function,
which other modules may hold under their own names since before the patch: there
only attributes named as the target are restored (a ``from X import target as h``
run after the patch keeps the replacement: a limit).

``unreachable`` lists what rebinding leaves behind, as a report, not a fix, in
the ``auto`` scope: the same object under another name (``from X import f as g``),
inside a scoped module's dict, list, tuple or set values one level deep
(``HANDLERS = {"greet": greet}``), and in the ``__defaults__``/``__kwdefaults__``
of the module's own functions (``def call(f=greet)``). Deeper containers,
closures, instances and subclasses are not searched (that would need ``gc``,
too slow for every process start).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from types import FunctionType, ModuleType
from typing import Any


def _modules(prefixes: Iterable[str]) -> Iterator[ModuleType]:
    prefixes = tuple(prefixes)
    dotted = tuple(p + "." for p in prefixes)
    for name, module in list(sys.modules.items()):
        if module is not None and (name in prefixes or name.startswith(dotted)):
            yield module


def scope(target_module: str, policy: str | tuple[str, ...], packages: Iterable[str]) -> tuple[str, ...]:
    """Module-name prefixes to rebind in, for an entry's ``rebind`` policy."""
    if policy == "none":
        return ()
    if policy == "auto":
        return (target_module.split(".")[0], *packages)
    return tuple(policy)


def rebind(name: str, old: Any, new: Any, prefixes: Iterable[str], owner: ModuleType, into: list[str]) -> None:
    """Replace ``module.<name> is old`` by ``new`` in scoped modules; append each module changed to ``into``
    as it goes, so a failure half-way leaves an exact list for ``restore``."""
    for module in _modules(prefixes):
        if module is owner:
            continue
        namespace = vars(module)
        if namespace.get(name, None) is old:
            namespace[name] = new
            into.append(module.__name__)


def restore(installed: Any, original: Any, prefixes: Iterable[str], owner: ModuleType, name: str) -> None:
    """Attributes of scoped modules (not ``owner``) that hold ``installed`` get ``original``: any of them when
    patchkit made ``installed``, else those named ``name`` (the target's); never the definition of
    ``installed`` itself (a ``replace`` entry's function in its own module). See the module docstring."""
    home = (getattr(installed, "__module__", None), getattr(installed, "__name__", None))
    made = hasattr(installed, "__patchkit__")
    for module in _modules(prefixes):
        if module is owner:
            continue
        namespace = vars(module)
        for attr, value in list(namespace.items()):
            if value is installed and (made or attr == name) and (module.__name__, attr) != home:
                namespace[attr] = original


def unreachable(name: str, old: Any, prefixes: Iterable[str], owner: ModuleType) -> list[str]:
    """Where scoped modules still hold ``old`` after rebinding (see the module docstring)."""
    found: list[str] = []
    for module in _modules(prefixes):
        if module is owner:
            continue
        where = module.__name__
        for attr, value in list(vars(module).items()):
            if value is old:
                if attr != name:
                    found.append(f"{where}.{attr}")
            elif isinstance(value, dict):
                found += (f"{where}.{attr}[{k!r}]" for k, v in list(value.items()) if v is old)
            elif isinstance(value, list | tuple):
                found += (f"{where}.{attr}[{i}]" for i, v in enumerate(value) if v is old)
            elif isinstance(value, set | frozenset):
                if any(v is old for v in value):
                    found.append(f"{where}.{attr} (a set member)")
            elif isinstance(value, FunctionType) and value.__module__ == where:
                found += (f"{where}.{attr}.__defaults__[{i}]" for i, v in enumerate(value.__defaults__ or ())
                          if v is old)
                found += (f"{where}.{attr}.__kwdefaults__[{k!r}]"
                          for k, v in (value.__kwdefaults__ or {}).items() if v is old)
    return found
