"""Resolving ``module:qualname`` targets and swapping the attribute they name.

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
import sys
from types import ModuleType
from typing import Any

from patchkit.plan import MISSING


class TargetMissing(LookupError):
    """The target (or its owner) does not exist in the running code."""


def import_ref(ref: str) -> Any:
    """Import ``module:qualname`` and return the object (used for callables named by a manifest)."""
    module_name, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


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
