"""``AFDGptOssForCausalLM``: vLLM's gpt-oss, split into an attention role and an FFN (experts) role.

See ``afd_patches.models.causal_lm`` for the role contract and its limits. Every
gpt-oss decoder layer (``TransformerBlock``) holds attention with sinks
(sliding-window or full) and an ``MLPBlock`` (router with bias, FusedMoE
experts with biases and the clamped SwiGLU). vLLM builds it through two class
attributes meant for overriding -- ``GptOssModel.block_cls`` and
``TransformerBlock.mlp_cls`` -- not through module-level names, so the
attention role binds ``GptOssModel`` (the name ``GptOssForCausalLM.__init__``
builds its model by) to a subclass whose ``block_cls`` is a ``TransformerBlock``
subclass whose ``mlp_cls`` is ``MLPBlock``'s proxy. Nothing else changes: the
attention, sinks, norms, embedding and LM head are vLLM's.

FFN role: one ``MLPBlock`` per layer, held by a ``GptOssModel`` subclass that
builds nothing else, so vLLM's own ``GptOssModel.load_weights`` (fused
``[experts, hidden, 2 * intermediate]`` expert tensors, interleaved gate/up,
biases) loads the expert weights, after ``GptOssForCausalLM``'s name mapper.
vLLM's gpt-oss keeps no MoE bookkeeping, so neither role reports any. Limits (besides those of ``causal_lm``): no
sequence-parallel MoE, no EPLB or expert parallelism; MXFP4 and Quark
checkpoints go through vLLM's loader but are not tested here (vLLM's CPU build
has no MXFP4 MoE kernel).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM, GptOssModel, MLPBlock, TransformerBlock

from afd_patches.models.causal_lm import AfdCausalLMMixin
from afd_patches.models.ffn_proxy import proxy_type


class _ProxyMlpBlock(TransformerBlock):
    """vLLM's ``TransformerBlock`` with its ``mlp_cls`` override point set to ``MLPBlock``'s proxy."""

    mlp_cls = proxy_type(MLPBlock)


class GptOssModelProxy(GptOssModel):
    """vLLM's ``GptOssModel`` with its ``block_cls`` override point set to ``_ProxyMlpBlock``; the manifests'
    scoped-rebind entry afd.gpt-oss.ffn-proxies binds it as ``GptOssModel`` while the attention role's model
    ``__init__`` runs (patchkit applies it)."""

    block_cls = _ProxyMlpBlock


class _ExpertsOnlyModel(GptOssModel):
    """The FFN role's ``model``: the per-layer ``MLPBlock``s and the configs, so that vLLM's
    ``GptOssModel.load_weights`` loads them; it is never called (the FFN role has no forward)."""

    def __init__(self, vllm_config: Any, layers: nn.ModuleList) -> None:
        nn.Module.__init__(self)  # GptOssModel.__init__ would build the embedding, attention and norms
        self.config = vllm_config.model_config.hf_config  # the attributes GptOssModel.__init__ sets and
        self.quant_config = vllm_config.quant_config  # its load_weights reads
        self.parallel_config = vllm_config.parallel_config
        self.layers = layers


class AFDGptOssForCausalLM(AfdCausalLMMixin, GptOssForCausalLM):
    """gpt-oss with Attention-FFN Disaggregation (role from ``additional_config["afd"]``)."""

    # no afd_moe_classes: vLLM's gpt-oss keeps no MoE bookkeeping
    afd_needs_forward_context = True

    def afd_check_attention_layers(self) -> None:
        """As in ``causal_lm``, and no sequence-parallel MoE (its blocks chunk and gather around the FFN)."""
        if self.vllm_config.parallel_config.use_sequence_parallel_moe:
            raise ValueError("AFD gpt-oss: sequence-parallel MoE (use_sequence_parallel_moe) is not supported")
        super().afd_check_attention_layers()

    def _afd_build_ffn_model(self, vllm_config: Any, prefix: str) -> None:
        """As in ``causal_lm``, with the layers held by ``_ExpertsOnlyModel`` (vLLM's loader runs on it)."""
        super()._afd_build_ffn_model(vllm_config, prefix)
        self.model = _ExpertsOnlyModel(vllm_config, self.model.layers)

    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        return MLPBlock(vllm_config, layer, prefix=prefix)
