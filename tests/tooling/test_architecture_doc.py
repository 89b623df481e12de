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
