"""Applying a compiled plan: ordered, guarded, idempotent, transactional, reversible.

One ``Run`` per plugin per process. ``Run.start()`` decides every entry's guards,
then applies each entry as soon as (a) its target module is imported and (b)
every entry it comes ``after`` is settled — at once for modules already
imported, otherwise from a post-import hook, before the importer sees the module.

Guarantees:
- *Idempotent*: a wrapper carries ``__patchkit__ = (plugin, entry id)``; an
  entry whose target already holds its own object is reported
  ``already-applied`` and changes nothing.
- *Transactional*: a required entry that fails restores every entry this run
  applied (newest first), including the aliases it rebound, and cancels what
  is still pending; the error names the entry. Any exception counts, not only
  the expected ones: one raised while installing, rebinding or registering a
  model, at start or later in an import callback. At start this raises
  ``PatchError``; later (in an import callback, where raising would break
  someone else's ``import``) it is logged and kept in ``Run.error`` for the
  plugin to act on, and the importer gets its module. A rollback step that
  itself raises is logged and the rollback goes on with the next one.
- *Reversible*: ``revert()`` restores the originals, including every alias in
  the rebind scope that holds our object, whenever it was bound. An attribute
  that someone else changed after us is left alone and reported.

How one entry is put in place and taken out is ``patchkit.runtime.targets``,
loaded when the first entry's module is there. Wrappers are generated in this
process (``patchkit.runtime.wrappers``); nothing executable is cached.

Post-import callbacks (``when_imported``, ``cancel``, ``pending``, at the end of
this module): ``when_imported(name, callback)`` calls ``callback(module)`` at
once when the module is already fully imported; otherwise a finder at the front
of ``sys.meta_path`` wraps that module's loader, so the callback runs after the
module body and before ``import`` returns: code that does ``from name import f``
afterwards gets the patched ``f``. Registration takes the import system's own
lock for ``name``, the one ``import`` holds from finding a module to finishing
its body, so a module another thread is importing right now is waited for and
then handled as imported, and a module imported later always meets the finder.
A callback that raises is logged and the importer still gets its module; ``Run``
is what leaves a consistent state. They live here, not in a module of their
own, because the hook needs them in every process and each module on its path
costs about 0.1 ms.

Limits: an entry is applied once per process; references taken to the original
before the swap are not reachable (see ``rebind``). Only modules imported
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
import os
import sys
import threading
import time
from collections.abc import Callable
from importlib import _bootstrap  # type: ignore[attr-defined]
from types import ModuleType
from typing import TYPE_CHECKING, Any

from patchkit.plan import MISSING, Compiled, Entry, Manifest, PatchError, Runtime, runtime_verdict
from patchkit.runtime.cache import Fingerprints

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

    from patchkit.runtime.targets import Slot

logger = logging.getLogger("patchkit")

ImportCallback = Callable[[ModuleType], None]

MODEL_REGISTRY_MODULE = "vllm.model_executor.models.registry"  # where model registrations wait


class Outcome:
    """What happened to one entry in this process (``to_json`` goes into reports)."""

    __slots__ = ("fingerprint", "id", "installed", "op", "original", "outcome", "reason", "rebound", "seconds",
                 "slot", "target", "undo", "unreachable")

    def __init__(self, entry_id: str, target: str, op: str) -> None:
        self.id = entry_id
        self.target = target
        self.op = op
        self.outcome = "pending"
        self.reason = ""
        self.fingerprint = ""
        self.seconds = 0.0
        self.rebound: list[str] = []
        self.unreachable: list[str] = []
        self.slot: Slot | None = None
        self.original: Any = MISSING
        self.installed: Any = MISSING
        self.undo: Callable[[], None] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "target": self.target, "op": self.op, "outcome": self.outcome,
            "reason": self.reason, "fingerprint": self.fingerprint,
            "ms": round(self.seconds * 1000, 3), "rebound": self.rebound, "unreachable": self.unreachable,
        }


class Run:
    """The application of one compiled plan in this process."""

    def __init__(self, plugin: str, compiled: Compiled, runtime: Runtime,
                 on_change: Callable[[Run], None] | None = None) -> None:
        assert compiled.manifest is not None
        self.plugin = plugin
        self.compiled = compiled
        self.manifest: Manifest = compiled.manifest
        self.runtime = runtime
        self.entries = {e.id: e for e in self.manifest.entries}
        self.records = {i: Outcome(i, self.entries[i].target, self.entries[i].op) for i in compiled.order}
        for m in self.manifest.models:
            self.records[f"model:{m.arch}"] = Outcome(f"model:{m.arch}", m.class_ref, "model")
        self.status = "new"
        self.error: PatchError | None = None
        self._stack: list[Outcome] = []
        self._ready: set[str] = set()
        self._lock = threading.RLock()
        self._pumping = False
        self._starting = False
        self._current: str | None = None  # the entry being applied, for unexpected errors
        self._callbacks: list[ImportCallback] = []
        self._fingerprints = Fingerprints()
        self._on_change = on_change

    # -- scheduling -------------------------------------------------------------------------
    def start(self) -> None:
        """Decide guards, apply what can be applied now, hook the rest. Raises PatchError."""
        disabled = {s.strip() for s in os.environ.get("PATCHKIT_DISABLE", "").split(",") if s.strip()}
        with self._lock:
            self._starting = True
            self.status = "active"
            modules: list[str] = []
            for entry_id, record in self.records.items():
                entry = self.entries.get(entry_id)
                when = entry.when if entry else self._model(entry_id).when
                reason = self.compiled.static.get(entry_id) or runtime_verdict(when, self.runtime)
                if entry_id in disabled or (entry_id.startswith("model:") and "models" in disabled):
                    record.outcome, record.reason = "disabled", "PATCHKIT_DISABLE"
                    logger.warning("patchkit: %s entry %s disabled by PATCHKIT_DISABLE", self.plugin, entry_id)
                elif reason:
                    record.outcome, record.reason = "guarded-out", reason
                elif entry is not None:
                    modules.append(entry.module)
            try:
                if any(r.outcome == "pending" for k, r in self.records.items() if k.startswith("model:")):
                    self._hook(MODEL_REGISTRY_MODULE, self._register_models)
                for module in dict.fromkeys(modules):
                    self._hook(module, self._on_import)
            finally:
                self._starting = False
            if self.error is not None:
                raise self.error
        self._changed()

    def _hook(self, module: str, callback: ImportCallback) -> None:
        self._callbacks.append(callback)
        when_imported(module, callback)

    def _on_import(self, module: ModuleType) -> None:
        with self._lock:
            self._ready.add(module.__name__)
            if self._pumping or self.status != "active":
                return
            self._pumping = True
            try:
                self._pump()
            except Exception as exc:  # noqa: BLE001 - an unexpected error: roll back, name it
                self._fail(PatchError(self._current or "?", f"unexpected error: {exc!r}"))
            finally:
                self._pumping = False
                self._fingerprints.flush()
        if not self._starting:
            self._changed()

    def _pump(self) -> None:
        progress = True
        while progress and self.status == "active":
            progress = False
            for entry_id in self.compiled.order:
                record = self.records[entry_id]
                entry = self.entries[entry_id]
                if record.outcome != "pending" or entry.module not in self._ready:
                    continue
                if any(self.records[d].outcome == "pending" for d in entry.after):
                    continue
                self._apply(entry, record)
                progress = True
                if self.status != "active":
                    return

    # -- one entry ----------------------------------------------------------------------------
    def _apply(self, entry: Entry, record: Outcome) -> None:
        from patchkit.runtime import targets

        started = time.perf_counter()
        self._current = entry.id
        try:
            marker = (self.plugin, entry.id)
            targets.install(entry, record, self.plugin, self.runtime, self.compiled.static, self._fingerprints,
                            _LIVE.get(marker))
            _LIVE[marker] = record.installed
            self._stack.append(record)  # from here on a rollback restores the slot and every rebound alias
            record.outcome = "applied"
            targets.rebind_aliases(entry, record, self.manifest.packages)
        except targets.Skip as skip:
            record.outcome, record.reason = skip.outcome, skip.reason
        except Exception as exc:  # noqa: BLE001 - EntryFailed, or anything unexpected: named, rolled back
            reason = str(exc) if isinstance(exc, targets.EntryFailed) else f"unexpected error: {exc!r}"
            if entry.required:
                self._fail(PatchError(entry.id, reason))
                record.outcome, record.reason = "failed", reason
            else:
                if record in self._stack:  # installed, then rebinding failed: undo this entry alone
                    self._stack.remove(record)
                    _LIVE.pop((self.plugin, entry.id), None)
                    targets.undo(record, self._alias_scope(record))
                record.outcome, record.reason = "failed-optional", reason
                logger.warning("patchkit: optional entry %s left out: %s", entry.id, reason)
        finally:
            record.seconds = time.perf_counter() - started

    # -- models ----------------------------------------------------------------------------
    def _model(self, record_id: str) -> Any:
        arch = record_id.partition(":")[2]
        return next(m for m in self.manifest.models if m.arch == arch)

    def _register_models(self, module: ModuleType) -> None:
        from patchkit.runtime import vllm as vllm_adapter

        with self._lock:
            if self.status != "active":
                return
            for m in self.manifest.models:
                record = self.records[f"model:{m.arch}"]
                if record.outcome != "pending":
                    continue
                started = time.perf_counter()
                try:
                    record.undo = vllm_adapter.register_model(module, m.arch, m.class_ref)
                    record.outcome = "applied"
                    self._stack.append(record)
                except Exception as exc:  # noqa: BLE001 - named in the error; nothing escapes into import
                    record.outcome, record.reason = "failed", repr(exc)
                    self._fail(PatchError(record.id, f"model registration failed: {exc!r}"))
                    break
                finally:
                    record.seconds = time.perf_counter() - started
        if not self._starting:
            self._changed()

    # -- failure, revert ----------------------------------------------------------------------
    def _fail(self, error: PatchError) -> None:
        self._undo_all("rolled-back")
        self.status = "failed"
        self.error = error
        logger.error("patchkit: %s plan rolled back, the process runs unpatched: %s", self.plugin, error)

    def _undo_all(self, outcome: str) -> None:
        """Restore every applied entry, newest first; a step that raises is logged and marked."""
        for callback in self._callbacks:
            cancel(callback)
        if self._stack:
            from patchkit.runtime import targets
        for record in reversed(self._stack):
            try:
                targets.undo(record, self._alias_scope(record))
                record.outcome = outcome
            except Exception as exc:  # noqa: BLE001 - go on with the others, say which one failed
                record.outcome, record.reason = "undo-failed", repr(exc)
                logger.error("patchkit: %s: restoring %s failed: %r", self.plugin, record.target, exc)
            _LIVE.pop((self.plugin, record.id), None)
        self._stack.clear()
        for record in self.records.values():
            if record.outcome == "pending":
                record.outcome = "cancelled"

    def _alias_scope(self, record: Outcome) -> tuple[str, ...]:
        from patchkit.runtime import targets

        return targets.alias_scope(self.entries.get(record.id), record, self.manifest.packages)

    def revert(self) -> None:
        with self._lock:
            self._undo_all("reverted")
            if self.status != "failed":
                self.status = "reverted"
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)

    def report(self) -> dict[str, Any]:
        return {
            "plugin": self.plugin, "manifest": os.path.basename(self.manifest.file),
            "digest": self.compiled.digest, "status": self.status,
            "error": str(self.error) if self.error else None,
            "vllm": {"version": self.runtime.vllm_version, "commit": self.runtime.vllm_commit},
            "entries": [r.to_json() for r in self.records.values()],
        }


_LIVE: dict[tuple[str, str], Any] = {}


# -- post-import callbacks ------------------------------------------------------------------------

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
