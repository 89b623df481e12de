"""Replay: the warm path's short cut, a plan application recorded once, then checked and repeated.

When the full engine (``patchkit.engine``) has started a plan,
``patchkit.recording`` writes down what it did at once, for the entries whose
modules were already imported: where each target lives, what was there
(descriptor kind, and the source key the fingerprint cache uses: same key, same
source, same fingerprint), and what went in (the wrapper's compiled code, the
name of the ``with`` callable). Programs are stored in the cache directory under
``key(...)`` of the inputs, one per *situation*: which of the plan's modules were
imported and which were not.

``apply`` repeats a program in a later process of the same situation in two
phases. First it checks everything the engine would check — the owner and the
attribute exist, no patch is there yet, descriptor kind and source key are as
recorded, every named callable imports — and builds the new objects, changing
nothing. Only if all of that holds does it install them (and restores them, in
reverse, if an install fails). Otherwise it returns None and the caller runs the
full engine, with its own errors, records and reports.

Work that waits for an import (entries on modules not imported yet, model
registrations) is not replayed: ``defer`` hands the plan to the engine at the
first such import (``engine.Run.adopt`` takes over what was installed). vLLM is
importing one of its own modules then, so the engine's import cost is not seen.

This module is the warm path of every vLLM process, with ``patchkit`` (and
``patchkit.importhook`` when something waits for an import): it imports nothing
else of patchkit until it hands over. Limit: the engine imports an entry's callable
just before it applies that entry; a replay imports all of them before it
applies any.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import marshal
import os
import sys
import time
from collections.abc import Callable
from importlib import import_module
from importlib.util import MAGIC_NUMBER
from types import CodeType, FunctionType
from typing import TYPE_CHECKING, Any

from patchkit import cache_dir, code_key, manifest_files, plan_inputs, python_tag, read_trusted

if TYPE_CHECKING:
    from pathlib import Path

    from patchkit.importhook import Callback
    from patchkit.planning import Runtime

FORMAT = "patchkit-replay-1"
_DESCRIPTORS: dict[str, type] = {"staticmethod": staticmethod, "classmethod": classmethod}
_MISSING = object()

# One installed entry: (entry id, owner, attribute, original, installed, seconds, fingerprint verdict).
Step = tuple[str, type, str, Any, Any, float, str]


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


def key(directory: Path, vllm_version: str | None, vllm_commit: str | None) -> str | None:
    """The programs' key for these inputs, from file metadata only (nothing is read or parsed).

    Each manifest's and the schema's path, inode, size, mtime and ctime; the vLLM
    version and commit; Python. Writing a file changes its ctime, which, unlike
    its mtime (``cp -p``, reproducible builds, ``touch -d``), a user cannot set
    back, so an edited manifest never finds an old program. None if a file
    cannot be examined (then there is no replay).
    """
    h = hashlib.sha256(FORMAT.encode())
    try:
        for p in plan_inputs(manifest_files(directory)):
            st = os.stat(p)
            h.update(f"{p}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}\n".encode())
    except OSError:
        return None
    h.update(f"{vllm_version}|{vllm_commit}|{python_tag()}".encode())
    return h.hexdigest()[:32]


def program_path(key: str) -> Path:
    return cache_dir() / f"replay-{key}.bin"


def programs(key: str) -> list[dict[str, Any]]:
    """Every program stored under ``key`` (none if the file is missing, untrusted or damaged)."""
    data = read_trusted(program_path(key))
    if data is None:
        return []
    try:
        fmt, magic, programs = marshal.loads(data)
    except (ValueError, EOFError, TypeError):
        return []
    return programs if fmt == FORMAT and magic == MAGIC_NUMBER and isinstance(programs, list) else []


def load(key: str) -> dict[str, Any] | None:
    """The stored program for this process's situation, or None."""
    for program in programs(key):
        modules = sys.modules
        if all(m in modules for m in program["imported"]) and not any(m in modules for m in program["absent"]):
            return program
    return None


def apply(program: dict[str, Any], plugin: str, runtime: Runtime | None) -> list[Step] | None:
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
            undo(done)
            return None
        done.append((step[0], owner, step[3], raw, new, seconds + time.perf_counter() - started, step[10]))
    return done


def undo(steps: list[Step]) -> None:
    """Put back what ``apply`` installed, newest first."""
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


def defer(program: dict[str, Any], takeover: Callback) -> None:
    """Call ``takeover`` when the first module the program waits for is imported.

    ``patchkit.importhook`` is loaded only if the program waits for something (in
    the front end it does: vLLM's model registry is imported later)."""
    if program["absent"]:
        from patchkit import importhook

        for module in program["absent"]:
            importhook.when_imported(module, takeover)
