"""The attention role's FFN proxies and the construction-time rebinding (``afd_patches.models.common``).

Fakes stand in for vLLM's FFN classes and for a model module's globals; the
real construction on vLLM is ``tests/integration/test_afd_construction.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from afd_patches.models.common import AfdFfnProxy, AfdLink, _ffn_classes_rebound, proxy_type


class FakeMlp(nn.Module):
    """Allocates a parameter when really constructed (a proxy must never do that)."""

    def __init__(self, hidden_size: int, prefix: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, hidden_size))


class FakeMoe(nn.Module):
    def __init__(self, *, config: object, prefix: str = "") -> None:
        super().__init__()
        self.experts = nn.Linear(2, 2)


def _namespace() -> dict[str, object]:
    return {"__name__": "fake_model", "FakeMlp": FakeMlp, "AliasMoe": FakeMoe, "other": 1}


def test_rebound_names_build_parameter_free_proxies_then_are_restored() -> None:
    link = AfdLink(2, 4)
    namespace = _namespace()
    proxies = {FakeMlp: proxy_type(FakeMlp), FakeMoe: proxy_type(FakeMoe, moe=True)}
    with _ffn_classes_rebound(namespace, proxies, link):
        dense = namespace["FakeMlp"](4, prefix="model.layers.0.mlp")
        moe = namespace["AliasMoe"](config=None, prefix="model.layers.1.mlp")
        assert isinstance(moe, namespace["AliasMoe"])  # vLLM's own isinstance checks see the proxy type
    assert namespace == _namespace()
    assert isinstance(dense, FakeMlp) and isinstance(moe, FakeMoe)
    assert isinstance(dense, AfdFfnProxy) and (dense.layer, moe.layer) == (0, 1)
    assert list(dense.parameters()) == list(moe.parameters()) == []
    assert moe.experts is None and moe.n_logical_experts == 0 and not hasattr(dense, "n_logical_experts")
    assert proxy_type(FakeMlp) is proxies[FakeMlp]


def test_names_are_restored_when_construction_fails() -> None:
    namespace = _namespace()
    with pytest.raises(ValueError, match="boom"), _ffn_classes_rebound(namespace, {FakeMlp: proxy_type(FakeMlp)},
                                                                        AfdLink()):
        raise ValueError("boom")
    assert namespace == _namespace()


def test_a_module_that_no_longer_names_an_ffn_class_is_refused() -> None:
    namespace = _namespace()
    del namespace["FakeMlp"]
    with pytest.raises(RuntimeError, match="fake_model no longer names FakeMlp"), \
            _ffn_classes_rebound(namespace, {FakeMlp: proxy_type(FakeMlp)}, AfdLink()):
        pass


def test_a_proxy_outside_an_attention_build_or_without_a_layer_prefix_is_refused() -> None:
    with pytest.raises(RuntimeError, match="only while an AFD attention-role model is built"):
        proxy_type(FakeMlp)(4, prefix="model.layers.0.mlp")
    namespace = _namespace()
    with _ffn_classes_rebound(namespace, {FakeMlp: proxy_type(FakeMlp)}, AfdLink()), \
            pytest.raises(RuntimeError, match="names no decoder layer"):
        namespace["FakeMlp"](4, prefix="model.shared.mlp")


def test_cuda_and_cpu_role_workers_leave_model_construction_to_the_model() -> None:
    """Import check of the CUDA workers: neither kind builds the model itself, so both get the same role split
    (vLLM's model runner builds the AFD model class through its model loader on either device)."""
    from afd_patches.workers import common, cpu, cuda

    for worker in (cuda.CudaAttentionWorker, cpu.CpuAttentionWorker):
        assert worker.load_model is common.AttentionRoleMixin.load_model
    for worker in (cuda.CudaFfnWorker, cpu.CpuFfnWorker):
        assert worker.load_model is common.FfnRoleMixin.load_model
