"""AFD role workers on vLLM's CPU worker (``vllm.v1.worker.cpu_worker.CPUWorker``)."""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from afd_patches.workers.attention import AttentionRoleMixin
from afd_patches.workers.ffn import FfnRoleMixin


class CpuAttentionWorker(AttentionRoleMixin, CPUWorker):
    """Attention role on CPU: vLLM's CPU worker plus the connector binding."""


class CpuFfnWorker(FfnRoleMixin, CPUWorker):
    """FFN role on CPU: no KV cache, no warm-up forwards, serve loop in a thread."""

    def _should_warm_up_model(self) -> bool:
        return False  # the FFN-only model has no forward; CPUWorker then skips warm-up
