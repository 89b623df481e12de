"""``AFDGlm4MoeForCausalLM``: vLLM's GLM-4.5/4.6 (``glm4_moe``), split into an attention and an FFN role.

See ``afd_patches.models.causal_lm`` for the role contract and its limits. The FFN
of decoder layer ``i`` is ``mlp``: a dense ``Glm4MoeMLP`` for the first
``first_k_dense_replace`` layers, a ``Glm4MoE`` elsewhere -- a float32 router
``gate`` with its ``e_score_correction_bias``, FusedMoE experts with grouped
sigmoid top-k (``n_group``/``topk_group``) and ``routed_scaling_factor``, and the
shared expert, which vLLM runs inside the block (so it lives on the FFN role).
The FFN role builds exactly the module vLLM's decoder layer would build for each
layer; the attention role's ``Glm4MoeDecoderLayer`` builds proxies for both.

Weights: the FFN role loads ``model.layers.N.mlp.*`` with vLLM's AutoWeightsLoader
and ``Glm4MoeModel``'s own name mapper (``gate_proj``/``up_proj`` ->
``gate_up_proj``); MTP layers (``num_nextn_predict_layers``) are never FFN
weights, and vLLM skips them for the main model on the attention role.
FusedMoE looks itself up in vLLM's forward context, so FFN calls run inside one.
Limits (besides ``causal_lm``'s): no ROCm AITER fused shared experts, no EPLB or
expert parallelism. The MoE bookkeeping describes the FFN role's experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.model_executor.models.glm4_moe import (
    Glm4MoE,
    Glm4MoeForCausalLM,
    Glm4MoeMLP,
    Glm4MoeModel,
)
from vllm.model_executor.models.utils import AutoWeightsLoader, get_spec_layer_idx_from_weight_name

from afd_patches.models.causal_lm import AfdCausalLMMixin, adopt_moe_blocks, build_dense_mlp
from afd_patches.models.ffn_proxy import proxy_type


def is_moe_layer(config: Any, layer: int) -> bool:
    """The condition under which vLLM's GLM-4-MoE decoder layer builds a ``Glm4MoE`` (else ``Glm4MoeMLP``).

    vLLM has no helper for it, so this mirrors ``Glm4MoeDecoderLayer.__init__``, which the manifest pins
    in full (``requires:``)."""
    return config.n_routed_experts is not None and layer >= config.first_k_dense_replace



# The attention role's stand-ins while vLLM's model ``__init__`` runs: the manifests' scoped-rebind entry
# afd.glm4-moe.ffn-proxies binds them (patchkit applies it).
Glm4MoeMLPProxy = proxy_type(Glm4MoeMLP)
Glm4MoEProxy = proxy_type(Glm4MoE, moe=True)


class AFDGlm4MoeForCausalLM(AfdCausalLMMixin, Glm4MoeForCausalLM):
    """GLM-4.5/4.6 with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""

    afd_moe_classes = (Glm4MoE,)
    afd_needs_forward_context = True

    def afd_describe_experts(self, blocks: list[nn.Module]) -> None:
        """What ``Glm4MoeForCausalLM.__init__`` sets: ``adopt_moe_blocks``, then vLLM's own
        ``extract_moe_parameters`` on the last MoE block."""
        adopt_moe_blocks(self, blocks)
        self.extract_moe_parameters(blocks[-1] if blocks else None)

    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        config = vllm_config.model_config.hf_config
        if is_moe_layer(config, layer):
            return Glm4MoE(config=config, quant_config=vllm_config.quant_config, prefix=prefix,
                           enable_eplb=vllm_config.parallel_config.enable_eplb)
        return build_dense_mlp(Glm4MoeMLP, vllm_config, prefix)

    def afd_is_ffn_weight(self, name: str) -> bool:
        """A decoder layer's ``mlp.*`` tensor, excluding MTP (next-token-prediction) layers."""
        return super().afd_is_ffn_weight(name) and get_spec_layer_idx_from_weight_name(self.config, name) is None

    def afd_load_ffn_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's AutoWeightsLoader with ``Glm4MoeModel``'s mapper (dense/shared-expert ``gate_up_proj``)."""
        return AutoWeightsLoader(self).load_weights(weights, mapper=Glm4MoeModel.hf_to_vllm_mapper)
