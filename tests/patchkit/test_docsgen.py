"""``patchkit docs``: docs/patches.md from the registered manifests.

The first test is the guard: the committed docs/patches.md must equal what the
registered manifests generate now, so the suite fails when a manifest changed
and nobody ran ``patchkit docs``. The rest use synthetic manifest folders.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from harness.env import REPO
from patchkit.cli import main
from patchkit.manifest import registered_manifest_dirs
from patchkit.review.docs import render, run_docs


def test_committed_patches_md_is_current():
    committed = REPO / "docs" / "patches.md"
    assert committed.exists(), "docs/patches.md is missing: run `patchkit docs`"
    assert committed.read_text() == render(registered_manifest_dirs()), (
        "docs/patches.md is stale: run `patchkit docs` and commit the result")


_TEMPLATE = textwrap.dedent("""\
    format: 1
    plugin: demo
    packages: [demo_patches]
    vllm: {{version: "{version}", commit: null}}
    {fallback}patches:
      - id: demo.one
        target: {target}
        op: wrap
        with: demo_patches.w:one
        why: >-
          Why one
          exists.
        upstream: https://example.invalid/pr/1
        retire_when: {{vllm: ">=0.40"}}
    """)


def _m(version: str, target: str, extra: str = "", fallback: bool = False) -> str:
    fb = "fallback: true\n" if fallback else ""
    return _TEMPLATE.format(version=version, target=target, fallback=fb) + extra


def _dirs(tmp_path: Path) -> dict[str, Path]:
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / "vllm-0.32.yaml").write_text(_m("==0.32.0", "vllm.x:f", textwrap.dedent("""\
        models:
          - {arch: DemoLM, class: demo_patches.m:DemoLM, why: a demo model}
        workers:
          at: vllm.x:build
          role_of: demo_patches.r:role_of
          overrides:
            - {role: attention, class: demo_patches.w:Attn, when: {platform: [cpu]}}
        """)))
    (demo / "vllm-0.33.yaml").write_text(_m("==0.33.0", "vllm.y:f", textwrap.dedent("""\
          - id: demo.two
            target: vllm.y:g
            op: set
            value: {a: 1}
            why: only in 0.33
        models:
          - {arch: DemoLM, class: demo_patches.m:DemoLM, why: a demo model}
        """)))
    (demo / "any.yaml").write_text(_m(">=0", "vllm.x:f", fallback=True))
    other = tmp_path / "other"
    other.mkdir()
    return {"zeta": other, "demo": demo}


def test_render_content(tmp_path):
    text = render(_dirs(tmp_path))
    assert text.index("## Plugin `demo`") < text.index("## Plugin `zeta`")  # plugins by name
    assert "| `vllm-0.32.yaml` | `vllm==0.32.0` | — | 1 | 0 | 1 | yes |" in text
    assert "| `any.yaml` | fallback: any release no pinned manifest supports | — | 1 | 0 | 0 | no |" in text
    one = text[text.index("#### `demo.one`"):text.index("#### `demo.two`")]
    assert "Releases: vllm==0.32.0 (`vllm-0.32.yaml`), vllm==0.33.0 (`vllm-0.33.yaml`), fallback (`any.yaml`)" in one
    # the target moved in 0.33: both variants, each with its releases
    assert "In vllm==0.32.0 (`vllm-0.32.yaml`), fallback (`any.yaml`):" in one
    assert "In vllm==0.33.0 (`vllm-0.33.yaml`):" in one and "- target `vllm.y:f`: wrap with `demo_patches.w:one`" in one
    assert "Why one exists." in one and "- upstream: https://example.invalid/pr/1" in one
    assert "- retire when: vLLM `>=0.40`" in one
    two = text[text.index("#### `demo.two`"):]
    assert "- target `vllm.y:g`: set to `{\"a\": 1}`" in two and "- retire when: not set" in two
    assert ("| `DemoLM` | `demo_patches.m:DemoLM` | — | vllm==0.32.0 (`vllm-0.32.yaml`), vllm==0.33.0 "
            "(`vllm-0.33.yaml`) | a demo model |") in text
    assert "| attention | `demo_patches.w:Attn` | `{\"platform\": [\"cpu\"]}` |" in text
    assert "No manifest files." in text  # zeta
    assert str(tmp_path) not in text


def test_requirements_listed_per_release(tmp_path):
    dirs = _dirs(tmp_path)
    for name, pin, feature in (("vllm-0.32.yaml", "signature", ""), ("vllm-0.33.yaml", "full", "feature: x-y\n    ")):
        path = dirs["demo"] / name
        path.write_text(path.read_text().replace("\nmodels:", (
            "\nrequires:\n  - target: vllm.z:Base.__init__\n"
            f"    pin: {pin}\n    {feature}fingerprint: \"ast1:0123456789abcdef:0123456789abcdef\"\n"
            "    why: constructed with keywords\nmodels:"), 1)
            + ("features:\n  x-y: {without: w}\n" if feature else ""))
    text = render(dirs)
    assert "| `vllm-0.32.yaml` | `vllm==0.32.0` | — | 1 | 1 | 1 | yes |" in text
    section = text[text.index("### Requirements"):text.index("### Models")]
    assert ("| `vllm.z:Base.__init__` | signature | fail | all | vllm==0.32.0 (`vllm-0.32.yaml`) | "
            "constructed with keywords |") in section
    assert "| `vllm.z:Base.__init__` | full | fail | `x-y` | vllm==0.33.0 (`vllm-0.33.yaml`) |" in section


def test_deterministic(tmp_path):
    dirs = _dirs(tmp_path)
    assert render(dirs) == render(dict(reversed(list(dirs.items()))))


def test_check_and_write(tmp_path):
    dirs = _dirs(tmp_path)
    out = tmp_path / "docs" / "patches.md"
    assert run_docs(out, check=True, dirs=dirs)[0] == 1  # missing
    assert not out.exists()
    assert run_docs(out, dirs=dirs) == (0, f"{out}: written")
    assert run_docs(out, check=True, dirs=dirs)[0] == 0
    out.write_text(out.read_text() + "edited\n")
    code, message = run_docs(out, check=True, dirs=dirs)
    assert code == 1 and "stale" in message


def test_invalid_manifest_is_bad_input(tmp_path):
    dirs = _dirs(tmp_path)
    (dirs["demo"] / "broken.yaml").write_text("format: 1\nplugin: demo\n")
    code, message = run_docs(tmp_path / "p.md", dirs=dirs)
    assert code == 2 and "broken.yaml:1" in message
    assert run_docs(tmp_path / "p.md", dirs={})[0] == 2


def test_cli(tmp_path, capsys):
    out = tmp_path / "patches.md"
    assert main(["docs", "--check", "--out", str(out)]) == 1
    assert "missing" in capsys.readouterr().err
    assert main(["docs", "--out", str(out)]) == 0
    assert main(["docs", "--check", "--out", str(out)]) == 0
    assert out.read_text() == render(registered_manifest_dirs())
