"""``patchkit deps``: every vLLM symbol afd_patches uses is declared in every AFD manifest, and gaps are found."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from harness.env import REPO
from patchkit import manifest
from patchkit.cli import main
from patchkit.review.deps import run_deps
from tests.patchkit.test_retarget import _wheel

MANIFESTS = REPO / "manifests" / "afd"
RELEASES = {version: m.file for version, m in manifest.releases(MANIFESTS)}  # from manifests/afd


def _tree(release: str) -> str:
    return "installed" if release == "0.32.0" else str(_wheel(release))


@pytest.mark.vllm
@pytest.mark.parametrize("release", sorted(RELEASES))
def test_every_afd_manifest_declares_every_symbol_afd_uses(release):
    code, out = run_deps(RELEASES[release], _tree(release), fmt="json")
    report = json.loads(out)
    assert code == 0, out
    assert report["coverage"] == 1.0 and report["missing"] == [] and report["unused"] == []
    assert report["symbols"] >= 30  # subclassed, constructed, called, imported and inherited members
    kinds = {k for u in report["used"] for k in u["kinds"]}
    assert {"subclass", "construct", "call", "import"} <= kinds, kinds


@pytest.fixture
def afd_copy(tmp_path: Path) -> Path:
    shutil.copytree(REPO / "afd_patches", tmp_path / "afd_patches", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_deps_finds_a_vllm_symbol_added_to_a_copy_of_afd_patches(afd_copy, capsys):
    assert main(["deps", str(MANIFESTS / "vllm-0.32.yaml"), "--src", str(afd_copy)]) == 0
    declared = int(re.search(r"(\d+) vLLM symbols", capsys.readouterr().out).group(1))
    simple = afd_copy / "afd_patches" / "models" / "simple.py"
    simple.write_text(simple.read_text() + (
        "\n\ndef _layer_of(prefix: str) -> int:\n"
        "    from vllm.model_executor.models.utils import extract_layer_index as index_of\n\n"
        "    return index_of(prefix)\n"))
    code = main(["deps", str(MANIFESTS / "vllm-0.32.yaml"), "--src", str(afd_copy), "--suggest"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "UNDECLARED vllm.model_executor.models.utils:extract_layer_index (call;" in out, out
    assert "afd_patches/models/simple.py:" in out
    assert "target: vllm.model_executor.models.utils:extract_layer_index\n    pin: signature" in out  # --suggest
    assert f"{declared + 1} vLLM symbols" in out and f"{declared} declared" in out


def test_deps_follows_aliases_re_exports_and_inherited_members(afd_copy):
    (afd_copy / "afd_patches" / "extra.py").write_text(
        "import vllm.model_executor.models.llama as llama_mod\n"
        "from vllm.model_executor.models.qwen3 import Qwen3MLP\n\n\n"
        "class Mine(llama_mod.LlamaForCausalLM):\n"
        "    def go(self, x):\n"
        "        return self.compute_logits(x), Qwen3MLP(hidden_size=1)\n")
    code, out = run_deps(str(MANIFESTS / "vllm-0.32.yaml"), "installed", src=str(afd_copy), fmt="json")
    report = json.loads(out)
    used = {u["ref"]: u for u in report["used"]}
    # Qwen3MLP is vLLM's Qwen2MLP re-exported: one symbol, already declared (as Qwen3MLP.__init__)
    assert "construct" in used["vllm.model_executor.models.qwen2:Qwen2MLP"]["kinds"]
    assert "call" in used["vllm.model_executor.models.llama:LlamaForCausalLM.compute_logits"]["kinds"]
    assert code == 0 and report["missing"] == [], out  # LlamaForCausalLM is pinned 'full': its members are covered


def test_deps_reports_a_requirement_no_code_uses(tmp_path):
    shutil.copy(MANIFESTS / "base.yaml", tmp_path / "base.yaml")
    text = (MANIFESTS / "vllm-0.32.yaml").read_text() + (
        "requires:\n  - target: vllm.model_executor.models.utils:extract_layer_index\n    pin: exists\n"
        "    why: not used by afd_patches\n")
    path = tmp_path / "vllm-0.32.yaml"
    path.write_text(text)
    code, out = run_deps(str(path), "installed")
    assert code == 1
    assert "UNUSED     vllm.model_executor.models.utils:extract_layer_index" in out, out


def test_deps_bad_input_is_one_line(tmp_path):
    code, out = run_deps(str(MANIFESTS / "vllm-0.32.yaml"), "installed", src=str(tmp_path))
    assert code == 2 and out == f"patchkit deps: package 'afd_patches' not found in {tmp_path}"
    code, out = run_deps(str(MANIFESTS / "vllm-0.32.yaml"), str(tmp_path / "nowhere"))
    assert code == 2 and "no such file or directory" in out
