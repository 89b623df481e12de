"""``AFDQwen3ForCausalLM``: vLLM's Qwen3 (dense), split into an attention role and an FFN role.

See ``afd_patches.models.common`` for the role contract and its limits. The FFN
role builds vLLM's own ``Qwen3MLP`` per layer with the arguments a Qwen3
decoder layer would give it.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM, Qwen3MLP

from afd_patches.models.common import AfdCausalLMMixin


class AFDQwen3ForCausalLM(AfdCausalLMMixin, Qwen3ForCausalLM):
    """Qwen3 with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""

    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        config = vllm_config.model_config.hf_config
        return Qwen3MLP(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            quant_config=vllm_config.quant_config,
            prefix=prefix,
        )
