"""``AFDStep3TextForCausalLM``: vLLM's Step-3 text model, split into an attention role and an FFN role.

See ``afd_patches.models.causal_lm`` for the role contract and its limits. A Step-3
decoder layer holds either a dense ``Step3TextMLP`` as ``mlp`` or, on the layers
``moe_layers_enum`` lists, a ``FusedMoEBlock`` as ``moe`` (router ``gate`` +
FusedMoE experts) and a ``Step3TextMLP`` as ``share_expert``, whose outputs its
forward adds (``share_expert(x) + moe(x)``). Both halves go to the FFN role, which
computes that same sum per MoE layer (``Step3FfnLayer``); on the attention role the
``moe`` proxy exchanges and the ``share_expert`` proxy is folded (returns zeros),
so the decoder layer's sum is the FFN role's output exactly.

Weights: ``model.layers.N.{mlp,moe,share_expert}.*`` are FFN weights; the FFN role
loads them with vLLM's own ``Step3TextModel.load_weights`` (stacked 3-D expert
tensors, ``gate_up_proj`` stacking) run on its layers. FusedMoE looks itself up in
vLLM's forward context, so FFN calls run inside one. vLLM's Step-3 model keeps no
MoE bookkeeping, so neither role reports any. The MoE-layer rule and the sum mirror
``Step3TextDecoderLayer`` (``__init__`` and ``forward``), which the manifest pins in full.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.model_executor.models.step3_text import (
    FusedMoEBlock,
    Step3TextForCausalLM,
    Step3TextMLP,
    Step3TextModel,
)

from afd_patches.models.causal_lm import AfdCausalLMMixin
from afd_patches.models.ffn_proxy import proxy_type


def moe_layers(config: Any) -> set[int]:
    """The layers on which vLLM's Step-3 decoder layer builds ``moe`` + ``share_expert`` (mirrors its
    ``__init__``: ``moe_layers_enum``, default every layer but the first)."""
    listed = getattr(config, "moe_layers_enum", None)
    if listed is not None:
        return {int(i) for i in listed.strip().split(",")}
    return set(range(1, config.num_hidden_layers))


class Step3FfnLayer(nn.Module):
    """FFN role: one Step-3 layer's FFN modules under their checkpoint names; ``forward`` is what the
    decoder layer computes from them (``share_expert(x) + moe(x)``, or ``mlp(x)``)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "moe"):
            return self.share_expert(hidden_states) + self.moe(hidden_states)  # type: ignore[no-any-return]
        return self.mlp(hidden_states)  # type: ignore[no-any-return]



# The attention role's stand-ins while vLLM's model ``__init__`` runs: the manifests' scoped-rebind entry
# afd.step3-text.ffn-proxies binds them (patchkit applies it).
FusedMoEBlockProxy = proxy_type(FusedMoEBlock)
Step3TextMLPProxy = proxy_type(Step3TextMLP)


class AFDStep3TextForCausalLM(AfdCausalLMMixin, Step3TextForCausalLM):
    """Step-3 with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""

    afd_folded_ffn_attrs = ("share_expert",)
    afd_needs_forward_context = True
    _FFN_WEIGHT = re.compile(r"(^|\.)layers\.\d+\.(mlp|moe|share_expert)\.")

    def afd_ffn_of(self, layer: nn.Module) -> nn.Module | None:
        """FFN role: the ``Step3FfnLayer``; attention role: the ``moe`` proxy, or the ``mlp`` one."""
        if isinstance(layer, Step3FfnLayer):
            return layer
        return layer.moe if hasattr(layer, "moe") else getattr(layer, "mlp", None)

    def afd_build_ffn_layer(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        """What vLLM's decoder layer builds for its FFN, with the same arguments (``hidden_act`` silu)."""
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        holder = Step3FfnLayer()
        if layer in moe_layers(config):
            holder.moe = FusedMoEBlock(config=config, quant_config=quant_config, prefix=f"{prefix}.moe")
            holder.share_expert = Step3TextMLP(hidden_size=config.hidden_size,
                                               intermediate_size=config.share_expert_dim, hidden_act="silu",
                                               quant_config=quant_config, prefix=f"{prefix}.share_expert")
        else:
            holder.mlp = Step3TextMLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                                      hidden_act="silu", quant_config=quant_config, prefix=f"{prefix}.mlp")
        return holder

    def afd_load_ffn_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's ``Step3TextModel.load_weights`` run on the FFN role's ``model`` (names relative to it)."""
        self.model.config = self.config  # it reads the config (share_q_dim) and the model's parameters
        loaded = Step3TextModel.load_weights(self.model, ((name.removeprefix("model."), w) for name, w in weights))
        return {f"model.{name}" for name in loaded}
