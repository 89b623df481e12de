"""patchkit: versioned YAML manifests → ordered, guarded, reversible patches of vLLM.

The public API is what this module exports; everything else lives in
submodules and may change:

- ``activate(plugin, manifest_dir)`` — select, plan and apply the plugin's
  manifest for the running vLLM. Safe to call many times per process and in
  every process. Never raises for an unsupported release or a bad manifest
  (vLLM calls plugin hooks without a try): it logs once and returns a
  ``Status`` that says why nothing was applied.
- ``status(plugin)`` — that ``Status`` again, later (e.g. when a run asks for the
  plugin's feature and must fail if the plan is not active); ``Status.refusal(feature)`` gives the
  verdict's words for a refused feature, the same in every process.
- ``applied(plugin=None)`` — the per-entry records of this process.
- ``note(plugin, key, value)`` — a fact the plugin learnt about this process after start (e.g.
  ``model_runner``), written into its per-process report (``facts``).
- ``revert(plugin=None)`` — restore everything (for tests).
- ``Status`` and the error types ``PatchkitError``, ``ManifestError``,
  ``PatchError``, ``UnsupportedRelease``.

There is one way a plan gets applied: ``patchkit.runtime.engine``. What repeats between
processes is cached as data only (``patchkit.runtime.cache``); nothing executable
is read from disk.
"""

from __future__ import annotations

import logging
import os
import threading
import typing

from patchkit.plan import ManifestError, PatchError, PatchkitError, UnsupportedRelease

if typing.TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

    from patchkit.plan import Compiled, Runtime
    from patchkit.runtime.engine import Run
    from patchkit.verdict import Verdict

__version__ = "0.1.0"  # the distribution's version (pyproject.toml); part of the plan cache key

__all__ = [
    "ManifestError", "PatchError", "PatchkitError", "Status", "UnsupportedRelease",
    "activate", "applied", "note", "revert", "status",
]

_lock = threading.RLock()
_status: dict[str, Status] = {}
_logger = logging.getLogger("patchkit")


class Status:
    """Where one plugin's plan stands in this process.

    ``active``: the plan is applied (or waiting for its modules) and has not failed.
    ``problem``: why not, when not. ``supported``: the releases the plugin's
    pinned manifests name, for messages. ``run``: the ``patchkit.runtime.engine.Run``
    when a manifest was selected, else None. ``fallback``: the selected manifest
    is the plugin's ``fallback: true`` one (no pinned manifest fits this vLLM).
    """

    __slots__ = ("active", "plugin", "problem", "run", "supported")

    def __init__(self, plugin: str, active: bool, problem: str | None, supported: str, run: Run | None = None) -> None:
        self.plugin = plugin
        self.active = active
        self.problem = problem
        self.supported = supported
        self.run = run

    @property
    def fallback(self) -> bool:
        return self.run is not None and self.run.manifest.fallback

    @property
    def vllm_version(self) -> str | None:
        return self.run.runtime.vllm_version if self.run is not None else None

    # -- the verdict (patchkit.verdict): decided once per manifest and tree, the same in every process --
    @property
    def verdict(self) -> Verdict | None:
        """The verdict on the selected manifest against the vLLM tree this process imports (computed by the
        first process after a change of either, stored with the plan); None without a plan or a tree."""
        return self.run.compiled.verdict if self.run is not None else None

    def refusal(self, feature: str | None = None) -> str | None:
        """The words that refuse ``feature`` (a name the manifest's ``features:`` declares), or, for ``None``, the
        plugin itself; None when the verdict does not refuse it. The plugin asks this where a run asks for the
        feature; every process gets the same words (which members fail, why, and how to run without it)."""
        verdict = self.verdict
        return verdict.refusal(feature) if verdict is not None else None

    def __repr__(self) -> str:
        return f"Status({self.plugin!r}, active={self.active}, problem={self.problem!r})"


def activate(plugin: str, manifest_dir: str | Path, runtime: Runtime | None = None,
             plugin_version: str = "", packages: tuple[str, ...] = ()) -> Status:
    """Apply ``plugin``'s manifest for the running vLLM (idempotent, never raises PatchkitError).

    ``runtime`` defaults to the running vLLM; tests pass their own.
    ``plugin_version`` goes into the plan cache's key (pass the plugin's version).
    ``packages``: the plugin's own code (e.g. ``("afd_patches",)``); a plan, cached or not, that names
    anything outside it is not applied. Without it the manifest's ``packages`` list is the bound.
    A second call returns the first call's status, unless that run failed, in
    which case it tries again.
    """
    with _lock:
        current = _status.get(plugin)
        if current is not None and (current.active or current.run is None):
            return current
        from patchkit.plan import Runtime
        from patchkit.runtime import cache, engine

        runtime = runtime or Runtime.detect()
        try:
            compiled = cache.compiled(os.fspath(manifest_dir), runtime, plugin_version, _compile_plan,
                                      tuple(packages))
        except ManifestError as exc:
            _logger.error("patchkit: %s: invalid manifest, nothing applied:\n%s", plugin, exc)
            return _remember(Status(plugin, False, f"invalid manifest:\n{exc}", ""))
        stray = cache.outside(compiled, tuple(packages))
        if stray:
            problem = f"the manifest names code outside the packages {plugin} declared: {', '.join(stray[:5])}"
            _logger.error("patchkit: %s: %s; nothing applied", plugin, problem)
            return _remember(Status(plugin, False, problem, compiled.supported))
        if compiled.manifest is None:
            _logger.warning("patchkit: %s: %s; nothing applied", plugin, compiled.error)
            return _remember(Status(plugin, False, compiled.error, compiled.supported))
        run = engine.Run(plugin, compiled, runtime, on_change=_write_report)
        result = _remember(Status(plugin, True, None, compiled.supported, run))
        try:
            run.start()
        except PatchError as exc:
            result.active, result.problem = False, str(exc)
        return result


def _compile_plan(files: list[str], runtime: Runtime) -> Compiled:
    """On a plan-cache miss: validate the manifests and select (YAML, JSON Schema: loaded only now)."""
    from patchkit.manifest.select import compile_plan

    return compile_plan(files, runtime)


def _write_report(run: Run) -> None:
    if os.environ.get("PATCHKIT_REPORT_DIR"):
        from patchkit.runtime import report

        report.write(run.report())


def _remember(s: Status) -> Status:
    _status[s.plugin] = s
    return s


def status(plugin: str) -> Status | None:
    """The plugin's ``Status`` in this process, or None if it never activated.

    A plan that failed after start (in an import callback) shows ``active=False``.
    """
    s = _status.get(plugin)
    if s is not None and s.run is not None and s.run.status == "failed":
        s.active, s.problem = False, str(s.run.error)
    return s


def applied(plugin: str | None = None) -> list[dict[str, Any]]:
    """Per-entry records (id, target, op, outcome, reason, fingerprint verdict, ms, rebound, unreachable)."""
    out = []
    for name, s in sorted(_status.items()):
        if s.run is not None and (plugin is None or plugin == name):
            out.extend({"plugin": name, **r.to_json()} for r in s.run.records.values())
    return out


def note(plugin: str, key: str, value: str) -> None:
    """Record ``key: value`` in the report of ``plugin``'s plan in this process (``PATCHKIT_REPORT_DIR``, under
    ``facts``); nothing when the plugin has no plan here. Facts are the plugin's words: keep secrets out of them."""
    s = _status.get(plugin)
    if s is not None and s.run is not None:
        s.run.note(key, value)


def revert(plugin: str | None = None) -> None:
    """Restore every original this process's plans replaced, and forget the plans."""
    with _lock:
        for name in [n for n in _status if plugin is None or n == plugin]:
            run = _status.pop(name).run
            if run is not None:
                run.revert()
