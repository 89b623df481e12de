"""``AFDErnie4_5_MoeForCausalLM``: vLLM's ERNIE-4.5-MoE, split into an attention role and an FFN role.

See ``afd_patches.models.causal_lm`` for the role contract and its limits. The FFN
of decoder layer ``i`` is ``mlp``: an ``Ernie4_5_MoeMoE`` (float32 router ``gate``
with its ``e_score_correction_bias``, FusedMoE experts, shared experts run inside
the block, so on the FFN role) on the layers the config's
``moe_layer_start_index``/``moe_layer_end_index``/``moe_layer_interval`` select,
a dense ``Ernie4_5_MoeMLP`` elsewhere. The FFN role builds exactly what vLLM's
decoder layer would; the attention role's ``Ernie4_5_MoeDecoderLayer`` builds
proxies for both.

Weights: the FFN role loads ``model.layers.N.mlp.*`` through vLLM's own
``Ernie4_5_MoeModel`` preprocessing (``moe_statics.e_score_correction_bias`` ->
``gate.e_score_correction_bias``, squeezed) and name mapper (``gate_up_proj``
stacking, MTP weights dropped). FusedMoE looks itself up in vLLM's forward
context, so FFN calls run inside one. EPLB and expert parallelism are not
supported. The MoE bookkeeping describes the FFN role's experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.model_executor.models.ernie45_moe import (
    Ernie4_5_MoeForCausalLM,
    Ernie4_5_MoeMLP,
    Ernie4_5_MoeModel,
    Ernie4_5_MoeMoE,
)
from vllm.model_executor.models.utils import AutoWeightsLoader

from afd_patches.models.causal_lm import AfdCausalLMMixin, build_dense_mlp, copy_expert_counts
from afd_patches.models.ffn_proxy import proxy_type


def is_moe_layer(config: Any, layer: int) -> bool:
    """The condition under which vLLM's ERNIE-4.5-MoE decoder layer builds an ``Ernie4_5_MoeMoE``.

    vLLM has no helper for it, so this mirrors ``Ernie4_5_MoeDecoderLayer.__init__`` (its defaults
    included), which the manifest pins in full (``requires:``)."""
    num_experts = getattr(config, "moe_num_experts", 0)
    start = getattr(config, "moe_layer_start_index", 0)
    end = getattr(config, "moe_layer_end_index", config.num_hidden_layers - 1)
    interval = getattr(config, "moe_layer_interval", 1)
    use_moe = getattr(config, "use_moe", num_experts > 0)
    return bool(use_moe) and (layer + 1) % interval == 0 and start <= layer <= end



# The attention role's stand-ins while vLLM's model ``__init__`` runs: the manifests' scoped-rebind entry
# afd.ernie45-moe.ffn-proxies binds them (patchkit applies it).
Ernie4_5_MoeMLPProxy = proxy_type(Ernie4_5_MoeMLP)
Ernie4_5_MoeMoEProxy = proxy_type(Ernie4_5_MoeMoE, moe=True)


class AFDErnie4_5_MoeForCausalLM(AfdCausalLMMixin, Ernie4_5_MoeForCausalLM):
    """ERNIE-4.5-MoE with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""

    afd_moe_classes = (Ernie4_5_MoeMoE,)
    afd_needs_forward_context = True

    def afd_describe_experts(self, blocks: list[nn.Module]) -> None:
        """The expert counts ``Ernie4_5_MoeForCausalLM.__init__`` sets (every MoE block has the same)."""
        copy_expert_counts(self, blocks, blocks[0].n_shared_experts if blocks else 0)

    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        config = vllm_config.model_config.hf_config
        if is_moe_layer(config, layer):
            return Ernie4_5_MoeMoE(config=config, quant_config=vllm_config.quant_config, prefix=prefix,
                                   enable_eplb=vllm_config.parallel_config.enable_eplb)
        return build_dense_mlp(Ernie4_5_MoeMLP, vllm_config, prefix, use_bias=getattr(config, "use_bias", False))

    def afd_load_ffn_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's AutoWeightsLoader over ``Ernie4_5_MoeModel``'s own preprocessing, with its mapper."""
        return AutoWeightsLoader(self).load_weights(Ernie4_5_MoeModel._preprocess(self, weights),
                                                    mapper=Ernie4_5_MoeModel.hf_to_vllm_mapper)
