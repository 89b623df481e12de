"""``patchkit report DIR`` reads reports as the plan cache reads its files (``patchkit.runtime.cache.read_own``):
this user's own regular files with one link, not writable by others, of bounded size. Anything else is named
with the reason and fails the check; nothing makes it wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from patchkit import cli

NOBODY = 65534
REPORT = {"pid": 1, "role": "main", "plugin": "p", "digest": "d1", "status": "active",
          "entries": [{"id": "e", "outcome": "applied"}]}


def _write(path: Path, data: dict[str, object] = REPORT, mode: int = 0o600) -> Path:
    path.write_text(json.dumps(data))
    path.chmod(mode)
    return path


@pytest.fixture()
def reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A folder holding one good report, which passes the check alone."""
    folder = tmp_path / "reports"
    folder.mkdir()
    _write(folder / "p-1.json")
    assert cli.main(["report", str(folder)]) == 0, capsys.readouterr().out
    capsys.readouterr()
    return folder


def _refused(folder: Path, capsys: pytest.CaptureFixture[str], name: str, why: str) -> None:
    code = cli.main(["report", str(folder)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert f"{name}: REFUSED: {why}" in out and "NOT OK" in out, out


def test_a_fifo_named_like_a_report_is_refused_without_waiting(reports: Path) -> None:
    os.mkfifo(reports / "zz.json")
    code = ("import sys; from patchkit.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "report", str(reports)], capture_output=True, text=True,
                          timeout=30, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 1, done
    assert "zz.json: REFUSED: not a regular file (a FIFO)" in done.stdout, done.stdout


def test_a_symlink_is_refused(reports: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (reports / "link.json").symlink_to(_write(tmp_path / "elsewhere.json"))
    _refused(reports, capsys, "link.json", "a symbolic link")


def test_a_world_writable_report_is_refused(reports: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(reports / "p-2.json", {**REPORT, "pid": 2}, mode=0o666)
    _refused(reports, capsys, "p-2.json", "writable by others (mode 666)")


def test_a_hard_linked_report_is_refused(reports: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.link(_write(tmp_path / "elsewhere.json"), reports / "hard.json")
    _refused(reports, capsys, "hard.json", "2 hard links")


def test_an_oversized_report_is_refused(reports: Path, capsys: pytest.CaptureFixture[str]) -> None:
    big = _write(reports / "p-3.json", {**REPORT, "pid": 3, "padding": "x" * (8 << 20)})  # far past any report
    _refused(reports, capsys, "p-3.json", f"{big.stat().st_size} bytes, more than")


def test_a_report_owned_by_another_user_is_refused(reports: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """As root the file is given to ``nobody``; otherwise this process reads as another user would (its
    effective uid reported as ``nobody``'s), which is the same check from the other side."""
    foreign = _write(reports / "p-4.json", {**REPORT, "pid": 4})
    owner, me = (NOBODY, 0) if os.geteuid() == 0 else (os.geteuid(), NOBODY)
    if os.geteuid() == 0:
        os.chown(foreign, NOBODY, NOBODY)
    else:
        monkeypatch.setattr(os, "geteuid", lambda: NOBODY)
    _refused(reports, capsys, "p-4.json", f"owned by uid {owner}, not by this user ({me})")


@pytest.mark.parametrize("title,role", [
    ("VLLM::Worker_TP0 ", "Worker_TP0"), ("ABC::EngineCore_DP1", "EngineCore_DP1"),
    ("[pytest-xdist running] tests/a.py::test_x", "main"), ("python tests/a.py::x", "main")])
def test_the_role_comes_from_vllms_title_only(monkeypatch, title, role):
    """A vLLM process's title (``PREFIX::Name``) names its role; any other program's title does not."""
    from types import SimpleNamespace

    from patchkit.runtime.report import process_role

    monkeypatch.delenv("PATCHKIT_PROCESS_ROLE", raising=False)
    monkeypatch.setitem(sys.modules, "setproctitle", SimpleNamespace(getproctitle=lambda: title))
    assert process_role() == role
