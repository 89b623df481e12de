"""``afd_patches.models.deepseek_v2`` without running an engine: class shape, FFN-weight filter, name mapping.

Imports vLLM's DeepSeek-V2 module (vLLM must be installed); builds
no model. The token-exact run against plain vLLM is
``tests/integration/test_afd_e2e.py::test_afd_1a1f_matches_plain_vllm[deepseek_v2-batched]``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2ForCausalLM,
    DeepseekV2MLP,
    DeepseekV3ForCausalLM,
)

from afd_patches.models.causal_lm import AfdCausalLMMixin
from afd_patches.models.deepseek_v2 import (
    _FFN_STACKED,
    AFDDeepseekV2ForCausalLM,
    AFDDeepseekV3ForCausalLM,
    DeepseekV2MLPProxy,
    is_moe_layer,
)
from afd_patches.models.ffn_proxy import AfdFfnProxy, building
from afd_patches.models.link import AfdLink


def _bare(cls: type, **config: object) -> AfdCausalLMMixin:
    """An instance with only ``config`` set (no vLLM config, no layers)."""
    obj = cls.__new__(cls)
    torch.nn.Module.__init__(obj)
    obj.config = SimpleNamespace(**config)
    return obj


def test_mro_puts_the_mixin_before_vllm() -> None:
    mro = AFDDeepseekV2ForCausalLM.__mro__
    assert mro.index(AfdCausalLMMixin) < mro.index(DeepseekV2ForCausalLM)
    mro3 = AFDDeepseekV3ForCausalLM.__mro__
    assert mro3.index(AFDDeepseekV2ForCausalLM) < mro3.index(AfdCausalLMMixin) < mro3.index(DeepseekV3ForCausalLM)
    assert mro3.index(DeepseekV3ForCausalLM) < mro3.index(DeepseekV2ForCausalLM)
    assert AFDDeepseekV2ForCausalLM.afd_ffn_attr == "mlp" and AFDDeepseekV2ForCausalLM.afd_needs_forward_context


def test_ffn_weight_filter_on_checkpoint_names() -> None:
    model = _bare(AFDDeepseekV2ForCausalLM, num_hidden_layers=2, num_nextn_predict_layers=1)
    ffn = [
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.experts.3.up_proj.weight",
        "model.layers.1.mlp.shared_experts.down_proj.weight",
    ]
    other = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.1.self_attn.kv_b_proj.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.2.mlp.experts.0.gate_proj.weight",  # MTP layer: vLLM skips it for the main model
        "model.layers.2.mlp.shared_experts.up_proj.weight",
    ]
    assert [n for n in ffn + other if model.afd_is_ffn_weight(n)] == ffn


def test_ffn_weight_filter_without_mtp_layers() -> None:
    model = _bare(AFDDeepseekV2ForCausalLM, num_hidden_layers=2)
    assert model.afd_is_ffn_weight("model.layers.2.mlp.gate.weight")  # no MTP: plain layer-name rule


def test_ffn_name_mapping_stacks_dense_and_shared_but_not_experts() -> None:
    shared = "model.layers.1.mlp.shared_experts"
    cases = {
        "model.layers.0.mlp.gate_proj.weight": ("model.layers.0.mlp.gate_up_proj.weight", 0),
        "model.layers.0.mlp.up_proj.weight": ("model.layers.0.mlp.gate_up_proj.weight", 1),
        "model.layers.0.mlp.down_proj.weight": ("model.layers.0.mlp.down_proj.weight", None),
        f"{shared}.gate_proj.weight": (f"{shared}.gate_up_proj.weight", 0),
        f"{shared}.up_proj.weight": (f"{shared}.gate_up_proj.weight", 1),
        "model.layers.1.mlp.gate.weight": ("model.layers.1.mlp.gate.weight", None),
        "model.layers.1.mlp.experts.2.gate_proj.weight": ("model.layers.1.mlp.experts.2.gate_proj.weight", None),
    }
    for name, (mapped, shard) in cases.items():
        got = list(_FFN_STACKED.apply([(name, torch.zeros(1))]))
        assert [n for n, _ in got] == [mapped], name
        assert getattr(got[0][1], "shard_id", None) == shard, name


def test_moe_layer_rule() -> None:
    cfg = SimpleNamespace(n_routed_experts=4, first_k_dense_replace=1, moe_layer_freq=1)
    assert [is_moe_layer(cfg, i) for i in range(3)] == [False, True, True]
    assert [is_moe_layer(SimpleNamespace(**{**vars(cfg), "moe_layer_freq": 2}), i) for i in range(4)] == [
        False, False, True, False]
    assert not is_moe_layer(SimpleNamespace(**{**vars(cfg), "n_routed_experts": None}), 3)


class _Loopback:
    """A connector that answers each layer with ``2 * hidden``."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def send_attn_output(self, hidden: torch.Tensor, layer: int, step: int, microbatch: int = 0) -> None:
        self.sent.append(layer)
        self.last = hidden

    def recv_ffn_output(self, layer: int, step: int, microbatch: int = 0) -> torch.Tensor:
        return self.last * 2


def test_dense_proxy_is_a_parameter_free_deepseek_mlp() -> None:
    link = AfdLink(2, 4)
    link.connector = _Loopback()  # type: ignore[assignment]
    with building(link):  # as while the scoped-rebind entry afd.deepseek-v2.ffn-proxies has it bound
        proxy = DeepseekV2MLPProxy(hidden_size=4, intermediate_size=8, hidden_act="silu",
                                   quant_config=None, prefix="model.layers.0.mlp")
    assert isinstance(proxy, DeepseekV2MLP) and isinstance(proxy, AfdFfnProxy) and proxy.layer == 0
    assert list(proxy.parameters()) == [] and list(proxy.children()) == []
    x = torch.ones(3, 4)
    assert torch.equal(proxy(x), 2 * x)
    assert link.exchanges == 1 and link.connector.sent == [0]  # type: ignore[union-attr]
