"""``AFDLlamaForCausalLM``: vLLM's Llama, split into an attention role and an FFN role.

See ``afd_patches.models.common`` for the role contract and its limits. The FFN
role builds vLLM's own ``LlamaMLP`` per layer with the arguments a Llama decoder
layer would give it.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from vllm.model_executor.models.llama import LlamaForCausalLM, LlamaMLP

from afd_patches.models.common import AfdCausalLMMixin


class AFDLlamaForCausalLM(AfdCausalLMMixin, LlamaForCausalLM):
    """Llama with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""

    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        config = vllm_config.model_config.hf_config
        return LlamaMLP(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            quant_config=vllm_config.quant_config,
            bias=getattr(config, "mlp_bias", False),
            prefix=prefix,
        )
