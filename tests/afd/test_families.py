"""``afd_patches.models.families`` (the simple families as data) and ``simple`` (their generated classes),
without vLLM: the table against the manifest and against ``simple``'s import block, the family names the
features use, and the layer rules and ways of building that mirror vLLM's decoder layers."""

from __future__ import annotations

import ast
from types import SimpleNamespace

import pytest
import yaml

from afd_patches.models import families, simple
from afd_patches.models.families import FAMILIES, SERVED, SIMPLE_MODULE, family_name
from harness.env import REPO

BASE = yaml.safe_load((REPO / "manifests" / "afd" / "base.yaml").read_text())


def _type_checking_imports() -> set[tuple[str, str]]:
    """(module, name) of every import in ``simple``'s ``if TYPE_CHECKING:`` block."""
    tree = ast.parse((REPO / "afd_patches" / "models" / "simple.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    return {(n.module, a.name) for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}


def test_the_import_block_names_exactly_what_the_rows_hold():
    """``patchkit deps`` reads imports, not strings: the block is what keeps every row's vLLM name declared."""
    wanted = {(row.vllm_module, name) for row in FAMILIES.values() for name in row.names()}
    assert _type_checking_imports() == wanted


def test_every_served_name_is_in_the_manifest_and_every_simple_ref_is_served():
    models = {m["arch"]: m["class"] for m in BASE["models"]}
    binds = {ref for p in BASE["patches"] for ref in (p.get("bind") or {}).values()}
    served_refs = {f"{SIMPLE_MODULE}:{name}" for name in SERVED}
    assert served_refs == {ref for ref in [*models.values(), *binds] if ref.startswith(SIMPLE_MODULE + ":")}
    for name, row in FAMILIES.items():
        for arch, _ in row.archs:
            assert models[arch] == f"{SIMPLE_MODULE}:{arch}"
            assert family_name(models[arch]) == name


def test_each_models_feature_is_its_family():
    """The runtime reads a model's family from its registration's ``feature`` (``engine_config.family_of``): it
    must be ``family:<name>`` of the table row or module that holds the class."""
    for m in BASE["models"]:
        assert m["feature"] == f"family:{family_name(m['class'])}", m


def test_each_name_is_served_once_and_every_keyword_is_known():
    assert len(SERVED) == sum(len(r.archs) + len(r.ffn_classes) for r in FAMILIES.values())
    for row in FAMILIES.values():
        assert row.moe_layers in simple.MOE_LAYERS
        assert {row.dense_args, row.moe_args} <= set(simple.BUILDERS)
        assert row.experts in ("", "copy", "adopt")
        assert row.config in ("hf_config", "hf_text_config")
        assert row.moe is not None or row.dense is not None


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        simple.Nope  # noqa: B018
    assert not hasattr(families, "AFDLlamaForCausalLM")


@pytest.mark.parametrize("rule,fields,layers,expected", [
    ("sparse_step", {"num_experts": 4, "decoder_sparse_step": 1}, 3, [True, True, True]),
    ("sparse_step", {"num_experts": 4, "decoder_sparse_step": 2, "mlp_only_layers": [1]}, 4,
     [False, False, False, True]),
    ("sparse_step", {"num_experts": 0, "decoder_sparse_step": None}, 2, [False, False]),
    ("first_k_dense", {"first_k_dense_replace": 1}, 3, [False, True, True]),
    ("routed_after_first_k", {"first_k_dense_replace": 1, "n_routed_experts": 8}, 3, [False, True, True]),
    ("routed_after_first_k", {"first_k_dense_replace": 0, "n_routed_experts": None}, 2, [False, False]),
    ("every", {}, 2, [True, True]),
])
def test_moe_layer_rules(rule, fields, layers, expected):
    assert [simple.MOE_LAYERS[rule](SimpleNamespace(**fields), i) for i in range(layers)] == expected


def _recorder():
    calls = []

    def cls(*args, **kwargs):
        calls.append((args, kwargs))
        return "built"

    return cls, calls


def test_builders_pass_what_the_decoder_layers_pass():
    config = SimpleNamespace(hidden_size=8, intermediate_size=16, hidden_act="silu", num_local_experts=4,
                             num_experts_per_tok=2, mlp_bias=True)
    vllm_config = SimpleNamespace(quant_config="q", parallel_config=SimpleNamespace(enable_eplb=False),
                                  model_config=SimpleNamespace(hf_text_config=config, hf_config=config))
    cls, calls = _recorder()
    simple.BUILDERS["dense_mlp"](cls, vllm_config, config, "p", FAMILIES["llama"])
    simple.BUILDERS["vllm_config"](cls, vllm_config, config, "p", FAMILIES["qwen3_moe"])
    simple.BUILDERS["config_eplb"](cls, vllm_config, config, "p", FAMILIES["glm4_moe"])
    simple.BUILDERS["mixtral"](cls, vllm_config, config, "p", FAMILIES["mixtral"])
    simple.BUILDERS["bailing"](cls, vllm_config, config, "p", FAMILIES["bailing_moe"])
    assert calls == [
        ((), {"hidden_size": 8, "intermediate_size": 16, "hidden_act": "silu", "quant_config": "q", "prefix": "p",
              "bias": True}),
        ((), {"vllm_config": vllm_config, "prefix": "p"}),
        ((), {"config": config, "quant_config": "q", "prefix": "p", "enable_eplb": False}),
        ((), {"num_experts": 4, "top_k": 2, "hidden_size": 8, "intermediate_size": 16, "quant_config": "q",
              "prefix": "p", "enable_eplb": False}),
        ((16, config, "q", True), {"prefix": "p"}),
    ]
