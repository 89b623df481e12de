"""Where the suite's time goes, per test module: the sum of each module's test times from a pytest JUnit file.

    python -m benchmarks.suite_modules AFTER.xml... [--before BEFORE.xml...] [--top 25] [--log OUTPUT --record]

Prints a Markdown table, slowest module first: tests, failures, seconds (setup + call + teardown, as JUnit
records them; several files are summed, e.g. the two sessions of one run), and with ``--before`` the same module's
seconds there. Make the files with README's test command: ``JUNIT_PREFIX=/tmp/run bash scripts/test.sh`` writes
``/tmp/run-vllm.xml`` and ``/tmp/run-rest.xml``; the vLLM starts per module are in the summary that command prints
at the end of the real-vLLM session.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from benchmarks import record


def per_module(junits: list[Path]) -> tuple[Counter[str], Counter[str], Counter[str]]:
    """(seconds, tests, failures or errors) per module path (``tests/x/test_y.py``) over ``junits``."""
    seconds: Counter[str] = Counter()
    tests: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    for case in (c for junit in junits for c in ET.parse(junit).getroot().iter("testcase")):
        module = case.get("classname", "").replace(".", "/") + ".py"
        seconds[module] += float(case.get("time") or 0.0)
        tests[module] += 1
        failed[module] += any(child.tag in ("failure", "error") for child in case)
    return seconds, tests, failed


def main(argv: list[str] | None = None) -> None:
    parser = record.parser(__doc__, recorded=True, from_files=True)
    parser.add_argument("after", type=Path, nargs="+")
    parser.add_argument("--before", type=Path, nargs="+")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--log", type=Path, help="that run's output: its ci-time lines and vLLM starts are read too")
    args = parser.parse_args(argv)
    seconds, tests, failed = per_module(args.after)
    before = per_module(args.before)[0] if args.before else None
    print("| module | tests | failed | seconds |" + (" before |" if before is not None else ""))
    print("|---|---:|---:|---:|" + ("---:|" if before is not None else ""))
    for module, s in seconds.most_common(args.top):
        extra = f" {before.get(module, 0.0):.0f} |" if before is not None else ""
        print(f"| {module} | {tests[module]} | {failed[module]} | {s:.0f} |{extra}")
    rest = sum(seconds.values()) - sum(s for _, s in seconds.most_common(args.top))
    print(f"\n{sum(tests.values())} tests, {sum(failed.values())} failed or errored, {sum(seconds.values()):.0f} s in "
          f"all ({rest:.0f} s outside the top {args.top})")
    if args.record:
        record.write("suite_modules", run_figures(args.log, sum(tests.values()), sum(failed.values())),
                     commit=args.commit)


def run_figures(log: Path | None, tests: int, failed: int) -> list[record.Figure]:
    """The figures of one run of README's test command: tests, failures and, from its output (``log``), the wall
    time of each part (its ``ci-time:`` lines) and of the whole command (install, ruff and all tests, one after
    the other), and the vLLM processes started by the real-vLLM session (its summary is printed first) and by the
    release smokes' sessions together."""
    figures = [record.Figure("tests", "tests run (both sessions)", tests, "", 0),
               record.Figure("failed", "tests failed or errored", failed, "", 0)]
    text = log.read_text(errors="replace") if log else ""
    parts = {match[1]: int(match[2]) for match in re.finditer(r"^ci-time: (.+) (\d+) s$", text, re.M)}
    for i, (part, seconds) in enumerate(parts.items()):
        figures.append(record.Figure(f"time_{i}", f"wall time: {part}", seconds / 60, "min", 1, f"{seconds} s"))
    if {"install", "ruff", "all tests"} <= parts.keys():
        whole = parts["install"] + parts["ruff"] + parts["all tests"]
        figures.append(record.Figure("time_whole", "wall time: the whole command", whole / 60, "min", 1,
                                     f"{whole} s"))
    sessions = [match for match in re.finditer(r"vLLM starts: (\d+) \(([^)]*)\)", text) if match[1] != "0"]
    if sessions:
        figures.append(record.Figure("starts_0", "vLLM processes started by the real-vLLM session",
                                     int(sessions[0][1]), "", 0, sessions[0][2]))
    if len(sessions) > 1:
        smokes = sessions[1:]
        figures.append(record.Figure("starts_smokes", f"vLLM processes started by the {len(smokes)} release smokes",
                                     sum(int(m[1]) for m in smokes), "", 0,
                                     " + ".join(m[1] for m in smokes)))
    return figures


if __name__ == "__main__":
    main()
