"""Rebinding ``from X import name`` aliases of a patched module-level object.

``from vllm.plugins import load_general_plugins`` copies a reference into the
importing module; patching ``vllm.plugins.load_general_plugins`` afterwards
does not reach it. ``rebind`` walks the already-imported modules *in scope* —
the target's top-level package and the plugin's own packages, or an explicit
list — and replaces attributes that have the target's own name and are the
very object being replaced. It never touches other names or modules out of
scope (a blind identity scan of ``sys.modules`` breaks unrelated libraries).

``unreachable`` lists what rebinding leaves behind: the same object under
another name (``from X import f as g``) in a scoped module.
It is a report, not a fix, and it searches the ``auto`` scope only; references
inside closures, default arguments, containers and subclasses are not searched
(that would need ``gc``, too slow for every process start).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from types import ModuleType
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


def rebind(name: str, old: Any, new: Any, prefixes: Iterable[str], owner: ModuleType) -> list[str]:
    """Replace ``module.<name> is old`` by ``new`` in scoped modules; return the modules changed."""
    changed = []
    for module in _modules(prefixes):
        if module is owner:
            continue
        namespace = vars(module)
        if namespace.get(name, None) is old:
            namespace[name] = new
            changed.append(module.__name__)
    return changed


def unreachable(name: str, old: Any, prefixes: Iterable[str], owner: ModuleType) -> list[str]:
    """``module.attr`` strings in scoped modules that still hold ``old`` (aliases under other names)."""
    found = []
    for module in _modules(prefixes):
        if module is owner:
            continue
        for attr, value in list(vars(module).items()):
            if value is old and attr != name:
                found.append(f"{module.__name__}.{attr}")
    return found


def restore(name: str, current: Any, original: Any, modules: Iterable[str]) -> None:
    """Undo ``rebind`` in the listed modules (only where our object is still bound)."""
    for module_name in modules:
        module = sys.modules.get(module_name)
        if module is not None and vars(module).get(name, None) is current:
            vars(module)[name] = original
