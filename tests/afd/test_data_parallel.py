"""``afd_patches.patches.data_parallel``: AFD attention ranks from vLLM's data-parallel ranks (no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from afd_patches import AfdConfigError
from afd_patches.config import AfdConfig
from afd_patches.patches.data_parallel import (
    attention_config,
    check_front_end,
    started_dp_ranks,
    vllm_keeps_lockstep,
)


def _args(size: int = 1, rank: int | None = None, start: int | None = None,
          local: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(data_parallel_size=size, data_parallel_rank=rank, data_parallel_start_rank=start,
                           data_parallel_size_local=local)


def _vllm_config(index: int, size: int = 1) -> SimpleNamespace:
    return SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=index, data_parallel_size=size))


def test_started_ranks_internal_hybrid_and_external() -> None:
    assert started_dp_ranks(_args()) == [0]
    assert started_dp_ranks(_args(4)) == [0, 1, 2, 3]
    assert started_dp_ranks(_args(4, start=2, local=2)) == [2, 3]
    assert started_dp_ranks(_args(4, rank=3)) == [3]


def test_without_dp_the_config_is_untouched() -> None:
    raw = {"role": "attention", "rank": 1, "num_attention_ranks": 2}
    assert check_front_end(_args(), raw) is raw


def test_num_attention_ranks_defaults_to_dp_size() -> None:
    assert check_front_end(_args(2), {"role": "attention"})["num_attention_ranks"] == 2


def test_a_rank_that_is_the_engines_dp_rank_is_kept() -> None:
    assert check_front_end(_args(2, rank=1), {"role": "attention", "rank": 1})["rank"] == 1  # external LB


@pytest.mark.parametrize("raw,match", [
    ({"role": "attention", "num_attention_ranks": 3}, r"num-attention-ranks.*3 disagrees with --data-parallel-size 2"),
    # a given rank must be every started engine's DP rank: rank 0 is fine for engine 0 only
    ({"role": "attention", "rank": 1}, r"--afd-rank .* 1 disagrees with vLLM's data-parallel rank 0"),
    ({"role": "attention", "rank": 0}, r"0 disagrees with vLLM's data-parallel rank 1"),
    ({"role": "ffn"}, "FFN role does not run as vLLM data-parallel engines"),
    ({"role": "attention", "connector_extra_config": {"micro_batches": 2}},
     r'\["micro_batches"\] 2 with --data-parallel-size 2'),
])
def test_the_front_end_refuses_under_dp_naming_the_key(raw: dict, match: str) -> None:
    with pytest.raises(AfdConfigError, match=match):
        check_front_end(_args(2), raw)
    assert check_front_end(_args(), raw) is raw  # without DP the same config is untouched


def test_engine_rank_comes_from_the_dp_rank() -> None:
    cfg = AfdConfig(role="attention", num_attention_ranks=2)
    assert attention_config(_vllm_config(0), cfg).rank == 0
    assert attention_config(_vllm_config(1), cfg).rank == 1
    # index 0 is also "no data parallelism" (today's one-server-per-rank form keeps its --afd-rank)
    assert attention_config(_vllm_config(0), AfdConfig(role="attention", num_attention_ranks=2, rank=1)).rank == 1
    with pytest.raises(AfdConfigError, match=r"rank.. 1 disagrees with vLLM's data-parallel rank 2"):
        attention_config(_vllm_config(2), AfdConfig(role="attention", num_attention_ranks=4, rank=1))
    with pytest.raises(AfdConfigError, match="data-parallel rank 2 is out of range for 2"):
        attention_config(_vllm_config(2), cfg)


def test_lockstep_only_where_the_worker_still_sees_dp() -> None:
    assert vllm_keeps_lockstep(_vllm_config(1, size=2))  # MoE: coupled DP group
    assert not vllm_keeps_lockstep(_vllm_config(1, size=1))  # dense: reconfigured as independent DP=1
