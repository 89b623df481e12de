"""Wrappers for ``op: wrap`` entries and the worker override, generated in this process.

``make_wrapper(factory, original, marker)`` returns a function that calls
``factory(original, ...)`` with the caller's arguments and looks like
``original`` (``functools.update_wrapper``). Nothing here is cached on disk.

Limit: the generated parameter list is exact only for Python functions; any
other callable gets a ``*args, **kwargs`` wrapper.
"""

from __future__ import annotations

import builtins
import functools
from collections.abc import Callable
from types import CodeType, FunctionType
from typing import Any


def make_wrapper(factory: Callable[..., Any], original: Callable[..., Any], marker: tuple[str, str]) -> Any:
    """``patched(...) == factory(original, ...)``, looking like ``original``.

    For a Python function the wrapper is generated with ``original``'s own
    parameter list (read from its code object; the defaults are ``original``'s
    own objects), so a call costs what a hand-written closure costs (no
    ``*args``/``**kwargs`` packing). Any other callable (a builtin, a
    ``functools.partial``, a callable instance) gets ``*args, **kwargs``.
    The wrapper carries ``__patchkit__ = marker`` and ``original``'s metadata.
    """
    params, forward = _signature_source(original)
    source = f"def patched({params}):\n    return factory(original{forward})\n"
    module_code = compile(source, f"<patchkit wrapper {marker[1]}>", "exec")
    code = next(c for c in module_code.co_consts if isinstance(c, CodeType))
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


_CO_VARARGS, _CO_VARKEYWORDS = 0x04, 0x08  # inspect.CO_VARARGS / CO_VARKEYWORDS


def _signature_source(func: Callable[..., Any]) -> tuple[str, str]:
    """(parameter list, forwarded arguments) for ``func``, without defaults (``make_wrapper``
    gives the wrapper ``func``'s own default objects)."""
    generic = ("*args, **kwargs", ", *args, **kwargs")
    code = getattr(func, "__code__", None)
    if not isinstance(func, FunctionType) or code is None:
        return generic
    npos, nkw = code.co_argcount, code.co_kwonlyargcount
    names = code.co_varnames
    star = names[npos + nkw] if code.co_flags & _CO_VARARGS else None
    starstar = names[npos + nkw + bool(star)] if code.co_flags & _CO_VARKEYWORDS else None
    every = [*names[: npos + nkw], *(n for n in (star, starstar) if n)]
    if any(n in ("factory", "original") or not n.isidentifier() for n in every):
        return generic
    params: list[str] = []
    forward: list[str] = []
    for i, name in enumerate(names[:npos]):
        params.append(name)
        forward.append(name)
        if i + 1 == code.co_posonlyargcount:
            params.append("/")
    if star:
        params.append("*" + star)
        forward.append("*" + star)
    elif nkw:
        params.append("*")
    for name in names[npos : npos + nkw]:
        params.append(name)
        forward.append(f"{name}={name}")
    if starstar:
        params.append("**" + starstar)
        forward.append("**" + starstar)
    return ", ".join(params), "".join(", " + f for f in forward)
