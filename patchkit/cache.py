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
Fingerprints of live objects and compiled wrappers are cached the same way (``CodeCache``),
and so are replay programs (``patchkit.replay``), under the same key as the plan.
"""

from __future__ import annotations

import binascii
import hashlib
import json
import marshal
import os
import sys
import tempfile
from importlib.util import MAGIC_NUMBER
from pathlib import Path
from types import CodeType
from typing import TYPE_CHECKING, Any

from patchkit import schema_path

if TYPE_CHECKING:
    from patchkit.planning import Compiled, Runtime

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


def key(files: list[Path], vllm_version: str | None, vllm_commit: str | None) -> str:
    """The cache key of everything that can change a compiled plan (or a replay program)."""
    h = hashlib.sha256(FORMAT.encode())
    for p in [*files, schema_path("manifest.schema.json")]:
        # The content, not size + mtime: reproducible builds and `cp -p` keep mtimes, and an edit
        # of one fingerprint digit keeps the size, so size + mtime can name a stale plan.
        with open(p, "rb", buffering=0) as f:
            h.update(f"{p}|{hashlib.sha256(f.read()).hexdigest()}\n".encode())
    h.update(f"{vllm_version}|{vllm_commit}|{python_tag()}".encode())
    return h.hexdigest()[:32]


def installed_vllm() -> tuple[str | None, str | None]:
    """(version, commit) as the installed vLLM reports them, unnormalized (None where absent).

    ``planning.Runtime.detect`` normalizes these; the cache keys on them as they are.
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


def _read_json(path: Path) -> Any:
    data = read_trusted(path)
    try:
        return json.loads(data) if data is not None else None
    except ValueError:
        return None


def read_trusted(path: Path) -> bytes | None:
    """The file's bytes if it exists and passes the ownership check, else None."""
    try:
        with open(path, "rb") as f:
            return f.read() if _trusted(os.fstat(f.fileno())) else None
    except OSError:
        return None


def _trusted(st: os.stat_result) -> bool:
    """A cached plan names callables to import: only trust a file that this user (or root) owns
    and that nobody else may rewrite. Files written here are 0600 (mkstemp), so they pass."""
    if not hasattr(os, "getuid"):
        return True
    return st.st_uid in (0, os.getuid()) and not st.st_mode & 0o022


def _write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data).encode())


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


def compiled(directory: Path, runtime: Runtime, plan_key: str | None = None) -> Compiled:
    """Cached ``compile_plan`` for every manifest in ``directory``.

    ``plan_key``: ``key(...)`` of those files, when the caller already computed it.
    """
    from patchkit.planning import Compiled

    files = manifest_files(directory)
    plan_key = plan_key or key(files, runtime.vllm_version, runtime.vllm_commit)
    path = cache_dir() / f"plan-{plan_key}.json"
    data = _read_json(path)
    if isinstance(data, dict) and data.get("format") == FORMAT:
        try:
            return Compiled.from_json(data["plan"])
        except (KeyError, TypeError):
            pass
    from patchkit.selection import compile_plan  # YAML, JSON Schema, selection: only on a miss

    result = compile_plan(files, runtime)
    _write_json(path, {"format": FORMAT, "plan": result.to_json()})
    return result


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


class CodeCache:
    """What patchkit derives from live code, kept across processes in one JSON file.

    - fingerprints: ``(file, size, mtime, first line, qualname)`` → fingerprint;
    - compiled wrappers: (bytecode magic, file name, source) → marshalled code.

    Both are pure functions of their key, so a stale entry is never read; an
    entry that does not decode is computed again. The file is read only when
    it passes the same ownership check as the plans (it holds code to run).
    """

    def __init__(self) -> None:
        self._path = cache_dir() / "code-cache.json"
        self._data: dict[str, str] | None = None
        self._dirty = False

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

    def compiled(self, source: str, filename: str) -> CodeType:
        """``compile(source, filename, "exec")``, from the cache when this Python compiled it before."""
        key = f"code|{MAGIC_NUMBER.hex()}|{filename}|{source}"
        cached = self.get(key)
        if cached is not None:
            try:
                code = marshal.loads(binascii.a2b_base64(cached))
                if isinstance(code, CodeType):
                    return code
            except (ValueError, EOFError, TypeError, binascii.Error):
                pass
        code = compile(source, filename, "exec")
        self.put(key, binascii.b2a_base64(marshal.dumps(code), newline=False).decode("ascii"))
        return code

    def flush(self) -> None:
        if self._dirty and self._data is not None:
            current = _read_json(self._path)
            merged = {**(current if isinstance(current, dict) else {}), **self._data}
            _write_json(self._path, merged)
            self._dirty = False
