"""The AFD families whose adapters differ only by names and keywords, as data; and each class's family name.

A row of ``FAMILIES`` says, for one vLLM model module, which ``*ForCausalLM`` classes get an AFD
architecture, which classes its decoder layer builds as FFN, by which rule a layer gets the MoE
block, with which arguments each is built, and how the FFN role keeps its MoE bookkeeping and
loads its weights. ``afd_patches.models.simple`` generates the ``AFD<Arch>`` classes and the
attention role's proxies from it, for one family at a time, when vLLM first asks for one of its
names. Families with logic of their own (a layer with several FFN modules, a weight layout to
convert, a rule with defaults, a refusal) keep a module of their own in this package
(docs/adding-a-model.md says which kind a new family is).

Importing this module imports neither torch nor vLLM. ``family_name`` gives a registration's family as the
table knows it; the manifest's ``models[].feature`` must say the same (tests/afd/test_families.py holds them
together: the runtime reads the feature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SIMPLE_MODULE = "afd_patches.models.simple"  # where the rows' classes live (the manifests' ``class:`` refs)


@dataclass(frozen=True)
class Family:
    """One family of the simple kind. Names are those of ``vllm.model_executor.models.<module>``.

    Keywords (their meaning is in ``afd_patches.models.simple``):

    - ``moe_layers``: which layers build ``moe`` rather than ``dense`` -- ``every``, ``sparse_step``
      (Qwen3-MoE's ``mlp_only_layers``/``decoder_sparse_step``), ``first_k_dense``
      (``first_k_dense_replace``), ``routed_after_first_k`` (the same, and ``n_routed_experts`` set);
    - ``dense_args`` / ``moe_args``: how the decoder layer calls the class -- ``dense_mlp`` (the keyword
      arguments of ``causal_lm.build_dense_mlp``, plus ``dense_extra``), ``vllm_config``, ``config_eplb``,
      ``mixtral``, ``bailing`` (positional);
    - ``experts``: the MoE bookkeeping the FFN role sets -- ``""`` none (vLLM's model keeps none),
      ``copy`` (``copy_expert_counts``), ``adopt`` (``adopt_moe_blocks`` and vLLM's
      ``extract_moe_parameters``).
    """

    module: str  # vllm.model_executor.models.<module>
    archs: tuple[tuple[str, str], ...]  # (AFD architecture, vLLM class); later ones subclass the first's
    dense: str | None = None  # the dense FFN class
    moe: str | None = None  # the MoE FFN class (its proxy reports no experts)
    moe_layers: str = "every"
    dense_args: str = "dense_mlp"
    dense_extra: tuple[tuple[str, str, Any], ...] = ()  # (keyword, config attribute, default) for dense_mlp
    moe_args: str = "vllm_config"
    ffn_attr: str = "mlp"  # the decoder layer's attribute that holds the FFN
    config: str = "hf_text_config"  # which of model_config's configs the layer's arguments come from
    experts: str = ""
    skip_mtp: bool = False  # MTP layers' weights are not FFN weights (get_spec_layer_idx_from_weight_name)
    mapper: str | None = None  # the class whose hf_to_vllm_mapper the FFN role loads with (else the model's)
    # vLLM classes the generated class reaches only through its vLLM base (``self.extract_moe_parameters``):
    # named so that ``patchkit deps`` sees them in ``simple``'s import block.
    base_members: tuple[str, ...] = ()

    @property
    def vllm_module(self) -> str:
        return f"vllm.model_executor.models.{self.module}"

    @property
    def ffn_classes(self) -> tuple[str, ...]:
        return tuple(c for c in (self.dense, self.moe) if c is not None)

    def names(self) -> tuple[str, ...]:
        """Every name of the vLLM module this row uses."""
        return (*(cls for _, cls in self.archs), *self.ffn_classes,
                *((self.mapper,) if self.mapper else ()), *self.base_members)


# family name (``family:<name>``, the feature the manifests scope a family's requirements to) -> row
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", (("AFDLlamaForCausalLM", "LlamaForCausalLM"),), dense="LlamaMLP",
                    dense_extra=(("bias", "mlp_bias", False),)),
    "qwen3": Family("qwen3", (("AFDQwen3ForCausalLM", "Qwen3ForCausalLM"),), dense="Qwen3MLP"),
    "qwen3_moe": Family("qwen3_moe", (("AFDQwen3MoeForCausalLM", "Qwen3MoeForCausalLM"),), dense="Qwen3MoeMLP",
                        moe="Qwen3MoeSparseMoeBlock", moe_layers="sparse_step", experts="copy"),
    "mixtral": Family("mixtral", (("AFDMixtralForCausalLM", "MixtralForCausalLM"),), moe="MixtralMoE",
                      moe_args="mixtral", ffn_attr="block_sparse_moe", experts="copy"),
    "glm4_moe": Family("glm4_moe", (("AFDGlm4MoeForCausalLM", "Glm4MoeForCausalLM"),), dense="Glm4MoeMLP",
                       moe="Glm4MoE", moe_layers="routed_after_first_k", moe_args="config_eplb",
                       config="hf_config", experts="adopt", skip_mtp=True, mapper="Glm4MoeModel",
                       base_members=("Glm4MixtureOfExperts",)),
    "bailing_moe": Family("bailing_moe", (("AFDBailingMoeForCausalLM", "BailingMoeForCausalLM"),
                                          ("AFDBailingMoeV2ForCausalLM", "BailingMoeV2ForCausalLM")),
                          dense="BailingMLP", moe="BailingMoE", moe_layers="first_k_dense", dense_args="bailing",
                          moe_args="bailing", config="hf_config", mapper="BailingMoeModel"),
}

# each name ``simple`` serves -> its family: the AFD architectures and the ``<FFN class>Proxy`` stand-ins
SERVED: dict[str, str] = {
    **{arch: name for name, row in FAMILIES.items() for arch, _ in row.archs},
    **{f"{cls}Proxy": name for name, row in FAMILIES.items() for cls in row.ffn_classes},
}


def family_name(class_ref: str) -> str:
    """The family of a manifest's ``module:Class`` model registration: the row that generates the class, or
    else the ``afd_patches.models`` module that holds it (``family:<name>`` is the feature name)."""
    module, _, qualname = class_ref.partition(":")
    if module == SIMPLE_MODULE and qualname in SERVED:
        return SERVED[qualname]
    return module.rpartition(".")[2]
