"""Compiled plans, cached across processes so the plugin hook stays cheap.

Validating YAML needs ``yaml``, ``jsonschema`` and ``packaging`` (about 150 ms
of imports) — too much for every vLLM process. ``compiled(...)`` returns the
selected manifest, the plan order and the static guard verdicts; the first
process computes them and stores JSON under the cache directory, keyed by every
input that can change the answer: each manifest file's name and content hash,
the schema, patchkit's format version, the vLLM version and commit, and Python.
Later processes read one small JSON file.

The cache directory is ``$PATCHKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/patchkit``,
else ``~/.cache/patchkit``. Writes are atomic (temp file + rename), so
concurrent processes at worst compute the same plan twice. An unwritable or
corrupt cache is ignored, never fatal, and so is a cache file that another user owns
or that group/others may write (the cache is trusted input: a plan names callables).
Fingerprints of live objects are cached the same way, keyed by file, size, mtime and first line.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from patchkit import resources
from patchkit.errors import ManifestError, UnsupportedRelease
from patchkit.planning import Compiled, Runtime, order, python_tag, select, static_verdict, supported

FORMAT = "patchkit-plan-3"


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


def _key(files: list[Path], runtime: Runtime) -> str:
    h = hashlib.sha256(FORMAT.encode())
    for p in [*files, resources.schema_path("manifest.schema.json")]:
        # The content, not size + mtime: reproducible builds and `cp -p` keep mtimes, and an edit
        # of one fingerprint digit keeps the size, so size + mtime can name a stale plan.
        h.update(f"{p}|{hashlib.sha256(p.read_bytes()).hexdigest()}\n".encode())
    h.update(f"{runtime.vllm_version}|{runtime.vllm_commit}|{python_tag()}".encode())
    return h.hexdigest()[:32]


def compile_plan(files: list[Path], runtime: Runtime) -> Compiled:
    """Validate every manifest (ManifestError on any problem) and select/order for ``runtime``."""
    from patchkit import manifest as manifest_module  # YAML + JSON Schema: only when the cache misses

    manifests = []
    problems = []
    for f in files:
        try:
            manifests.append(manifest_module.load(f))
        except ManifestError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ManifestError(problems)
    try:
        chosen = select(manifests, runtime)
    except UnsupportedRelease as exc:
        return Compiled(None, [], {}, supported(manifests), str(exc), "")
    ordered = order(chosen.entries)
    static = {e.id: static_verdict(e.when, runtime) for e in ordered}
    static.update({f"model:{m.arch}": static_verdict(m.when, runtime) for m in chosen.models})
    digest = hashlib.sha256(f"{chosen.digest}|{[e.id for e in ordered]}".encode()).hexdigest()[:16]
    return Compiled(chosen, [e.id for e in ordered], static, supported(manifests), None, digest)


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            if not _trusted(os.fstat(f.fileno())):
                return None
            return json.load(f)
    except (OSError, ValueError):
        return None


def _trusted(st: os.stat_result) -> bool:
    """A cached plan names callables to import: only trust a file that this user (or root) owns
    and that nobody else may rewrite. Files written here are 0600 (mkstemp), so they pass."""
    if not hasattr(os, "getuid"):
        return True
    return st.st_uid in (0, os.getuid()) and not st.st_mode & 0o022


def _write_json(path: Path, data: Any) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass


def compiled(directory: Path, runtime: Runtime) -> Compiled:
    """Cached ``compile_plan`` for every manifest in ``directory``."""
    files = manifest_files(directory)
    key = _key(files, runtime)
    path = cache_dir() / f"plan-{key}.json"
    data = _read_json(path)
    if isinstance(data, dict) and data.get("format") == FORMAT:
        try:
            return Compiled.from_json(data["plan"])
        except (KeyError, TypeError):
            pass
    result = compile_plan(files, runtime)
    _write_json(path, {"format": FORMAT, "plan": result.to_json()})
    return result


class FingerprintCache:
    """``(file, size, mtime, first line, qualname)`` → fingerprint, persisted as one JSON file."""

    def __init__(self) -> None:
        self._path = cache_dir() / "fingerprints.json"
        self._data: dict[str, str] | None = None
        self._dirty = False

    @staticmethod
    def key_of(obj: Any) -> str | None:
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

    def get(self, key: str) -> str | None:
        if self._data is None:
            loaded = _read_json(self._path)
            self._data = loaded if isinstance(loaded, dict) else {}
        return self._data.get(key)

    def put(self, key: str, value: str) -> None:
        self.get(key)
        assert self._data is not None
        self._data[key] = value
        self._dirty = True

    def flush(self) -> None:
        if self._dirty and self._data is not None:
            current = _read_json(self._path)
            merged = {**(current if isinstance(current, dict) else {}), **self._data}
            _write_json(self._path, merged)
            self._dirty = False
