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

This module is the whole *warm path*: what a vLLM process runs when a stored
replay program fits it (nearly every process). It is one module on purpose:
in a process that has imported vLLM, every further module costs about
0.1–0.2 ms of import machinery before its body runs, and the plugin hook runs
in every process vLLM starts. Its sections:

1. the ground floor: where patchkit's files are, whom it trusts, what runs;
2. after-import callbacks (run code right after a module executes);
3. replay: a recorded plan application, checked and repeated;
4. the public API.

Everything else (YAML, JSON Schema, planning, the engine, recording) lives in
submodules that only a process without a fitting program imports.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import marshal
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from importlib import import_module
from importlib.util import MAGIC_NUMBER
from pathlib import Path
from types import CodeType, FunctionType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec
    from types import ModuleType

    from patchkit.errors import ManifestError, PatchError, PatchkitError, UnsupportedRelease
    from patchkit.planning import Runtime

    ImportCallback = Callable[[ModuleType], None]
    # One installed replay step: (entry id, owner, attribute, original, installed, seconds, verdict).
    Step = tuple[str, type, str, Any, Any, float, str]

__all__ = [
    "ManifestError", "PatchError", "PatchkitError", "Status", "UnsupportedRelease",
    "activate", "applied", "revert", "status",
]

_PACKAGE_DIR = os.path.dirname(__file__)  # a str: a Path here costs every vLLM process ~50 µs


# -- 1. the ground floor ----------------------------------------------------------------------------
# The cache directory is ``$PATCHKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/patchkit``, else
# ``~/.cache/patchkit``; it holds compiled plans and the code cache (``patchkit.plancache``)
# and replay programs (section 3). Everything in it names code to run, so a file is
# read only if this user (or root) owns it and nobody else may write it; files are written
# 0600 through a temp file and a rename, so concurrent processes at worst compute the same
# thing twice. An unwritable or corrupt cache is ignored, never fatal.


def schema_path(name: str) -> str:
    """A shipped JSON Schema, e.g. ``manifest.schema.json``: ``patchkit/_schemas/`` in a wheel,
    the repository's ``schemas/`` in a checkout or editable install (looked up here only)."""
    packaged = os.path.join(_PACKAGE_DIR, "_schemas")
    folder = packaged if os.path.isdir(packaged) else os.path.join(os.path.dirname(_PACKAGE_DIR), "schemas")
    return os.path.join(folder, name)


def _cache_root() -> str:
    if os.environ.get("PATCHKIT_CACHE_DIR"):
        return os.environ["PATCHKIT_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "patchkit")


def cache_dir() -> Path:
    return Path(_cache_root())


def manifest_files(directory: str | os.PathLike[str]) -> list[str]:
    """The ``*.yaml`` files directly in ``directory``, sorted by name."""
    try:
        with os.scandir(directory) as it:
            return sorted(e.path for e in it if e.name.endswith(".yaml") and e.is_file())
    except OSError:
        return []


def plan_inputs(files: list[str]) -> list[str]:
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


def read_trusted(path: str | Path) -> bytes | None:
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


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (mode 0600) via a temp file + rename; OSError is ignored."""
    folder = os.path.dirname(path) or "."  # a bare file name: the current directory, as before
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
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


# -- 2. after-import callbacks ------------------------------------------------------------------------
# ``when_imported(name, callback)`` calls ``callback(module)`` at once when the module is
# already in ``sys.modules``; otherwise a finder on ``sys.meta_path`` wraps that module's
# loader so the callback runs after the module body and before ``import`` returns: code
# that does ``from name import f`` afterwards gets the patched ``f``.
# Limits: only modules imported through the normal import system are seen (not ``exec``
# of source, not modules put into ``sys.modules`` by hand). A callback runs once per
# registration; ``importlib.reload`` does not re-run it.

_imports_lock = threading.RLock()
_pending: dict[str, list[ImportCallback]] = {}
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
        with _imports_lock:
            callbacks = _pending.pop(self._name, [])
        for callback in callbacks:
            callback(module)


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
    with _imports_lock:
        module = sys.modules.get(name)
        if module is None:
            _pending.setdefault(name, []).append(callback)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return False
    callback(module)
    return True


def cancel_when_imported(callback: ImportCallback) -> None:
    """Forget a pending callback (used by rollback and revert)."""
    with _imports_lock:
        for name in list(_pending):
            _pending[name] = [c for c in _pending[name] if c is not callback]
            if not _pending[name]:
                del _pending[name]


def pending_imports() -> dict[str, int]:
    """Module name → number of callbacks still waiting (for reports and tests)."""
    with _imports_lock:
        return {name: len(cbs) for name, cbs in _pending.items()}


# -- 3. replay ------------------------------------------------------------------------------------------
# When the engine (``patchkit.engine``) has started a plan, ``patchkit.recording`` writes down
# what it did at once, for the entries whose modules were already imported: where each target
# lives, what was there (descriptor kind, and the source key the fingerprint cache uses: same
# key, same source, same fingerprint), and what went in (the wrapper's compiled code, the name
# of the ``with`` callable). Programs are stored in the cache directory under ``replay_key``
# of the inputs, one per *situation*: which of the plan's modules were imported and which not.
#
# ``apply_program`` repeats a program in a later process of the same situation in two phases.
# First it checks everything the engine would check (the owner and the attribute exist, no
# patch is there yet, descriptor kind and source key are as recorded, every named callable
# imports) and builds the new objects, changing nothing. Only if all of that holds does it
# install them (and restores them, in reverse, if an install fails). Otherwise it returns
# None and the caller runs the full engine, with its own errors, records and reports.
#
# Work that waits for an import (entries on modules not imported yet, model registrations)
# is not replayed: ``activate`` hands the plan to the engine at the first such import
# (``engine.Run.adopt`` takes over what was installed). vLLM is importing one of its own
# modules then, so the engine's import cost is not seen.
# Limit: the engine imports an entry's callable just before it applies that entry; a replay
# imports all of them before it applies any.

REPLAY_FORMAT = "patchkit-replay-1"
_DESCRIPTORS: dict[str, type] = {"staticmethod": staticmethod, "classmethod": classmethod}
_MISSING = object()


def new_wrapper(code: CodeType, factory: Callable[..., Any], original: Any, marker: tuple[str, str]) -> Any:
    """The function ``patched`` compiled as ``code`` (``def patched(<original's parameters>):
    return factory(original, ...)``), with ``original``'s defaults, metadata and our marker."""
    own = getattr(original, "__code__", None)
    same_parameters = isinstance(original, FunctionType) and own is not None and (
        (code.co_argcount, code.co_kwonlyargcount) == (own.co_argcount, own.co_kwonlyargcount))
    patched = FunctionType(code, {"__builtins__": builtins, "factory": factory, "original": original},
                           "patched", original.__defaults__ if same_parameters else None)
    if same_parameters and original.__kwdefaults__:
        patched.__kwdefaults__ = dict(original.__kwdefaults__)
    functools.update_wrapper(patched, original)
    patched.__patchkit__ = marker
    return patched


def descriptor_name(raw: Any) -> str:
    """``"staticmethod"`` / ``"classmethod"`` for exactly those types, else ``""``."""
    kind = type(raw)
    return kind.__name__ if kind in (staticmethod, classmethod) else ""


def replay_key(directory: str | os.PathLike[str], vllm_version: str | None, vllm_commit: str | None) -> str | None:
    """The programs' key for these inputs, from file metadata only (nothing is read or parsed).

    Each manifest's and the schema's path, inode, size, mtime and ctime; the vLLM
    version and commit; Python. Writing a file changes its ctime, which, unlike
    its mtime (``cp -p``, reproducible builds, ``touch -d``), a user cannot set
    back, so an edited manifest never finds an old program. None if a file
    cannot be examined (then there is no replay).
    """
    h = hashlib.sha256(REPLAY_FORMAT.encode())
    try:
        for p in plan_inputs(manifest_files(directory)):
            st = os.stat(p)
            h.update(f"{p}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}\n".encode())
    except OSError:
        return None
    h.update(f"{vllm_version}|{vllm_commit}|{python_tag()}".encode())
    return h.hexdigest()[:32]


def program_path(key: str) -> str:
    return os.path.join(_cache_root(), f"replay-{key}.bin")


def programs(key: str) -> list[dict[str, Any]]:
    """Every program stored under ``key`` (none if the file is missing, untrusted or damaged)."""
    data = read_trusted(program_path(key))
    if data is None:
        return []
    try:
        fmt, magic, stored = marshal.loads(data)
    except (ValueError, EOFError, TypeError):
        return []
    return stored if fmt == REPLAY_FORMAT and magic == MAGIC_NUMBER and isinstance(stored, list) else []


def load_program(key: str) -> dict[str, Any] | None:
    """The stored program for this process's situation, or None."""
    modules = sys.modules
    for program in programs(key):
        if all(m in modules for m in program["imported"]) and not any(m in modules for m in program["absent"]):
            return program
    return None


def apply_program(program: dict[str, Any], plugin: str, runtime: Runtime | None) -> list[Step] | None:
    """Check every step, then install them all; None (nothing changed) if any check fails."""
    planned: list[tuple[tuple[Any, ...], type, Any, Any, float]] = []
    current: dict[tuple[int, str], Any] = {}  # what this replay put where, for entries sharing a target
    for step in program["steps"]:
        started = time.perf_counter()
        entry_id, module, owner_path, name, descriptor, source_key, kind, ref, spec, code, _ = step
        owner: Any = sys.modules.get(module)
        for part in owner_path:
            owner = getattr(owner, part, None)
        if not isinstance(owner, type):
            return None
        raw = current.get((id(owner), name), _MISSING)
        first = raw is _MISSING
        if first:
            raw = vars(owner).get(name, _MISSING)
        wrapper_of = _DESCRIPTORS.get(descriptor)
        if raw is _MISSING or descriptor_name(raw) != descriptor:
            return None
        func = raw.__func__ if wrapper_of else raw
        if first and hasattr(func, "__patchkit__"):
            return None
        if source_key is not None and code_key(func) != source_key:
            return None
        try:
            target = _resolve(ref)
        except Exception:  # noqa: BLE001 - the engine will report it, naming the entry
            return None
        if kind == "replace":
            if func is target:
                return None  # already replaced: the engine reports it
            new = target
        elif not callable(func) or not callable(target):
            return None
        else:
            factory = _workers(spec, runtime) if kind == "workers" else target
            new = new_wrapper(code, factory, func, (plugin, entry_id))
        if wrapper_of:
            new = wrapper_of(new)
        current[(id(owner), name)] = new
        planned.append((step, owner, raw, new, time.perf_counter() - started))
    done: list[Step] = []
    for step, owner, raw, new, seconds in planned:
        started = time.perf_counter()
        try:
            setattr(owner, step[3], new)
        except Exception:  # noqa: BLE001 - whatever a metaclass raises: put back, let the engine report
            undo_program(done)
            return None
        done.append((step[0], owner, step[3], raw, new, seconds + time.perf_counter() - started, step[10]))
    return done


def undo_program(steps: list[Step]) -> None:
    """Put back what ``apply_program`` installed, newest first."""
    for _, owner, name, original, *_rest in reversed(steps):
        setattr(owner, name, original)


def _resolve(ref: str) -> Any:
    module_name, _, qualname = ref.partition(":")
    return functools.reduce(getattr, qualname.split("."), import_module(module_name))


def _workers(spec: dict[str, Any], runtime: Runtime | None) -> Callable[..., Any]:
    """The worker override's factory, built (as the engine builds it) at its first call."""
    built: list[Callable[..., Any]] = []

    def factory(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not built:
            from patchkit import vllm_adapter
            from patchkit.planning import Runtime

            built.append(vllm_adapter.worker_wrapper(spec, runtime or Runtime.detect()))
        return built[0](original, *args, **kwargs)

    return factory


# -- 4. the public API ------------------------------------------------------------------------------------
_lock = threading.RLock()
_status: dict[str, Status] = {}


class Status:
    """Where one plugin's plan stands in this process.

    ``run`` is the ``patchkit.engine.Run`` when a manifest was selected, else None.
    ``replayed`` says this process applied the plan by replaying a stored program
    (section 3); its ``Run`` is then built on first access.
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

    # -- requirement verdicts (issue 15): a read-only view, delegated; nothing here runs in the hook --
    @property
    def requirements(self) -> list[Any]:
        """Verdicts of the selected manifest's ``requires:`` against the running vLLM's source
        (``patchkit.requirements.Verdict``; judged on first access, then kept). Empty without a plan."""
        from patchkit import requirements

        return requirements.of_status(self)

    def __repr__(self) -> str:
        return f"Status({self.plugin!r}, active={self.active}, problem={self.problem!r})"


def activate(plugin: str, manifest_dir: str | Path, runtime: Runtime | None = None) -> Status:
    """Apply ``plugin``'s manifest for the running vLLM (idempotent, never raises PatchkitError).

    ``runtime`` defaults to the running vLLM; tests pass their own. A process
    whose situation has a stored replay program repeats it (section 3); any
    other runs the engine, which records a program for the next one.
    """
    with _lock:
        current = _status.get(plugin)
        if current is not None and (current.active or current.run is None):
            return current
        manifest_dir = Path(manifest_dir)
        if os.environ.get("PATCHKIT_DISABLE"):
            return _start(plugin, manifest_dir, runtime, None)
        identity = (runtime.vllm_version, runtime.vllm_commit) if runtime else installed_vllm()
        key = replay_key(manifest_dir, *identity)
        replayed = _replay(plugin, manifest_dir, runtime, key) if key is not None else None
        return replayed if replayed is not None else _start(plugin, manifest_dir, runtime, key)


def _replay(plugin: str, manifest_dir: Path, runtime: Runtime | None, key: str) -> Status | None:
    """Repeat the stored program for this situation; hand over to the engine at the first
    import it waits for (or at once, when per-process reports are asked for)."""
    program = load_program(key)
    steps = apply_program(program, plugin, runtime) if program is not None else None
    if program is None or steps is None:
        return None
    result = _remember(Status(plugin, True, None, program["supported"]))
    result.replayed = True

    def takeover(_module: Any = None) -> None:
        with _lock:
            if result._takeover is None:
                return
            result._takeover = None
            cancel_when_imported(takeover)
            adopted = _start(plugin, manifest_dir, runtime, None, adopt=(steps, program["digest"]), status=result)
            if adopted._run is None:
                undo_program(steps)  # the plan under this key no longer selects a manifest

    result._takeover = takeover
    for module in program["absent"]:
        when_imported(module, takeover)
    if os.environ.get("PATCHKIT_REPORT_DIR"):
        takeover()
    return result


def _start(plugin: str, manifest_dir: Path, runtime: Runtime | None, record_under: str | None,
           adopt: tuple[list[Any], str] | None = None, status: Status | None = None) -> Status:
    """Run the engine: compile (or read) the plan and apply it; ``adopt``: take over a replay first.

    ``record_under``: the replay key to record a program for this situation under (None: record none).
    """
    import logging

    from patchkit import engine, plancache
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
                undo_program(steps)
        run.start()
    except PatchError as exc:
        result.active, result.problem = False, str(exc)
    if record_under is not None and result.active:
        from patchkit import recording

        recording.store(record_under, run)
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
