"""docs/architecture.md names only code that exists: every file path under the two packages it mentions."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PATH = re.compile(r"(?<![\w/])((?:afd_patches|patchkit)/[\w/]*\w(?:\.py)?)")


def test_every_module_the_architecture_doc_names_exists() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    named = sorted(set(PATH.findall(text)))
    assert len(named) >= 30, named  # the doc walks both packages
    missing = [p for p in named if not (REPO / p).exists() and not (REPO / f"{p}.py").exists()]
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"


def test_the_decode_step_section_walks_the_exchange() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("## The life of one decode step"):]
    for module in ("afd_patches/models/exchange_op.py", "afd_patches/connectors/tcp.py",
                   "afd_patches/connectors/schedule.py", "afd_patches/models/microbatch.py"):
        assert module in section, module


def test_the_picture_shows_the_processes_the_manifest_path_and_one_step() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"```mermaid\n(.*?)```", text, re.S)
    flow = next(b for b in blocks if b.startswith("flowchart"))
    for name in ("API server", "VLLM::EngineCore", "VLLM::Worker, attention role", "VLLM::Worker, FFN role",
                 "afd_patches:register_afd", "patchkit.activate", "plan cache", "manifests/afd/", "patches"):
        assert name in flow, name
    step = next(b for b in blocks if b.startswith("sequenceDiagram"))
    for name in ("afd::exchange", "send_attn_output", "recv_attn_output", "send_ffn_output", "recv_ffn_output"):
        assert name in step, name
    config = text[text.index("**Where a step's config values come from.**"):]
    for name in ("validate_afd_config", "parse", "to_dict()", "restore", "no I/O", "GroupSpec.of"):
        assert name in config, name
