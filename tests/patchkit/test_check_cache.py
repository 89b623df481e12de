"""``patchkit check``'s per-entry cache (patchkit.review.check_cache): a check run again says exactly what a
fresh one says, judging again only what changed, and reads nothing from the cache that is not a valid row.

Built on test_static's synthetic trees: a wheel (known by its members' CRC-32s), a folder (known by sizes and
modification times once they are older than the racy window), a plugin package on ``sys.path``.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from harness.env import REPO
from patchkit.review.check import run_check
from patchkit.review.check_rows import Row, schema_text
from tests.patchkit.test_static import BASE, NEW, TARGETS, pinned, write_tree, write_wheel

PLUGIN = {
    "ckplug/__init__.py": "",
    "ckplug/wrappers.py": "def wrap_config(original, self, usage):\n    return original(self, usage)\n",
}


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = write_tree(tmp_path / "plugin", PLUGIN)
    age(root)
    monkeypatch.syspath_prepend(str(root))
    return root


def age(root: Path, seconds: float = 60.0) -> None:
    """Set every file under ``root`` back ``seconds``: out of the racy window of a folder's identity."""
    when = time.time() - seconds
    for path in root.rglob("*"):
        os.utime(path, (when, when))


def manifest_text(base: Path, extra_line: bool = False, config_fp: str | None = None) -> str:
    """A manifest with a wrap handing the plugin's callable, plain wraps and requirements."""
    lines = ["format: 1", "plugin: demo", "packages: [ckplug]", "vllm: {version: '==0.39.0'}", "patches:"]
    if extra_line:
        lines.append("  # a comment that moves every entry down one line")
    lines += [
        "  - id: config", f"    target: {TARGETS['config']}", "    op: wrap", "    with: ckplug.wrappers:wrap_config",
        f"    fingerprint: {config_fp or pinned(base, TARGETS['config'])}", "    why: test",
        "  - id: helper", f"    target: {TARGETS['helper']}", "    op: set", "    value: 1", "    why: test",
        "requires:",
        f"  - target: {TARGETS['plugins']}", "    pin: full",
        f"    fingerprint: {pinned(base, TARGETS['plugins'])}", "    why: test",
        f"  - target: {TARGETS['old']}", "    pin: exists", "    why: test",
    ]
    return "\n".join(lines) + "\n"


def check(manifest: Path, src: Path, use_cache: bool = True) -> dict[str, Any]:
    code, out = run_check(manifest, str(src), None, "json", use_cache=use_cache)
    assert code in (0, 1), out
    return json.loads(out)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal but for what only says how the run went (time, modules parsed, rows from the cache)."""
    def strip(doc: dict[str, Any]) -> dict[str, Any]:
        return {**doc, "summary": {k: v for k, v in doc["summary"].items() if k not in ("seconds", "parsed", "cached")}}
    return strip(a) == strip(b)


@pytest.fixture
def setup(tmp_path: Path, cache_dir: Path, plugin: Path) -> tuple[Path, Path, Path]:
    base = write_tree(tmp_path / "base", BASE)
    wheel = write_wheel(tmp_path / "vllm-0.40.1-py3-none-any.whl", NEW, "0.40.1")
    manifest = tmp_path / "demo.yaml"
    manifest.write_text(manifest_text(base))
    return base, wheel, manifest


def test_a_second_check_takes_every_row_from_the_cache_and_says_the_same(setup: tuple[Path, Path, Path],
                                                                         cache_dir: Path) -> None:
    _, wheel, manifest = setup
    first = check(manifest, wheel)
    assert first["summary"]["cached"] == 0 and first["summary"]["parsed"] > 0
    again = check(manifest, wheel)
    assert again["summary"]["cached"] == len(again["entries"]) == 4 and again["summary"]["parsed"] == 0
    assert same(first, again)
    fresh = check(manifest, wheel, use_cache=False)
    assert fresh["summary"]["cached"] == 0 and same(fresh, again)
    assert [p.name for p in cache_dir.iterdir() if p.name.startswith("check-")]
    _code, text = run_check(manifest, str(wheel))
    assert "4 of 4 entries unchanged since the last check: from the cache" in text, text


def test_an_edited_entry_alone_is_judged_again_and_the_others_keep_their_new_lines(
        setup: tuple[Path, Path, Path]) -> None:
    base, wheel, manifest = setup
    check(manifest, wheel)
    manifest.write_text(manifest_text(base, extra_line=True, config_fp="ast1:0123456789abcdef:0123456789abcdef"))
    edited = check(manifest, wheel)
    assert edited["summary"]["cached"] == 3, edited["summary"]
    rows = {e["id"]: e for e in edited["entries"]}
    assert rows["config"]["verdict"] == "drifted: signature" and rows["config"]["fails"], rows["config"]
    assert same(edited, check(manifest, wheel, use_cache=False))  # the sources are the new lines


def test_a_changed_tree_is_judged_afresh(tmp_path: Path, setup: tuple[Path, Path, Path]) -> None:
    _base, wheel, manifest = setup
    assert {e["id"]: e["verdict"] for e in check(manifest, wheel)["entries"]}["require:" + TARGETS["plugins"]] == "ok"
    changed = {**NEW, "vllm/plugins.py": NEW["vllm/plugins.py"].replace("return 1", "return 7")}
    write_wheel(wheel, changed, "0.40.1")  # same path, same member sizes: the CRCs differ
    after = check(manifest, wheel)
    assert after["summary"]["cached"] == 0
    assert {e["id"]: e["verdict"] for e in after["entries"]}["require:" + TARGETS["plugins"]] == "drifted: body"


def test_a_folder_is_cached_only_once_its_files_are_older_than_the_racy_window(
        tmp_path: Path, setup: tuple[Path, Path, Path], cache_dir: Path) -> None:
    _base, _, manifest = setup
    new = write_tree(tmp_path / "new", NEW)
    check(manifest, new)
    assert check(manifest, new)["summary"]["cached"] == 0  # just written: no identity, nothing kept
    age(new)
    check(manifest, new)
    assert check(manifest, new)["summary"]["cached"] == 4
    plugins = new / "vllm" / "plugins.py"
    plugins.write_text(plugins.read_text().replace("return 1", "return 7"))
    age(new, 30.0)  # the edit, also moved out of the racy window: a new modification time
    after = check(manifest, new)
    assert after["summary"]["cached"] == 0
    assert same(after, check(manifest, new, use_cache=False))


def test_an_edited_plugin_callable_is_judged_again_and_requirements_are_not(
        setup: tuple[Path, Path, Path], plugin: Path) -> None:
    _, wheel, manifest = setup
    check(manifest, wheel)
    (plugin / "ckplug" / "wrappers.py").write_text("def wrap_config(original, self):\n    return original(self)\n")
    age(plugin, 30.0)
    after = check(manifest, wheel)
    assert after["summary"]["cached"] == 3, after["summary"]  # the wrap is judged again, the rest is not
    config = {e["id"]: e for e in after["entries"]}["config"]
    assert [f["fits"] for f in config["signatures"]] == [False] and config["fails"], config


def _stored(cache_dir: Path) -> Path:
    (found,) = [p for p in cache_dir.iterdir() if p.name.startswith("check-")]
    return found


@pytest.mark.parametrize("tamper", ["not json", "a field of the wrong type", "an unknown field", "rows swapped",
                                    "another format", "a symlink", "a FIFO", "writable by others"])
def test_a_stored_file_that_is_not_a_valid_row_store_is_a_miss(setup: tuple[Path, Path, Path], cache_dir: Path,
                                                                tamper: str, tmp_path: Path) -> None:
    _, wheel, manifest = setup
    fresh = check(manifest, wheel)
    path = _stored(cache_dir)
    doc = json.loads(path.read_bytes())
    keys = list(doc["rows"])
    edits: dict[str, Callable[[], None]] = {
        "not json": lambda: path.write_text("{nope"),
        "a field of the wrong type": lambda: _write(path, doc, lambda d: d["rows"][keys[0]].update(fails="no")),
        "an unknown field": lambda: _write(path, doc, lambda d: d["rows"][keys[0]].update(extra=1)),
        "rows swapped": lambda: _write(path, doc, lambda d: d.update(rows=dict(zip(keys, reversed(
            [d["rows"][k] for k in keys]), strict=True)))),
        "another format": lambda: _write(path, doc, lambda d: d.update(format="patchkit-check-0")),
        "a symlink": lambda: _link(path, tmp_path / "elsewhere.json"),
        "a FIFO": lambda: (path.unlink(), os.mkfifo(path)),
        "writable by others": lambda: path.chmod(0o666),
    }
    edits[tamper]()
    again = check(manifest, wheel)
    assert again["summary"]["cached"] == 0 or (tamper == "rows swapped" and again["summary"]["cached"] < 4)
    assert same(fresh, again)


def _write(path: Path, doc: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> None:
    edit(doc)
    path.write_text(json.dumps(doc))


def _link(path: Path, target: Path) -> None:
    target.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(target)


def test_rows_have_the_declared_shape_and_the_schema_file_is_made_from_it(setup: tuple[Path, Path, Path]) -> None:
    """``check_rows.Row`` is what the check prints (decoded strictly from fresh rows of every kind), and
    schemas/check-entry.schema.json is generated from it (``python -m patchkit.review.check_rows``)."""
    base, wheel, manifest = setup
    manifest.write_text(manifest_text(base, config_fp="ast1:0123456789abcdef:0123456789abcdef"))
    doc = check(manifest, wheel, use_cache=False)
    for row in doc["entries"]:
        assert msgspec.to_builtins(msgspec.convert(row, type=Row)) == row
    assert (REPO / "schemas" / "check-entry.schema.json").read_text() == schema_text(), (
        "schemas/check-entry.schema.json is stale: python -m patchkit.review.check_rows > "
        "schemas/check-entry.schema.json")
    assert textwrap.dedent(schema_text()).startswith("{")
