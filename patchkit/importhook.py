"""Run a callback right after a module executes, before its importer sees it.

``when_imported(name, callback)`` calls ``callback(module)`` at once when the
module is already in ``sys.modules``; otherwise a finder on ``sys.meta_path``
wraps that module's loader so the callback runs after the module body and
before ``import`` returns. Code that does ``from name import f`` afterwards gets
the patched ``f``.

Limits: only modules imported through the normal import system are seen (not
``exec`` of source, not modules put into ``sys.modules`` by hand). A callback
runs once per registration; ``importlib.reload`` does not re-run it.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable
    from importlib.machinery import ModuleSpec
    from types import ModuleType

    Callback = Callable[[ModuleType], None]  # for annotations only: not built in every process

_lock = threading.RLock()
_pending: dict[str, list[Callback]] = {}
_busy: set[tuple[int, str]] = set()  # (thread, module) whose spec _Finder is looking up right now


class _LoaderProxy:
    """Delegates to the real loader; runs the pending callbacks after ``exec_module``.

    Plain classes, not ``importlib.abc`` subclasses: the import system needs only
    these methods, and ABC classes cost every vLLM process their creation."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._loader, attr)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        # Put the real loader back so tools that inspect it (inspect, pkgutil) see the usual type.
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        module.__loader__ = self._loader
        _run(self._name, module)


class _Finder:
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        busy = (threading.get_ident(), fullname)
        if fullname not in _pending or busy in _busy:
            return None
        _busy.add(busy)  # another finder may import while it looks: do not recurse into ourselves
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            _busy.discard(busy)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _LoaderProxy(spec.loader, fullname)
        return spec


_finder = _Finder()


def _run(name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _pending.pop(name, [])
    for callback in callbacks:
        callback(module)


def when_imported(name: str, callback: Callback) -> bool:
    """Call ``callback(module)`` now (returns True) or right after ``name`` is imported (False)."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _pending.setdefault(name, []).append(callback)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return False
    callback(module)
    return True


def cancel(callback: Callback) -> None:
    """Forget a pending callback (used by rollback and revert)."""
    with _lock:
        for name in list(_pending):
            _pending[name] = [c for c in _pending[name] if c is not callback]
            if not _pending[name]:
                del _pending[name]


def pending() -> dict[str, int]:
    """Module name → number of callbacks still waiting (for reports and tests)."""
    with _lock:
        return {name: len(cbs) for name, cbs in _pending.items()}
