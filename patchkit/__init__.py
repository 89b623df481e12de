"""patchkit: versioned YAML manifests → ordered, guarded, reversible patches of vLLM.

Public API (everything a plugin needs; the rest is internal):

- ``activate(plugin, manifest_dir)`` — select, plan and apply the plugin's
  manifest for the running vLLM. Safe to call many times per process and in
  every process. Never raises for an unsupported release or a bad manifest
  (vLLM calls plugin hooks without a try): it logs once and returns a
  ``Status`` that says why nothing was applied.
- ``status(plugin)`` — that ``Status`` again, later (e.g. when a run asks for the
  plugin's feature and must fail if the plan is not active).
- ``applied(plugin=None)`` — the per-entry records of this process.
- ``revert(plugin=None)`` — restore everything (for tests).

Importing patchkit is cheap: YAML and JSON Schema are only imported when a
manifest changed since the cached compiled plan was written.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from patchkit.errors import ManifestError, PatchError, PatchkitError, UnsupportedRelease
    from patchkit.planning import Runtime as RuntimeInfo

__all__ = [
    "ManifestError", "PatchError", "PatchkitError", "Status", "UnsupportedRelease",
    "activate", "applied", "revert", "status",
]

logger = logging.getLogger("patchkit")
_PACKAGE_DIR = Path(__file__).parent


def schema_path(name: str) -> Path:
    """A shipped JSON Schema, e.g. ``manifest.schema.json``: ``patchkit/_schemas/`` in a wheel,
    the repository's ``schemas/`` in a checkout or editable install (looked up here only)."""
    packaged = _PACKAGE_DIR / "_schemas"
    return (packaged if packaged.is_dir() else _PACKAGE_DIR.parent / "schemas") / name
_lock = threading.RLock()
_status: dict[str, Status] = {}


class Status:
    """Where one plugin's plan stands in this process.

    ``run`` is the ``patchkit.engine.Run`` when a manifest was selected, else None.
    ``replayed`` says this process applied the plan by replaying a stored program
    (``patchkit.replay``); its ``Run`` is then built on first access.
    ``fallback`` says the selected manifest is the plugin's ``fallback: true`` one
    (no pinned manifest fits this vLLM); ``vllm_version`` is the running vLLM's.
    """

    __slots__ = ("_run", "_takeover", "active", "plugin", "problem", "replayed", "supported")

    def __init__(self, plugin: str, active: bool, problem: str | None, supported: str, run: Any = None) -> None:
        self.plugin = plugin
        self.active = active
        self.problem = problem
        self.supported = supported
        self._run = run
        self._takeover: Callable[[], None] | None = None
        self.replayed = False

    @property
    def run(self) -> Any:
        if self._takeover is not None:
            self._takeover()
        return self._run

    @property
    def fallback(self) -> bool:
        return self.run is not None and self.run.manifest.fallback

    @property
    def vllm_version(self) -> str | None:
        return self.run.runtime.vllm_version if self.run is not None else None

    def __repr__(self) -> str:
        return f"Status({self.plugin!r}, active={self.active}, problem={self.problem!r})"


def activate(plugin: str, manifest_dir: str | Path, runtime: RuntimeInfo | None = None) -> Status:
    """Apply ``plugin``'s manifest for the running vLLM (idempotent, never raises PatchkitError).

    ``runtime`` defaults to the running vLLM; tests pass their own. A process
    whose situation has a stored replay program repeats it (``patchkit.replay``);
    any other runs the engine, which records a program for the next one.
    """
    from patchkit import cache

    with _lock:
        current = _status.get(plugin)
        if current is not None and (current.active or current.run is None):
            return current
        manifest_dir = Path(manifest_dir)
        files = cache.manifest_files(manifest_dir)
        identity = (runtime.vllm_version, runtime.vllm_commit) if runtime else cache.installed_vllm()
        key = cache.key(files, *identity)
        if not os.environ.get("PATCHKIT_DISABLE"):
            replayed = _replay(plugin, manifest_dir, runtime, key)
            if replayed is not None:
                return replayed
        return _start(plugin, manifest_dir, runtime, key)


def _replay(plugin: str, manifest_dir: Path, runtime: RuntimeInfo | None, key: str) -> Status | None:
    from patchkit import replay

    program = replay.load(key)
    steps = replay.apply(program, plugin, runtime) if program is not None else None
    if program is None or steps is None:
        return None
    result = _remember(Status(plugin, True, None, program["supported"]))
    result.replayed = True

    def takeover(_module: Any = None) -> None:
        with _lock:
            if result._takeover is None:
                return
            result._takeover = None
            from patchkit import importhook

            importhook.cancel(takeover)
            if _start(plugin, manifest_dir, runtime, key, adopt=(steps, program["digest"]), status=result)._run is None:
                replay.undo(steps)  # the plan under this key no longer selects a manifest

    result._takeover = takeover
    replay.defer(program, takeover)
    if os.environ.get("PATCHKIT_REPORT_DIR"):
        takeover()
    return result


def _start(plugin: str, manifest_dir: Path, runtime: RuntimeInfo | None, key: str,
           adopt: tuple[list[Any], str] | None = None, status: Status | None = None) -> Status:
    """Run the engine: compile (or read) the plan and apply it; ``adopt``: take over a replay first."""
    from patchkit import cache, engine, replay
    from patchkit.errors import ManifestError, PatchError
    from patchkit.planning import Runtime

    runtime = runtime or Runtime.detect()
    try:
        compiled = cache.compiled(manifest_dir, runtime, key)
    except ManifestError as exc:
        logger.error("patchkit: %s: invalid manifest, nothing applied:\n%s", plugin, exc)
        return _remember(Status(plugin, False, f"invalid manifest:\n{exc}", ""), status)
    if compiled.manifest is None:
        logger.warning("patchkit: %s: %s; nothing applied", plugin, compiled.error)
        return _remember(Status(plugin, False, compiled.error, compiled.supported), status)
    run = engine.Run(plugin, compiled, runtime, on_change=_write_report)
    result = _remember(Status(plugin, True, None, compiled.supported, run), status)
    try:
        if adopt is not None:
            steps, digest = adopt
            if digest == compiled.digest:
                run.adopt(steps)
            else:  # not the plan the program was recorded from: the engine applies this one itself
                replay.undo(steps)
        run.start()
    except PatchError as exc:
        result.active, result.problem = False, str(exc)
    if adopt is None and result.active:
        replay.store(key, run)
    return result


def __getattr__(name: str) -> Any:
    """The error types, imported on first use (the warm path never needs them)."""
    if name in ("ManifestError", "PatchError", "PatchkitError", "UnsupportedRelease"):
        from patchkit import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'patchkit' has no attribute {name!r}")


def _write_report(run: Any) -> None:
    if os.environ.get("PATCHKIT_REPORT_DIR"):
        from patchkit import report

        report.write(run.report())


def _remember(s: Status, into: Status | None = None) -> Status:
    """Keep ``s`` as the plugin's status (copied into ``into``, the replay's status, when given)."""
    if into is not None:
        into.active, into.problem, into.supported, into._run = s.active, s.problem, s.supported, s._run
        s = into
    _status[s.plugin] = s
    return s


def status(plugin: str) -> Status | None:
    """The plugin's ``Status`` in this process, or None if it never activated.

    A plan that failed after start (in an import hook) shows ``active=False``.
    """
    s = _status.get(plugin)
    if s is not None and s._run is not None and s._run.status == "failed":
        s.active, s.problem = False, str(s._run.error)
    return s


def applied(plugin: str | None = None) -> list[dict[str, Any]]:
    """Per-entry records (id, target, op, outcome, reason, fingerprint verdict, ms, rebound, unreachable)."""
    out = []
    for name, s in sorted(_status.items()):
        if s.run is not None and (plugin is None or plugin == name):
            out.extend({"plugin": name, **r.to_json()} for r in s.run.records.values())
    return out


def revert(plugin: str | None = None) -> None:
    """Restore every original this process's plans replaced, and forget the plans."""
    with _lock:
        for name in [n for n in _status if plugin is None or n == plugin]:
            run = _status[name].run  # a replay's Run is built first, so that it can be reverted
            del _status[name]
            if run is not None:
                run.revert()
