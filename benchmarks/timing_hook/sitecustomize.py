"""Benchmark-only timing counters for AFD, loaded by Python at start-up when this folder is on PYTHONPATH.

Used by ``benchmarks/afd_server_load.py --timings``: with ``AFD_TIMINGS_DIR`` set,
every process that imports ``afd_patches.connectors.torch_dist`` or
``afd_patches.workers.ffn`` gets wall-clock counters around the connector
calls, the FFN call and the attention model's forward step; each process writes
``<pid>.json`` (name -> [calls, seconds]) to that directory every 2 s. Nothing
happens without the variable. Not part of the plugin.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time

_DIR = os.environ.get("AFD_TIMINGS_DIR")
_TOTALS: dict[str, list[float]] = {}
_TARGETS = {
    "afd_patches.connectors.torch_dist": [("TorchDistConnector", "send_attn_output"),
                                          ("TorchDistConnector", "recv_ffn_output"),
                                          ("TorchDistConnector", "recv_attn_output"),
                                          ("TorchDistConnector", "send_ffn_output")],
    "afd_patches.workers.ffn_server": [(None, "run_ffn")],
    "afd_patches.models.causal_lm": [("AfdCausalLMMixin", "forward")],
}



def _timed(name: str, fn):  # type: ignore[no-untyped-def]
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            slot = _TOTALS.setdefault(name, [0, 0.0])
            slot[0] += 1
            slot[1] += time.perf_counter() - t0
    return wrapper


def _instrument(module) -> None:  # type: ignore[no-untyped-def]
    for cls_name, attr in _TARGETS[module.__name__]:
        owner = getattr(module, cls_name) if cls_name else module
        setattr(owner, attr, _timed(f"{cls_name or module.__name__.rsplit('.', 1)[1]}.{attr}", getattr(owner, attr)))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name not in _TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            original(module)
            _instrument(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _writer() -> None:
    path = os.path.join(_DIR, f"{os.getpid()}.json")
    while True:
        time.sleep(2.0)
        if _TOTALS:
            with open(path + ".tmp", "w") as fh:
                json.dump(_TOTALS, fh)
            os.replace(path + ".tmp", path)


if _DIR:
    sys.meta_path.insert(0, _Finder())
    threading.Thread(target=_writer, name="afd-timings", daemon=True).start()
