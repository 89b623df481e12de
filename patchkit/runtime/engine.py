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

Post-import callbacks come from ``patchkit.runtime.hooks``.

Limits: an entry is applied once per process; references taken to the original
before the swap are not reachable (see ``rebind``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from patchkit.plan import MISSING, Change, Compiled, Manifest, PatchError, PlanRefused, Runtime, runtime_verdict
from patchkit.runtime.cache import Fingerprints
from patchkit.runtime.hooks import ImportCallback, cancel, when_imported

if TYPE_CHECKING:
    from patchkit.runtime.targets import Slot

logger = logging.getLogger("patchkit")

MODEL_REGISTRY_MODULE = "vllm.model_executor.models.registry"  # where model registrations wait


def _vllm_log(plugin: str) -> logging.Logger:
    """The plugin's logger under vLLM's (``vllm.<plugin>``): vLLM configures ``vllm`` with a handler, so what
    users must read (a refusal) reaches vLLM's own log, where the ``patchkit`` logger is not printed."""
    return logging.getLogger(f"vllm.{plugin}")


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
        self.facts: dict[str, str] = {}  # what the plugin learnt about this process (``note``), for its report
        verdict = compiled.verdict
        self._judged = {m.id: m for m in verdict.members} if verdict is not None else {}

    # -- scheduling -------------------------------------------------------------------------
    def start(self) -> None:
        """Apply the verdict, decide guards, apply what can be applied now, hook the rest. Raises PatchError
        (``PlanRefused`` when the verdict refuses the plugin: then nothing is hooked or patched)."""
        disabled = {s.strip() for s in os.environ.get("PATCHKIT_DISABLE", "").split(",") if s.strip()}
        verdict = self.compiled.verdict
        if verdict is not None and not verdict.holds:
            self._refuse(verdict.refusal() or "")
        if verdict is not None and verdict.refused:
            _vllm_log(self.plugin).info(
                "%s: features refused on %s (the rest runs; `patchkit check` names why): %s", self.plugin,
                verdict.tree, ", ".join(sorted(verdict.refused)))
        with self._lock:
            self._starting = True
            self.status = "active"
            modules: list[str] = []
            for entry_id, record in self.records.items():
                entry = self.entries.get(entry_id)
                member = entry if entry is not None else self._model(entry_id)
                when = member.when
                reason = self.compiled.static.get(entry_id) or runtime_verdict(when, self.runtime)
                if verdict is not None and verdict.off(member.feature):
                    record.outcome = "feature-off"
                    record.reason = f"feature {member.feature} is refused: {', '.join(verdict.refused[member.feature])}"
                elif entry_id in disabled or (entry_id.startswith("model:") and "models" in disabled):
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
    def _apply(self, entry: Change, record: Outcome) -> None:
        from patchkit.runtime import targets

        started = time.perf_counter()
        self._current = entry.id
        try:
            marker = (self.plugin, entry.id)
            targets.install(entry, record, self.plugin, self.runtime, self.compiled.static, self._fingerprints,
                            _LIVE.get(marker), self._judged.get(entry.id))
            _LIVE[marker] = record.installed
            self._stack.append(record)  # from here on a rollback restores the slot and every rebound alias
            record.outcome = "applied"
            targets.rebind_aliases(entry, record, self.manifest.packages)
            self._judge_noted(entry, record)
        except targets.Skip as skip:
            record.outcome, record.reason = skip.outcome, skip.reason
        except Exception as exc:  # noqa: BLE001 - EntryFailed, or anything unexpected: named, rolled back
            reason = str(exc) if isinstance(exc, targets.EntryFailed) else f"unexpected error: {exc!r}"
            judged = self._judged.get(entry.id)
            if judged is not None and not judged.fails:
                reason = (f"{reason} [contradicts the verdict, which found {entry.target} {judged.verdict} in "
                          f"{self.compiled.verdict.tree}: the tree changed after it was judged, or the static "
                          "model cannot see this (docs/manifests.md, 'Features and the verdict')]")
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
    def _refuse(self, words: str) -> None:
        """The verdict refuses the plugin: nothing is hooked; every member says so; raise ``PlanRefused``."""
        for record in self.records.values():
            record.outcome, record.reason = "refused", "the verdict refuses the plugin"
        self.status = "failed"
        self.error = PlanRefused(words)
        _vllm_log(self.plugin).error("%s: %s; nothing of it is applied in this process", self.plugin, words)
        self._changed()
        raise self.error

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

    def note(self, key: str, value: str) -> None:
        """Record a fact about this process that only the plugin learns after start (e.g. which vLLM model runner
        its worker built) in the report, rewritten at once; a later note of the same key replaces it. An applied
        entry whose ``when.noted`` guard the fact contradicts is reported ``off-path`` from then on (its code
        stays installed: its target is not on this process's running path, so it never runs)."""
        with self._lock:
            self.facts[key] = value
            for entry_id, record in self.records.items():
                entry = self.entries.get(entry_id)
                if entry is not None and record.outcome == "applied":
                    self._judge_noted(entry, record)
        self._changed()

    def _judge_noted(self, entry: Change, record: Outcome) -> None:
        """``off-path`` with the reason, when a noted fact is not among the values ``entry.when.noted`` lists."""
        for key, values in entry.when.get("noted", {}).items():
            if key in self.facts and self.facts[key] not in values:
                record.outcome = "off-path"
                record.reason = (f"noted {key} {self.facts[key]} not in {values}: the target is not on this "
                                 "process's running path")
                return

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)

    def report(self) -> dict[str, Any]:
        return {
            "plugin": self.plugin, "manifest": os.path.basename(self.manifest.file),
            "digest": self.compiled.digest, "status": self.status,
            "verdict": self.compiled.verdict.summary() if self.compiled.verdict is not None else None,
            "error": str(self.error) if self.error else None,
            "vllm": {"version": self.runtime.vllm_version, "commit": self.runtime.vllm_commit},
            "facts": dict(self.facts),
            "entries": [r.to_json() for r in self.records.values()],
        }


_LIVE: dict[tuple[str, str], Any] = {}
