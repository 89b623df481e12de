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

Importing patchkit is cheap: a process that can replay a stored program loads
only ``patchkit.replay`` (and ``patchkit.importhook``) besides this module; YAML
and JSON Schema are only imported when a manifest changed since the cached
compiled plan was written.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
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

_PACKAGE_DIR = os.path.dirname(__file__)  # a str: a Path here costs every vLLM process ~50 µs


# -- the ground floor: where patchkit's files are, whom it trusts, what runs -----------------------
# Every process needs these before it knows whether it can replay, so they live here rather
# than in a module of their own (each module is another import in every vLLM process).
# The cache directory is ``$PATCHKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/patchkit``, else
# ``~/.cache/patchkit``; it holds compiled plans and the code cache (``patchkit.plancache``)
# and replay programs (``patchkit.replay``). Everything in it names code to run, so a file is
# read only if this user (or root) owns it and nobody else may write it; files are written
# 0600 through a temp file and a rename, so concurrent processes at worst compute the same
# thing twice. An unwritable or corrupt cache is ignored, never fatal.


def schema_path(name: str) -> Path:
    """A shipped JSON Schema, e.g. ``manifest.schema.json``: ``patchkit/_schemas/`` in a wheel,
    the repository's ``schemas/`` in a checkout or editable install (looked up here only)."""
    packaged = Path(_PACKAGE_DIR, "_schemas")
    return (packaged if packaged.is_dir() else packaged.parent.parent / "schemas") / name


def cache_dir() -> Path:
    if os.environ.get("PATCHKIT_CACHE_DIR"):
        return Path(os.environ["PATCHKIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "patchkit"


def manifest_files(directory: Path) -> list[Path]:
    """The ``*.yaml`` files directly in ``directory``, sorted by name."""
    try:
        with os.scandir(directory) as it:
            names = sorted(e.name for e in it if e.name.endswith(".yaml") and e.is_file())
    except OSError:
        return []
    return [directory / n for n in names]


def plan_inputs(files: list[Path]) -> list[Path]:
    """The files a plan is computed from: ``files`` (the manifests) and the manifest schema.

    The plan cache's key and the replay programs' key both cover exactly these."""
    return [*files, schema_path("manifest.schema.json")]


def installed_vllm() -> tuple[str | None, str | None]:
    """(version, commit) as the installed vLLM reports them, unnormalized (None where absent).

    ``planning.Runtime.detect`` normalizes these; the caches key on them as they are.
    """
    try:
        import vllm
    except ImportError:
        return None, None
    try:
        from vllm import _version as version_module

        commit = getattr(version_module, "__commit_id__", None)
    except ImportError:
        commit = None
    return getattr(vllm, "__version__", None), commit if isinstance(commit, str) else None


def python_tag() -> str:
    return f"{sys.implementation.name}-{sys.version_info[0]}.{sys.version_info[1]}.{sys.version_info[2]}"


def read_trusted(path: Path) -> bytes | None:
    """The file's bytes if it exists and passes the ownership check, else None."""
    try:
        with open(path, "rb") as f:
            return f.read() if _trusted(os.fstat(f.fileno())) else None
    except OSError:
        return None


def _trusted(st: os.stat_result) -> bool:
    """Only a file that this user (or root) owns and that nobody else may rewrite.
    Files written here are 0600 (mkstemp), so they pass."""
    if not hasattr(os, "getuid"):
        return True
    return st.st_uid in (0, os.getuid()) and not st.st_mode & 0o022


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (mode 0600) via a temp file + rename; OSError is ignored."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass


def code_key(obj: Any) -> str | None:
    """``file|size|mtime_ns|first line|qualname`` of the code under ``obj`` (through ``__func__``
    and ``__wrapped__``): the same key means the same source, so the same fingerprint."""
    import inspect

    obj = getattr(obj, "__func__", obj)
    obj = inspect.unwrap(obj) if callable(obj) else obj
    code = getattr(obj, "__code__", None)
    if code is None:
        return None
    try:
        st = os.stat(code.co_filename)
    except OSError:
        return None
    return f"{code.co_filename}|{st.st_size}|{st.st_mtime_ns}|{code.co_firstlineno}|{code.co_qualname}"


# -- the public API ---------------------------------------------------------------------------------
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
    with _lock:
        current = _status.get(plugin)
        if current is not None and (current.active or current.run is None):
            return current
        manifest_dir = Path(manifest_dir)
        if os.environ.get("PATCHKIT_DISABLE"):
            return _start(plugin, manifest_dir, runtime, None)
        from patchkit import replay

        identity = (runtime.vllm_version, runtime.vllm_commit) if runtime else installed_vllm()
        key = replay.key(manifest_dir, *identity)
        replayed = _replay(plugin, manifest_dir, runtime, key) if key is not None else None
        return replayed if replayed is not None else _start(plugin, manifest_dir, runtime, key)


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
            adopted = _start(plugin, manifest_dir, runtime, None, adopt=(steps, program["digest"]), status=result)
            if adopted._run is None:
                replay.undo(steps)  # the plan under this key no longer selects a manifest

    result._takeover = takeover
    replay.defer(program, takeover)
    if os.environ.get("PATCHKIT_REPORT_DIR"):
        takeover()
    return result


def _start(plugin: str, manifest_dir: Path, runtime: RuntimeInfo | None, replay_key: str | None,
           adopt: tuple[list[Any], str] | None = None, status: Status | None = None) -> Status:
    """Run the engine: compile (or read) the plan and apply it; ``adopt``: take over a replay first.

    ``replay_key``: where to record a replay program for this situation (None: record none).
    """
    from patchkit import engine, plancache, replay
    from patchkit.errors import ManifestError, PatchError
    from patchkit.planning import Runtime

    runtime = runtime or Runtime.detect()
    try:
        compiled = plancache.compiled(manifest_dir, runtime)
    except ManifestError as exc:
        logging.getLogger("patchkit").error("patchkit: %s: invalid manifest, nothing applied:\n%s", plugin, exc)
        return _remember(Status(plugin, False, f"invalid manifest:\n{exc}", ""), status)
    if compiled.manifest is None:
        logging.getLogger("patchkit").warning("patchkit: %s: %s; nothing applied", plugin, compiled.error)
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
    if replay_key is not None and result.active:
        from patchkit import recording

        recording.store(replay_key, run)
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
