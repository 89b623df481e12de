"""What ``patchkit.plan``'s ``_Record`` saves: importing the module as it is against the same module with
``@dataclass(frozen=True)`` generating ``__setattr__``, ``__delattr__``, ``__eq__`` and ``__repr__`` instead.

    .venv/bin/python -m benchmarks.plan_classes_cost [--runs 15] [--record]

Each variant is imported in ``--runs`` fresh interpreters that first import what ``plan`` imports (those are paid
by the plugin hook either way); the figure is the median wall time of executing ``plan`` itself. The frozen
variant is made from the current source by a text substitution (written to a temporary folder), so the two
differ only in how the classes get their methods. Every vLLM process imports ``plan`` in the plugin hook (budget
10 ms in all, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import record
from benchmarks.record import REPO

RECORD_DECORATOR = "@dataclass(slots=True, kw_only=True, eq=False, repr=False)"
FROZEN_DECORATOR = "@dataclass(slots=True, kw_only=True, frozen=True)"
CHILD = """
import importlib.util, sys, time
sys.path.insert(0, {repo!r})
import dataclasses, hashlib, json, typing, patchkit.fingerprint  # what plan imports
t = time.perf_counter()
spec = importlib.util.spec_from_file_location("plan_variant", {path!r})
module = importlib.util.module_from_spec(spec)
sys.modules["plan_variant"] = module
spec.loader.exec_module(module)
print(time.perf_counter() - t)
"""


def variants(folder: Path) -> dict[str, Path]:
    """The module as it is and its frozen-dataclass twin, as files in ``folder``."""
    source = (REPO / "patchkit" / "plan.py").read_text()
    if RECORD_DECORATOR not in source or "(_Record)" not in source:
        raise SystemExit("patchkit/plan.py no longer uses _Record: nothing to compare")
    frozen = source.replace(RECORD_DECORATOR, FROZEN_DECORATOR).replace("(_Record)", "")
    paths = {"_Record (as shipped)": folder / "plan_record.py", "frozen dataclasses": folder / "plan_frozen.py"}
    for (_, path), text in zip(paths.items(), (source, frozen), strict=True):
        path.write_text(text)
    return paths


def median_ms(path: Path, runs: int) -> float:
    code = CHILD.format(repo=str(REPO), path=str(path))
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)  # writes its .pyc
    return statistics.median(
        float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
        for _ in range(runs)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    record.add_argument(parser)
    args = parser.parse_args()
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, path) in enumerate(variants(Path(tmp)).items()):
            ms = median_ms(path, args.runs)
            print(f"{name:22s} import of plan: median {ms:6.2f} ms over {args.runs} runs")
            figures.append(record.Figure(f"plan_import_{i}", f"importing `patchkit.plan` (every vLLM process), {name}",
                                         ms, "ms", 1, f"median of {args.runs} fresh interpreters"))
    if args.record:
        record.write("plan_classes_cost", figures)


if __name__ == "__main__":
    main()
