"""Post-import callbacks: ``when_imported``, ``cancel``, ``pending``.

``when_imported(name, callback)`` calls ``callback(module)`` at
once when the module is already fully imported; otherwise a finder at the front
of ``sys.meta_path`` wraps that module's loader, so the callback runs after the
module body and before ``import`` returns: code that does ``from name import f``
afterwards gets the patched ``f``. Registration takes the import system's own
lock for ``name``, the one ``import`` holds from finding a module to finishing
its body, so a module another thread is importing right now is waited for and
then handled as imported, and a module imported later always meets the finder.
A callback that raises is logged and the importer still gets its module; ``Run``
is what leaves a consistent state.

Limits: only modules imported
through the normal import system are seen (not ``exec`` of source, not modules
put into ``sys.modules`` by hand). A module whose own body is being executed by
the registering thread (a circular import) is handed over at once,
half-initialized. A callback runs once per registration; ``importlib.reload``
does not re-run it. The per-module lock is
``importlib._bootstrap._ModuleLockManager``, private but unchanged since Python
3.3; where it is missing, registration falls back to the plain check.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable
from importlib import _bootstrap  # type: ignore[attr-defined]
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

logger = logging.getLogger("patchkit")

ImportCallback = Callable[[ModuleType], None]

_import_lock = threading.RLock()
_pending: dict[str, list[ImportCallback]] = {}
_busy: set[tuple[int, str]] = set()  # (thread, module) whose spec _Finder is looking up right now
_module_lock: Callable[[str], Any] = getattr(_bootstrap, "_ModuleLockManager", lambda _name: contextlib.nullcontext())


def _call_all(callbacks: list[ImportCallback], module: ModuleType) -> None:
    for callback in callbacks:
        try:
            callback(module)
        except Exception:
            logger.exception("patchkit: a callback for the import of %s failed", module.__name__)


class _LoaderProxy:
    """Delegates to the real loader; runs the pending callbacks after ``exec_module``.

    Plain classes, not ``importlib.abc`` subclasses: the import system needs only
    these methods."""

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
        with _import_lock:
            callbacks = _pending.pop(self._name, [])
        _call_all(callbacks, module)


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


def when_imported(name: str, callback: ImportCallback) -> bool:
    """Call ``callback(module)`` now (returns True) or right after ``name`` is imported (False)."""
    lock = _module_lock(name)
    try:
        lock.__enter__()
    except RuntimeError:  # the import system detected a deadlock on that lock: decide without it
        lock = contextlib.nullcontext()
    try:
        module = _imported_or_registered(name, callback)
    finally:
        lock.__exit__(None, None, None)
    if module is None:
        return False
    _call_all([callback], module)
    return True


def _imported_or_registered(name: str, callback: ImportCallback) -> ModuleType | None:
    with _import_lock:
        module = sys.modules.get(name)
        if module is None:
            _pending.setdefault(name, []).append(callback)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
        return module


def cancel(callback: ImportCallback) -> None:
    """Forget a pending callback (used by rollback and revert)."""
    with _import_lock:
        for name in list(_pending):
            _pending[name] = [c for c in _pending[name] if c is not callback]
            if not _pending[name]:
                del _pending[name]


def pending() -> dict[str, int]:
    """Module name → number of callbacks still waiting (for reports and tests)."""
    with _import_lock:
        return {name: len(cbs) for name, cbs in _pending.items()}
