"""Compiled plans and what the engine derives from live code, cached across processes.

Validating YAML needs ``yaml``, ``jsonschema`` and ``packaging`` (about 150 ms
of imports) — too much for every vLLM process. ``compiled(...)`` returns the
selected manifest, the plan order and the static guard verdicts; the first
process computes them and stores JSON in the cache directory (see
``patchkit``: where, atomic writes, the ownership check), keyed by every
input that can change the answer: each manifest file's name and content hash,
the schema, patchkit's format version, the vLLM version and commit, and Python.
Later processes read one small JSON file. Fingerprints of live objects and
compiled wrappers are cached the same way (``CodeCache``).

Only the engine uses this module; a process that replays a program
(replay, in ``patchkit`` itself) never imports it.
"""

from __future__ import annotations

import binascii
import hashlib
import json
import marshal
from importlib.util import MAGIC_NUMBER
from pathlib import Path
from types import CodeType
from typing import TYPE_CHECKING, Any

from patchkit import cache_dir, manifest_files, plan_inputs, python_tag, read_trusted, write_atomic

if TYPE_CHECKING:
    from patchkit.planning import Compiled, Runtime

FORMAT = "patchkit-plan-3"


def key(files: list[str], vllm_version: str | None, vllm_commit: str | None) -> str:
    """The cache key of everything that can change a compiled plan."""
    h = hashlib.sha256(FORMAT.encode())
    for p in plan_inputs(files):
        # The content, not size + mtime: reproducible builds and `cp -p` keep mtimes, and an edit
        # of one fingerprint digit keeps the size, so size + mtime can name a stale plan.
        with open(p, "rb", buffering=0) as f:
            h.update(f"{p}|{hashlib.sha256(f.read()).hexdigest()}\n".encode())
    h.update(f"{vllm_version}|{vllm_commit}|{python_tag()}".encode())
    return h.hexdigest()[:32]


def read_json(path: Path) -> Any:
    data = read_trusted(path)
    try:
        return json.loads(data) if data is not None else None
    except ValueError:
        return None


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data).encode())


def compiled(directory: Path, runtime: Runtime) -> Compiled:
    """Cached ``compile_plan`` for every manifest in ``directory``."""
    from patchkit.planning import Compiled

    files = manifest_files(directory)
    path = cache_dir() / f"plan-{key(files, runtime.vllm_version, runtime.vllm_commit)}.json"
    data = read_json(path)
    if isinstance(data, dict) and data.get("format") == FORMAT:
        try:
            return Compiled.from_json(data["plan"])
        except (KeyError, TypeError):
            pass
    from patchkit.selection import compile_plan  # YAML, JSON Schema, selection: only on a miss

    result = compile_plan(files, runtime)
    write_json(path, {"format": FORMAT, "plan": result.to_json()})
    return result


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
            loaded = read_json(self._path)
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
            current = read_json(self._path)
            merged = {**(current if isinstance(current, dict) else {}), **self._data}
            write_json(self._path, merged)
            self._dirty = False
