"""``AFDQwen3ForCausalLM``: vLLM's Qwen3 (dense), split into an attention role and an FFN role.

See ``afd_patches.models.causal_lm`` for the role contract and its limits. On the
attention role, ``Qwen3DecoderLayer`` builds a proxy in place of ``Qwen3MLP``;
the FFN role builds vLLM's own ``Qwen3MLP`` per layer with the arguments a
Qwen3 decoder layer would give it.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM, Qwen3MLP

from afd_patches.models.causal_lm import AfdCausalLMMixin, build_dense_mlp
from afd_patches.models.ffn_proxy import proxy_type

# The attention role's stand-ins for ``Qwen3MLP`` while vLLM's model ``__init__`` runs:
# the manifests' scoped-rebind entry afd.qwen3.ffn-proxies binds them (patchkit applies it).
Qwen3MLPProxy = proxy_type(Qwen3MLP)


class AFDQwen3ForCausalLM(AfdCausalLMMixin, Qwen3ForCausalLM):
    """Qwen3 with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""


    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        return build_dense_mlp(Qwen3MLP, vllm_config, prefix)
