"""AFD role workers on vLLM's GPU worker (``vllm.v1.worker.gpu_worker.Worker``).

Selected by the manifest on the cuda platform only. Not run in this project's
CPU-only CI; import-checked statically. Limits as in ``common``; in addition the
attention role needs ``enforce_eager=True`` (no CUDA graphs across the exchange).
"""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.worker_base import CompilationTimes

from afd_patches.workers.common import AttentionRoleMixin, FfnRoleMixin


class CudaAttentionWorker(AttentionRoleMixin, Worker):
    """Attention role on CUDA: vLLM's GPU worker plus the connector binding."""


class CudaFfnWorker(FfnRoleMixin, Worker):
    """FFN role on CUDA: no KV cache, no warm-up/capture (the FFN-only model has no forward)."""

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)
