"""AFD role workers on vLLM's GPU worker (``vllm.v1.worker.gpu_worker.Worker``).

Selected by the manifest on the cuda platform only. Limits as in ``attention`` and ``ffn``;
the attention role is compiled piecewise with ``afd::exchange`` as a split point
and full CUDA graphs refused (``afd_patches.patches.compilation``).

Model runners: vLLM's GPU worker builds the V2 model runner
(``vllm.v1.worker.gpu.model_runner``) when Triton works, else the V1 one. The
attention role needs nothing runner-specific: both call the model's
``forward`` (compiled piecewise, or eagerly), which exchanges per layer. The
FFN role never runs a forward and has no KV cache, so it skips what both
runners would build for one: ``initialize_from_config`` only records the
(empty) block count instead of handing an empty KV cache config to the
runner (attention backends, block tables, CUDA-graph manager), and
``compile_or_warm_up_model`` does nothing. Not run in this project's CPU-only
CI (the CPU workers' MRV2 runner is covered by tests/integration/test_afd_mrv2.py,
this class is not); what holds on a GPU is recorded in docs/running.md, "CUDA".
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.worker_base import CompilationTimes

from afd_patches.workers.attention import AttentionRoleMixin
from afd_patches.workers.ffn import FfnRoleMixin


class CudaAttentionWorker(AttentionRoleMixin, Worker):
    """Attention role on CUDA: vLLM's GPU worker plus the connector binding."""


class CudaFfnWorker(FfnRoleMixin, Worker):
    """FFN role on CUDA: no KV cache, no warm-up/capture (the FFN-only model has no forward)."""

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        self.cache_config.num_gpu_blocks = kv_cache_config.num_blocks  # nothing to allocate or build

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)
