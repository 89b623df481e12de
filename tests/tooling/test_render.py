"""benchmarks.render: README's figures table and docs/benchmarks.md's current figures are what
benchmarks/results/ holds, and a result file that does not follow benchmarks.record's format is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import record, render
from harness.env import REPO


def _copy(tmp_path: Path) -> Path:
    """README, docs/benchmarks.md and the result files, as a tree render can work on."""
    (tmp_path / "docs").mkdir()
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    shutil.copy(REPO / "docs" / "benchmarks.md", tmp_path / "docs" / "benchmarks.md")
    shutil.copytree(REPO / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    return tmp_path


def test_the_committed_figures_are_what_the_result_files_give(capsys: pytest.CaptureFixture[str]) -> None:
    assert render.main(["--check"]) == 0, capsys.readouterr().err
    runs = render.load()
    rows = sorted(f["readme"] for run in runs for f in run["figures"] if "readme" in f)
    assert rows == list(range(1, len(rows) + 1)) and 4 <= len(rows) <= render.README_ROWS, rows


def test_a_changed_result_makes_check_fail_and_render_writes_it(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy(tmp_path)
    path = root / "benchmarks" / "results" / "hook_cost.json"
    doc = json.loads(path.read_text())
    doc["figures"][0]["value"] = 4321.5
    path.write_text(json.dumps(doc))
    assert render.main(["--check"], root=root) == 1
    assert "out of date: README.md, docs/benchmarks.md" in capsys.readouterr().err
    assert render.main([], root=root) == 0
    assert "**4,321.5 ms**" in (root / "README.md").read_text()
    assert "| 4,321.5 ms |" in (root / "docs" / "benchmarks.md").read_text()
    assert render.main(["--check"], root=root) == 0
    readme = (root / "README.md").read_text()
    assert readme.split(render.BEGIN)[0] == (REPO / "README.md").read_text().split(render.BEGIN)[0]


@pytest.mark.parametrize("change,message", [
    (lambda d: d["figures"][0].pop("value"), "figures[0].value: missing"),
    (lambda d: d["figures"][1].update(value="fast"), "figures[1].value: expected int or float"),
    (lambda d: d["figures"][0].update(colour=1), "figures[0].colour: unknown field"),
    (lambda d: d.update(benchmark="other"), "benchmark: 'other' does not match the file name"),
    (lambda d: d.pop("commit"), "commit: missing or not a string"),
])
def test_a_malformed_result_is_refused_naming_file_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             change, message: str) -> None:
    root = _copy(tmp_path)
    path = root / "benchmarks" / "results" / "hook_cost.json"
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
    before = (root / "README.md").read_text()
    assert render.main([], root=root) == 2
    assert f"hook_cost.json: {message}" in capsys.readouterr().err
    assert (root / "README.md").read_text() == before


def test_more_rows_than_readme_takes_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy(tmp_path)
    monkeypatch.setattr(record, "RESULTS", root / "benchmarks" / "results")
    monkeypatch.setattr(record, "_git", lambda *args: "")
    figures = [record.Figure(f"f{i}", f"figure {i}", i, "s", readme=10 + i) for i in range(render.README_ROWS)]
    record.write("extra", figures, argv=[])
    assert render.main([], root=root) == 2
    assert f"figures name a README row, at most {render.README_ROWS}" in capsys.readouterr().err


def test_the_shared_parser_gives_each_benchmark_the_same_flags() -> None:
    """record.parser: the description from the docstring's first line, ``--record`` (``--commit`` for a benchmark that
    reads another run's files), ``--baseline DIR`` and integer flags with the benchmark's own defaults."""
    parser = record.parser("What it measures.\n\nHow.", recorded=True, from_files=True, baseline="another checkout",
                           rounds=3, max_tokens=16)
    assert parser.description == "What it measures."
    args = parser.parse_args([])
    assert (args.rounds, args.max_tokens, args.baseline, args.record, args.commit) == (3, 16, None, False, None)
    args = parser.parse_args(["--rounds", "5", "--max-tokens", "2", "--baseline", "/x", "--record", "--commit", "c"])
    assert (args.rounds, args.max_tokens, args.baseline, args.record, args.commit) == (5, 2, "/x", True, "c")
    bare = record.parser(None).parse_args([])
    assert not hasattr(bare, "record") and not hasattr(bare, "baseline")
