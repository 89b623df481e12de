"""patchkit.static and ``patchkit check``: a vLLM tree read without importing it.

Most tests build two small synthetic ``vllm`` trees in ``tmp_path`` — ``base`` (what a
manifest was written against) and ``new`` (a later release) — so every verdict, alias
site kind and input error is covered without vLLM. The tests at the end read the
installed vLLM (skipped when there is none); the one marked ``vllm`` imports it to
compare the static fingerprints with the runtime ones.
"""

from __future__ import annotations

import ast
import json
import textwrap
import zipfile
from pathlib import Path

import pytest

from harness.env import REPO
from patchkit import fingerprint
from patchkit.cli import main
from patchkit.manifest import load as load_manifest
from patchkit.review.check import run_check
from patchkit.static import Resolver, TreeError, open_tree
from tests.support.import_scan import imports_from_ast, imports_from_text

COMMON = {
    "vllm/__init__.py": """
        '''Fake vLLM.'''
        from .plugins import load_general_plugins
        from .version import __version__
    """,
    "vllm/engine/__init__.py": "",
    "vllm/worker/__init__.py": "",
    "vllm/worker/base.py": """
        class Worker:
            def init_device(self):
                return "base"

            def other(self):
                return 0
    """,
    "vllm/worker/cpu.py": """
        from vllm.worker.base import Worker


        class CPUWorker(Worker):
            def init_device(self):
                return "cpu"


        class Mid(Worker):
            pass
    """,
    "vllm/worker/deep.py": """
        from .cpu import Mid


        class DeepWorker(Mid):
            def init_device(self):
                return super().init_device()


        class Unrelated:
            def init_device(self):
                return "not a worker"
    """,
    "vllm/misc.py": """
        from typing import TYPE_CHECKING

        import vllm.plugins as pl

        if TYPE_CHECKING:
            from vllm.plugins import helper


        def use():
            return pl.helper(2)
    """,
    "vllm/sub/__init__.py": "",
    "vllm/sub/consumer.py": """
        from vllm import load_general_plugins


        def run():
            return load_general_plugins()
    """,
}

BASE = {
    **COMMON,
    "vllm/_version.py": "__version__ = version = '0.39.0'\n",
    "vllm/version.py": "from ._version import __version__\n",
    "vllm/plugins.py": """
        def load_general_plugins():
            '''Load plugins.'''
            return 1


        def helper(x):
            return x + 1


        def old_func():
            return 5


        def gone():
            return 6
    """,
    "vllm/engine/arg_utils.py": """
        from dataclasses import dataclass, field

        from vllm.plugins import helper as aliased_helper
        from vllm.plugins import load_general_plugins


        @dataclass
        class EngineArgs:
            model: str = "m"
            max_len: int = field(default=16)
            LIMIT = 3

            def create_engine_config(self, usage):
                load_general_plugins()
                return usage

            class Inner:
                def go(self):
                    return 2


        def late():
            from vllm.plugins import helper

            return helper(1) + aliased_helper(2)
    """,
}

NEW = {
    **COMMON,
    "vllm/_version.py": "__version__ = version = '0.40.1'\n",
    "vllm/version.py": "from ._version import __version__\n",
    "vllm/plugins.py": """
        def load_general_plugins():
            '''Load plugins (docstring changed: ignored).'''
            # a comment: ignored
            return 1


        def helper(x, y=0):
            return x + 1
    """,
    "vllm/moved_here.py": """
        def old_func():
            return 5
    """,
    "vllm/engine/arg_utils.py": BASE["vllm/engine/arg_utils.py"].replace("return usage", "return usage * 2"),
}

TARGETS = {
    "plugins": "vllm.plugins:load_general_plugins",
    "helper": "vllm.plugins:helper",
    "config": "vllm.engine.arg_utils:EngineArgs.create_engine_config",
    "old": "vllm.plugins:old_func",
    "gone": "vllm.plugins:gone",
    "field": "vllm.engine.arg_utils:EngineArgs.max_len",
    "classattr": "vllm.engine.arg_utils:EngineArgs.LIMIT",
    "nested": "vllm.engine.arg_utils:EngineArgs.Inner.go",
    "reexport": "vllm:load_general_plugins",
    "worker": "vllm.worker.base:Worker.init_device",
}


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def write_wheel(path: Path, files: dict[str, str], version: str) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for rel, text in files.items():
            zf.writestr(rel, textwrap.dedent(text).lstrip("\n"))
        zf.writestr(f"vllm-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return path


def pinned(base: Path, target: str) -> str:
    found = Resolver(open_tree(str(base))).resolve_target(target).definition
    assert found is not None, target
    return fingerprint.of_node(found.node)


def write_manifest(path: Path, entries: list[dict[str, object]], version: str = "==0.39.0") -> Path:
    lines = ["format: 1", "plugin: demo", "packages: [afd_patches]", f"vllm: {{version: '{version}'}}", "patches:"]
    for e in entries:
        lines.append(f"  - id: {e['id']}")
        for key, value in e.items():
            if key != "id":
                lines.append(f"    {key}: {json.dumps(value)}")
        lines.append("    why: test")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def trees(tmp_path: Path) -> tuple[Path, Path]:
    return write_tree(tmp_path / "base", BASE), write_tree(tmp_path / "new", NEW)


def entry(key: str, base: Path, **extra: object) -> dict[str, object]:
    e: dict[str, object] = {"id": key, "target": TARGETS[key], "op": "wrap", "with": "afd_patches.x:f"}
    if key not in ("field", "classattr"):
        e["fingerprint"] = pinned(base, TARGETS[key])
    e.update(extra)
    return e


@pytest.fixture
def manifest(tmp_path: Path, trees: tuple[Path, Path]) -> Path:
    base, _ = trees
    entries = [entry(k, base) for k in ("plugins", "helper", "config", "old", "gone", "nested", "reexport", "worker")]
    entries.append({"id": "field", "target": TARGETS["field"], "op": "set", "value": 32})
    entries.append({"id": "classattr", "target": TARGETS["classattr"], "op": "set", "value": 4,
                    "retire_when": {"vllm": ">=0.40"}})
    entries.append({"id": "newattr", "target": "vllm.engine.arg_utils:EngineArgs.brand_new", "op": "set",
                    "value": 1})
    entries.append({**entry("worker", base), "id": "worker-warn", "on_drift": "warn",
                    "target": "vllm.worker.base:Worker.missing_method", "fingerprint": pinned(base, TARGETS["worker"]),
                    "retire_when": {"vllm": ">=0.50"}})
    return write_manifest(tmp_path / "demo.yaml", entries)


def check_json(manifest: Path, src: Path | str, base: Path | None = None) -> tuple[int, dict]:
    code, out = run_check(manifest, str(src), str(base) if base else None, "json")
    assert code in (0, 1), out
    return code, json.loads(out)


def by_id(doc: dict) -> dict[str, dict]:
    return {e["id"]: e for e in doc["entries"]}


# -- trees ---------------------------------------------------------------------


def test_open_tree_accepts_package_dir_parent_dir_and_wheel(tmp_path: Path, trees: tuple[Path, Path]) -> None:
    _, new = trees
    for spec in (new, new / "vllm"):
        tree = open_tree(str(spec))
        assert tree.version == "0.40.1"
        assert "vllm.engine.arg_utils" in tree.modules and tree.is_package("vllm.engine")
    wheel = write_wheel(tmp_path / "vllm-0.40.1-py3-none-any.whl", NEW, "0.40.1")
    tree = open_tree(str(wheel))
    assert tree.kind == "wheel" and tree.version == "0.40.1"
    assert set(tree.modules) == set(open_tree(str(new)).modules)


def test_version_falls_back_to_wheel_metadata(tmp_path: Path) -> None:
    files = {k: v for k, v in NEW.items() if "version" not in k}
    files["vllm/__init__.py"] = ""
    wheel = write_wheel(tmp_path / "vllm-0.41.0-py3-none-any.whl", files, "0.41.0")
    assert open_tree(str(wheel)).version == "0.41.0"


@pytest.mark.parametrize("make", ["missing", "not-vllm", "corrupt-wheel", "wheel-without-vllm"])
def test_open_tree_rejects_bad_input(tmp_path: Path, make: str) -> None:
    path = tmp_path / "x"
    if make == "not-vllm":
        write_tree(path, {"other/__init__.py": ""})
    elif make == "corrupt-wheel":
        path = tmp_path / "vllm-1.0-py3-none-any.whl"
        path.write_bytes(b"PK\x03\x04 definitely not a zip archive")
    elif make == "wheel-without-vllm":
        path = tmp_path / "other-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("other/__init__.py", "")
    with pytest.raises(TreeError):
        open_tree(str(path))


# -- verdicts --------------------------------------------------------------------


def test_every_verdict(manifest: Path, trees: tuple[Path, Path]) -> None:
    _, new = trees
    code, doc = check_json(manifest, new)
    entries = by_id(doc)
    assert {k: e["verdict"] for k, e in entries.items()} == {
        "plugins": "ok",
        "helper": "drifted: signature",
        "config": "drifted: body",
        "old": "moved",
        "gone": "missing",
        "nested": "ok",
        "reexport": "ok",
        "worker": "ok",
        "field": "ok",
        "classattr": "ok",
        "newattr": "missing",
        "worker-warn": "missing",
    }
    assert entries["old"]["candidates"] == ["vllm.moved_here:old_func"]
    assert entries["helper"]["fingerprint"]["pinned"].split(":")[1] != entries["helper"]["fingerprint"]["found"].split(
        ":")[1]
    assert code == 1
    assert doc["summary"]["failing"] == ["helper", "config", "old", "gone"]
    assert entries["newattr"]["fails"] is False  # op set may create the attribute
    assert entries["worker-warn"]["fails"] is False  # on_drift: warn
    assert any("inherits" in n or "does not define" in n for n in entries["worker-warn"]["notes"])


def test_unchanged_tree_is_all_ok_and_exits_0(manifest: Path, trees: tuple[Path, Path]) -> None:
    base, _ = trees
    code, doc = check_json(manifest, base)
    assert code == 0
    verdicts = {e["id"]: e["verdict"] for e in doc["entries"]}
    assert verdicts.pop("newattr") == "missing" and verdicts.pop("worker-warn") == "missing"
    assert set(verdicts.values()) == {"ok"}


def test_class_attribute_and_dataclass_field_fingerprints(trees: tuple[Path, Path]) -> None:
    _, new = trees
    resolver = Resolver(open_tree(str(new)))
    field_def = resolver.resolve_target(TARGETS["field"]).definition
    attr_def = resolver.resolve_target(TARGETS["classattr"]).definition
    assert field_def is not None and isinstance(field_def.node, ast.AnnAssign)
    assert fingerprint.of_node(field_def.node) == fingerprint.of_source("max_len: int = field(default=16)")
    assert attr_def is not None and fingerprint.of_node(attr_def.node) == fingerprint.of_source("LIMIT = 3")


def test_reexport_through_package_init_is_followed(manifest: Path, trees: tuple[Path, Path]) -> None:
    _, new = trees
    _, doc = check_json(manifest, new)
    e = by_id(doc)["reexport"]
    assert e["definition"]["ref"] == "vllm.plugins:load_general_plugins"
    assert any("defined as vllm.plugins:load_general_plugins" in n for n in e["notes"])


def test_wheel_gives_the_same_verdicts_as_the_folder(tmp_path: Path, manifest: Path,
                                                     trees: tuple[Path, Path]) -> None:
    _, new = trees
    wheel = write_wheel(tmp_path / "vllm-0.40.1-py3-none-any.whl", NEW, "0.40.1")
    code_dir, doc_dir = check_json(manifest, new)
    code_whl, doc_whl = check_json(manifest, wheel)
    assert code_dir == code_whl == 1
    strip = [{k: v for k, v in e.items() if k not in ("definition", "alias_sites", "overrides")}
             for e in doc_dir["entries"]]
    assert strip == [{k: v for k, v in e.items() if k not in ("definition", "alias_sites", "overrides")}
                     for e in doc_whl["entries"]]
    assert doc_whl["vllm"]["version"] == "0.40.1"


# -- alias sites and overrides ---------------------------------------------------


def sites_of(doc: dict, entry_id: str) -> dict[tuple[str, int], dict]:
    return {(s["module"], s["line"]): s for s in by_id(doc)[entry_id]["alias_sites"]}


def test_alias_site_kinds_and_coverage(manifest: Path, trees: tuple[Path, Path]) -> None:
    _, new = trees
    _, doc = check_json(manifest, new)
    plugins = sites_of(doc, "plugins")
    kinds = {(m, s["kind"], s["bound"], s["covered"]) for (m, _), s in plugins.items()}
    assert kinds == {
        ("vllm", "from-import", "load_general_plugins", True),  # package re-export: a holder itself
        ("vllm.engine.arg_utils", "from-import", "load_general_plugins", True),
        ("vllm.sub.consumer", "from-import", "load_general_plugins", True),  # through the re-export
    }  # vllm.misc imports the module as 'pl' but never names load_general_plugins: not a site
    helper = {(m, s["kind"], s["bound"], s["covered"]) for (m, _), s in sites_of(doc, "helper").items()}
    assert ("vllm.engine.arg_utils", "function-local", "helper", True) in helper
    assert ("vllm.engine.arg_utils", "from-import", "aliased_helper", False) in helper  # another name
    assert ("vllm.misc", "type-checking", "helper", True) in helper
    assert ("vllm.misc", "module-alias", "pl", True) in helper
    line = next(s for s in sites_of(doc, "helper").values() if s["kind"] == "function-local")["line"]
    assert (new / "vllm/engine/arg_utils.py").read_text().splitlines()[line - 1].strip() == \
        "from vllm.plugins import helper"


def test_rebind_scope_decides_coverage(tmp_path: Path, trees: tuple[Path, Path]) -> None:
    base, new = trees
    m = write_manifest(tmp_path / "scoped.yaml", [
        entry("plugins", base, rebind=["vllm.engine"]),
        {**entry("plugins", base, rebind="none"), "id": "plugins-none", "after": ["plugins"]},
    ])
    _, doc = check_json(m, new)
    scoped = {s["module"]: s["covered"] for s in by_id(doc)["plugins"]["alias_sites"] if s["kind"] == "from-import"}
    assert scoped == {"vllm": False, "vllm.engine.arg_utils": True, "vllm.sub.consumer": False}
    none = [s for s in by_id(doc)["plugins-none"]["alias_sites"] if s["kind"] == "from-import"]
    assert none and not any(s["covered"] for s in none)
    # a function-local import reading from an unrebound re-exporter keeps the original too
    assert doc["summary"]["uncovered_sites"] >= 3


def test_subclass_overrides_are_listed(manifest: Path, trees: tuple[Path, Path]) -> None:
    _, new = trees
    _, doc = check_json(manifest, new)
    overrides = {o["ref"]: o["calls_super"] for o in by_id(doc)["worker"]["overrides"]}
    assert overrides == {"vllm.worker.cpu:CPUWorker.init_device": False,
                         "vllm.worker.deep:DeepWorker.init_device": True}


def test_an_override_after_a_method_free_candidate_class_is_found(tmp_path: Path, trees: tuple[Path, Path]) -> None:
    # the text prefilter reads each candidate class's own body: a file whose first candidate does not
    # define the method but whose second does must still be parsed
    base, _ = trees
    new = write_tree(tmp_path / "two", {**COMMON, "vllm/worker/pair.py": """
        from vllm.worker.base import Worker


        class Quiet(Worker):
            def other(self):
                return 1


        class Loud(Worker):
            x = 1

            def init_device(self):
                return "loud"
    """})
    manifest = write_manifest(tmp_path / "m.yaml", [entry("worker", base)])
    _, doc = check_json(manifest, new)
    assert "vllm.worker.pair:Loud.init_device" in {o["ref"] for o in by_id(doc)["worker"]["overrides"]}


def test_check_splits_work_with_a_forked_child_and_says_the_same(
        manifest: Path, trees: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from patchkit.review import check, forked

    base, new = trees
    outputs = []
    for parallel in (False, True):
        monkeypatch.setattr(forked, "available", lambda parallel=parallel: parallel)
        code, out = run_check(manifest, str(new), str(base), "json")
        doc = json.loads(out)
        doc["summary"].pop("seconds")
        outputs.append((code, doc))
    assert outputs[0] == outputs[1]
    entries = [*load_manifest(manifest).entries]
    assert all(check._halves(entries, open_tree(str(new))))  # both halves get work


def test_a_failing_child_half_is_redone_in_process(manifest: Path, trees: tuple[Path, Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from patchkit.review import check, forked

    base, new = trees
    monkeypatch.setattr(forked, "available", lambda: False)
    expected = json.loads(run_check(manifest, str(new), str(base), "json")[1])
    parent, real = os.getpid(), check._check_json

    def broken_in_child(*args: object) -> object:
        if os.getpid() != parent:
            raise RuntimeError("child broke")
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(forked, "available", lambda: True)
    monkeypatch.setattr(check, "_check_json", broken_in_child)
    got = json.loads(run_check(manifest, str(new), str(base), "json")[1])
    for doc in (expected, got):
        doc["summary"].pop("seconds")
    assert got == expected


def test_forked_child_result_and_failures() -> None:
    from patchkit.review import forked

    assert forked.start(lambda: {"rows": [1, 2]}).result() == {"rows": [1, 2]}
    assert forked.start(lambda: 1 / 0).result() is None
    assert forked.start(lambda: object()).result() is None  # not JSON


def test_text_import_scan_agrees_with_the_ast() -> None:
    source = textwrap.dedent('''
        """Module docstring with an example:

            from vllm.plugins import helper
        """
        import os, sys as system
        from typing import TYPE_CHECKING
        from vllm.plugins import (
            helper,  # comment
            load_general_plugins as lgp,
        )
        from vllm.plugins import \\
            old_func
        from vllm.plugins import (  # see f(x)
            helper as h2,  # g(y)
        )
        from . import sibling; import json

        if TYPE_CHECKING:
            from vllm.plugins import gone
        else:
            from vllm.plugins import gone as g2
        if TYPE_CHECKING or os.environ:
            import vllm.plugins as vp


        class C:
            from vllm.plugins import helper as class_level

            def method(
                self,
            ) -> None:
                from vllm.plugins import helper as in_method
                x = """
        from vllm.plugins import not_real
        """


        def f():
            if True:
                try:
                    from vllm.plugins import deep
                except ImportError:
                    pass
            class Local:
                from vllm.plugins import local_class
    ''')
    expected: list = []
    imports_from_ast(ast.parse(source).body, "module", expected)
    found = imports_from_text(source.encode())
    assert sorted((s.lineno, ast.dump(s), c) for s, c in found) == sorted(
        (s.lineno, ast.dump(s), c) for s, c in expected)
    contexts = {ast.unparse(s): c for s, c in found}
    assert contexts["from vllm.plugins import helper as class_level"] == "class"
    assert contexts["from vllm.plugins import helper as in_method"] == "function"
    assert contexts["from vllm.plugins import gone"] == "type-checking"
    assert contexts["from vllm.plugins import gone as g2"] == "module"
    assert contexts["import vllm.plugins as vp"] == "module"
    assert contexts["from vllm.plugins import local_class"] == "function"
    assert "from vllm.plugins import not_real" not in contexts


# -- the check command -----------------------------------------------------------


def test_retirement_conditions(manifest: Path, trees: tuple[Path, Path]) -> None:
    base, new = trees
    _, doc = check_json(manifest, new)
    assert by_id(doc)["classattr"]["retire"] == {"vllm": ">=0.40", "met": True}
    assert by_id(doc)["worker-warn"]["retire"] == {"vllm": ">=0.50", "met": False}
    _, doc = check_json(manifest, base)
    assert by_id(doc)["classattr"]["retire"]["met"] is False
    assert doc["vllm"]["selected_by_manifest"] is True


def test_base_diff_of_drifted_targets(manifest: Path, trees: tuple[Path, Path]) -> None:
    base, new = trees
    _, doc = check_json(manifest, new, base)
    entries = by_id(doc)
    assert "-    return usage\n" in entries["config"]["diff"]  # dedented to the definition
    assert "+    return usage * 2\n" in entries["config"]["diff"]
    assert "+def helper(x, y=0):" in entries["helper"]["diff"]
    assert entries["gone"]["diff"].startswith("--- base/vllm.plugins:gone")
    assert entries["plugins"]["diff"] is None  # unchanged: no diff


def test_markdown_and_text_outputs(manifest: Path, trees: tuple[Path, Path]) -> None:
    base, new = trees
    code, md = run_check(manifest, str(new), str(base), "markdown")
    assert code == 1
    assert "| entry | target | verdict |" in md and "```diff" in md
    lines = md.splitlines()
    top = lines.index("| entry | target | verdict | fails | uncovered aliases | overriding subclasses | "
                      "unpatched siblings | retire |")
    rows = lines[top + 2: top + 2 + 12]
    assert [r.split("|")[1].strip() for r in rows] == [f"`{e['id']}`" for e in json.loads(
        run_check(manifest, str(new), None, "json")[1])["entries"]]
    assert all(r.count("|") == 9 for r in rows)
    code, text = run_check(manifest, str(new), None, "text")
    assert code == 1 and "[FAIL] helper" in text and "drifted: signature" in text
    assert "vllm.worker.cpu:CPUWorker.init_device" in text


def test_cli_check_json_to_stdout(manifest: Path, trees: tuple[Path, Path], capsys: pytest.CaptureFixture) -> None:
    _, new = trees
    assert main(["check", str(manifest), "--vllm", str(new), "--format", "json"]) == 1
    out = capsys.readouterr().out
    assert json.loads(out)["exit_code"] == 1


@pytest.mark.parametrize("case", ["missing-path", "not-vllm", "corrupt-wheel", "invalid-manifest", "missing-manifest",
                                  "missing-base"])
def test_cli_bad_input_exits_2_without_traceback(tmp_path: Path, manifest: Path, trees: tuple[Path, Path],
                                                  case: str, capsys: pytest.CaptureFixture) -> None:
    _, new = trees
    args = ["check", str(manifest), "--vllm", str(new)]
    expect = ""
    if case == "missing-path":
        args[3] = str(tmp_path / "nowhere")
        expect = "no such file or directory"
    elif case == "not-vllm":
        args[3] = str(write_tree(tmp_path / "proj", {"pkg/__init__.py": ""}))
        expect = "not a vLLM tree"
    elif case == "corrupt-wheel":
        bad = tmp_path / "vllm-0.40.1-py3-none-any.whl"
        bad.write_bytes(b"not a zip")
        args[3] = str(bad)
        expect = "not a readable wheel"
    elif case == "invalid-manifest":
        bad = tmp_path / "bad.yaml"
        bad.write_text("format: 1\nplugin: demo\npackages: [afd_patches]\nvllm: {version: '==1'}\n"
                       "patches:\n  - id: x\n    target: not a target\n    op: wrap\n")
        args[1] = str(bad)
        expect = f"{bad}:7: patches[0].target"
    elif case == "missing-manifest":
        args[1] = str(tmp_path / "none.yaml")
        expect = "cannot read"
    else:
        args += ["--base", str(tmp_path / "nowhere")]
        expect = "no such file or directory"
    assert main(args) == 2
    captured = capsys.readouterr()
    assert expect in captured.err
    assert "Traceback" not in captured.err + captured.out


def test_corrupt_wheel_member_is_bad_input(tmp_path: Path, manifest: Path) -> None:
    wheel = write_wheel(tmp_path / "vllm-0.40.1-py3-none-any.whl", NEW, "0.40.1")
    raw = bytearray(wheel.read_bytes())
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo("vllm/plugins.py")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    raw[start:start + 4] = b"\xff\xff\xff\xff"
    wheel.write_bytes(bytes(raw))
    code, out = run_check(manifest, str(wheel))
    assert code == 2 and "corrupt member vllm/plugins.py" in out


def test_unknown_format_is_bad_input(manifest: Path, trees: tuple[Path, Path]) -> None:
    assert run_check(manifest, str(trees[1]), fmt="yaml")[0] == 2


# -- the installed vLLM ----------------------------------------------------------


@pytest.mark.vllm
def test_afd_manifest_checks_clean_against_installed_vllm() -> None:
    code, out = run_check(REPO / "manifests" / "afd" / "vllm-0.32.yaml", "installed", fmt="json")
    doc = json.loads(out)
    assert code == 0, out
    assert doc["summary"]["failing"] == []
    assert doc["entries"] and all(e["verdict"] == "ok" for e in doc["entries"] if e["fingerprint"]["pinned"])


@pytest.mark.vllm
def test_fingerprint_text_is_ast_dump_on_real_files() -> None:
    # patchkit.fingerprint writes ast.dump's text itself (faster); pinned fingerprints depend on it
    import sys

    tree = open_tree("installed")
    modules = sorted(tree.modules)[::40]
    full: dict[str, bool] = {"show_empty": True} if sys.version_info >= (3, 13) else {}
    for module in modules:
        for node in ast.walk(tree.parse(module)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Assign):
                expected = ast.dump(node, include_attributes=False, **full)
                assert fingerprint._format(node) == expected, (module, node.lineno)


@pytest.mark.vllm
def test_text_import_scan_agrees_with_the_ast_on_real_files() -> None:
    tree = open_tree("installed")
    sample = [m for m, data in tree.all_data() if b"set_forward_context" in data or b"TYPE_CHECKING" in data][:60]
    assert sample
    for module in sample:
        expected: list = []
        imports_from_ast(tree.parse(module).body, "module", expected)
        found = imports_from_text(tree.data(module))
        assert sorted((s.lineno, ast.dump(s), c) for s, c in found) == sorted(
            (s.lineno, ast.dump(s), c) for s, c in expected), module


@pytest.mark.vllm
@pytest.mark.parametrize("target", [
    "vllm.engine.arg_utils:EngineArgs.create_engine_config",
    "vllm.plugins:load_general_plugins",
    "vllm.platforms.interface:Platform.check_and_update_config",
    "vllm.forward_context:set_forward_context",
])
def test_static_fingerprint_equals_runtime_fingerprint(target: str) -> None:
    import importlib

    from patchkit.runtime.targets import Slot, unwrap_descriptor

    module = importlib.import_module(target.partition(":")[0])
    live, _ = unwrap_descriptor(Slot.resolve(target, module).get_raw())
    static = Resolver(open_tree("installed")).resolve_target(target).definition
    assert static is not None
    assert fingerprint.of_node(static.node) == fingerprint.of_object(live)
