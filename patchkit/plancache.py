"""Compiled plans and fingerprints of live code, cached as JSON data between processes.

Validating YAML needs ``yaml``, ``jsonschema`` and ``packaging`` (well over
100 ms of imports), and fingerprinting a long vLLM method means reading and
parsing its source: too much for every vLLM process. The first process does
that work and stores the result in the cache directory (``patchkit.files``:
where, and the rules a file must pass to be read); later processes read one
small JSON file.

What a cache file can hold is data, and it is checked again when read:
- a plan (``plan-<key>.json``) is keyed by the SHA-256 of every manifest's and
  the schema's content, patchkit's plan format and version, the plugin's
  version, the vLLM version and commit, and Python. On read it must have the
  plan's exact shape, name one of the manifest files read for the key with
  that file's content hash, and every callable it names must lie inside the
  manifest's declared packages (the rule ``patchkit.manifest`` enforces);
  anything else is a miss and the plan is compiled again.
- fingerprints (``fingerprints.json``) are keyed by the SHA-256 of the source
  file's content plus the definition's first line and qualified name, so an
  edited file never finds a stale value; values must look like fingerprints.
A poisoned cache can at worst make this user's own processes run the
plugin's declared callables or skip a drift check; it can never run code.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import TYPE_CHECKING, Any

from patchkit import __version__
from patchkit.files import manifest_files, read_private, schema_path, write_private

if TYPE_CHECKING:
    from patchkit.planning import Compiled, Runtime

FORMAT = "patchkit-plan-4"
_FINGERPRINTS = "fingerprints.json"
_HEX = frozenset("0123456789abcdef")


def _sha256_file(path: str) -> str:
    with open(path, "rb", buffering=0) as f:
        return hashlib.sha256(f.read()).hexdigest()


def _python_tag() -> str:
    return f"{sys.implementation.name}-{sys.version_info[0]}.{sys.version_info[1]}.{sys.version_info[2]}"


def _load_json(name: str) -> Any:
    data = read_private(name)
    try:
        return json.loads(data) if data is not None else None
    except (ValueError, RecursionError):
        return None


def compiled(directory: str, runtime: Runtime, plugin_version: str = "") -> Compiled:
    """``selection.compile_plan`` for the manifests in ``directory``, read from the cache when it fits."""
    files = manifest_files(directory)
    digests = {p: _sha256_file(p) for p in files}
    h = hashlib.sha256(f"{FORMAT}|{__version__}|{plugin_version}".encode())
    for p in [*files, schema_path("manifest.schema.json")]:
        h.update(f"{p}|{digests.get(p) or _sha256_file(p)}\n".encode())
    h.update(f"{runtime.vllm_version}|{runtime.vllm_commit}|{_python_tag()}".encode())
    name = f"plan-{h.hexdigest()[:32]}.json"
    cached = _plan_from_json(_load_json(name), digests)
    if cached is not None:
        return cached
    from patchkit.selection import compile_plan  # YAML, JSON Schema, selection: only on a miss

    result = compile_plan(files, runtime)
    write_private(name, json.dumps({"format": FORMAT, "plan": result.to_json()}).encode())
    return result


def _plan_from_json(data: Any, digests: dict[str, str]) -> Compiled | None:
    """The cached plan if it has the right shape and agrees with the files on disk, else None."""
    from patchkit.planning import Compiled

    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    try:
        plan = Compiled.from_json(data["plan"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    manifest = plan.manifest
    if manifest is None:
        return plan if isinstance(plan.error, str) else None
    if digests.get(manifest.file) != manifest.digest:
        return None
    packages = set(manifest.packages)
    refs = [*(e.with_ for e in manifest.entries if e.with_), *(m.class_ref for m in manifest.models)]
    for e in manifest.entries:
        if e.workers:
            refs += [e.workers["role_of"], *(o["class"] for o in e.workers["overrides"])]
    if not all(isinstance(r, str) and r.partition(":")[0].split(".")[0] in packages for r in refs):
        return None
    return plan


class Fingerprints:
    """Fingerprints of live definitions, cached by the content of their source file.

    ``of(func)`` returns the fingerprint ``patchkit.fingerprint.of_object`` would
    compute, from the cache when the same file content, line and qualname were
    fingerprinted before. ``flush()`` stores new values (merged with the file).
    """

    def __init__(self) -> None:
        self._data: dict[str, str] | None = None
        self._new: dict[str, str] = {}
        self._file_digests: dict[str, str] = {}  # several targets often share one source file

    def of(self, func: Any) -> str | None:
        key = self._source_key(func)
        if key is not None:
            if self._data is None:
                self._data = _valid_fingerprints(_load_json(_FINGERPRINTS))
            if key in self._data:
                return self._data[key]
        from patchkit import fingerprint

        value = fingerprint.of_object(func)
        if key is not None and value:
            self._data[key] = self._new[key] = value  # type: ignore[index]
        return value

    def flush(self) -> None:
        if self._new:
            merged = {**_valid_fingerprints(_load_json(_FINGERPRINTS)), **self._new}
            write_private(_FINGERPRINTS, json.dumps(merged).encode())
            self._new = {}


    def _source_key(self, func: Any) -> str | None:
        """``sha256(file content)|first line|qualname`` of the code under ``func``, or None."""
        import inspect

        func = getattr(func, "__func__", func)
        func = inspect.unwrap(func) if callable(func) else func
        code = getattr(func, "__code__", None)
        if code is None:
            return None
        file = code.co_filename
        if file not in self._file_digests:
            try:
                self._file_digests[file] = _sha256_file(file)
            except OSError:
                return None
        return f"{self._file_digests[file]}|{code.co_firstlineno}|{code.co_qualname}"


def _is_fingerprint(value: object) -> bool:
    """``ast<N>:<16 hex>:<16 hex>``, the only shape a cached fingerprint may have."""
    if not isinstance(value, str):
        return False
    prefix, _, rest = value.partition(":")
    sig, _, body = rest.partition(":")
    return (prefix.startswith("ast") and prefix[3:].isdigit() and len(sig) == len(body) == 16
            and _HEX.issuperset(sig) and _HEX.issuperset(body))


def _valid_fingerprints(data: Any) -> dict[str, str]:
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and _is_fingerprint(v)}
