"""The drift lane (scripts/drift_lane.py): same verdicts as ``patchkit check``, a report, an exit code."""

from __future__ import annotations

import json
import shutil

import pytest

from harness.env import REPO
from patchkit.review.check import run_check
from scripts import drift_lane
from tests.patchkit.test_retarget import _wheel
from tests.support.drift_injection import DRIFTS, drifted_copy

M033 = REPO / "manifests" / "afd" / "vllm-0.33.yaml"


def test_newest_manifest_is_the_highest_pinned_release():
    assert drift_lane.newest_manifest(REPO / "manifests" / "afd") == REPO / "manifests" / "afd" / "vllm-0.34.yaml"


@pytest.mark.vllm
def test_lane_on_the_033_wheel_gives_the_verdicts_of_patchkit_check(tmp_path):
    wheel = str(_wheel("0.33.0"))
    code, report, results = drift_lane.run_lane(M033, [("0.33 wheel", wheel)], None)
    check_code, out = run_check(M033, wheel, fmt="json")
    expected = {e["id"]: (e["verdict"], e["fails"]) for e in json.loads(out)["entries"]}
    got = {e["id"]: (e["verdict"], e["fails"]) for e in results["0.33 wheel"]["entries"]}
    from patchkit import manifest

    committed = manifest.load(M033)
    assert got == expected and len(got) == len(committed.entries) + len(committed.requires)
    assert code == check_code == 0
    assert "## 0.33 wheel: vLLM 0.33.0 fits" in report
    out_file = tmp_path / "report.md"
    assert drift_lane.main(["--wheel", wheel, "--manifest", str(M033), "--report", str(out_file)]) == 0
    assert "vLLM 0.33.0 fits" in out_file.read_text()


@pytest.mark.vllm
def test_a_feature_the_manifest_refuses_on_its_own_release_is_not_drift(tmp_path):
    """A release file that keeps a feature's requirement whose target its own release lacks refuses that feature
    there (a copy of vllm-0.34.yaml with one such requirement). Against its own wheel that is no drift (exit 0, the
    refusal named); a feature refused only on the checked source would be (exit 1)."""
    folder = tmp_path / "afd"
    shutil.copytree(REPO / "manifests" / "afd", folder)
    m034 = folder / "vllm-0.34.yaml"
    text = m034.read_text()
    kept = ("  - target: vllm.v1.worker.ubatch_utils:gone_in_this_release\n    pin: exists\n"
            "    feature: micro-batches\n    why: kept on purpose while its release lacks it\n")
    m034.write_text(text.replace("\nrequires:\n", "\nrequires:\n" + kept, 1))
    wheel = str(_wheel("0.34.0"))
    assert drift_lane.refused_on_own_release(m034, wheel) == {"micro-batches"}
    code, report, _ = drift_lane.run_lane(m034, [("0.34 wheel", wheel)], wheel, {"micro-batches"})
    assert code == 0 and "vLLM 0.34.0 fits" in report and "`micro-batches` (as on its own release)" in report
    assert drift_lane.run_lane(m034, [("0.34 wheel", wheel)], wheel)[0] == 1


def test_lane_reports_drift_with_exit_1_and_names_it(tmp_path):
    tree = drifted_copy(tmp_path / "tree", ["kwarg"])
    out_file = tmp_path / "report.md"
    manifest = REPO / "manifests" / "afd" / "vllm-0.32.yaml"
    code = drift_lane.main(["--wheel", str(tree), "--manifest", str(manifest), "--base", "installed",
                            "--report", str(out_file)])
    report = out_file.read_text()
    assert code == 1
    assert "**DRIFTED**" in report and f"`require:{DRIFTS['kwarg'].requirement}`" in report
    assert "```diff" in report  # the source diff against the base tree


def test_lane_with_nothing_checkable_exits_2(tmp_path):
    out_file = tmp_path / "report.md"
    assert drift_lane.main(["--wheel", str(tmp_path / "missing.whl"), "--report", str(out_file)]) == 2
    assert "Could not be checked" in out_file.read_text()
