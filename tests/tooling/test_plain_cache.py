"""Plain vLLM's results cached by content (``harness.plain_cache``): the key follows the checkpoint's bytes and the
settings, and what is read back is data that passed its checks, or a miss (a symlink, a FIFO, another owner, a
malformed or mis-shaped result)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from harness import plain_cache


@pytest.fixture
def spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setattr(plain_cache, "FOLDER", tmp_path / "cache")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "dtype": "float32"}))
    (model / "model.safetensors").write_bytes(b"weights")
    return {"name": "p", "mode": "plain", "model": str(model), "prompts": [[1, 2], [3]], "max_tokens": 2,
            "logprobs": 1}


RESULT = {"tokens": [[5, 6], [7, 8]], "logprobs": [[{"5": -0.5}, {"6": -0.25}], [{"7": -1.0}, {"8": -2.0}]],
          "seconds": {"start": 1.0}}


def test_the_key_follows_content_and_settings(spec: dict[str, Any], tmp_path: Path) -> None:
    first = plain_cache.key(spec)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in Path(spec["model"]).iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert plain_cache.key({**spec, "model": str(copy)}) == first  # content, not path
    (copy / "model.safetensors").write_bytes(b"other weights")
    assert plain_cache.key({**spec, "model": str(copy)}) != first
    assert plain_cache.key({**spec, "max_tokens": 3}) != first
    assert plain_cache.key({**spec, "compiled": True}) != first
    assert plain_cache.key({**spec, "runner": "mrv2"}) != first


def test_a_stored_result_comes_back_marked(spec: dict[str, Any]) -> None:
    assert plain_cache.load(spec) is None
    plain_cache.store(spec, RESULT)
    assert plain_cache.load(spec) == {**RESULT, "cached": True}


def _path(spec: dict[str, Any]) -> Path:
    return plain_cache.FOLDER / f"{plain_cache.key(spec)}.json"


def test_what_fails_a_check_is_a_miss(spec: dict[str, Any], tmp_path: Path) -> None:
    plain_cache.store(spec, RESULT)
    path = _path(spec)
    for text in ("{not json", json.dumps({**RESULT, "tokens": [[5], [7, 8]]}), json.dumps([1, 2])):
        path.write_text(text)
        assert plain_cache.load(spec) is None
    plain_cache.store(spec, {**RESULT, "tokens": "x"})  # not stored either
    assert plain_cache.load(spec) is None
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(RESULT))
    path.unlink()
    path.symlink_to(elsewhere)
    assert plain_cache.load(spec) is None
    path.unlink()
    os.mkfifo(path)
    assert plain_cache.load(spec) is None  # and does not wait for a writer
    path.unlink()
    path.write_text(json.dumps(RESULT))
    if os.getuid() == 0:  # root can hand the file to another user
        os.chown(path, 1, 1)
        assert plain_cache.load(spec) is None
