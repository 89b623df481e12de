"""``AFDMixtralForCausalLM``: vLLM's Mixtral, split into an attention role and an FFN (experts) role.

See ``afd_patches.models.causal_lm`` for the role contract and its limits. Every
Mixtral decoder layer holds one ``MixtralMoE`` (router + FusedMoE experts, no
shared expert) as ``block_sparse_moe``; the FFN role builds it per layer with the
arguments vLLM's decoder layer gives it, and the attention role's
``MixtralDecoderLayer`` builds a proxy in its place. Checkpoint names are
``model.layers.N.block_sparse_moe.*`` (``gate``, ``experts.E.w1/w2/w3``), loaded
by vLLM's AutoWeightsLoader with Mixtral's own name mapper. FusedMoE looks itself
up in vLLM's forward context, so FFN calls run inside one. The MoE bookkeeping
(``moe_layers``, expert counts) describes the FFN role's experts, as
``MixtralForCausalLM.__init__`` would; the attention role reports none. EPLB and
expert parallelism are not supported.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from vllm.model_executor.models.mixtral import MixtralForCausalLM, MixtralMoE

from afd_patches.models.causal_lm import AfdCausalLMMixin, copy_expert_counts
from afd_patches.models.ffn_proxy import proxy_type

# The attention role's stand-ins while vLLM's model ``__init__`` runs: the manifests' scoped-rebind entry
# afd.mixtral.ffn-proxies binds them (patchkit applies it).
MixtralMoEProxy = proxy_type(MixtralMoE, moe=True)


class AFDMixtralForCausalLM(AfdCausalLMMixin, MixtralForCausalLM):
    """Mixtral with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""

    afd_moe_classes = (MixtralMoE,)
    afd_ffn_attr = "block_sparse_moe"
    afd_needs_forward_context = True

    def afd_describe_experts(self, blocks: list[nn.Module]) -> None:
        """The expert counts ``MixtralForCausalLM.__init__`` sets, from the first MoE block."""
        copy_expert_counts(self, blocks)

    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        config = vllm_config.model_config.hf_text_config
        return MixtralMoE(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                          hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                          quant_config=vllm_config.quant_config, prefix=prefix,
                          enable_eplb=vllm_config.parallel_config.enable_eplb)
