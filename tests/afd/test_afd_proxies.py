"""The attention role's FFN proxies (``afd_patches.models.ffn_proxy``); the rebinding that makes vLLM build
them is a manifest entry (``op: scoped-rebind``), tested in tests/patchkit/test_scoped_rebind.py.

Fakes stand in for vLLM's FFN classes and for a model module's globals; the
real construction on vLLM is ``tests/integration/test_afd_construction.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from afd_patches.models.ffn_proxy import AfdFfnProxy, building, building_attention_model, proxy_type
from afd_patches.models.link import AfdLink


class FakeMlp(nn.Module):
    """Allocates a parameter when really constructed (a proxy must never do that)."""

    def __init__(self, hidden_size: int, prefix: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, hidden_size))


class FakeMoe(nn.Module):
    def __init__(self, *, config: object, prefix: str = "") -> None:
        super().__init__()
        self.experts = nn.Linear(2, 2)


def test_proxies_are_parameter_free_instances_of_the_class_they_stand_in_for() -> None:
    link = AfdLink(2, 4)
    proxies = {FakeMlp: proxy_type(FakeMlp), FakeMoe: proxy_type(FakeMoe, moe=True)}
    assert not building_attention_model()
    with building(link):  # what AfdCausalLMMixin does around vLLM's __init__ on the attention role
        assert building_attention_model("any", arguments=True)
        dense = proxies[FakeMlp](4, prefix="model.layers.0.mlp")
        moe = proxies[FakeMoe](config=None, prefix="model.layers.1.mlp")
    assert not building_attention_model()
    assert isinstance(dense, FakeMlp) and isinstance(moe, FakeMoe)
    assert isinstance(dense, AfdFfnProxy) and (dense.layer, moe.layer) == (0, 1)
    assert list(dense.parameters()) == list(moe.parameters()) == []
    assert moe.experts is None and moe.n_logical_experts == 0 and not hasattr(dense, "n_logical_experts")
    assert proxy_type(FakeMlp) is proxies[FakeMlp]


def test_the_building_mark_is_cleared_when_construction_fails() -> None:
    with pytest.raises(ValueError, match="boom"), building(AfdLink()):
        raise ValueError("boom")
    assert not building_attention_model()


def test_a_proxy_outside_an_attention_build_or_without_a_layer_prefix_is_refused() -> None:
    with pytest.raises(RuntimeError, match="only while an AFD attention-role model is built"):
        proxy_type(FakeMlp)(4, prefix="model.layers.0.mlp")
    with building(AfdLink()), pytest.raises(RuntimeError, match="names no decoder layer"):
        proxy_type(FakeMlp)(4, prefix="model.shared.mlp")


def test_exchange_slots_give_each_ffn_module_of_a_layer_its_own_exchange_index() -> None:
    """LongCat-Flash's layout: ``mlp``, ``mlps.0``, ``mlps.1`` per layer, exchanged in that order as
    ``3 * layer + k``; an idle step sends every index once; a module outside the slots is refused."""
    slots = ("mlp", "mlps.0", "mlps.1")
    link = AfdLink(2, 4, slots=slots)
    with building(link):
        built = {(layer, path): (proxy_type(FakeMoe, moe=True)(config=None, prefix=f"model.layers.{layer}.{path}")
                                 if path == "mlp" else proxy_type(FakeMlp)(4, prefix=f"model.layers.{layer}.{path}"))
                 for layer in range(2) for path in slots}
        with pytest.raises(ValueError, match="not one of"):
            proxy_type(FakeMlp)(4, prefix="model.layers.0.shared_mlp")
    assert [built[layer, path].layer for layer in range(2) for path in slots] == list(range(6))
    assert link.num_exchanges == 6

    sent: list[tuple[int, torch.Tensor]] = []  # a connector that answers every exchange with its input
    link.connector = SimpleNamespace(  # type: ignore[assignment]
        send_attn_output=lambda hidden, layer, step, microbatch=0: sent.append((layer, hidden)),
        recv_ffn_output=lambda layer, step, microbatch=0: sent[-1][1])
    assert link.try_idle_step(0.0) and [layer for layer, _ in sent] == list(range(6))


def test_without_slots_a_module_nested_under_a_layer_names_no_decoder_layer() -> None:
    with building(AfdLink(2, 4)), pytest.raises(RuntimeError, match="names no decoder layer"):
        proxy_type(FakeMlp)(4, prefix="model.layers.0.mlps.0")


def test_cuda_and_cpu_role_workers_leave_model_construction_to_the_model() -> None:
    """Import check of the CUDA workers: neither kind builds the model itself, so both get the same role split
    (vLLM's model runner builds the AFD model class through its model loader on either device)."""
    from afd_patches.workers import attention, cpu, cuda, ffn

    for worker in (cuda.CudaAttentionWorker, cpu.CpuAttentionWorker):
        assert worker.load_model is attention.AttentionRoleMixin.load_model
    for worker in (cuda.CudaFfnWorker, cpu.CpuFfnWorker):
        assert worker.load_model is ffn.FfnRoleMixin.load_model
