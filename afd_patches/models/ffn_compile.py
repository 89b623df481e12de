"""The FFN role's per-layer modules, compiled the way vLLM compiles a model on this platform.

The FFN role runs no vLLM model forward, so vLLM compiles nothing there. Where vLLM would
compile with a plain ``torch.compile`` backend (``CompilationMode.DYNAMO_TRACE_ONCE``, the
CPU default, and ``STOCK_TORCH_COMPILE``), ``compile_ffn_modules`` compiles each layer's
MLP/MoE module with the same settings vLLM's ``TorchCompileWithNoGuardsWrapper`` uses for
the model: the backend from ``CompilationConfig.init_backend``, its
``inductor_compile_config``, ``fullgraph=True``, the token dimension marked dynamic, and no
guards (``torch.compiler.skip_all_guards_unsafe``): one graph per layer serves every token
count, as one graph serves every batch of the attention model. Each layer is compiled and
run once on ``warmup_tokens`` zero rows at load time, so no request pays for it and the time
is logged per role.

Caches: inductor's artifacts go under ``$VLLM_CACHE_ROOT/torch_compile_cache/afd_ffn/<hash>``
(``TORCHINDUCTOR_CACHE_DIR`` for this process), where ``<hash>`` is the hash of vLLM's own
compile-cache factors for this engine (``aot_compile_hash_factors``: environment, the whole
``VllmConfig`` including ``additional_config``), so a second start of the same FFN engine
reuses them (``VLLM_DISABLE_COMPILE_CACHE=1`` switches inductor's caches off, as it switches
vLLM's off); dynamo still traces each layer at start. Like
vLLM's, these caches hold generated code that torch loads and runs: the cache root must be
as private as the code itself.

Under ``VLLM_COMPILE`` (CUDA's default), ``NONE`` or ``--enforce-eager`` the modules run
eagerly (no CUDA graphs on the FFN role).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from afd_patches import LOGGER

logger = logging.getLogger(LOGGER)

FfnCall = Callable[[torch.Tensor], torch.Tensor]


def compiles(vllm_config: Any) -> bool:
    """Whether vLLM would compile a model of this engine with a plain ``torch.compile`` backend."""
    from vllm.config import CompilationMode

    mode = vllm_config.compilation_config.mode
    return mode in (CompilationMode.DYNAMO_TRACE_ONCE, CompilationMode.STOCK_TORCH_COMPILE)


def cache_dir(vllm_config: Any) -> str:
    """Where this engine's FFN compile artifacts go (keyed by vLLM's own compile-cache factors)."""
    from vllm import envs
    from vllm.compilation.caching import aot_compile_hash_factors

    key = hashlib.sha256(str(aot_compile_hash_factors(vllm_config)).encode()).hexdigest()
    return os.path.join(envs.VLLM_CACHE_ROOT, "torch_compile_cache", "afd_ffn", key)


def _compile(module: nn.Module, vllm_config: Any) -> FfnCall:
    from vllm import envs
    from vllm.config import CompilationMode

    compilation = vllm_config.compilation_config
    backend = compilation.init_backend(vllm_config)
    options: dict[str, Any] = {}
    if backend == "inductor":
        options.update(compilation.inductor_compile_config)
    if envs.VLLM_DISABLE_COMPILE_CACHE:
        options["force_disable_caches"] = True
    if compilation.mode != CompilationMode.STOCK_TORCH_COMPILE:  # which keeps torch's guards, as in vLLM
        options["guard_filter_fn"] = torch.compiler.skip_all_guards_unsafe
    return torch.compile(module, fullgraph=True, dynamic=False, backend=backend,  # type: ignore[return-value]
                         options=options or None)


def compile_ffn_modules(modules: list[nn.Module], vllm_config: Any, run: Callable[[FfnCall, torch.Tensor], Any],
                        hidden_size: int, device: torch.device, dtype: torch.dtype,
                        warmup_tokens: int = 16) -> tuple[list[FfnCall], float]:
    """Each of ``modules`` compiled (see module docstring) and warmed up through ``run(call, x)``.

    Returns the callables in layer order and the seconds spent; when vLLM would not compile
    (``compiles`` is false) the modules themselves and 0.0. ``run`` calls an FFN the way the
    serve loop does (e.g. inside vLLM's forward context for FusedMoE).
    """
    if not compiles(vllm_config):
        return list(modules), 0.0
    folder = os.path.join(cache_dir(vllm_config), "inductor_cache")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder  # this process compiles nothing else
    started = time.monotonic()
    compiled = []
    x = torch.zeros((warmup_tokens, hidden_size), device=device, dtype=dtype)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.inference_mode():
        for module in modules:
            call = _compile(module, vllm_config)
            run(call, x)
            compiled.append(call)
    seconds = time.monotonic() - started
    logger.info("AFD FFN role: %d layer modules compiled (%s) in %.1f s; cache %s", len(modules),
                vllm_config.compilation_config.backend, seconds, folder)
    return compiled, seconds
