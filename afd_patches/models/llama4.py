"""``AFDLlama4ForCausalLM``: vLLM's Llama-4 text decoder, split into an attention role and an FFN role.

See ``afd_patches.models.causal_lm`` for the role contract and its limits. A
Llama-4 decoder layer's FFN is ``feed_forward``: a dense ``LlamaMLP`` (of
``intermediate_size_mlp``) or, every ``interleave_moe_layer_step``-th layer, a
``Llama4MoE`` (router, FusedMoE experts and the shared expert vLLM runs inside
FusedMoE). The FFN role builds exactly that module per layer; the attention
role keeps the RoPE/NoPE attention, QK norm, temperature tuning, norms,
embeddings and LM head, with ``Llama4DecoderLayer`` building proxies in place
of both FFN classes.

Weights: Llama-4 checkpoints store each MoE layer's experts fused, as
``experts.gate_up_proj`` ``[experts, hidden, 2 * intermediate]`` and
``experts.down_proj`` ``[experts, intermediate, hidden]`` (input dimension
first). The FFN role turns them to vLLM's ``[experts, out, in]`` layout and
hands them to FusedMoE's own loader; dense and shared-expert
``gate_proj``/``up_proj`` go to vLLM's fused ``gate_up_proj`` through
``LlamaModel``'s name mapper. Per-expert checkpoints load unchanged.

The MoE bookkeeping vLLM reads (``moe_layers``, ``num_moe_layers``, expert
counts) describes the FFN role's experts; the attention role reports none.
Limits (besides those of ``causal_lm``): no sequence-parallel MoE, no EPLB or
expert parallelism; the vision tower of ``Llama4ForConditionalGeneration`` is
not covered (text decoder only).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from vllm.model_executor.models.llama4 import (
    Llama4ForCausalLM,
    Llama4Model,
    Llama4MoE,
    LlamaMLP,
)
from vllm.model_executor.models.utils import AutoWeightsLoader

from afd_patches.models.causal_lm import AfdCausalLMMixin, copy_expert_counts
from afd_patches.models.ffn_proxy import proxy_type

_FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def is_moe_layer(config: Any, layer: int) -> bool:
    """The condition under which vLLM's Llama-4 decoder layer builds a ``Llama4MoE``.

    vLLM has no helper for it, so this mirrors ``Llama4DecoderLayer.__init__``, which every
    manifest pins in full (``requires:``, docs/manifests.md)."""
    step = config.interleave_moe_layer_step
    return step > 0 and (layer + 1) % step == 0


def _experts_out_first(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Fused expert tensors (input dimension first) as ``[experts, out, in]``; everything else as is."""
    for name, w in weights:
        yield name, (w.transpose(-1, -2) if w.dim() == 3 and _FUSED_EXPERTS.search(name) else w)



# The attention role's stand-ins while vLLM's model ``__init__`` runs: the manifests' scoped-rebind entry
# afd.llama4.ffn-proxies binds them (patchkit applies it).
LlamaMLPProxy = proxy_type(LlamaMLP)
Llama4MoEProxy = proxy_type(Llama4MoE, moe=True)


class AFDLlama4ForCausalLM(AfdCausalLMMixin, Llama4ForCausalLM):
    """Llama-4 (text) with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""

    afd_moe_classes = (Llama4MoE,)
    afd_ffn_attr = "feed_forward"
    afd_needs_forward_context = True

    def afd_describe_experts(self, blocks: list[nn.Module]) -> None:
        """The expert counts ``Llama4ForCausalLM.set_moe_parameters`` sets, from the last MoE block."""
        copy_expert_counts(self, blocks, blocks[-1].n_shared_experts if blocks else 0)
        self.num_expert_groups = 1 if blocks else 0

    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        config = vllm_config.model_config.hf_config
        if is_moe_layer(config, layer):
            return Llama4MoE(vllm_config=vllm_config, prefix=prefix)
        return LlamaMLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size_mlp,
                        hidden_act="silu", quant_config=vllm_config.quant_config, bias=False, prefix=prefix)

    def afd_load_ffn_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's AutoWeightsLoader with ``LlamaModel``'s name mapper; fused experts turned to ``[E, out, in]``."""
        return AutoWeightsLoader(self).load_weights(_experts_out_first(weights), mapper=Llama4Model.hf_to_vllm_mapper)
