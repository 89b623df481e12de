"""AFD's compilation rules (afd_patches/patches/compilation.py) on vLLM's real config objects.

The CUDA branch is exercised here with ``cuda=True`` on vLLM's own ``CompilationConfig``: what
vLLM then does with it on a GPU is scripts/gpu_check's job (its ``piecewise`` check).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

from afd_patches.models.exchange_op import OP_NAME
from afd_patches.patches.compilation import AfdCompilationError, after_config, before_config


def _args(enforce_eager: bool = False, **compilation: object) -> SimpleNamespace:
    return SimpleNamespace(enforce_eager=enforce_eager, compilation_config=CompilationConfig(**compilation))


@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "FULL", "FULL_AND_PIECEWISE"])
@pytest.mark.parametrize("cuda", [True, False])
def test_full_cuda_graphs_are_refused_on_the_attention_role(mode: str, cuda: bool) -> None:
    with pytest.raises(AfdCompilationError, match=f"cudagraph_mode={mode}: full CUDA graphs .*PIECEWISE"):
        before_config(_args(cudagraph_mode=mode), "attention", cuda)


def test_attention_on_cuda_defaults_to_piecewise_graphs_and_keeps_explicit_choices() -> None:
    args = _args()
    before_config(args, "attention", cuda=True)
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    for mode in ("NONE", "PIECEWISE"):
        args = _args(cudagraph_mode=mode)
        before_config(args, "attention", cuda=True)
        assert args.compilation_config.cudagraph_mode == CUDAGraphMode[mode]


@pytest.mark.parametrize("role,cuda,eager", [("attention", False, False), ("ffn", True, False),
                                              ("attention", True, True)])
def test_nothing_changes_off_cuda_on_the_ffn_role_or_when_eager(role: str, cuda: bool, eager: bool) -> None:
    args = _args(enforce_eager=eager, cudagraph_mode="FULL_DECODE_ONLY" if role == "ffn" or eager else None)
    before = args.compilation_config.cudagraph_mode
    before_config(args, role, cuda)
    assert args.compilation_config.cudagraph_mode == before


def test_piecewise_compilation_splits_at_the_exchange_next_to_vllms_attention_ops() -> None:
    compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    compilation.set_splitting_ops_for_v1(all2all_backend="naive")
    vllm_ops = list(compilation.splitting_ops)
    assert vllm_ops and OP_NAME not in vllm_ops
    config = SimpleNamespace(compilation_config=compilation)
    after_config(config, "attention")
    after_config(config, "attention")  # idempotent
    assert compilation.splitting_ops == [*vllm_ops, OP_NAME]
    assert compilation.splitting_ops_contain_attention()
    ffn = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    ffn.set_splitting_ops_for_v1(all2all_backend="naive")
    after_config(SimpleNamespace(compilation_config=ffn), "ffn")
    assert OP_NAME not in ffn.splitting_ops


def test_full_graphs_vllm_chose_itself_are_refused_after_the_config() -> None:
    compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode="FULL")
    compilation.set_splitting_ops_for_v1(all2all_backend="naive")
    with pytest.raises(AfdCompilationError, match=r"cudagraph_mode=FULL \(set by vLLM while building the config\)"):
        after_config(SimpleNamespace(compilation_config=compilation), "attention")
    after_config(SimpleNamespace(compilation_config=compilation), "ffn")  # the FFN role captures nothing


def test_cpu_default_mode_needs_no_split() -> None:
    compilation = CompilationConfig(mode=CompilationMode.DYNAMO_TRACE_ONCE)
    compilation.set_splitting_ops_for_v1(all2all_backend="naive")
    after_config(SimpleNamespace(compilation_config=compilation), "attention")
    assert compilation.splitting_ops == []
