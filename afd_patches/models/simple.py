"""The AFD classes of the simple families, generated from their rows in ``afd_patches.models.families``.

vLLM imports a registered architecture lazily (``afd_patches.models.simple:AFDLlamaForCausalLM``),
and a family's scoped-rebind entry binds ``afd_patches.models.simple:<FFN class>Proxy`` while the
attention role's model is built. Either name, asked of this module the first time, builds that
family's classes (``__getattr__``): it imports only that family's vLLM module, and every later ask
in the process gets the same class objects.

A generated ``AFD<Arch>`` is ``class AFD<Arch>(RowFamily, <vLLM class>)`` with the row's keywords
as class attributes; ``RowFamily`` implements the ``AfdCausalLMMixin`` hooks by the row:

- ``afd_build_ffn``: the MoE class on the layers ``MOE_LAYERS[row.moe_layers]`` picks, the dense
  class elsewhere, each built as ``BUILDERS[row.moe_args / row.dense_args]`` says vLLM's decoder
  layer builds it. Each rule and each way of building mirrors vLLM code the manifests pin in full
  (``requires:``), so a release that changes one fails ``patchkit check`` and AFD is refused there.
- ``afd_describe_experts``: ``copy_expert_counts`` (as Mixtral's and Qwen3-MoE's ``__init__``
  do) or ``adopt_moe_blocks`` plus vLLM's own ``extract_moe_parameters`` (GLM-4-MoE's).
- ``afd_is_ffn_weight``: a decoder layer's FFN tensor, MTP layers excluded where the row says so.
- ``afd_load_ffn_weights``: vLLM's AutoWeightsLoader with the row's mapper class's
  ``hf_to_vllm_mapper`` (else the model's own).

The families' own notes (what vLLM's decoder layer builds, where shared experts run, limits) are
in docs/adding-a-model.md and the manifests' ``why:`` texts.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from afd_patches.models.causal_lm import AfdCausalLMMixin, adopt_moe_blocks, build_dense_mlp, copy_expert_counts
from afd_patches.models.families import FAMILIES, SERVED, Family
from afd_patches.models.ffn_proxy import proxy_type

if TYPE_CHECKING:
    # Every vLLM name the rows hold, for type checkers and for ``patchkit deps``, which reads imports, not the
    # table's strings, and so keeps checking that each is declared in the manifests' ``requires:``
    # (tests/afd/test_families.py keeps this block equal to the table).
    from vllm.model_executor.models.bailing_moe import (  # noqa: F401
        BailingMLP,
        BailingMoE,
        BailingMoeForCausalLM,
        BailingMoeModel,
        BailingMoeV2ForCausalLM,
    )
    from vllm.model_executor.models.glm4_moe import (  # noqa: F401
        Glm4MixtureOfExperts,
        Glm4MoE,
        Glm4MoeForCausalLM,
        Glm4MoeMLP,
        Glm4MoeModel,
    )
    from vllm.model_executor.models.llama import LlamaForCausalLM, LlamaMLP  # noqa: F401
    from vllm.model_executor.models.mixtral import MixtralForCausalLM, MixtralMoE  # noqa: F401
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM, Qwen3MLP  # noqa: F401
    from vllm.model_executor.models.qwen3_moe import (  # noqa: F401
        Qwen3MoeForCausalLM,
        Qwen3MoeMLP,
        Qwen3MoeSparseMoeBlock,
    )


# ---- which layers build the MoE class (each mirrors the decoder layer's __init__ named) ----------------
def _sparse_step(config: Any, layer: int) -> bool:
    """``Qwen3MoeDecoderLayer.__init__``: not in ``mlp_only_layers``, experts configured, every
    ``decoder_sparse_step``-th layer."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer not in mlp_only and config.num_experts > 0 and (layer + 1) % step == 0


def _first_k_dense(config: Any, layer: int) -> bool:
    """``BailingMoeBlock.__init__``: every layer from ``first_k_dense_replace`` on."""
    return layer >= config.first_k_dense_replace


def _routed_after_first_k(config: Any, layer: int) -> bool:
    """``Glm4MoeDecoderLayer.__init__``: routed experts configured, and from ``first_k_dense_replace`` on."""
    return config.n_routed_experts is not None and layer >= config.first_k_dense_replace


def _every(config: Any, layer: int) -> bool:
    """``MixtralDecoderLayer.__init__``: every layer holds the MoE block."""
    return True


MOE_LAYERS: dict[str, Callable[[Any, int], bool]] = {
    "every": _every, "sparse_step": _sparse_step, "first_k_dense": _first_k_dense,
    "routed_after_first_k": _routed_after_first_k,
}


# ---- how the decoder layer builds an FFN class (cls, vllm_config, the row's config, prefix, row) -------
def _dense_mlp(cls: type[nn.Module], vllm_config: Any, config: Any, prefix: str, row: Family) -> nn.Module:
    """``build_dense_mlp``'s keyword arguments, plus the row's ``dense_extra`` read from the config."""
    extra = {keyword: getattr(config, attr, default) for keyword, attr, default in row.dense_extra}
    return build_dense_mlp(cls, vllm_config, prefix, **extra)


def _vllm_config(cls: type[nn.Module], vllm_config: Any, config: Any, prefix: str, row: Family) -> nn.Module:
    return cls(vllm_config=vllm_config, prefix=prefix)


def _config_eplb(cls: type[nn.Module], vllm_config: Any, config: Any, prefix: str, row: Family) -> nn.Module:
    return cls(config=config, quant_config=vllm_config.quant_config, prefix=prefix,
               enable_eplb=vllm_config.parallel_config.enable_eplb)


def _mixtral(cls: type[nn.Module], vllm_config: Any, config: Any, prefix: str, row: Family) -> nn.Module:
    return cls(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
               hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
               quant_config=vllm_config.quant_config, prefix=prefix,
               enable_eplb=vllm_config.parallel_config.enable_eplb)


def _bailing(cls: type[nn.Module], vllm_config: Any, config: Any, prefix: str, row: Family) -> nn.Module:
    """``BailingMoeBlock.__init__`` passes both its FFN classes the same positional arguments."""
    return cls(config.intermediate_size, config, vllm_config.quant_config, True, prefix=prefix)


BUILDERS: dict[str, Callable[[type[nn.Module], Any, Any, str, Family], nn.Module]] = {
    "dense_mlp": _dense_mlp, "vllm_config": _vllm_config, "config_eplb": _config_eplb, "mixtral": _mixtral,
    "bailing": _bailing,
}


class RowFamily(AfdCausalLMMixin):
    """The ``AfdCausalLMMixin`` hooks of a simple family, read from its row (module docstring)."""

    afd_row: ClassVar[Family]
    afd_vllm: ClassVar[dict[str, Any]]  # the row's names, resolved in its vLLM module

    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        row = self.afd_row
        config = getattr(vllm_config.model_config, row.config)
        if row.moe is not None and MOE_LAYERS[row.moe_layers](config, layer):
            return BUILDERS[row.moe_args](self.afd_vllm[row.moe], vllm_config, config, prefix, row)
        assert row.dense is not None, f"{row.module}: a layer without the MoE block, and no dense class"
        return BUILDERS[row.dense_args](self.afd_vllm[row.dense], vllm_config, config, prefix, row)

    def afd_describe_experts(self, blocks: list[nn.Module]) -> None:
        """``copy``: the expert counts the model's ``__init__`` copies from its first MoE block; ``adopt``: what
        it sets in ``moe_mlp_layers`` and ``num_expert_groups``, then vLLM's own ``extract_moe_parameters`` on
        the last MoE block."""
        if self.afd_row.experts == "copy":
            copy_expert_counts(self, blocks)
        elif self.afd_row.experts == "adopt":
            adopt_moe_blocks(self, blocks)
            self.extract_moe_parameters(blocks[-1] if blocks else None)  # type: ignore[attr-defined]

    def afd_is_ffn_weight(self, name: str) -> bool:
        """A decoder layer's FFN tensor; with ``skip_mtp``, not one of an MTP (next-token-prediction) layer."""
        if not super().afd_is_ffn_weight(name):
            return False
        if not self.afd_row.skip_mtp:
            return True
        from vllm.model_executor.models.utils import get_spec_layer_idx_from_weight_name

        return get_spec_layer_idx_from_weight_name(self.config, name) is None  # type: ignore[attr-defined]

    def afd_load_ffn_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's AutoWeightsLoader with the row's mapper class's ``hf_to_vllm_mapper`` (else the model's)."""
        if self.afd_row.mapper is None:
            return super().afd_load_ffn_weights(weights)
        from vllm.model_executor.models.utils import AutoWeightsLoader

        mapper = self.afd_vllm[self.afd_row.mapper].hf_to_vllm_mapper
        return AutoWeightsLoader(self).load_weights(weights, mapper=mapper)


def generate(row: Family) -> dict[str, Any]:
    """The classes of ``row``: its ``AFD<Arch>`` architectures and its FFN classes' proxies, by name."""
    module = importlib.import_module(row.vllm_module)
    names = {name: getattr(module, name) for name in row.names()}
    # a MoE proxy reports no experts to vLLM's bookkeeping; a model that keeps none gets a plain one
    out: dict[str, Any] = {f"{cls}Proxy": proxy_type(names[cls], moe=cls == row.moe and bool(row.experts))
                           for cls in row.ffn_classes}
    attrs = {"__module__": __name__, "afd_row": row, "afd_vllm": names, "afd_ffn_attr": row.ffn_attr,
             "afd_needs_forward_context": row.moe is not None,  # FusedMoE looks itself up in it
             "afd_moe_classes": (names[row.moe],) if row.moe is not None and row.experts else ()}
    first: type | None = None
    for arch, vllm_cls in row.archs:
        doc = f"vLLM's ``{vllm_cls}`` with Attention-FFN Disaggregation (role from ``additional_config[\"afd\"]``)."
        if first is None:
            first = type(arch, (RowFamily, names[vllm_cls]), {**attrs, "__qualname__": arch, "__doc__": doc})
            out[arch] = first
        else:  # vLLM's class is the first one under another name: the AFD class is the first one's, too
            out[arch] = type(arch, (first, names[vllm_cls]), {"__module__": __name__, "__qualname__": arch,
                                                              "__doc__": doc})
    return out


_LOCK = threading.Lock()
_GENERATED: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """A served name (``families.SERVED``): its family's classes, generated on the first ask."""
    family = SERVED.get(name)
    if family is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _LOCK:
        if name not in _GENERATED:
            _GENERATED.update(generate(FAMILIES[family]))
    return _GENERATED[name]
