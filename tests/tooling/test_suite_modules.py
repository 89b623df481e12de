"""benchmarks.suite_modules reads a run of README's test command: the whole command's time is the sum of its
sequential parts, and the real-vLLM session's starts are told apart from the release smokes'."""

from __future__ import annotations

from pathlib import Path

from benchmarks.suite_modules import run_figures

LOG = """ci-time: install 99 s
ci-time: ruff 0 s
=== vLLM starts: 284 (249 engines, 27 API servers, 8 front ends; 276 forked) ===
ci-time: suite(0.32.0, vllm) 2160 s
====== vLLM starts: 0 (0 engines, 0 API servers, 0 front ends; 0 forked) =======
ci-time: suite(0.32.0, not vllm) 701 s
====== vLLM starts: 10 (9 engines, 0 API servers, 1 front end; 9 forked) =======
ci-time: smoke(0.27.1) 336 s
====== vLLM starts: 9 (9 engines, 0 API servers, 0 front ends; 9 forked) =======
ci-time: smoke(0.28.0) 294 s
ci-time: all tests 2160 s
"""


def test_whole_command_and_starts_per_session(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text(LOG)
    figures = {f.key: f for f in run_figures(log, 1347, 0)}
    assert figures["time_whole"].detail == "2259 s"  # install + ruff + all tests
    assert figures["starts_0"].value == 284 and "249 engines" in figures["starts_0"].detail
    assert figures["starts_smokes"].value == 19 and figures["starts_smokes"].detail == "10 + 9"
    assert "2 release smokes" in figures["starts_smokes"].what


def test_a_run_without_its_last_part_has_no_whole_time(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text(LOG.replace("ci-time: all tests 2160 s\n", ""))
    assert "time_whole" not in {f.key for f in run_figures(log, 1, 1)}
