"""``requires:``: the manifest format, pins, and injected drift seen by check, retarget and the verdict.

The drift tests copy the installed vLLM tree (tests/support/drift_injection.py) and change one
required symbol per kind; the run-time half (AFD refused, plain generation unaffected)
is in tests/integration/test_requirements_runtime.py.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from harness.env import REPO
from patchkit import ManifestError, fingerprint, manifest
from patchkit.judge import judge
from patchkit.manifest.select import judged
from patchkit.review.check import run_check
from patchkit.review.diff import diff_manifests, render
from patchkit.review.retarget import retarget_text
from patchkit.static import open_tree
from tests.support.drift_injection import DRIFTS, drifted_copy

M032 = REPO / "manifests" / "afd" / "vllm-0.32.yaml"
BASE = REPO / "manifests" / "afd" / "base.yaml"  # what vllm-0.32.yaml extends
FP = "ast1:0123456789abcdef:fedcba9876543210"


def _doc(requires: str) -> str:
    return textwrap.dedent("""\
        format: 1
        plugin: demo
        packages: [demo_patches]
        vllm: {version: "==0.32.0"}
        requires:
        """) + textwrap.indent(textwrap.dedent(requires), "  ") + textwrap.dedent("""\
        features:
          afd: {without: run without AFD}
          micro-batches: {without: set micro_batches to 1}
          family:llama: {without: serve another family}
        """)


def requirement_verdicts(loaded: manifest.Manifest, src: str) -> list:
    """The verdict's rows of ``loaded``'s requirements against the tree ``src``."""
    return [m for m in judged(loaded, src).members if m.kind == "require"]


@pytest.mark.parametrize("requires,needle", [
    (f'- {{target: "vllm.x:Y", pin: always, fingerprint: "{FP}", why: w}}\n', "requires[0].pin"),
    ("- {target: vllm.x:Y, pin: signature, why: w}\n", "pin 'signature' needs a 'fingerprint'"),
    ("- {target: vllm.x:Y, pin: exists, why: w}\n- {target: vllm.x:Y, pin: exists, why: v}\n",
     "duplicate requirement 'vllm.x:Y'"),
    ("- {target: vllm.x:Y, pin: exists}\n", "requires[0]: 'why' is required"),
    ("- {target: not a ref, pin: exists, why: w}\n", "requires[0].target"),
])
def test_bad_requirement_is_named_with_file_and_line(requires, needle):
    with pytest.raises(ManifestError) as err:
        manifest.parse(_doc(requires), "m.yaml")
    text = str(err.value)
    assert needle in text, text
    assert "m.yaml:6" in text or "m.yaml:7" in text, text


def test_requirement_defaults_and_fields():
    m = manifest.parse(_doc(f'- {{target: "vllm.x:Y.__init__", pin: signature, fingerprint: "{FP}", why: w}}\n'
                            "- {target: vllm.x:Z, pin: exists, indirect: true, on_drift: warn, why: v}\n"),
                       "m.yaml")
    first, second = m.requires
    assert (first.op, first.id, first.pin, first.on_drift, first.indirect) == (
        "require", "require:vllm.x:Y.__init__", "signature", "fail", False)
    assert (second.pin, second.on_drift, second.indirect, second.fingerprint) == ("exists", "warn", True, None)
    assert m.entries == ()  # requirements are never applied


def test_pins_compare_the_parts_they_name():
    sig_changed = "ast1:1111111111111111:fedcba9876543210"
    body_changed = "ast1:0123456789abcdef:2222222222222222"
    assert fingerprint.compare_pinned("exists", FP, sig_changed) == "match"
    assert fingerprint.compare_pinned("signature", FP, body_changed) == "match"
    assert fingerprint.compare_pinned("signature", FP, sig_changed) == "drifted:signature"
    assert fingerprint.compare_pinned("full", FP, body_changed) == "drifted:body"
    assert fingerprint.compare_pinned("full", FP, FP) == "match"


def test_installed_tree_meets_every_requirement_of_its_manifest():
    loaded = manifest.load(M032)
    verdicts = requirement_verdicts(loaded, "installed")
    assert len(verdicts) == len(loaded.requires) >= 20
    assert [(v.id, v.reason) for v in verdicts if v.verdict != "ok"] == []
    assert all(v.where and ".py:" in v.where for v in verdicts)


@pytest.fixture(scope="module")
def drifted_trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {kind: drifted_copy(tmp_path_factory.mktemp(f"vllm-{kind}"), [kind]) for kind in DRIFTS}


@pytest.mark.parametrize("kind", sorted(DRIFTS))
def test_check_fails_naming_the_drifted_requirement(drifted_trees, kind):
    drift = DRIFTS[kind]
    code, out = run_check(M032, str(drifted_trees[kind]), base_src="installed")
    # a feature's members do not fail the check, unless the feature is required (afd: AFD itself); ``removed``
    # also breaks the qwen3-moe proxies patch, a member of family:qwen3_moe too
    assert code == (1 if drift.feature == "afd" else 0), out
    line = next(ln for ln in out.splitlines() if f"requires {drift.requirement} " in ln)
    assert line.endswith(f"-> {drift.verdict}"), line
    assert line.startswith("[feature-off]") and f"feature {drift.feature})" in line, line
    refused = next(ln for ln in out.splitlines() if ln.startswith(f"feature {drift.feature} refused on this tree"))
    assert f"require:{drift.requirement}" in refused, refused
    assert f"--- base/{drift.requirement}" in out  # with --base: the source diff of the drifted symbol
    if kind == "removed":
        assert "+++ new/(absent)" in out


@pytest.mark.parametrize("kind", sorted(DRIFTS))
def test_retarget_flags_the_drifted_requirement(drifted_trees, kind):
    drift = DRIFTS[kind]
    result = retarget_text(M032.read_text(), str(M032), open_tree(str(drifted_trees[kind])))
    flagged = {d.entry_id: d for d in result.needs_review}
    decision = flagged[f"require:{drift.requirement}"]
    assert decision.verdict == drift.verdict
    lines = result.text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.strip() == f"- target: {drift.requirement}")
    block = "\n".join(lines[at:at + 4])
    assert f"# REVIEW: {drift.verdict}" in block, block


@pytest.mark.parametrize("kind", sorted(DRIFTS))
def test_runtime_verdicts_name_the_drifted_requirement(drifted_trees, kind):
    drift = DRIFTS[kind]
    verdicts = {v.target: v for v in requirement_verdicts(manifest.load(M032), str(drifted_trees[kind]))}
    v = verdicts[drift.requirement]
    assert v.verdict == drift.verdict and v.fails and v.feature == drift.feature
    assert drift.verdict in v.reason


def _release_with_base(tmp_path: Path, base_text: str) -> Path:
    """A copy of vllm-0.32.yaml in ``tmp_path`` that extends ``base_text`` (an edited base.yaml)."""
    (tmp_path / "base.yaml").write_text(base_text)
    path = tmp_path / M032.name
    path.write_text(M032.read_text())
    return path


def test_warn_requirement_is_reported_but_does_not_fail(drifted_trees, tmp_path):
    text = BASE.read_text()
    for target in ("LlamaMLP.__init__", "LlamaDecoderLayer.__init__"):
        # the drift renames a keyword of LlamaMLP and, so, the call site in LlamaDecoderLayer.__init__
        entry = f"  - target: vllm.model_executor.models.llama:{target}\n"
        assert entry in text
        text = text.replace(entry, entry + "    on_drift: warn\n")
    path = _release_with_base(tmp_path, text)
    code, out = run_check(path, str(drifted_trees["kwarg"]))
    assert code == 0, out
    assert "[warn] requires vllm.model_executor.models.llama:LlamaMLP.__init__ (pin signature, feature afd)" in out
    assert ("[warn] requires vllm.model_executor.models.llama:LlamaDecoderLayer.__init__ (pin full, feature "
            "family:llama)") in out
    v = next(v for v in requirement_verdicts(manifest.load(path), str(drifted_trees["kwarg"]))
             if v.target.endswith("LlamaMLP.__init__"))
    assert v.verdict == "drifted: signature" and not v.fails


def test_unreadable_tree_refuses_the_plugin_naming_why(tmp_path):
    verdict = judged(manifest.load(M032), str(tmp_path / "absent"))
    assert not verdict.holds
    assert "the vLLM tree cannot be read" in (verdict.refusal() or ""), verdict.refusal()


def test_diff_lists_requirement_changes(tmp_path):
    old = manifest.load(M032)
    text = BASE.read_text()
    start = text.index("  - target: vllm.model_executor.models.utils:PPMissingLayer")
    end = text.index("  - target:", start + 5)
    new = manifest.load(_release_with_base(tmp_path, text[:start] + text[end:]))
    changes = diff_manifests(old, new)
    assert [(c.section, c.kind, c.subject) for c in changes] == [
        ("requires", "removed", "vllm.model_executor.models.utils:PPMissingLayer")]
    assert "- requires vllm.model_executor.models.utils:PPMissingLayer: pin exists" in render(
        changes, "text", "old", "new")


# -- requirements scoped to a feature (issue 36 item 3): a synthetic vLLM tree and the afd wiring --

FEATURED_TREE = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '0.27.1'\n",
    "vllm/runner.py": "class Runner:\n    def step(self):\n        return 1\n",
}


def _featured(tmp_path: Path) -> tuple[Path, Path]:
    """(manifest, tree): one plain requirement the tree meets, one of ``micro-batches`` it lacks, one of
    ``family:llama`` it meets."""
    tree = tmp_path / "tree"
    for rel, text in FEATURED_TREE.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    path = tmp_path / "m.yaml"
    path.write_text(_doc("""\
        - {target: "vllm.runner:Runner.step", pin: exists, why: AFD itself calls it}
        - {target: "vllm.runner:Runner._allow_microbatching", pin: exists, feature: micro-batches, why: the veto}
        - {target: "vllm.runner:Runner", pin: exists, feature: "family:llama", why: subclassed}
        """))
    return path, tree


def test_feature_is_parsed_and_its_name_checked():
    m = manifest.parse(_doc("- {target: vllm.x:Y, pin: exists, feature: micro-batches, why: w}\n"
                            "- {target: vllm.x:Z, pin: exists, why: w}\n"), "m.yaml")
    assert [r.feature for r in m.requires] == ["micro-batches", None]
    with pytest.raises(ManifestError, match=r"m\.yaml:6: requires\[0\]\.feature"):
        manifest.parse(_doc("- {target: vllm.x:Y, pin: exists, feature: Micro Batches, why: w}\n"), "m.yaml")


def test_a_feature_requirement_refuses_its_feature_only(tmp_path):
    path, tree = _featured(tmp_path)
    verdict = judge(manifest.load(path), open_tree(str(tree)))
    assert verdict.holds and verdict.refusal() is None  # nothing refuses the plugin itself
    assert verdict.refused == {"micro-batches": ["require:vllm.runner:Runner._allow_microbatching"]}
    words = verdict.refusal("micro-batches") or ""
    assert "vllm.runner:Runner._allow_microbatching" in words and "missing" in words, words
    assert words.endswith("Without it: set micro_batches to 1"), words
    assert verdict.refusal("family:llama") is None
    with pytest.raises(ValueError, match="feature 'data-parallel' is not declared"):
        verdict.refusal("data-parallel")


def test_check_passes_and_names_the_refused_feature(tmp_path):
    path, tree = _featured(tmp_path)
    code, out = run_check(path, str(tree))
    assert code == 0, out
    assert ("[feature-off] requires vllm.runner:Runner._allow_microbatching (pin exists, feature micro-batches)"
            " -> missing") in out
    assert "feature micro-batches refused on this tree (the plugin runs without it): " \
           "require:vllm.runner:Runner._allow_microbatching" in out
    import json

    doc = json.loads(run_check(path, str(tree), fmt="json")[1])
    assert doc["summary"]["failing"] == []
    assert doc["summary"]["features_refused"] == {"micro-batches": ["require:vllm.runner:Runner._allow_microbatching"]}


def test_afd_refuses_the_feature_by_name_and_still_runs(tmp_path, monkeypatch):
    """afd's front-end wiring on a status whose verdict comes from the synthetic tree: AFD passes its plan
    check, a run asking for micro-batches is refused in the verdict's words (the feature, the member, its
    verdict, the manifest's way without it) before vLLM builds anything, and the features a run asks for follow
    its arguments."""
    import dataclasses
    from types import SimpleNamespace

    import patchkit
    from afd_patches.patches import engine_config
    from patchkit.plan import ModelRegistration

    path, tree = _featured(tmp_path)
    loaded = manifest.load(path)
    verdict = judge(loaded, open_tree(str(tree)))
    loaded = dataclasses.replace(loaded, models=(
        ModelRegistration(arch="AFDLlamaForCausalLM", class_ref="afd_patches.models.simple:AFDLlamaForCausalLM",
                          feature="family:llama"),))
    status = patchkit.Status("afd", True, None, "vllm==0.27.1", SimpleNamespace(
        manifest=loaded, runtime=SimpleNamespace(vllm_version="0.27.1"), compiled=SimpleNamespace(verdict=verdict)))
    monkeypatch.setattr(patchkit, "status", lambda plugin: status if plugin == "afd" else None)

    engine_config.require_active_plan()  # AFD itself still runs
    engine_config.require_features(["family:llama"])

    def original(args: object) -> object:
        raise AssertionError("vLLM must not build a config for a refused feature")

    raw = {"role": "attention", "connector_extra_config": {"backend": "gloo", "micro_batches": 2}}
    with pytest.raises(engine_config.AfdUnavailable) as err:
        engine_config.validate_afd_config(original, SimpleNamespace(additional_config={"afd": raw},
                                                                     enable_prefix_caching=True))
    text = str(err.value)
    assert "feature 'micro-batches' is refused on vLLM 0.27.1" in text, text
    assert "require:vllm.runner:Runner._allow_microbatching (vllm.runner:Runner._allow_microbatching): missing" in text
    assert "Without it: set micro_batches to 1" in text, text

    from afd_patches.config import parse

    ffn = parse({"role": "ffn"})
    assert engine_config.features_asked(SimpleNamespace(data_parallel_size=1, tensor_parallel_size=1), ffn) == []
    assert engine_config.features_asked(SimpleNamespace(data_parallel_size=2, tensor_parallel_size=2), ffn) == [
        "data-parallel", "tp-groups"]
    config = SimpleNamespace(model_config=SimpleNamespace(architectures=["AFDLlamaForCausalLM"]))
    assert engine_config.family_of(config) == "family:llama"
    assert engine_config.family_of(SimpleNamespace(model_config=SimpleNamespace(architectures=["X"]))) is None
