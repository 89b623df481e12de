"""``AFDBailingMoeForCausalLM``: vLLM's Bailing-MoE (Ling), split into an attention role and an FFN role.

See ``afd_patches.models.causal_lm`` for the role contract and its limits. A
Bailing decoder layer (``BailingMoeBlock``) builds its FFN as ``mlp``: a dense
``BailingMLP`` for the first ``first_k_dense_replace`` layers, a ``BailingMoE``
(router ``gate``, FusedMoE ``experts``, optional ``shared_experts``, which
vLLM runs inside FusedMoE) for the others. The FFN role builds exactly that
module per layer, with the arguments vLLM's layer passes; the attention role
keeps the fused-QKV attention, norms, embeddings and (optionally normalized)
LM head, with ``BailingMoeBlock`` building proxies in place of both classes.

Weights: dense and shared-expert ``gate_proj``/``up_proj`` go to vLLM's fused
``gate_up_proj`` through ``BailingMoeModel``'s own name mapper; routed experts
go to FusedMoE's loader. vLLM's Bailing keeps no MoE bookkeeping (it is not a
``MixtureOfExperts`` model), so neither role reports any. Limits (besides
those of ``causal_lm``): no EPLB or expert parallelism.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.model_executor.models.bailing_moe import (
    BailingMLP,
    BailingMoE,
    BailingMoeForCausalLM,
    BailingMoeModel,
    BailingMoeV2ForCausalLM,
)
from vllm.model_executor.models.utils import AutoWeightsLoader

from afd_patches.models.causal_lm import AfdCausalLMMixin
from afd_patches.models.ffn_proxy import proxy_type


def is_moe_layer(config: Any, layer: int) -> bool:
    """The condition under which vLLM's ``BailingMoeBlock`` builds a ``BailingMoE``.

    vLLM has no helper for it, so this mirrors ``BailingMoeBlock.__init__``, which every
    manifest pins in full (``requires:``, docs/manifests.md)."""
    return layer >= config.first_k_dense_replace



# The attention role's stand-ins while vLLM's model ``__init__`` runs: the manifests' scoped-rebind entry
# afd.bailing-moe.ffn-proxies binds them (patchkit applies it).
BailingMLPProxy = proxy_type(BailingMLP)
BailingMoEProxy = proxy_type(BailingMoE)


class AFDBailingMoeForCausalLM(AfdCausalLMMixin, BailingMoeForCausalLM):
    """Bailing-MoE with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""

    afd_needs_forward_context = True

    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        config = vllm_config.model_config.hf_config
        ffn_cls = BailingMoE if is_moe_layer(config, layer) else BailingMLP
        return ffn_cls(config.intermediate_size, config, vllm_config.quant_config, True, prefix=prefix)

    def afd_load_ffn_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's AutoWeightsLoader with ``BailingMoeModel``'s name mapper."""
        return AutoWeightsLoader(self).load_weights(weights, mapper=BailingMoeModel.hf_to_vllm_mapper)


class AFDBailingMoeV2ForCausalLM(AFDBailingMoeForCausalLM, BailingMoeV2ForCausalLM):
    """Bailing-MoE V2 with AFD; vLLM's ``BailingMoeV2ForCausalLM`` is its V1 class under another name."""
