"""``AFDDeepseekV2ForCausalLM`` / ``AFDDeepseekV3ForCausalLM``: vLLM's DeepSeek-V2/V3, split into roles.

See ``afd_patches.models.causal_lm`` for the role contract and its limits. In
vLLM's DeepSeek-V2 family the FFN of decoder layer ``i`` is ``mlp`` for both
kinds of layer: a dense ``DeepseekV2MLP`` for the first
``first_k_dense_replace`` layers (and layers off ``moe_layer_freq``), and a
``DeepseekV2MoE`` (router ``gate``, FusedMoE ``experts``, optional
``shared_experts``) elsewhere. The FFN role builds exactly the module vLLM's
decoder layer would build for each layer, with the same arguments, so
parameter names match the checkpoint (``model.layers.N.mlp.*``).

Attention role: the attention side keeps vLLM's MLA (or MHA) attention, norms,
embeddings and LM head; ``DeepseekV2DecoderLayer`` builds proxies in place of
``DeepseekV2MoE`` and ``DeepseekV2MLP``. A dense layer's proxy is also an
instance of ``DeepseekV2MLP`` (it builds none of its layers), so vLLM's decoder
layer applies its own float16 overflow rescaling of dense-MLP outputs exactly
as it does without AFD; MoE layers rescale inside ``DeepseekV2MoE`` on the FFN
role.

FFN role: checkpoint names are mapped onto vLLM's fused parameters
(``gate_proj``/``up_proj`` -> ``gate_up_proj`` for dense MLPs and shared
experts); routed-expert weights go to vLLM's FusedMoE loader. MTP
(``num_nextn_predict_layers``) weights are never FFN weights: both roles leave
them to vLLM, which skips them for the main model. FusedMoE looks itself up in
vLLM's forward context, so FFN calls run inside one.

Limits (besides those of ``causal_lm``): no sequence-parallel MoE
(``use_sequence_parallel_moe``), no ROCm AITER fused shared experts, no EPLB or
expert parallelism; DeepSeek-V3.2 (sparse attention indexer) is not covered.
The MoE bookkeeping vLLM reads (``moe_layers``, ``num_moe_layers``, expert
counts) describes the FFN role's experts; the attention role reports none.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm._aiter_ops import rocm_aiter_ops
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2ForCausalLM,
    DeepseekV2MLP,
    DeepseekV2MoE,
    DeepseekV3ForCausalLM,
)
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    WeightsMapper,
    get_spec_layer_idx_from_weight_name,
)

from afd_patches.models.causal_lm import AfdCausalLMMixin, adopt_moe_blocks, build_dense_mlp
from afd_patches.models.ffn_proxy import proxy_type

# Checkpoint -> vLLM names of the FFN role's fused dense projections. Routed
# experts (``mlp.experts.E.*``) do not match and go to FusedMoE's own loader.
_FFN_STACKED = WeightsMapper(
    orig_to_new_stacked={
        ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
        ".mlp.up_proj": (".mlp.gate_up_proj", 1),
        ".shared_experts.gate_proj": (".shared_experts.gate_up_proj", 0),
        ".shared_experts.up_proj": (".shared_experts.gate_up_proj", 1),
    }
)


def is_moe_layer(config: Any, layer: int) -> bool:
    """The condition under which vLLM's DeepSeek-V2 decoder layer builds a ``DeepseekV2MoE``.

    vLLM has no helper for it, so this mirrors ``DeepseekV2DecoderLayer.__init__``, which every
    manifest pins in full (``requires:``, docs/manifests.md)."""
    freq = getattr(config, "moe_layer_freq", 1)
    return config.n_routed_experts is not None and layer >= config.first_k_dense_replace and layer % freq == 0


# The attention role's stand-ins for ``DeepseekV2MoE`` and ``DeepseekV2MLP`` while vLLM's model ``__init__`` runs:
# the manifests' scoped-rebind entry afd.deepseek-v2.ffn-proxies binds them (patchkit applies it).
DeepseekV2MoEProxy = proxy_type(DeepseekV2MoE, moe=True)
DeepseekV2MLPProxy = proxy_type(DeepseekV2MLP)


class AFDDeepseekV2ForCausalLM(AfdCausalLMMixin, DeepseekV2ForCausalLM):
    """DeepSeek-V2 with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""

    afd_moe_classes = (DeepseekV2MoE,)
    afd_needs_forward_context = True

    def afd_describe_experts(self, blocks: list[nn.Module]) -> None:
        """What ``DeepseekV2ForCausalLM.__init__`` sets: ``adopt_moe_blocks``, then vLLM's own
        ``extract_moe_parameters`` on the last MoE block."""
        adopt_moe_blocks(self, blocks)
        self.extract_moe_parameters(blocks[-1] if blocks else None)

    # ---- attention role -------------------------------------------------
    def afd_check_attention_layers(self) -> None:
        """As in ``causal_lm``, and no sequence-parallel MoE (its layers expect another exchange)."""
        if any(getattr(layer, "use_sequence_parallel_moe", False) for layer in self._afd_layers()):
            raise ValueError("AFD DeepSeek: sequence-parallel MoE (use_sequence_parallel_moe) is not supported")
        super().afd_check_attention_layers()

    # ---- FFN role -------------------------------------------------------
    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        config = vllm_config.model_config.hf_config
        if is_moe_layer(config, layer):
            return DeepseekV2MoE(
                config=config,
                parallel_config=vllm_config.parallel_config,
                quant_config=vllm_config.quant_config,
                prefix=prefix,
                apply_routed_scale_to_output=not rocm_aiter_ops.is_fused_moe_enabled(),
            )
        return build_dense_mlp(DeepseekV2MLP, vllm_config, prefix)

    def afd_is_ffn_weight(self, name: str) -> bool:
        """A decoder layer's ``mlp.*`` tensor, excluding MTP (next-token-prediction) layers."""
        return super().afd_is_ffn_weight(name) and get_spec_layer_idx_from_weight_name(self.config, name) is None

    def afd_load_ffn_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's AutoWeightsLoader with the dense/shared-expert ``gate_up_proj`` stacking."""
        return AutoWeightsLoader(self).load_weights(weights, mapper=_FFN_STACKED)


class AFDDeepseekV3ForCausalLM(AFDDeepseekV2ForCausalLM, DeepseekV3ForCausalLM):
    """DeepSeek-V3 (and Kimi-K2, same architecture) with AFD; vLLM's ``DeepseekV3ForCausalLM`` is its V2 class
    under another name. V3's routing -- ``noaux_tc`` sigmoid scores with the router's
    ``e_score_correction_bias``, ``n_group``/``topk_group`` group-limited top-k, ``routed_scaling_factor`` --
    all lives in ``DeepseekV2MoE``, so it runs on the FFN role exactly as vLLM runs it."""
