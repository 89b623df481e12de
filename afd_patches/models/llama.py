"""``AFDLlamaForCausalLM``: vLLM's Llama, split into an attention role and an FFN role.

See ``afd_patches.models.causal_lm`` for the role contract and its limits. On the
attention role, ``LlamaDecoderLayer`` builds a proxy in place of ``LlamaMLP``;
the FFN role builds vLLM's own ``LlamaMLP`` per layer with the arguments a
Llama decoder layer would give it.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from vllm.model_executor.models.llama import LlamaForCausalLM, LlamaMLP

from afd_patches.models.causal_lm import AfdCausalLMMixin, build_dense_mlp
from afd_patches.models.ffn_proxy import proxy_type

# The attention role's stand-ins for ``LlamaMLP`` while vLLM's model ``__init__`` runs:
# the manifests' scoped-rebind entry afd.llama.ffn-proxies binds them (patchkit applies it).
LlamaMLPProxy = proxy_type(LlamaMLP)


class AFDLlamaForCausalLM(AfdCausalLMMixin, LlamaForCausalLM):
    """Llama with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""


    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        bias = getattr(vllm_config.model_config.hf_text_config, "mlp_bias", False)
        return build_dense_mlp(LlamaMLP, vllm_config, prefix, bias=bias)
