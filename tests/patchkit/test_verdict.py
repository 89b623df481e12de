"""One verdict per manifest (issue 52), on a synthetic vLLM tree (no vLLM): features as the unit, judged once,
applied alike by every process, before anything is patched.

Each "process" is a fresh Python whose import path starts with a folder holding a tiny ``vllm`` package and the
plugin's package ``demo_patches``; it activates the plugin with a runtime whose tree is that ``vllm`` folder
(``patchkit.plan.Runtime(tree=...)``, as ``Runtime.detect()`` names the installed one), and prints what it
applied. Processes of one test share a plan cache, as the processes of one vLLM installation do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from patchkit import ManifestError, manifest
from patchkit.review.check import run_check

REPO = Path(__file__).resolve().parents[2]

TREE = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '0.32.0'\n",
    "vllm/engine.py": """\
        def step(x):
            return x + 1


        class Runner:
            @property
            def kind(self):
                return "v1"
        """,
    "vllm/micro.py": "def split(batch, n):\n    return [batch] * n\n",
    "demo_patches/__init__.py": "",
    "demo_patches/hooks.py": """\
        def step(original, x):
            return original(x) * 10


        def split(original, batch, n):
            return original(batch, n)


        @property
        def kind(self):
            return "patched"


        class Model:
            pass
        """,
}

MANIFEST = """\
    format: 1
    plugin: demo
    packages: [demo_patches]
    vllm: {version: "==0.32.0"}
    features:
      micro:
        without: set micro to 1
    patches:
      - id: demo.step
        target: vllm.engine:step
        op: wrap
        with: demo_patches.hooks:step
        fingerprint: "%(step)s"
        why: the plugin itself
      - id: demo.split
        target: vllm.micro:split
        op: wrap
        with: demo_patches.hooks:split
        feature: micro
        why: micro-batches
      - id: demo.late
        target: vllm.late:run
        op: wrap
        with: demo_patches.hooks:split
        feature: micro
        why: a module no process imports at start (deferred)
    models:
      - arch: DemoMicroModel
        class: demo_patches.hooks:Model
        feature: micro
    """

# A process: activate, call what is patched, print what it saw.
PROCESS = """\
import json, sys
import patchkit
from patchkit.plan import Runtime
import vllm.engine
status = patchkit.activate("demo", sys.argv[1], runtime=Runtime("0.32.0", None, tree=sys.argv[2]))
out = {"active": status.active, "problem": status.problem,
       "verdict": status.verdict.summary() if status.verdict else None,
       "refusal_micro": status.refusal("micro") if status.verdict else None,
       "outcomes": {r["id"]: r["outcome"] for r in patchkit.applied("demo")},
       "fingerprints": {r["id"]: r["fingerprint"] for r in patchkit.applied("demo")},
       "step": vllm.engine.step(1), "judged_here": "patchkit.judge" in sys.modules}
print("RESULT " + json.dumps(out))
"""


def _fingerprint(root: Path, target: str) -> str:
    """The fingerprint ``patchkit check`` finds for ``target`` in the synthetic tree (what a pin would hold)."""
    from patchkit.plan import Patch
    from patchkit.static import Resolver, analyze, open_tree

    probe = Patch(id="p", target=target, op="wrap", with_="demo_patches.hooks:step")
    return analyze(Resolver(open_tree(str(root / "vllm"))), probe, ("demo_patches",)).found or ""


@pytest.fixture
def world(tmp_path: Path) -> dict[str, Path]:
    root = tmp_path / "root"
    for rel, text in TREE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    (manifests / "m.yaml").write_text(textwrap.dedent(MANIFEST) % {"step": _fingerprint(root, "vllm.engine:step")})
    return {"root": root, "manifests": manifests, "cache": tmp_path / "cache", "reports": tmp_path / "reports"}


def _process(world: dict[str, Path]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(world["root"]), str(REPO)]),
           "PATCHKIT_CACHE_DIR": str(world["cache"]), "PATCHKIT_REPORT_DIR": str(world["reports"])}
    env.pop("PATCHKIT_DISABLE", None)
    run = subprocess.run([sys.executable, "-c", PROCESS, str(world["manifests"]), str(world["root"] / "vllm")],
                         capture_output=True, text=True, timeout=120, env=env, cwd=world["root"])
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(line[len("RESULT "):])
    result["log"] = run.stderr
    return result


def test_a_missing_member_refuses_its_feature_in_every_process_before_anything_is_hooked(world):
    """``demo.late``'s module does not exist: judged up front (not left pending forever), it refuses feature
    ``micro``; every member of it is feature-off (``demo.split``, whose target is fine, and the model) in the
    first process and in a later one that reads the stored verdict; the rest is applied; the words name the
    member and the manifest's way without it; ``patchkit check`` says the same, with the same digest."""
    first, later = _process(world), _process(world)
    for run in (first, later):
        assert run["active"], run
        assert run["outcomes"] == {"demo.step": "applied", "demo.split": "feature-off", "demo.late": "feature-off",
                                   "model:DemoMicroModel": "feature-off"}, run
        assert run["step"] == 20  # the plugin's own member is applied
        assert run["verdict"]["features_refused"] == {"micro": ["demo.late"]}
        assert "demo.late (vllm.late:run): missing" in run["refusal_micro"], run
        assert run["refusal_micro"].endswith("Without it: set micro to 1"), run
    assert first["judged_here"] and not later["judged_here"]  # judged once; the later process re-stats only
    assert first["verdict"] == later["verdict"]
    code, out = run_check(world["manifests"] / "m.yaml", str(world["root"] / "vllm"), fmt="json")
    doc = json.loads(out)
    assert code == 0 and doc["summary"]["features_refused"] == {"micro": ["demo.late"]}, out
    assert doc["summary"]["verdict_digest"] == first["verdict"]["digest"]
    from patchkit.runtime import report

    ok, lines = report.check(world["reports"])
    assert ok, lines


def test_a_failing_member_without_a_feature_refuses_the_plugin_with_nothing_patched(world):
    """``demo.step`` drifted (its body changed after the pin): no member is applied in any process, the status
    carries the verdict's words, they reach vLLM's logger (``vllm.demo``), and check exits 1 on the same tree."""
    engine = world["root"] / "vllm" / "engine.py"
    engine.write_text(engine.read_text().replace("return x + 1", "return x + 2"))
    run = _process(world)
    assert not run["active"], run
    assert set(run["outcomes"].values()) == {"refused"}, run
    assert run["step"] == 3  # vLLM's own function, unpatched
    assert "the plugin is refused on vLLM 0.32.0" in run["problem"], run
    assert "demo.step (vllm.engine:step): drifted: body" in run["problem"], run
    code, _ = run_check(world["manifests"] / "m.yaml", str(world["root"] / "vllm"))
    assert code == 1


def test_a_tree_changed_after_judging_is_judged_again(world):
    """The stored verdict records what it read: editing a judged file (or creating the absent module) makes the
    next process judge again, and it applies the new verdict."""
    assert _process(world)["verdict"]["features_refused"] == {"micro": ["demo.late"]}
    (world["root"] / "vllm" / "late.py").write_text("def run(batch, n):\n    return batch\n")
    again = _process(world)
    assert again["judged_here"], again
    assert again["verdict"]["features_refused"] == {}, again
    # no longer feature-off: each waits for its module, which this process does not import
    assert again["outcomes"]["demo.split"] == again["outcomes"]["demo.late"] == "pending", again
    engine = world["root"] / "vllm" / "engine.py"
    engine.write_text(engine.read_text().replace("return x + 1", "return x + 2"))
    assert not _process(world)["active"]


def test_a_property_target_keeps_its_static_fingerprint_verdict(world):
    """A pinned property is ``ok`` in check; at run time the verdict's static fingerprint is the one applied
    (the live property object has no source: it used to read 'unverifiable' and fail)."""
    text = (world["manifests"] / "m.yaml").read_text()
    fp = _fingerprint(world["root"], "vllm.engine:Runner.kind")
    (world["manifests"] / "m.yaml").write_text(text.replace("patches:\n", f"""patches:
  - id: demo.kind
    target: vllm.engine:Runner.kind
    op: replace
    with: demo_patches.hooks:kind
    fingerprint: "{fp}"
    rebind: none
    why: a property
""", 1))
    run = _process(world)
    assert run["outcomes"]["demo.kind"] == "applied", run
    assert run["fingerprints"]["demo.kind"] == "match", run
    _, out = run_check(world["manifests"] / "m.yaml", str(world["root"] / "vllm"))
    assert "[ok] demo.kind" in out, out


def test_undeclared_and_inherited_features(tmp_path):
    base = textwrap.dedent("""\
        format: 1
        plugin: demo
        packages: [demo_patches]
        features:
          micro: {without: set micro to 1}
        """)
    (tmp_path / "base.yaml").write_text(base)
    (tmp_path / "r.yaml").write_text(textwrap.dedent("""\
        format: 1
        extends: base.yaml
        vllm: {version: "==0.32.0"}
        patches:
          - {id: a, target: "vllm.x:f", op: wrap, with: "demo_patches.h:f", feature: micro, why: w}
          - {id: b, target: "vllm.x:g", op: wrap, with: "demo_patches.h:g", feature: macro, why: w}
        """))
    with pytest.raises(ManifestError) as err:
        manifest.load(tmp_path / "r.yaml")
    text = str(err.value)
    assert "r.yaml:6: patches[1].feature: undeclared feature 'macro'" in text, text
    assert "patches[0]" not in text  # micro is declared by the base it extends


def test_a_callable_that_no_longer_fits_its_target_is_refused_before_apply(world):
    """A ``with:`` callable whose signature no longer fits its target is part of the verdict: the plugin is
    refused at start naming the entry, the callable and both signatures (no ``TypeError`` inside vLLM later),
    and the stored verdict refuses it the same way in the next process."""
    hooks = world["root"] / "demo_patches" / "hooks.py"
    hooks.write_text(hooks.read_text().replace("def step(original, x):", "def step(original, x, y):"))
    for run in (_process(world), _process(world)):
        assert not run["active"] and run["step"] == 2, run
        assert "demo.step (vllm.engine:step): with demo_patches.hooks:step" in run["problem"], run
        assert "does not fit the target" in run["problem"], run


def test_an_edited_plugin_callable_is_judged_again(world):
    assert _process(world)["active"]
    hooks = world["root"] / "demo_patches" / "hooks.py"
    hooks.write_text(hooks.read_text().replace("def step(original, x):", "def step(original, x, y):"))
    run = _process(world)
    assert run["judged_here"] and not run["active"], run
