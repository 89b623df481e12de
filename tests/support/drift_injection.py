"""Copies of the installed vLLM tree with one required symbol changed, one per kind of drift.

``drifted_copy(dest, kinds)`` hard-links every file of the installed ``vllm`` package
under ``dest/vllm`` (a real copy where links are impossible), then rewrites the files
the chosen drifts touch (a rewritten file is a new file: the installed one is never
changed). The copy stays importable and vLLM stays consistent — each change is made
at its definition and at vLLM's own call sites — so plain generation still works from
it (``PYTHONPATH=dest``), while what afd-plugin relies on has moved.

Kinds (``DRIFTS``): ``kwarg`` renames ``LlamaMLP``'s ``bias`` keyword (a constructor
AFD calls with keywords); ``body`` changes the body of ``LlamaForCausalLM.forward``
(a method of a class AFD subclasses); ``removed`` renames ``Qwen3MoeSparseMoeBlock``
away (a name AFD imports; its requirement serves one feature, ``family:qwen3_moe``, so only that family is
refused, not AFD); ``microbatch`` renames ``split_attn_metadata`` away (what micro-batches need, as vLLM 0.27.1
lacks ``_allow_microbatching``: AFD runs, ``micro_batches`` > 1 is refused; no patch target changes with it).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Drift:
    """One change: the requirement it breaks, the verdict ``check`` must give, the edits, and the feature of
    the requirement (``afd``: AFD itself, which the manifest marks required)."""

    requirement: str
    verdict: str
    edits: tuple[tuple[str, str, str, int], ...]  # (file under vllm/, old, new, expected count; 0 = all)
    feature: str | None = None


_LLAMA = "model_executor/models/llama.py"
DRIFTS: dict[str, Drift] = {
    "kwarg": Drift(
        "vllm.model_executor.models.llama:LlamaMLP.__init__", "drifted: signature",
        ((_LLAMA, '        bias: bool = False,\n        prefix: str = "",\n        reduce_results',
          '        mlp_bias: bool = False,\n        prefix: str = "",\n        reduce_results', 1),
         (_LLAMA, "            output_sizes=[intermediate_size] * 2,\n            bias=bias,",
          "            output_sizes=[intermediate_size] * 2,\n            bias=mlp_bias,", 1),
         (_LLAMA, "            output_size=hidden_size,\n            bias=bias,",
          "            output_size=hidden_size,\n            bias=mlp_bias,", 1),
         (_LLAMA, '            bias=getattr(config, "mlp_bias", False),',
          '            mlp_bias=getattr(config, "mlp_bias", False),', 1)),
        "afd",
    ),
    "body": Drift(
        "vllm.model_executor.models.llama:LlamaForCausalLM", "drifted: body",
        ((_LLAMA, "        return model_output\n",
          "        model_output = model_output\n        return model_output\n", 1),),
        "afd",
    ),
    "removed": Drift(
        "vllm.model_executor.models.qwen3_moe:Qwen3MoeSparseMoeBlock.__init__", "missing",
        (("model_executor/models/qwen3_moe.py", "Qwen3MoeSparseMoeBlock", "Qwen3MoeExpertsBlock", 0),
         ("model_executor/models/qwen3_vl_moe.py", "Qwen3MoeSparseMoeBlock", "Qwen3MoeExpertsBlock", 0)),
        "family:qwen3_moe",
    ),
    "microbatch": Drift(
        "vllm.v1.worker.ubatch_utils:split_attn_metadata", "missing",
        (("v1/worker/ubatch_utils.py", "def split_attn_metadata(", "def split_attention_metadata(", 1),
         ("v1/worker/gpu_model_runner.py", "split_attn_metadata", "split_attention_metadata", 2)),
        "micro-batches",
    ),
}


def installed_vllm_dir() -> Path:
    """The installed ``vllm`` package folder (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("vLLM is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations)))


def _link_tree(src: Path, dst: Path) -> None:
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        target = dst / Path(root).relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            try:
                os.link(Path(root, name), target / name)
            except OSError:
                shutil.copy2(Path(root, name), target / name)


def drifted_copy(dest: Path, kinds: list[str]) -> Path:
    """``dest`` holding ``vllm/`` with the drifts ``kinds`` applied; returns ``dest``."""
    package = dest / "vllm"
    _link_tree(installed_vllm_dir(), package)
    for kind in kinds:
        for rel, old, new, count in DRIFTS[kind].edits:
            path = package / rel
            text = path.read_text()
            found = text.count(old)
            if found == 0 or (count and found != count):
                raise AssertionError(f"{kind}: {rel} holds {found} of the text to change (this vLLM differs)")
            path.unlink()  # a hard link: write a new file, never through to the installed one
            path.write_text(text.replace(old, new))
    return dest
