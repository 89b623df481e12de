"""The wrapper factory of ``op: scoped-rebind`` entries: names bound in a module for one call.

``factory(entry_id, namespace, bind, active_if)`` returns ``f(original, *args, **kwargs)`` for
``patchkit.runtime.wrappers.make_wrapper``. Each call asks ``active_if(*args, **kwargs)``; when it is
false the original runs as if unpatched. When it is true, under one process-wide re-entrant lock,
every name of ``bind`` in module ``namespace`` is bound to its replacement, the original runs, and the
names get their previous values back in a ``finally`` (so also when the call raises). A name the
module no longer has is an error naming the module, the name and the entry, raised before anything is
bound. The replacements are imported on the first active call and kept.

Limits: the module's namespace is shared, so another thread running that module's code during the call
sees the replacements (the lock serializes scoped calls against each other, not other readers). The
lock is held for the whole call: a scoped call that waits for another thread's scoped call deadlocks.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

LOCK = threading.RLock()  # one for every scoped-rebind entry of every plugin in the process


class NameMissing(RuntimeError):
    """The module a scoped-rebind entry binds into no longer has one of the names."""


def missing_names(namespace: dict[str, Any], bind: tuple[tuple[str, str], ...]) -> list[str]:
    return [name for name, _ in bind if name not in namespace]


def factory(entry_id: str, namespace: str, bind: tuple[tuple[str, str], ...],
            active_if: Callable[..., Any], import_ref: Callable[[str], Any]) -> Callable[..., Any]:
    """The wrap factory for one scoped-rebind entry (see the module docstring)."""
    replacements: dict[str, Any] = {}

    def scoped(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not active_if(*args, **kwargs):
            return original(*args, **kwargs)
        with LOCK:
            names = vars(importlib.import_module(namespace))
            missing = missing_names(names, bind)
            if missing:
                raise NameMissing(f"{namespace} no longer names {', '.join(missing)} (patchkit entry "
                                  f"{entry_id!r}, op scoped-rebind); this vLLM is not supported")
            if not replacements:
                replacements.update({name: import_ref(ref) for name, ref in bind})
            saved = {name: names[name] for name, _ in bind}
            names.update(replacements)
            try:
                return original(*args, **kwargs)
            finally:
                names.update(saved)

    return scoped
