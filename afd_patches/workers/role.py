"""What the two AFD role workers share: ``RoleBase``, the base of ``AttentionRoleMixin`` and ``FfnRoleMixin``.

The role mixins (``afd_patches.workers.attention``, ``afd_patches.workers.ffn``) go before a vLLM worker class
in the bases (``afd_patches.workers.cpu``, ``afd_patches.workers.cuda``) and assume it further down the MRO
(``vllm_config``, ``model_runner``). Both name their vLLM model runner (V1 or Model Runner V2) in the log and
in the process's patchkit report (``facts.model_runner``, ``_afd_note_runner``), and both expose, through
``collective_rpc``, ``afd_stats()`` built on ``_afd_common_stats``: role, messages sent and received, KV
cache bytes and layers, the model runner, parameter names of FFN kind (by ``FFN_ATTRS``) and of attention
kind, and the AFD model's own ``afd_stats()``.

Tensor parallelism (``--tensor-parallel-size``) inside a role: one AFD rank is one vLLM TP group whose TP
rank 0 alone builds the connector; its TP peers follow it through vLLM's TP group
(``afd_patches.workers.tp_group``). Limits: one connector per TP group (no PP inside a role).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from afd_patches import LOGGER
from afd_patches.patches import micro_batches

logger = logging.getLogger(LOGGER)


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


# The names under which the AFD families' decoder layers hold FFN modules (and FusedMoE its experts).
FFN_ATTRS = ("mlp", "mlps", "experts", "block_sparse_moe", "moe", "share_expert", "feed_forward")


def _param_summary(model: torch.nn.Module) -> dict[str, Any]:
    names = [n for n, _ in model.named_parameters()]
    return {
        "mlp_param_names": [n for n in names if any(f".{attr}." in n for attr in FFN_ATTRS)],
        "attn_param_names": [n for n in names if ".self_attn." in n or "embed_tokens" in n or "lm_head" in n],
    }


class RoleBase:
    """Shared helpers; assumes a vLLM worker (``vllm_config``, ``model_runner``) further down the MRO."""

    vllm_config: Any
    model_runner: Any

    def _afd_model(self) -> Any:
        return self.model_runner.get_model()

    def _afd_note_runner(self, role: str) -> None:
        """Log which vLLM model runner this worker built (V1 or Model Runner V2, and its class) and note it in
        this process's patchkit report (``facts.model_runner``: ``v1``/``v2``, ``facts.model_runner_class``):
        the manifest's entries guarded by ``when.noted.model_runner`` are reported ``off-path`` where the
        runner is another."""
        import patchkit

        logger.info("AFD %s worker: vLLM model runner %s", role, micro_batches.runner_name(self.model_runner))
        patchkit.note("afd", "model_runner_class", micro_batches.runner_class(self.model_runner))
        patchkit.note("afd", "model_runner", micro_batches.runner_kind(self.model_runner))

    def _afd_common_stats(self, role: str, messages: tuple[int, int]) -> dict[str, Any]:
        """The stats both roles report; ``messages``: sent and received over every group so far (the role's
        lifecycle object counts them)."""
        model = self._afd_model()
        stats: dict[str, Any] = {
            "role": role,
            "messages_sent": messages[0],
            "messages_received": messages[1],
            "kv_cache_bytes": _tensor_bytes(getattr(self.model_runner, "kv_caches", [])),
            "kv_cache_spec_layers": len(self.get_kv_cache_spec()),  # type: ignore[attr-defined]
            "model_runner": micro_batches.runner_name(self.model_runner),
        }
        stats.update(_param_summary(model))
        stats.update(model.afd_stats() if hasattr(model, "afd_stats") else {})
        return stats
