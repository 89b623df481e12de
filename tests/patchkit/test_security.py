"""Security properties of manifest reading and activation (see SECURITY.md).

- YAML tags that build objects are refused and nothing is imported.
- A callable outside the manifest's declared packages is refused while reading, before
  anything is imported; target modules are never imported by patchkit.
- No environment variable moves the AFD manifest folder; patchkit reads only its
  documented variables (checked on the source's syntax tree).
- ``PATCHKIT_DISABLE`` is logged; reports, records and logs hold no environment values.
- The compiled-plan cache: a file others may write is ignored; the key follows content.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import afd_patches
import patchkit
from harness.env import REPO
from patchkit import ManifestError, manifest
from patchkit.plan import Runtime
from patchkit.runtime.cache import cache_dir
from tests.support.manifests import header

SENTINEL = "pksentinel"
TREE = {
    f"{SENTINEL}.py": "def boom(*args, **kwargs):\n    raise SystemExit('sentinel ran')\n\nclass C:\n    pass\n",
    "secplug/__init__.py": "",
    "secplug/w.py": "def loud(original, x):\n    return ('loud', original(x))\n\n"
                    "def role_of(config):\n    return None\n",
    "secvictim/__init__.py": "def f(x):\n    return x\n\ndef g(x):\n    return x\n",
}
HEAD = header("sec", "secplug")
ENTRY = '  - {id: a, target: "secvictim:f", op: wrap, with: "secplug.w:loud", why: t}\n'


@pytest.fixture
def tree(sandbox: Callable[..., Path], runtime: Runtime) -> Path:
    root = sandbox(TREE)
    sys.modules.pop(SENTINEL, None)
    return root


def activate(folder: Path, runtime: Runtime) -> patchkit.Status:
    patchkit._status.pop("sec", None)
    return patchkit.activate("sec", folder, runtime)


OBJECT_TAGS = [
    f"value: !!python/object/apply:{SENTINEL}.boom []",
    f"value: !!python/object:{SENTINEL}.C {{}}",
    f"value: !!python/object/new:{SENTINEL}.C []",
    f"value: !!python/name:{SENTINEL}.boom ''",
    f"value: !!python/module:{SENTINEL} ''",
    f"value: !<tag:yaml.org,2002:python/object/apply:{SENTINEL}.boom> []",
    f"value: [1, {{k: !!python/object/apply:{SENTINEL}.boom []}}]",
    "value: !!binary aGVsbG8=",
    "value: !custom x",
]


@pytest.mark.parametrize("line", OBJECT_TAGS)
def test_object_building_tags_are_refused_and_nothing_is_imported(tree: Path, manifest_dir: Callable[[str], Path],
                                                                  runtime: Runtime, line: str) -> None:
    text = HEAD + "patches:\n  - id: a\n    target: secvictim:f\n    op: set\n    " + line + "\n    why: t\n"
    with pytest.raises(ManifestError, match="is not allowed"):
        manifest.parse(text, "m.yaml")
    status = activate(manifest_dir(text), runtime)
    assert not status.active and status.problem and "is not allowed" in status.problem
    assert SENTINEL not in sys.modules


@pytest.mark.parametrize("text", [
    f"%TAG !p! tag:yaml.org,2002:python/\n---\nformat: !p!object/apply:{SENTINEL}.boom []\n",
    f"!!python/object/apply:{SENTINEL}.boom []\n",
    f"? !!python/object/apply:{SENTINEL}.boom []\n: 1\n",
    f"a: &x !!python/object/apply:{SENTINEL}.boom []\nb: *x\n",
])
def test_tags_anywhere_are_refused(tree: Path, text: str) -> None:
    with pytest.raises(ManifestError):
        manifest.parse(text, "m.yaml")
    assert SENTINEL not in sys.modules


@pytest.mark.parametrize("section", [
    "patches:\n  - {id: a, target: 'secvictim:f', op: wrap, with: 'pksentinel:boom', why: t}\n",
    "patches:\n  - {id: a, target: 'secvictim:f', op: replace, with: 'pksentinel:boom', why: t}\n",
    "patches:\n  - {id: a, target: 'secvictim:NEW', op: set, with: 'pksentinel:C', why: t}\n",
    "patches:\n  - {id: a, target: 'secvictim:f', op: wrap, with: 'secplugx.w:loud', why: t}\n",
    "models:\n  - {arch: A, class: 'pksentinel:C'}\n",
    "workers:\n  at: 'secvictim:f'\n  role_of: 'pksentinel:boom'\n  overrides: [{role: r, class: 'secplug.w:W'}]\n",
    "workers:\n  at: 'secvictim:f'\n  role_of: 'secplug.w:role_of'\n  overrides: [{role: r, class: 'pksentinel:C'}]\n",
])
def test_callables_outside_declared_packages_are_refused_before_import(
        tree: Path, manifest_dir: Callable[[str], Path], runtime: Runtime, section: str) -> None:
    import secvictim

    original = secvictim.f
    text = HEAD + section
    with pytest.raises(ManifestError, match="outside the declared packages"):
        manifest.parse(text, "m.yaml")
    status = activate(manifest_dir(text), runtime)
    assert not status.active and status.run is None
    assert SENTINEL not in sys.modules and "secplugx" not in sys.modules
    assert secvictim.f is original


def test_target_modules_are_never_imported(tree: Path, manifest_dir: Callable[[str], Path], runtime: Runtime) -> None:
    text = HEAD + "patches:\n  - {id: a, target: 'pksentinel:boom', op: wrap, with: 'secplug.w:loud', why: t}\n"
    status = activate(manifest_dir(text), runtime)
    assert status.active
    assert patchkit.applied("sec")[0]["outcome"] == "pending"
    assert SENTINEL not in sys.modules


ENV_ATTEMPTS = ["AFD_MANIFEST_DIR", "AFD_MANIFESTS", "PATCHKIT_MANIFEST_DIR", "PATCHKIT_MANIFESTS", "PATCHKIT_DIR",
                "VLLM_PLUGINS", "XDG_DATA_HOME", "XDG_CONFIG_HOME", "HOME"]


def test_no_environment_variable_moves_the_afd_manifest_folder(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    expected = afd_patches.manifest_dir()
    assert expected.resolve().is_relative_to(Path(afd_patches.__file__).resolve().parent.parent)
    (tmp_path / "evil.yaml").write_text(HEAD)
    for name in ENV_ATTEMPTS:
        monkeypatch.setenv(name, str(tmp_path))
    assert afd_patches.manifest_dir() == expected
    source = Path(afd_patches.__file__).read_text()
    assert "environ" not in source and "getenv" not in source


DOCUMENTED = {"PATCHKIT_CACHE_DIR", "PATCHKIT_REPORT_DIR", "PATCHKIT_DISABLE", "PATCHKIT_PROCESS_ROLE",
              "XDG_CACHE_HOME"}  # XDG_CACHE_HOME: the documented fallback of PATCHKIT_CACHE_DIR
# The one read of a name that is not a literal: the `when.env` guard reads the variables the manifest names.
DYNAMIC_READS = {("plan.py", "runtime_verdict")}


def _environment_reads() -> tuple[set[str], set[tuple[str, str]], list[str]]:
    names: set[str] = set()
    dynamic: set[tuple[str, str]] = set()
    other: list[str] = []
    for path in sorted((REPO / "patchkit").rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

        def function_of(node: ast.AST, parents: dict[ast.AST, ast.AST] = parents) -> str:
            while node in parents:
                node = parents[node]
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    return node.name
            return "<module>"

        for node in ast.walk(tree):
            is_environ = isinstance(node, ast.Attribute) and node.attr == "environ"
            is_getenv = isinstance(node, ast.Attribute) and node.attr in ("getenv", "environb")
            if not (is_environ or is_getenv):
                continue
            parent = parents.get(node)
            key: ast.AST | None = None
            if isinstance(parent, ast.Subscript):
                key = parent.slice
            elif isinstance(parent, ast.Attribute) and parent.attr == "get":
                call = parents.get(parent)
                key = call.args[0] if isinstance(call, ast.Call) and call.args else None
            elif isinstance(parent, ast.Call) and is_getenv:
                key = parent.args[0] if parent.args else None
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                names.add(key.value)
            elif key is not None:
                dynamic.add((path.name, function_of(node)))
            else:
                other.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return names, dynamic, other


def test_patchkit_reads_only_documented_environment_variables() -> None:
    names, dynamic, other = _environment_reads()
    assert names <= DOCUMENTED, names - DOCUMENTED
    assert {"PATCHKIT_CACHE_DIR", "PATCHKIT_REPORT_DIR", "PATCHKIT_DISABLE", "PATCHKIT_PROCESS_ROLE"} <= names
    assert dynamic <= DYNAMIC_READS, dynamic
    assert other == [], f"os.environ used as a whole (copied, iterated, passed on): {other}"


def test_disabling_by_environment_is_logged(tree: Path, manifest_dir: Callable[[str], Path], runtime: Runtime,
                                            monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import secvictim

    original = secvictim.f
    monkeypatch.setenv("PATCHKIT_DISABLE", "a")
    with caplog.at_level(logging.WARNING, logger="patchkit"):
        status = activate(manifest_dir(HEAD + "patches:\n" + ENTRY), runtime)
    assert status.active and secvictim.f is original
    assert patchkit.applied("sec")[0]["outcome"] == "disabled"
    assert any("a disabled by PATCHKIT_DISABLE" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records), caplog.text


def test_reports_records_and_logs_hold_no_environment_values(
        tree: Path, manifest_dir: Callable[[str], Path], runtime: Runtime, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    secret = "s3cr3t-Value-0xDEADBEEF"
    reports = tmp_path / "reports"
    monkeypatch.setenv("PATCHKIT_REPORT_DIR", str(reports))
    monkeypatch.setenv("PK_SECRET_TOKEN", secret)
    monkeypatch.setenv("PATCHKIT_PROCESS_ROLE", "front")
    text = HEAD + "patches:\n" + ENTRY + (
        "  - {id: b, target: 'secvictim:g', op: wrap, with: 'secplug.w:loud', why: t,"
        " when: {env: {PK_SECRET_TOKEN: null}}}\n"
        "  - {id: c, target: 'secvictim:NEW', op: set, value: 1, why: t, when: {env: {PK_SECRET_TOKEN: other}}}\n")
    with caplog.at_level(logging.DEBUG):
        status = activate(manifest_dir(text), runtime)
    assert status.active
    records = {r["id"]: r for r in patchkit.applied("sec")}
    assert records["b"]["outcome"] == records["c"]["outcome"] == "guarded-out"
    assert "PK_SECRET_TOKEN" in records["b"]["reason"]  # the name is fine, the value is not
    files = list(reports.glob("*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["role"] == "front"
    for blob in (files[0].read_text(), json.dumps(patchkit.applied()), caplog.text):
        assert secret not in blob


def test_a_cache_file_others_may_write_is_ignored(tree: Path, manifest_dir: Callable[[str], Path],
                                                  runtime: Runtime) -> None:
    import secvictim

    folder = manifest_dir(HEAD + "patches:\n" + ENTRY)
    assert activate(folder, runtime).active
    patchkit.revert()
    [plan] = Path(cache_dir()).glob("plan-*.json")
    data = json.loads(plan.read_text())
    data["plan"]["manifest"]["entries"][0]["with_"] = f"{SENTINEL}:boom"  # a poisoned plan
    plan.write_text(json.dumps(data))
    plan.chmod(0o666)
    status = activate(folder, runtime)
    assert status.active, status.problem
    assert SENTINEL not in sys.modules
    assert secvictim.f(1) == ("loud", 1)
    if hasattr(os, "getuid"):
        assert os.stat(plan).st_mode & 0o022 == 0, "the recomputed plan replaced the untrusted file"


def test_written_cache_files_are_private(tree: Path, manifest_dir: Callable[[str], Path], runtime: Runtime) -> None:
    assert activate(manifest_dir(HEAD + "patches:\n" + ENTRY), runtime).active
    for path in Path(cache_dir()).glob("*.json"):
        assert path.stat().st_mode & 0o077 == 0, oct(path.stat().st_mode)


def test_cache_key_follows_content_not_mtime(tree: Path, manifest_dir: Callable[[str], Path],
                                             runtime: Runtime) -> None:
    import secvictim

    folder = manifest_dir(HEAD + "patches:\n" + ENTRY)
    path = folder / "m.yaml"
    assert activate(folder, runtime).active
    patchkit.revert()
    st = path.stat()
    path.write_text(path.read_text().replace("secvictim:f", "secvictim:g"))  # same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    original_f = secvictim.f
    assert activate(folder, runtime).active
    assert secvictim.f is original_f and secvictim.g(1) == ("loud", 1), "a stale cached plan was used"
