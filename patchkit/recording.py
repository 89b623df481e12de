"""Recording replay programs: what a started ``engine.Run`` applied at once, for the next process.

``store(key, run)`` is called after the engine has started a plan; the program
it writes is what ``patchkit`` (section 3, replay) checks and repeats in a later process of
the same situation (which of the plan's modules are imported). Not on the warm
path: only processes that ran the engine get here.

What gets recorded (otherwise there is no program, and the engine always runs):
``wrap``, ``replace`` and ``workers`` entries on class attributes (functions,
``staticmethod``, ``classmethod``) without ``when`` guards or plan-time verdicts,
applied at once and with a matching fingerprint where one is pinned, and model
registrations that wait for vLLM's registry. Entries on module attributes (which
need rebinding), guarded entries, another plan's patch on the same slot and
``PATCHKIT_DISABLE`` make no program.
"""

from __future__ import annotations

import marshal
import os
import sys
from importlib.util import MAGIC_NUMBER
from types import FunctionType
from typing import TYPE_CHECKING, Any

from patchkit import REPLAY_FORMAT, code_key, descriptor_name, program_path, programs, write_atomic
from patchkit.targets import unwrap_descriptor
from patchkit.vllm_adapter import MODEL_REGISTRY_MODULE

if TYPE_CHECKING:
    from patchkit.engine import Run

_MISSING = object()


def store(key: str, run: Run) -> None:
    """Record ``run``'s immediate application as the program for this situation, if it qualifies.

    ``key``: ``patchkit.replay_key(...)`` of the inputs, computed before the engine read them.
    """
    program = record(run)
    if program is None:
        return
    same = (program["imported"], program["absent"])
    others = [p for p in programs(key) if (p["imported"], p["absent"]) != same]
    write_atomic(program_path(key), marshal.dumps((REPLAY_FORMAT, MAGIC_NUMBER, [program, *others])))


def record(run: Run) -> dict[str, Any] | None:
    """The program that repeats what ``run`` applied at start, or None if anything was unusual."""
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
        if descriptor is not None and descriptor_name(rec.original) == "":
            return None  # a subclass of staticmethod or classmethod
        previous = installed.get((id(owner), name), _MISSING)
        if previous is _MISSING and hasattr(func, "__patchkit__"):
            return None  # another plan's patch was there: its replay is its own affair
        if previous is not _MISSING and previous is not rec.original:
            return None
        source_key = code_key(func) if entry.fingerprint else None
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
