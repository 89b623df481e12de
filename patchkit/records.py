"""Immutable records with named fields, built without code generation.

``dataclasses`` and ``NamedTuple`` generate their methods with ``exec``/``eval``
when a class is defined: about half a millisecond per class, paid by every vLLM
process that imports patchkit. These records only need construction by keyword
(or position), equality, ``repr`` and ``_asdict``, so one small base does it.
"""

from __future__ import annotations

from typing import Any, ClassVar


class Record:
    """Subclasses list their fields, in order, in ``_fields`` (and ``__slots__ = _fields``),
    and their defaults in ``_defaults``."""

    __slots__ = ()
    _fields: ClassVar[tuple[str, ...]] = ()
    _defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = self._fields
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes at most {len(names)} positional arguments")
        values = dict(zip(names, args, strict=False))
        for key, value in kwargs.items():
            if key not in names or key in values:
                raise TypeError(f"{type(self).__name__}: unexpected or repeated argument {key!r}")
            values[key] = value
        for name in names:
            if name in values:
                value = values[name]
            elif name in self._defaults:
                value = self._defaults[name]
            else:
                raise TypeError(f"{type(self).__name__}: missing argument {name!r}")
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _asdict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._fields}

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._asdict() == other._asdict()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(tuple(repr(getattr(self, n)) for n in self._fields))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self._fields)})"
