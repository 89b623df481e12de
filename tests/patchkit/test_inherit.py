"""Manifest inheritance (``extends``): merge rules, provenance in errors, cycles, missing bases, the cache."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from harness.env import REPO
from patchkit import manifest
from patchkit.cli import main
from patchkit.manifest.select import compile_plan
from patchkit.plan import ManifestError, Runtime
from patchkit.runtime import cache

BASE = textwrap.dedent("""\
    format: 1
    plugin: demo
    packages: [demo_patches]
    patches:
      - id: demo.one
        target: vllm.x:f
        op: wrap
        with: demo_patches.w:one
        fingerprint: "ast1:0000000000000001:0000000000000001"
        why: first
      - id: demo.two
        target: vllm.x:g
        op: wrap
        with: demo_patches.w:two
        why: second
    requires:
      - target: vllm.x:h
        pin: exists
        why: called
    models:
      - arch: DemoLM
        class: demo_patches.m:DemoLM
    """)


def _write(folder: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).write_text(textwrap.dedent(text))


def test_release_overrides_field_by_field_adds_and_removes(tmp_path):
    _write(tmp_path, {"base.yaml": BASE, "vllm-1.0.yaml": """\
        format: 1
        extends: base.yaml
        vllm: {version: "==1.0"}
        patches:
          - id: demo.one
            fingerprint: "ast1:0000000000000001:0000000000000002"
          - id: demo.three
            target: vllm.x:k
            op: wrap
            with: demo_patches.w:three
            why: only in 1.0
        remove:
          patches: [demo.two]
          requires: [vllm.x:h]
        """})
    m = manifest.load(tmp_path / "vllm-1.0.yaml")
    by_id = {e.id: e for e in m.entries}
    assert list(by_id) == ["demo.one", "demo.three"]
    assert by_id["demo.one"].fingerprint == "ast1:0000000000000001:0000000000000002"
    assert by_id["demo.one"].why == "first" and by_id["demo.one"].with_ == "demo_patches.w:one"
    assert m.requires == () and [x.arch for x in m.models] == ["DemoLM"]
    assert [Path(f).name for f, _ in m.chain] == ["base.yaml", "vllm-1.0.yaml"]
    assert by_id["demo.three"].source.endswith("vllm-1.0.yaml:7")
    assert manifest.load(tmp_path / "base.yaml").is_base


def test_an_error_names_the_file_and_line_the_value_came_from(tmp_path):
    _write(tmp_path, {"base.yaml": BASE, "vllm-1.0.yaml": """\
        format: 1
        extends: base.yaml
        vllm: {version: "==1.0"}
        patches:
          - id: demo.two
            op: patch
        """})
    with pytest.raises(ManifestError) as info:
        manifest.load(tmp_path / "vllm-1.0.yaml")
    text = str(info.value)
    assert f"{tmp_path / 'vllm-1.0.yaml'}:6: patches[1].op: 'patch' is not one of" in text, text
    _write(tmp_path, {"vllm-1.0.yaml": """\
        format: 1
        extends: base.yaml
        vllm: {version: "==1.0"}
        patches:
          - id: demo.two
            with: elsewhere.w:two
        """})
    with pytest.raises(ManifestError) as info:
        manifest.load(tmp_path / "vllm-1.0.yaml")
    assert f"{tmp_path / 'vllm-1.0.yaml'}:6: patches[1].with: 'elsewhere.w:two' is outside" in str(info.value)


@pytest.mark.parametrize("case", ["missing", "cycle", "self", "path", "remove-unknown", "remove-alone"])
def test_bad_chains_name_both_files(tmp_path, case):
    release = tmp_path / "vllm-1.0.yaml"
    head = 'format: 1\nvllm: {version: "==1.0"}\n'
    files = {
        "missing": {"vllm-1.0.yaml": head + "extends: nowhere.yaml\n"},
        "cycle": {"vllm-1.0.yaml": head + "extends: a.yaml\n", "a.yaml": "format: 1\nextends: b.yaml\n",
                  "b.yaml": "format: 1\nextends: a.yaml\n"},
        "self": {"vllm-1.0.yaml": head + "extends: vllm-1.0.yaml\n"},
        "path": {"vllm-1.0.yaml": head + "extends: ../base.yaml\n"},
        "remove-unknown": {"base.yaml": BASE, "vllm-1.0.yaml": head + "extends: base.yaml\nremove: {patches: [x]}\n"},
        "remove-alone": {"vllm-1.0.yaml": BASE + 'vllm: {version: "==1.0"}\nremove: {patches: [demo.one]}\n'},
    }[case]
    _write(tmp_path, files)
    with pytest.raises(ManifestError) as info:
        manifest.load(release)
    text = str(info.value)
    assert text.startswith(str(release) if case != "cycle" else str(tmp_path / "b.yaml")), text
    if case == "missing":
        assert "nowhere.yaml" in text and "does not exist" in text
    if case == "cycle":
        assert "inheritance cycle" in text and "a.yaml" in text and "b.yaml" in text
    if case == "self":
        assert "inheritance cycle" in text
    if case == "remove-unknown":
        assert "remove.patches[0]" in text and "'x' is not among the inherited patches" in text


def test_bases_are_never_selected_and_the_cache_follows_every_file_of_the_chain(tmp_path, monkeypatch):
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "m"
    folder.mkdir()
    _write(folder, {"base.yaml": BASE, "vllm-1.0.yaml": 'format: 1\nextends: base.yaml\nvllm: {version: "==1.0"}\n'})
    runtime = Runtime("1.0", None)
    first = cache.compiled(str(folder), runtime, "t", compile_plan)
    assert first.manifest is not None and first.manifest.file.endswith("vllm-1.0.yaml")
    assert "demo.two" in first.order
    none = compile_plan(cache.manifest_files(folder), Runtime("2.0", None))
    assert none.manifest is None and none.supported == "vllm==1.0"  # the base is not a release
    (folder / "base.yaml").write_text(BASE.replace("why: second", "why: changed"))  # only the base changes
    second = cache.compiled(str(folder), runtime, "t", compile_plan)
    assert second.manifest is not None
    assert next(e for e in second.manifest.entries if e.id == "demo.two").why == "changed"
    assert second.manifest.digest != first.manifest.digest


def test_the_afd_releases_resolve_onto_one_base():
    releases = manifest.releases(REPO / "manifests" / "afd")
    assert [v for v, _ in releases] == ["0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]
    for _, m in releases:
        assert Path(m.chain[0][0]).name == "base.yaml"
    assert main(["validate", str(REPO / "manifests" / "afd")]) == 0


def test_plan_explain_names_where_each_field_came_from(capsys):
    code = main(["plan", "--manifests", str(REPO / "manifests" / "afd"), "--explain"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "id: base.yaml:" in out and "fingerprint: base.yaml:" in out
    assert "vllm.version: vllm-0.32.yaml:" in out


@pytest.mark.vllm
def test_retarget_of_a_release_file_writes_only_that_file_and_diff_shows_pins_and_fingerprints(tmp_path):
    import shutil

    from patchkit.review.diff import diff_manifests
    from tests.patchkit.test_retarget import _wheel

    folder = REPO / "manifests" / "afd"
    for name in ("base.yaml", "vllm-0.32.yaml"):
        shutil.copy(folder / name, tmp_path / name)
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "vllm-0.31.yaml"
    code = main(["retarget", str(tmp_path / "vllm-0.32.yaml"), "--vllm", str(_wheel("0.31.0")), "--out", str(out)])
    assert code == 1  # drifted entries are flagged, never silently re-pinned
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, out.name])
    assert (tmp_path / "base.yaml").read_text() == (folder / "base.yaml").read_text()
    text = out.read_text()
    assert "extends: base.yaml" in text and "# REVIEW: drifted" in text and "op:" not in text
    changes = diff_manifests(manifest.load(tmp_path / "vllm-0.32.yaml"), manifest.load(out))
    assert changes and {c.field for c in changes if c.section != "pin"} == {"fingerprint"}, changes
    assert {c.section for c in changes} <= {"pin", "patches", "requires", "workers"}
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    code = main(["retarget", str(tmp_path / "vllm-0.32.yaml"), "--vllm", str(_wheel("0.31.0")),
                 "--out", str(elsewhere / "x.yaml")])
    assert code == 2 and not (elsewhere / "x.yaml").exists()


@pytest.mark.parametrize("value,line", [
    ("1", "model runner: v2 (VLLM_USE_V2_MODEL_RUNNER)"), ("0", "model runner: v1 (VLLM_USE_V2_MODEL_RUNNER)"),
    (None, "model runner: chosen by vLLM per engine (VLLM_USE_V2_MODEL_RUNNER unset); each process's report names it")])
def test_plan_names_the_model_runner(capsys, monkeypatch, value, line):
    """``patchkit plan`` says which model runner an engine gets where that is known without an engine config."""
    if value is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    assert main(["plan", "--manifests", str(REPO / "manifests" / "afd")]) == 0
    assert capsys.readouterr().out.splitlines()[1] == line
