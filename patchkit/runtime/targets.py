"""Resolving ``module:qualname`` targets and swapping the attribute they name.

``install`` puts one manifest entry in place: it resolves the target, refuses a
target that already holds this entry's object, runs the entry's feature probes,
checks the pinned fingerprint (applying ``on_drift``), builds the new object and
swaps it in. There is one path for every kind of change: ``replace`` and ``set``
put an object in (the ``with:`` object or the ``set`` value); every other change
is a wrap, built by ``make_wrapper`` around a factory its kind supplies
(``wrap``: the ``with:`` callable; ``scoped-rebind``: ``patchkit.runtime.scoped``;
the worker override: ``patchkit.runtime.vllm.worker_wrapper``); ``rebind_aliases`` then repoints the aliases in
the entry's rebind scope, and ``undo`` restores the original and those aliases.
Each call changes one target and reports through the record it is given (the
engine's ``Outcome``; typed ``Any`` so that this module never imports the
engine). The engine decides when and in which order, and owns the rollback
stack; it loads this module only when an entry's module is imported.
Failures are raised as ``Skip`` (left out, with an outcome and a reason) or
``EntryFailed``; ``install`` changes nothing before it raises.

A target is an attribute of an owner: a module (``pkg.mod:func``) or a class
(``pkg.mod:Cls.method``, also nested ``Cls.Inner.attr``). ``Slot`` reads and
writes that one attribute. For class targets it reads the class's own
``__dict__`` so that ``staticmethod``/``classmethod`` descriptors survive the
swap, and it refuses attributes that the class only inherits: patching those
would silently patch the base class for every sibling.

Limits (see also ``rebind``): code that captured the original object before the
swap — a closure, a default argument, a subclass that overrides the method, a
``from X import f`` in a module outside the rebind scope — keeps the original.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from patchkit.plan import MISSING, Patch, ScopedRebind, WorkerOverride, override_key

if TYPE_CHECKING:
    from patchkit.plan import Change, Runtime
    from patchkit.runtime.cache import Fingerprints

logger = logging.getLogger("patchkit")


class TargetMissing(LookupError):
    """The target (or its owner) does not exist in the running code."""


class Slot:
    """One attribute ``owner.name`` that a manifest entry targets."""

    __slots__ = ("name", "owner", "target")

    def __init__(self, owner: Any, name: str, target: str) -> None:
        self.owner = owner
        self.name = name
        self.target = target

    @classmethod
    def resolve(cls, target: str, module: ModuleType | None = None) -> Slot:
        module_name, _, qualname = target.partition(":")
        if module is None:
            module = sys.modules.get(module_name)
            if module is None:
                raise TargetMissing(f"module {module_name} is not imported")
        owner: Any = module
        *path, name = qualname.split(".")
        for part in path:
            owner = getattr(owner, part, MISSING)
            if owner is MISSING:
                raise TargetMissing(f"{module_name} has no {part!r} (looking for {qualname})")
        return cls(owner, name, target)

    @property
    def on_class(self) -> bool:
        return isinstance(self.owner, type)

    def exists(self) -> bool:
        if self.on_class:
            return self.name in vars(self.owner)
        return hasattr(self.owner, self.name)

    def get_raw(self) -> Any:
        """The stored object (a descriptor such as ``classmethod`` for class targets)."""
        if self.on_class:
            if self.name not in vars(self.owner):
                inherited = " (inherited, not defined on the class itself)" if hasattr(self.owner, self.name) else ""
                raise TargetMissing(f"{self.owner.__qualname__} has no attribute {self.name!r}{inherited}")
            return vars(self.owner)[self.name]
        value = getattr(self.owner, self.name, MISSING)
        if value is MISSING:
            raise TargetMissing(f"{self.owner.__name__} has no attribute {self.name!r}")
        return value

    def set_raw(self, value: Any) -> None:
        setattr(self.owner, self.name, value)

    def delete(self) -> None:
        delattr(self.owner, self.name)


def unwrap_descriptor(raw: Any) -> tuple[Any, type | None]:
    """``classmethod(f)`` → ``(f, classmethod)``; anything else → ``(raw, None)``."""
    if isinstance(raw, classmethod | staticmethod):
        return raw.__func__, type(raw)
    return raw, None


# -- installing one entry --------------------------------------------------------------------------

class EntryFailed(Exception):
    """The entry cannot be applied; the message says why."""


class Skip(Exception):
    """The entry is left out: ``outcome`` (``skipped``, ``guarded-out``, ``already-applied``) and ``reason``."""

    def __init__(self, outcome: str, reason: str) -> None:
        super().__init__(reason)
        self.outcome = outcome
        self.reason = reason


def install(entry: Change, record: Any, plugin: str, runtime: Runtime, static: dict[str, str | None],
            fingerprints: Fingerprints, previous: Any, judged: Any = None) -> None:
    """Swap ``entry``'s object into its target; fill ``record``'s fingerprint, slot, original and installed.

    ``previous`` is what this process installed for the entry before (or None): a
    target holding it, or a function marked with this entry, is already applied. ``judged``: the entry's row
    of the plan's verdict (``patchkit.verdict.Member``), whose static fingerprint verdict is then the one
    applied (no live fingerprint: a property or an assignment reads the same as in ``patchkit check``);
    None (no verdict) fingerprints the live object."""
    marker = (plugin, entry.id)
    try:
        slot = Slot.resolve(entry.target)
        original = slot.get_raw() if (entry.op != "set" or slot.exists()) else MISSING
    except TargetMissing as exc:
        _drift(entry, f"target {entry.target} is missing: {exc}")
        raise Skip("skipped", f"target missing: {exc}") from None
    func, descriptor = unwrap_descriptor(original)
    if getattr(func, "__patchkit__", None) == marker or (previous is not None and previous is original):
        raise Skip("already-applied", "")
    _probe(entry, slot, func)
    if judged is not None and entry.fingerprint:
        record.fingerprint = "match" if judged.verdict == "ok" else judged.verdict
        if judged.verdict != "ok":
            _drift(entry, f"{entry.target} {judged.verdict} (the verdict: {judged.reason or judged.verdict})")
    elif entry.fingerprint and original is not MISSING:
        actual = fingerprints.of(func)
        verdict = "match" if actual == entry.fingerprint else _compare(entry.fingerprint, actual)
        record.fingerprint = verdict
        if verdict != "match":
            _drift(entry, f"{entry.target} {verdict} (pinned {entry.fingerprint}, found {actual})")
    new = new_object(entry, func, marker, runtime, static)
    if descriptor is not None:
        new = descriptor(new)
    try:
        slot.set_raw(new)
    except Exception as exc:  # noqa: BLE001 - whatever a metaclass or module raises
        raise EntryFailed(f"cannot set {entry.target}: {exc!r}") from None
    record.slot, record.original, record.installed = slot, original, new


def rebind_aliases(entry: Change, record: Any, packages: tuple[str, ...]) -> None:
    """Repoint the aliases of an installed module-level entry in its rebind scope; list the unreachable ones."""
    slot = record.slot
    if slot is None or slot.on_class or record.original is MISSING or entry.op == "set":
        return
    from patchkit.runtime import rebind

    try:
        scope = rebind.scope(entry.module, entry.rebind, packages)
        rebind.rebind(slot.name, record.original, record.installed, scope, slot.owner, into=record.rebound)
        auto = rebind.scope(entry.module, "auto", packages)
        record.unreachable = rebind.unreachable(slot.name, record.original, auto, slot.owner)
    except Exception as exc:  # noqa: BLE001 - rolled back by the engine, named here
        raise EntryFailed(f"rebinding aliases of {entry.target} failed: {exc!r}") from None


def new_object(entry: Change, func: Any, marker: tuple[str, str], runtime: Runtime,
               static: dict[str, str | None]) -> Any:
    """What goes into the target: the ``set`` value, the ``with:`` object, or a wrapper around ``func``
    (``wrap``, ``scoped-rebind`` and the worker override are one mechanism: a factory, wrapped here)."""
    if isinstance(entry, Patch) and entry.op != "wrap":
        if entry.has_value:
            return entry.value
        return _import(entry.with_ or "")
    factory = wrap_factory(entry, runtime, static)
    if not callable(func):
        raise EntryFailed(f"{entry.op} needs a callable target ({entry.target})")
    from patchkit.runtime.wrappers import make_wrapper

    return make_wrapper(factory, func, marker)


def wrap_factory(entry: Change, runtime: Runtime, static: dict[str, str | None]) -> Any:
    """``factory(original, *args, **kwargs)`` of a wrapping entry (EntryFailed when it cannot be built)."""
    if isinstance(entry, WorkerOverride):
        from patchkit.runtime import vllm as vllm_adapter

        try:
            verdicts = [static.get(override_key(entry.id, i)) for i in range(len(entry.overrides))]
            return vllm_adapter.worker_wrapper(import_ref(entry.role_of), list(entry.overrides), runtime, verdicts)
        except Exception as exc:  # noqa: BLE001 - reported as this entry's failure
            raise EntryFailed(f"cannot build worker override: {exc!r}") from None
    if isinstance(entry, ScopedRebind):
        from patchkit.runtime import scoped

        module = sys.modules.get(entry.namespace)
        missing = scoped.missing_names(vars(module), entry.bind) if module is not None else []
        if missing:
            _drift(entry, f"{entry.namespace} no longer names {', '.join(missing)}")
            raise Skip("skipped", f"{entry.namespace} no longer names {', '.join(missing)}")
        return scoped.factory(entry.id, entry.namespace, entry.bind, _import(entry.active_if), import_ref)
    obj = _import(entry.with_ or "") if isinstance(entry, Patch) else None
    if not callable(obj):
        raise EntryFailed(f"wrap needs callables ({getattr(entry, 'with_', None)}, {entry.target})")
    return obj


def _import(ref: str) -> Any:
    try:
        return import_ref(ref)
    except Exception as exc:  # noqa: BLE001 - any import failure is this entry's failure
        raise EntryFailed(f"cannot import {ref}: {exc!r}") from None


def alias_scope(entry: Change | None, record: Any, packages: tuple[str, ...]) -> tuple[str, ...]:
    """Where aliases of a module-level entry's object may be: its rebind scope, and ``auto``'s."""
    if entry is None or entry.op == "set" or record.slot is None or record.slot.on_class:
        return ()
    from patchkit.runtime import rebind

    return (*rebind.scope(entry.module, entry.rebind, packages), *rebind.scope(entry.module, "auto", packages))


def undo(record: Any, scope: tuple[str, ...]) -> None:
    """Put ``record``'s original back, and every alias in ``scope`` that holds our object."""
    if record.undo is not None:
        record.undo()
        return
    slot = record.slot
    assert slot is not None
    if scope and record.original is not MISSING:
        from patchkit.runtime import rebind

        rebind.restore(record.installed, record.original, (*record.rebound, *scope), slot.owner, slot.name)
    current = vars(slot.owner).get(slot.name, MISSING) if slot.on_class else getattr(slot.owner, slot.name, MISSING)
    if current is not record.installed:
        logger.warning("patchkit: %s was changed after %s patched it; left as it is", record.target, record.id)
        return
    if record.original is MISSING:
        slot.delete()
    else:
        slot.set_raw(record.original)


def _drift(entry: Change, what: str) -> None:
    """Apply the entry's ``on_drift`` policy to a drifted or missing target."""
    if entry.on_drift == "fail":
        raise EntryFailed(what)
    logger.warning("patchkit: %s: %s (on_drift=%s)", entry.id, what, entry.on_drift)
    if entry.on_drift == "skip":
        raise Skip("skipped", what)


def _probe(entry: Change, slot: Slot, func: Any) -> None:
    """The entry's feature probes: ``has_attr`` on the target's module, ``has_param`` on the target."""
    module = slot.owner if not slot.on_class else inspect.getmodule(slot.owner)
    for qualname in entry.when.get("has_attr", []):
        obj: Any = module
        for part in qualname.split("."):
            obj = getattr(obj, part, MISSING)
            if obj is MISSING:
                raise Skip("guarded-out", f"probe has_attr {qualname}: absent")
    wanted = entry.when.get("has_param", [])
    if wanted:
        try:
            params = inspect.signature(func).parameters
        except (TypeError, ValueError):
            params = {}
        missing = [p for p in wanted if p not in params]
        if missing:
            raise Skip("guarded-out", f"probe has_param: {entry.target} lacks {', '.join(missing)}")


def _compare(expected: str, actual: str | None) -> str:
    """``fingerprint.compare`` for a fingerprint that differs: which half drifted."""
    from patchkit import fingerprint

    return fingerprint.compare(expected, actual)


def import_ref(ref: str) -> Any:
    """Import ``module:qualname`` and return the object (used for callables named by a manifest)."""
    module_name, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
