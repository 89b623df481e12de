"""``AFDQwen3NextForCausalLM``: vLLM's Qwen3-Next (hybrid linear attention + MoE), split into roles.

See ``afd_patches.models.causal_lm`` for the role contract and its limits. Each
Qwen3-Next decoder layer holds either a Gated-DeltaNet linear attention or a
gated full attention, then its FFN ``mlp``: a ``Qwen3NextSparseMoeBlock``
(router, FusedMoE experts, gated shared expert) or, for ``mlp_only_layers``
and off ``decoder_sparse_step``, a dense ``Qwen3NextMLP``.

Attention role: both kinds of attention stay here, with their state -- the
KV cache of the full-attention layers and the convolution/recurrent state of
the linear-attention layers, which vLLM allocates and manages as for the plain
model; ``Qwen3NextDecoderLayer`` builds proxies in place of both FFN classes.
FFN role: only the per-layer FFN modules (no attention, no KV cache, no
linear-attention state). vLLM's CPU Gated-DeltaNet kernels need bfloat16, so on
CPU both roles run in bfloat16.

The MoE bookkeeping vLLM reads (``moe_layers``, ``num_moe_layers``, expert
counts) describes the FFN role's experts and mirrors
``QwenNextMixtureOfExperts.set_moe_parameters`` (pinned in full); the attention
role reports none. Limits (besides those of ``causal_lm``): no sequence-parallel
MoE, no fused shared experts, no EPLB or expert parallelism, no MTP.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.model_executor.models.qwen3_next import (
    Qwen3NextForCausalLM,
    Qwen3NextMLP,
    Qwen3NextModel,
    Qwen3NextSparseMoeBlock,
)
from vllm.model_executor.models.utils import AutoWeightsLoader

from afd_patches.models.causal_lm import AfdCausalLMMixin, build_dense_mlp, copy_expert_counts
from afd_patches.models.ffn_proxy import proxy_type


def is_moe_layer(config: Any, layer: int) -> bool:
    """The condition under which vLLM's Qwen3-Next decoder layer builds a sparse MoE block.

    vLLM has no helper for it, so this mirrors ``Qwen3NextDecoderLayer.__init__``, which every
    manifest pins in full (``requires:``, docs/manifests.md)."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    return layer not in mlp_only and config.num_experts > 0 and (layer + 1) % config.decoder_sparse_step == 0


class HybridMoeRules(AfdCausalLMMixin):
    """The hooks Qwen3-Next and Qwen3.5 share: no sequence-parallel MoE on the attention role, and the MoE
    bookkeeping of ``QwenNextMixtureOfExperts`` on the FFN role."""

    def afd_describe_experts(self, blocks: list[nn.Module]) -> None:
        """The expert counts ``QwenNextMixtureOfExperts.set_moe_parameters`` sets, from the last sparse block.
        Fused shared experts (ROCm AITER) are refused."""
        if any(b.is_fused_shared_expert_enabled for b in blocks):
            raise NotImplementedError("AFD Qwen3-Next/3.5 FFN role: fused shared experts are not supported")
        copy_expert_counts(self, blocks)

    def afd_check_attention_layers(self) -> None:
        """As in ``causal_lm``, and no sequence-parallel MoE (its layers expect another exchange)."""
        if any(getattr(layer, "use_attn_reduce_scatter_for_moe", False) for layer in self._afd_layers()):
            raise ValueError("AFD Qwen3-Next/3.5: sequence-parallel MoE is not supported")
        super().afd_check_attention_layers()



# The attention role's stand-ins while vLLM's model ``__init__`` runs: the manifests' scoped-rebind entry
# afd.qwen3-next.ffn-proxies binds them (patchkit applies it).
Qwen3NextMLPProxy = proxy_type(Qwen3NextMLP)
Qwen3NextSparseMoeBlockProxy = proxy_type(Qwen3NextSparseMoeBlock, moe=True)


class AFDQwen3NextForCausalLM(HybridMoeRules, Qwen3NextForCausalLM):
    """Qwen3-Next with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""

    afd_moe_classes = (Qwen3NextSparseMoeBlock,)
    afd_needs_forward_context = True

    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        if is_moe_layer(vllm_config.model_config.hf_text_config, layer):
            return Qwen3NextSparseMoeBlock(vllm_config=vllm_config, prefix=prefix)
        return build_dense_mlp(Qwen3NextMLP, vllm_config, prefix)

    def afd_load_ffn_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's AutoWeightsLoader with the class's mapper (drops MTP weights) and ``Qwen3NextModel``'s
        (dense and shared-expert ``gate_up_proj``)."""
        mapper = self.hf_to_vllm_mapper | Qwen3NextModel.hf_to_vllm_mapper
        return AutoWeightsLoader(self).load_weights(weights, mapper=mapper)
