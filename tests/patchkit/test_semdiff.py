"""``patchkit diff``: the semantic diff of two manifests, ``--git REV``, and the git diff driver.

Each test writes small manifests to ``tmp_path``. The git tests build a throwaway
repository (``git`` must be installed, as it is wherever this project is cloned),
compare a file with an earlier commit, and run ``git diff`` with the driver
configured the way docs/review.md says.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.env import REPO
from patchkit import manifest
from patchkit.cli import main
from patchkit.review.diff import diff_manifests, render, run_diff, run_git_driver

FP1 = "ast1:1111111111111111:2222222222222222"
FP2 = "ast1:1111111111111111:3333333333333333"
FP3 = "ast1:4444444444444444:3333333333333333"

OLD = f"""\
# old
format: 1
plugin: demo
packages: [demo_patches]
vllm:
  version: "==0.31.0"
  commit: null
defaults: {{on_drift: fail}}
patches:
  - id: a
    target: vllm.x:f
    op: wrap
    with: demo_patches.w:a
    fingerprint: "{FP1}"
    why: first
  - id: b
    target: vllm.x:g
    op: wrap
    with: demo_patches.w:b
    fingerprint: "{FP1}"
    why: second
  - id: c
    target: vllm.x:C.flag
    op: set
    value: 1
    why: third
  - id: gone
    target: vllm.x:h
    op: replace
    with: demo_patches.w:h
    why: removed later
models:
  - {{arch: M1, class: demo_patches.m:M1}}
  - {{arch: M2, class: demo_patches.m:M2}}
workers:
  at: vllm.x:build
  fingerprint: "{FP1}"
  role_of: demo_patches.r:role_of
  overrides:
    - {{role: attention, class: demo_patches.w:Attn}}
"""


def _new_text() -> str:
    text = OLD.replace('version: "==0.31.0"', 'version: "==0.33.0"').replace("commit: null", 'commit: "abcdef1"')
    text = text.replace("defaults: {on_drift: fail}", "defaults: {on_drift: warn}")
    text = text.replace(f"""    with: demo_patches.w:a
    fingerprint: "{FP1}\"""", f"""    with: demo_patches.w:a2
    fingerprint: "{FP2}"
    after: [b]
    when: {{platform: [cuda]}}""")
    text = text.replace(f"""    with: demo_patches.w:b
    fingerprint: "{FP1}\"""", f"""    with: demo_patches.w:b
    fingerprint: "{FP3}"
    rebind: none
    required: false""")
    text = text.replace("    value: 1\n", "    value: 2\n")
    text = text.replace("""  - id: gone
    target: vllm.x:h
    op: replace
    with: demo_patches.w:h
    why: removed later
""", """  - id: fresh
    target: vllm.y:k
    op: wrap
    with: demo_patches.w:k
    why: new in this release
""")
    text = text.replace("  - {arch: M2, class: demo_patches.m:M2}\n",
                        "  - {arch: M2, class: demo_patches.m:M2b, when: {platform: [cuda]}}\n"
                        "  - {arch: M3, class: demo_patches.m:M3}\n")
    text = text.replace("  - {arch: M1, class: demo_patches.m:M1}\n", "")
    text = text.replace("    - {role: attention, class: demo_patches.w:Attn}\n",
                        "    - {role: attention, class: demo_patches.w:Attn}\n"
                        "    - {role: ffn, class: demo_patches.w:Ffn}\n")
    return text


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(OLD)
    new.write_text(_new_text())
    return old, new


def _changes(old: str, new: str) -> set[tuple[str, str, str, str | None]]:
    return {(c.section, c.kind, c.subject, c.field)
            for c in diff_manifests(manifest.parse(old, "o"), manifest.parse(new, "n"))}


def test_every_kind_of_change(files):
    old, new = files
    found = _changes(old.read_text(), new.read_text())
    assert found == {
        ("pin", "changed", "version", "version"),
        ("pin", "changed", "commit", "commit"),
        ("patches", "changed", "a", "with"),
        ("patches", "changed", "a", "fingerprint"),
        ("patches", "changed", "a", "after"),
        ("patches", "changed", "a", "when"),
        ("patches", "changed", "b", "fingerprint"),
        ("patches", "changed", "b", "rebind"),
        ("patches", "changed", "b", "required"),
        ("patches", "changed", "c", "value"),
        *(("patches", "changed", i, "on_drift") for i in ("a", "b", "c")),  # defaults are folded in
        ("patches", "removed", "gone", None),
        ("patches", "added", "fresh", None),
        ("order", "changed", "plan order", None),
        ("models", "removed", "M1", None),
        ("models", "added", "M3", None),
        ("models", "changed", "M2", "class"),
        ("models", "changed", "M2", "when"),
        ("workers", "changed", "workers", "on_drift"),
        ("workers", "changed", "workers", "overrides"),
    }
    notes = {(c.subject, c.note) for c in diff_manifests(manifest.load(old), manifest.load(new))
             if c.field == "fingerprint"}
    assert notes == {("a", "body only"), ("b", "signature changed")}


def test_target_op_header_and_workers_removed():
    new = OLD.replace("    target: vllm.x:g\n    op: wrap", "    target: vllm.x:g2\n    op: replace")
    new = new.replace("packages: [demo_patches]", "packages: [demo_patches, other]")
    new = new[: new.index("workers:")]
    assert _changes(OLD, new) == {
        ("patches", "changed", "b", "target"), ("patches", "changed", "b", "op"),
        ("header", "changed", "packages", "packages"), ("workers", "removed", "workers", None)}


def test_a_review_note_is_a_change_of_its_entry():
    """A ``reviewed`` note is a field: adding one, or rewording it, shows in the semantic diff of that entry."""
    reviewed = OLD.replace("    why: second\n", "    why: second\n    reviewed: body diff is logging only\n")
    reviewed = reviewed.replace('  at: vllm.x:build\n', '  at: vllm.x:build\n  reviewed: >-\n    same signature\n')
    assert _changes(OLD, reviewed) == {("patches", "changed", "b", "reviewed"),
                                       ("workers", "changed", "workers", "reviewed")}
    reworded = reviewed.replace("logging only", "logging and a rename")
    assert _changes(reviewed, reworded) == {("patches", "changed", "b", "reviewed")}


def test_comments_and_formatting_are_not_changes(tmp_path, capsys):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(OLD)
    b.write_text(OLD.replace("# old", "# a different comment").replace('"==0.31.0"', "'==0.31.0'  # pin")
                 .replace("  - {arch: M1, class: demo_patches.m:M1}", "  - arch: M1\n    class: demo_patches.m:M1"))
    assert main(["diff", str(a), str(b)]) == 0
    assert "no semantic change" in capsys.readouterr().out


def test_formats(files, capsys):
    old, new = files
    assert main(["diff", str(old), str(new), "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["equal"] is False and doc["old"]["version"] == "==0.31.0" and doc["new"]["commit"] == "abcdef1"
    assert {"section", "kind", "subject", "field", "old", "new", "note"} <= set(doc["changes"][0])
    assert main(["diff", str(old), str(new), "--format", "markdown"]) == 1
    md = capsys.readouterr().out
    assert "| section | change | subject | field | old | new | note |" in md and "| patches | added | `fresh` |" in md
    assert main(["diff", str(old), str(new)]) == 1
    text = capsys.readouterr().out
    assert 'pin: version "==0.31.0" -> "==0.33.0"' in text
    assert f'    fingerprint: "{FP1}" -> "{FP2}" (body only)' in text
    assert "+ patches fresh: wrap vllm.y:k with demo_patches.w:k" in text and "- patches gone:" in text
    assert "order: a, b, c, gone, workers -> b, a, c, fresh, workers" in text
    equal = json.loads(render([], "json", "x", "y"))
    assert equal["equal"] is True


@pytest.mark.parametrize("args", [["missing.yaml", "other.yaml"], ["{old}"], ["{old}", "{bad}"],
                                  ["{old}", "{new}", "{new}"], ["{old}", "{new}", "--git", "HEAD"]])
def test_bad_input_exits_2(args, files, tmp_path, capsys):
    old, new = files
    bad = tmp_path / "bad.yaml"
    bad.write_text("format: 1\nplugin: demo\npackages: [p]\nvllm: {version: '==1'}\npatches: [{id: x}]\n")
    argv = ["diff", *(a.format(old=old, new=new, bad=bad) for a in args)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err and "Traceback" not in err
    if "{bad}" in args:
        assert f"{bad}:5: patches[0]: 'target' is required" in err


def test_run_diff_unknown_format(files):
    old, new = files
    assert run_diff(str(old), str(new), "yaml")[0] == 2


# -- git ---------------------------------------------------------------------------------------------------

def _git(repo: Path, *args: str, env: dict[str, str] | None = None) -> str:
    full_env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(repo.parent), **(env or {})}
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=full_env, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "manifests" / "demo").mkdir(parents=True)
    _git(root, "init", "-q")
    _git(root, "config", "user.email", "t@example.invalid")
    _git(root, "config", "user.name", "t")
    _git(root, "config", "commit.gpgsign", "false")
    (root / "manifests" / "demo" / "vllm.yaml").write_text(OLD)
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "v1")
    return root


def test_git_rev(repo, capsys):
    path = repo / "manifests" / "demo" / "vllm.yaml"
    assert main(["diff", str(path), "--git", "HEAD"]) == 0
    capsys.readouterr()
    path.write_text(_new_text())
    assert main(["diff", str(path), "--git", "HEAD", "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["old"]["file"].endswith("vllm.yaml@HEAD") and not doc["equal"]
    assert main(["diff", str(path), "--git", "no-such-rev"]) == 2
    assert "no-such-rev" in capsys.readouterr().err
    assert main(["diff", str(path), "--git=--upload-pack=x"]) == 2


def test_shipped_gitattributes_selects_the_driver():
    assert "manifests/**/*.yaml diff=patchkit" in (REPO / ".gitattributes").read_text().splitlines()
    assert 'git config diff.patchkit.command "patchkit diff --git-driver"' in (REPO / "docs/review.md").read_text()


def test_git_diff_driver_for_real(repo):
    """``git diff`` runs ``patchkit diff --git-driver`` through .gitattributes, as docs/review.md sets it up."""
    (repo / ".gitattributes").write_text((REPO / ".gitattributes").read_text())
    command = f"{shlex.quote(sys.executable)} -m patchkit.cli diff --git-driver"
    _git(repo, "config", "diff.patchkit.command", command)
    path = repo / "manifests" / "demo" / "vllm.yaml"
    path.write_text(_new_text())
    out = _git(repo, "diff")
    assert "patchkit diff a/manifests/demo/vllm.yaml -> b/manifests/demo/vllm.yaml" in out
    assert 'pin: version "==0.31.0" -> "==0.33.0"' in out and "+ patches fresh" in out
    assert "text diff:" in out and '+  version: "==0.33.0"' in out  # nothing hidden
    # a new manifest: git passes /dev/null as the old file
    (repo / "manifests" / "demo" / "other.yaml").write_text(OLD)
    _git(repo, "add", "manifests/demo/other.yaml")
    out = _git(repo, "diff", "--cached")
    assert "+ patches a: wrap vllm.x:f" in out and 'pin: version null -> "==0.31.0"' in out
    # a side that does not validate: still exit 0, with the plain diff
    path.write_text("format: 2\n")
    out = _git(repo, "diff")
    assert "not comparing semantically" in out and "+format: 2" in out
    # the plain diff is one flag away
    assert "patchkit diff" not in _git(repo, "diff", "--no-ext-diff")


def test_git_driver_arguments(tmp_path, capsys):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(OLD)
    b.write_text(OLD)
    code, out = run_git_driver(["m.yaml", str(a), "0" * 40, "100644", str(b), "1" * 40, "100644"])
    assert code == 0 and "no semantic change" in out and "text diff:" not in out
    assert run_git_driver(["m.yaml", str(a)])[0] == 2
    # seven bare paths are recognised as the driver form too
    assert main(["diff", "m.yaml", str(a), "x", "100644", str(b), "y", "100644"]) == 0
    assert "no semantic change" in capsys.readouterr().out
    code, out = run_git_driver(["m.yaml", str(tmp_path / "gone"), ".", ".", str(b), "x", "100644"])
    assert code == 0 and "cannot read" in out


def test_render_markdown_for_pr(files):
    old, new = files
    md = render(diff_manifests(manifest.load(old), manifest.load(new)), "markdown", "o", "n")
    assert md.startswith("### patchkit diff `o` → `n`")
    assert textwrap.dedent("""\
        | pin | changed | `version` | version | `"==0.31.0"` | `"==0.33.0"` |  |""") in md
