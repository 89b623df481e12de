"""Replay: the warm path's short cut, a plan application recorded once, then checked and repeated.

When the full engine (``patchkit.engine``) has started a plan, ``record`` writes
down what it did at once, for the entries whose modules were already imported:
where each target lives, what was there (descriptor kind, and the source key
the fingerprint cache uses: same key, same source, same fingerprint), and what
went in (the wrapper's compiled code, the name of the ``with`` callable). The
program is stored beside the compiled plan, under the same key (manifest
contents, schema, vLLM version and commit, Python), one per *situation*: which
of the plan's modules were imported and which were not.

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

What gets recorded (otherwise there is no program, and the engine always runs):
``wrap``, ``replace`` and ``workers`` entries on class attributes (functions,
``staticmethod``, ``classmethod``) without ``when`` guards, applied at once, and
model registrations that wait for vLLM's registry. ``PATCHKIT_DISABLE`` turns
replay off. Limit: the engine imports an entry's callable just before it applies
that entry; a replay imports all of them before it applies any.
"""

from __future__ import annotations

import builtins
import functools
import marshal
import os
import sys
import time
from collections.abc import Callable
from importlib import import_module
from importlib.util import MAGIC_NUMBER
from types import CodeType, FunctionType
from typing import TYPE_CHECKING, Any

from patchkit import cache, importhook

if TYPE_CHECKING:
    from patchkit.engine import Run
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


def _descriptor_name(raw: Any) -> str:
    kind = type(raw)
    return kind.__name__ if kind in (staticmethod, classmethod) else ""


def _path(key: str) -> Any:
    return cache.cache_dir() / f"replay-{key}.bin"


def _programs(key: str) -> list[dict[str, Any]]:
    data = cache.read_trusted(_path(key))
    if data is None:
        return []
    try:
        fmt, magic, programs = marshal.loads(data)
    except (ValueError, EOFError, TypeError):
        return []
    return programs if fmt == FORMAT and magic == MAGIC_NUMBER and isinstance(programs, list) else []


def load(key: str) -> dict[str, Any] | None:
    """The stored program for this process's situation, or None."""
    for program in _programs(key):
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
        if raw is _MISSING or _descriptor_name(raw) != descriptor:
            return None
        func = raw.__func__ if wrapper_of else raw
        if first and hasattr(func, "__patchkit__"):
            return None
        if source_key is not None and cache.code_key(func) != source_key:
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


def defer(program: dict[str, Any], takeover: importhook.Callback) -> None:
    """Call ``takeover`` when the first module the program waits for is imported."""
    for module in program["absent"]:
        importhook.when_imported(module, takeover)


# -- recording (after a full engine start; not on the warm path) ----------------------------------
def store(key: str, run: Run) -> None:
    """Record ``run``'s immediate application as the program for this situation, if it qualifies."""
    program = record(run)
    if program is None:
        return
    same = (program["imported"], program["absent"])
    programs = [p for p in _programs(key) if (p["imported"], p["absent"]) != same]
    cache.write_atomic(_path(key), marshal.dumps((FORMAT, MAGIC_NUMBER, [program, *programs])))


def record(run: Run) -> dict[str, Any] | None:
    """The program that repeats what ``run`` applied at start, or None if anything was unusual."""
    from patchkit.targets import unwrap_descriptor
    from patchkit.vllm_adapter import MODEL_REGISTRY_MODULE

    if run.status != "active" or os.environ.get("PATCHKIT_DISABLE"):
        return None
    steps: list[tuple[Any, ...]] = []
    installed: dict[tuple[int, str], Any] = {}
    absent: list[str] = []
    for entry_id, rec in run.records.items():
        entry = run.entries.get(entry_id)
        if rec.outcome == "pending":
            module = entry.module if entry is not None else MODEL_REGISTRY_MODULE
            if module in sys.modules and entry is None:
                return None
            if module not in sys.modules and module not in absent:
                absent.append(module)
            continue
        if rec.outcome != "applied" or entry is None or rec.slot is None or not rec.slot.on_class:
            return None
        if entry.op not in ("wrap", "replace", "workers") or entry.when or run.compiled.static.get(entry_id):
            return None
        owner, name = rec.slot.owner, rec.slot.name
        func, descriptor = unwrap_descriptor(rec.original)
        if descriptor is not None and _descriptor_name(rec.original) == "":
            return None  # a subclass of staticmethod or classmethod
        previous = installed.get((id(owner), name), _MISSING)
        if previous is _MISSING and hasattr(func, "__patchkit__"):
            return None  # another plan's patch was there: its replay is its own affair
        if previous is not _MISSING and previous is not rec.original:
            return None
        source_key = cache.code_key(func) if entry.fingerprint else None
        if entry.fingerprint and (source_key is None or rec.fingerprint != "match"):
            return None
        new, _ = unwrap_descriptor(rec.installed)
        code = None
        if entry.op != "replace":
            if not isinstance(new, FunctionType):
                return None
            code = new.__code__
        ref = entry.workers["role_of"] if entry.op == "workers" and entry.workers else entry.with_
        module_name, _, qualname = entry.target.partition(":")
        *owner_path, attr = qualname.split(".")
        if attr != name:
            return None
        steps.append((entry_id, module_name, tuple(owner_path), name, descriptor.__name__ if descriptor else "",
                      source_key, entry.op, ref, entry.workers if entry.op == "workers" else None, code,
                      rec.fingerprint))
        installed[(id(owner), name)] = rec.installed
    imported = tuple(dict.fromkeys(s[1] for s in steps))
    return {"imported": imported, "absent": tuple(absent), "steps": tuple(steps),
            "digest": run.compiled.digest, "supported": run.compiled.supported}
