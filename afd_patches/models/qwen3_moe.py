"""``AFDQwen3MoeForCausalLM``: vLLM's Qwen3-MoE, split into an attention role and an FFN (experts) role.

See ``afd_patches.models.causal_lm`` for the role contract and its limits. Per
layer the FFN role builds what vLLM's Qwen3-MoE decoder layer would build: the
sparse MoE block (router + FusedMoE experts, plus shared expert if configured)
or, for ``mlp_only_layers`` / non-sparse steps, the dense ``Qwen3MoeMLP``.
FusedMoE looks itself up in vLLM's forward context, so FFN calls run inside
one. On the attention role, ``Qwen3MoeDecoderLayer`` builds proxies in place
of both. The MoE bookkeeping attributes vLLM reads (``moe_layers``,
``num_moe_layers``, expert counts) describe the FFN role's experts; the
attention role reports none. Those counts mirror ``Qwen3MoeForCausalLM.__init__``
(vLLM has no helper that sets them from a block); the manifests pin that class in
full, ``__init__`` included. EPLB and expert parallelism are not supported.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from vllm.model_executor.models.qwen3_moe import (
    Qwen3MoeForCausalLM,
    Qwen3MoeMLP,
    Qwen3MoeSparseMoeBlock,
)

from afd_patches.models.causal_lm import AfdCausalLMMixin, build_dense_mlp, copy_expert_counts
from afd_patches.models.ffn_proxy import proxy_type


def _is_sparse(config: Any, layer: int) -> bool:
    """The condition under which vLLM's Qwen3-MoE decoder layer builds a sparse MoE block.

    vLLM has no helper for it, so this mirrors ``Qwen3MoeDecoderLayer.__init__``; every
    manifest pins that ``__init__`` (``requires:``, pin ``full``), so a vLLM that changes
    the rule fails ``patchkit check`` and AFD is refused on it (docs/manifests.md)."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer not in mlp_only and config.num_experts > 0 and (layer + 1) % step == 0


# The attention role's stand-ins for ``Qwen3MoeSparseMoeBlock`` and ``Qwen3MoeMLP`` while vLLM's model
# ``__init__`` runs;
# the manifests' scoped-rebind entry afd.qwen3-moe.ffn-proxies binds them (patchkit applies it).
Qwen3MoeSparseMoeBlockProxy = proxy_type(Qwen3MoeSparseMoeBlock, moe=True)
Qwen3MoeMLPProxy = proxy_type(Qwen3MoeMLP)


class AFDQwen3MoeForCausalLM(AfdCausalLMMixin, Qwen3MoeForCausalLM):
    """Qwen3-MoE with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""

    afd_moe_classes = (Qwen3MoeSparseMoeBlock,)
    afd_needs_forward_context = True

    def afd_describe_experts(self, blocks: list[nn.Module]) -> None:
        """The expert counts ``Qwen3MoeForCausalLM.__init__`` sets, from the first sparse block."""
        copy_expert_counts(self, blocks)

    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        config = vllm_config.model_config.hf_text_config
        if _is_sparse(config, layer):
            return Qwen3MoeSparseMoeBlock(vllm_config=vllm_config, prefix=prefix)
        return build_dense_mlp(Qwen3MoeMLP, vllm_config, prefix)
