"""patchkit.static.callpaths and the ``call_paths`` of ``patchkit check``: callers that choose, by a condition,
between a patched target and a same-named object of another module.

Synthetic trees in ``tmp_path`` cover each form (an ``if`` chain of imports, ``try``/``except``, a module
global against a function-local import, module aliases, a class member) and what is not a choice; the check
tests show a sibling no entry patches is listed and counted (exit unchanged, 1 with ``strict_call_paths``),
and a patched one is not flagged, cached rows included. The last test reads the CUDA 0.34.0 wheel
(marker ``vllm``): the CPU worker's choice of ``warmup_kernels`` that vllm-0.34.yaml covers with two entries.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest

from harness.env import REPO
from patchkit.review.check import run_check
from patchkit.review.check_rows import Row
from patchkit.static import Resolver, open_tree
from patchkit.static.callpaths import CallPath, call_paths
from tests.patchkit.test_static import pinned, write_manifest, write_tree

WARM = """
    def warmup_kernels(model_runner, worker_execute_model, worker_sample_tokens):
        return model_runner
"""
COMMON = {
    "vllm/__init__.py": "",
    "vllm/w/__init__.py": "",
    "vllm/w/gpu.py": WARM,
    "vllm/w/cpu.py": WARM,
    "vllm/w/xpu.py": WARM,
    "vllm/platforms.py": "def standalone():\n    return False\n",
}
GPU, CPU = "vllm.w.gpu:warmup_kernels", "vllm.w.cpu:warmup_kernels"


def paths(tmp_path: Path, files: dict[str, str], target: str = GPU) -> list[CallPath]:
    root = write_tree(tmp_path / "tree", {**COMMON, **files})
    return call_paths(Resolver(open_tree(str(root))), target)


BRANCH = """
    from vllm.platforms import standalone


    class Worker:
        def warm(self):
            if standalone():
                from vllm.w.cpu import warmup_kernels
            else:
                from vllm.w.gpu import warmup_kernels
            warmup_kernels(self, None, None)
"""


def test_import_from_in_if_else_branches(tmp_path: Path) -> None:
    (found,) = paths(tmp_path, {"vllm/worker.py": BRANCH})
    assert (found.caller, found.file, found.line) == ("vllm.worker:Worker.warm", "vllm/worker.py", 6)
    assert (found.kind, found.via, found.chosen, found.sibling) == ("if-branch", "from-import", GPU, CPU)
    assert (found.condition, found.sibling_condition) == ("not (standalone())", "standalone()")
    (back,) = paths(tmp_path, {"vllm/worker.py": BRANCH}, CPU)  # the same choice, seen from the other side
    assert (back.sibling, back.condition) == (GPU, "standalone()")


def test_elif_chain_and_a_module_level_choice_through_a_reexport(tmp_path: Path) -> None:
    files = {
        "vllm/w/__init__.py": "from .gpu import warmup_kernels as gpu_warmup\n",
        "vllm/pick.py": """
            import os

            if os.environ.get("A") == "cpu":
                from vllm.w.cpu import warmup_kernels
            elif (os.environ.get("A")
                  == "xpu"):
                from vllm.w.xpu import warmup_kernels
            else:
                from vllm.w import gpu_warmup as warmup_kernels
        """,
    }
    found = paths(tmp_path, files)
    assert [(p.caller, p.line, p.sibling) for p in found] == [
        ("vllm.pick", 3, CPU), ("vllm.pick", 3, "vllm.w.xpu:warmup_kernels")]
    assert found[0].condition == """not (os.environ.get("A") == "cpu") and not (os.environ.get("A") == "xpu")"""
    assert found[1].sibling_condition == """not (os.environ.get("A") == "cpu") and os.environ.get("A") == "xpu\""""


def test_try_except_import(tmp_path: Path) -> None:
    files = {"vllm/t.py": """
        try:
            from vllm.w.gpu import warmup_kernels
        except (ImportError, RuntimeError):
            from vllm.w.cpu import warmup_kernels
    """}
    (found,) = paths(tmp_path, files)
    assert (found.kind, found.caller, found.line, found.sibling) == ("try-except", "vllm.t", 1, CPU)
    assert (found.condition, found.sibling_condition) == ("no exception", "except (ImportError, RuntimeError)")


def test_module_global_against_a_local_import(tmp_path: Path) -> None:
    files = {"vllm/g.py": """
        from vllm.w.gpu import warmup_kernels


        def run():
            return warmup_kernels(None, None, None)


        def run_cpu(flag):
            if flag:
                from vllm.w.cpu import warmup_kernels
                return warmup_kernels(None, None, None)
    """}
    (found,) = paths(tmp_path, files)
    assert (found.kind, found.caller, found.line, found.sibling) == ("global-vs-local", "vllm.g:run_cpu", 10, CPU)
    assert (found.condition, found.sibling_condition) == ("outside run_cpu", "inside run_cpu when flag")


def test_a_later_conditional_import_rebinds_the_name(tmp_path: Path) -> None:
    files = {"vllm/late.py": """
        from vllm.platforms import standalone
        from vllm.w.gpu import warmup_kernels

        if standalone():
            from vllm.w.cpu import warmup_kernels
    """, "vllm/early.py": """
        from vllm.platforms import standalone

        if standalone():
            from vllm.w.cpu import warmup_kernels
        from vllm.w.gpu import warmup_kernels
    """}
    (found,) = paths(tmp_path, files)  # early.py: the unconditional import after the branch always wins
    assert (found.caller, found.line, found.kind, found.sibling) == ("vllm.late", 4, "if-branch", CPU)
    assert (found.condition, found.sibling_condition) == ("not (standalone())", "standalone()")


@pytest.mark.parametrize("imports", [
    ("import vllm.w.cpu as impl", "import vllm.w.gpu as impl"),
    ("from vllm.w import cpu as impl", "from vllm.w import gpu as impl"),
])
def test_module_alias_chosen_by_a_condition(tmp_path: Path, imports: tuple[str, str]) -> None:
    files = {"vllm/m.py": f"""
        from vllm.platforms import standalone

        if standalone():
            {imports[0]}
        else:
            {imports[1]}


        def warm():
            return impl.warmup_kernels(None, None, None)
    """}
    (found,) = paths(tmp_path, files)
    assert (found.kind, found.via, found.caller, found.line) == ("if-branch", "module-alias", "vllm.m", 3)
    assert (found.sibling, found.sibling_condition) == (CPU, "standalone()")


def test_a_class_member_target_names_the_other_class_member(tmp_path: Path) -> None:
    runner = "class Runner:\n    def run(self):\n        return 1\n"
    files = {"vllm/a.py": runner, "vllm/b.py": runner, "vllm/use.py": """
        import sys

        if sys.platform == "darwin":
            from vllm.b import Runner
        else:
            from vllm.a import Runner
    """}
    (found,) = paths(tmp_path, files, "vllm.a:Runner.run")
    assert (found.chosen, found.sibling, found.condition) == (
        "vllm.a:Runner.run", "vllm.b:Runner.run", 'not (sys.platform == "darwin")')


def test_what_is_not_a_choice(tmp_path: Path) -> None:
    files = {
        "vllm/seq.py": "from vllm.w.cpu import warmup_kernels\nfrom vllm.w.gpu import warmup_kernels\n",
        "vllm/two.py": """
            def a():
                from vllm.w.gpu import warmup_kernels

            def b():
                from vllm.w.cpu import warmup_kernels
        """,
        "vllm/typing_only.py": """
            from typing import TYPE_CHECKING

            if TYPE_CHECKING:
                from vllm.w.cpu import warmup_kernels
            else:
                from vllm.w.gpu import warmup_kernels
        """,
        "vllm/same.py": """
            import os

            if os.environ.get("X"):
                from vllm.w import gpu_warmup as warmup_kernels
            else:
                from vllm.w.gpu import warmup_kernels
        """,
        "vllm/w/__init__.py": "from .gpu import warmup_kernels as gpu_warmup\n",
        "vllm/cls.py": """
            class Holder:
                if True:
                    from vllm.w.cpu import warmup_kernels
                else:
                    from vllm.w.gpu import warmup_kernels
        """,
    }
    assert paths(tmp_path, files) == []


def _check(tmp_path: Path, ids: list[str], **kw: object) -> tuple[int, dict]:
    root = tmp_path / "tree"
    if not root.exists():
        write_tree(root, {**COMMON, "vllm/worker.py": BRANCH})
    entries = [{"id": key, "target": target, "op": "wrap", "with": "afd_patches.x:f",
                "fingerprint": pinned(root, target)} for key, target in (("gpu", GPU), ("cpu", CPU)) if key in ids]
    manifest = write_manifest(tmp_path / "m.yaml", entries)
    code, out = run_check(manifest, str(root), fmt="json", **kw)  # type: ignore[arg-type]
    return code, json.loads(out)


def test_check_lists_an_unpatched_sibling_without_failing(tmp_path: Path) -> None:
    code, doc = _check(tmp_path, ["gpu"], use_cache=False)
    (row,) = doc["entries"]
    assert code == 0 and doc["summary"]["unpatched_siblings"] == 1 and row["unpatched_siblings"] == 1
    assert row["call_paths"] == [{
        "caller": "vllm.worker:Worker.warm", "file": "vllm/worker.py", "line": 6, "kind": "if-branch",
        "via": "from-import", "condition": "not (standalone())", "sibling_condition": "standalone()",
        "chosen": GPU, "sibling": CPU, "sibling_patched": False}]
    msgspec.convert(row, Row)  # the schema's shape
    assert _check(tmp_path, ["gpu"], use_cache=False, strict_call_paths=True)[0] == 1
    manifest = tmp_path / "m.yaml"
    text = run_check(manifest, str(tmp_path / "tree"), use_cache=False)[1]
    assert f"UNPATCHED {CPU} at vllm/worker.py:6 in vllm.worker:Worker.warm (if-branch" in text
    assert "1 unpatched call-path siblings" in text
    markdown = run_check(manifest, str(tmp_path / "tree"), fmt="markdown", use_cache=False)[1]
    assert f"| `{CPU}` | **no** | `standalone()` | `not (standalone())` |" in markdown


def test_a_patched_sibling_is_not_flagged_cached_rows_included(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path / "cache"))
    write_tree(tmp_path / "tree", {**COMMON, "vllm/worker.py": BRANCH})
    for path in (tmp_path / "tree").rglob("*.py"):  # files written just now give a folder no identity (RACY_S)
        os.utime(path, ns=(path.stat().st_mtime_ns - 10**10,) * 2)
    assert _check(tmp_path, ["gpu"])[1]["summary"]["unpatched_siblings"] == 1  # stores the gpu row
    code, doc = _check(tmp_path, ["gpu", "cpu"], strict_call_paths=True)
    assert doc["summary"]["cached"] == 1  # the gpu row comes from the cache, judged again against every entry
    assert code == 0 and doc["summary"]["unpatched_siblings"] == 0
    assert [p["sibling_patched"] for e in doc["entries"] for p in e["call_paths"]] == [True, True]
    assert [e["unpatched_siblings"] for e in doc["entries"]] == [0, 0]


def test_an_entry_that_opts_in_fails_on_an_unpatched_sibling(tmp_path: Path) -> None:
    root = write_tree(tmp_path / "tree", {**COMMON, "vllm/worker.py": BRANCH})
    entry = {"id": "gpu", "target": GPU, "op": "wrap", "with": "afd_patches.x:f", "fingerprint": pinned(root, GPU),
             "call_paths": "fail"}
    manifest = write_manifest(tmp_path / "m.yaml", [entry])
    code, out = run_check(manifest, str(root), fmt="json", use_cache=False)
    doc = json.loads(out)
    assert code == 1 and doc["summary"]["failing"] == ["gpu"] and doc["entries"][0]["verdict"] == "ok"
    assert "[FAIL] gpu:" in run_check(manifest, str(root), use_cache=False)[1]
    text = manifest.read_text().replace('"fail"', '"warn"')
    manifest.write_text(text)
    assert run_check(manifest, str(root), use_cache=False)[0] == 0


@pytest.mark.vllm
def test_the_034_cpu_worker_chooses_its_warmup_and_the_manifest_covers_both() -> None:
    from tests.patchkit.test_retarget import _wheel

    wheel = str(_wheel("0.34.0"))
    (found,) = call_paths(Resolver(open_tree(wheel)), "vllm.v1.worker.gpu.warmup:warmup_kernels")
    assert (found.caller, found.file) == ("vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model",
                                          "vllm/v1/worker/cpu_worker.py")
    assert found.sibling == "vllm.v1.worker.cpu.warmup:warmup_kernels"
    assert found.sibling_condition == "current_platform.uses_standalone_cpu_model_runner()"
    code, out = run_check(REPO / "manifests" / "afd" / "vllm-0.34.yaml", wheel, fmt="json", use_cache=False)
    rows = {e["id"]: e for e in json.loads(out)["entries"]}
    assert code == 0
    for key in ("afd.ffn-skips-jit-warmup", "afd.ffn-skips-jit-warmup-standalone"):
        assert [p["sibling_patched"] for p in rows[key]["call_paths"]] == [True], rows[key]["call_paths"]
