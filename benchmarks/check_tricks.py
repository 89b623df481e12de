"""What each of ``patchkit check``'s three speed tricks buys: the whole command, with each trick taken away.

    .venv/bin/python -m benchmarks.check_tricks MANIFEST=TREE... [--runs 7] [--record]

The tricks: ``check`` forks a child that checks half of the entries on a second core
(``patchkit.review.forked``); it turns the cyclic garbage collector off while it parses
(``gc.disable`` in ``run_check``); the console script leaves with ``os._exit`` instead of freeing the
parsed trees (``patchkit.cli.run``). Each variant runs ``patchkit check MANIFEST --vllm TREE`` in a fresh
interpreter (for each ``MANIFEST=TREE`` case: a manifest and a tree, ``installed``, a folder or a wheel),
with the named tricks taken away by replacing them before ``main`` runs (no change to
patchkit itself); the variants take turns, ``--runs`` rounds, and each figure is the median wall time
of the whole process (interpreter start, imports and exit included), as a user waits for it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import record
from benchmarks.record import REPO

DRIVER = """
import gc, sys, types
fork, collect_off, hard_exit = {flags!r}
from patchkit.review import check, forked
if not fork:
    forked.available = lambda: False
if not collect_off:
    check.gc = types.SimpleNamespace(disable=lambda: None, enable=gc.enable, isenabled=gc.isenabled,
                                     collect=gc.collect)
from patchkit import cli
sys.argv = ["patchkit", "check", {manifest!r}, "--vllm", {tree!r}]
if hard_exit:
    cli.run()
sys.exit(cli.main())
"""
VARIANTS = {  # name: (fork, gc off, os._exit)
    "all three (as shipped)": (True, True, True),
    "without the fork": (False, True, True),
    "without gc.disable": (True, False, True),
    "without os._exit": (True, True, False),
    "none of them": (False, False, False),
}


def once(flags: tuple[bool, bool, bool], manifest: str, tree: str) -> tuple[float, int]:
    """Wall seconds and exit code of one run of the command with ``flags``."""
    code = DRIVER.format(flags=flags, manifest=manifest, tree=tree)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, check=False)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        raise SystemExit(f"check failed (exit {proc.returncode}): {proc.stderr.decode()[-2000:]}")
    return wall, proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", metavar="MANIFEST=TREE")
    parser.add_argument("--runs", type=int, default=7)
    record.add_argument(parser)
    args = parser.parse_args(argv)
    figures = []
    for case in args.cases:
        manifest, _, tree = case.partition("=")
        tree = tree or "installed"
        once(VARIANTS["all three (as shipped)"], manifest, tree)  # warm-up: page cache, byte code
        walls: dict[str, list[float]] = {name: [] for name in VARIANTS}
        codes: dict[str, set[int]] = {name: set() for name in VARIANTS}
        names = list(VARIANTS)
        for round_ in range(args.runs):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:  # rotate who goes first
                wall, code = once(VARIANTS[name], manifest, tree)
                walls[name].append(wall)
                codes[name].add(code)
        print(f"patchkit check {manifest} --vllm {tree}: median wall of {args.runs} runs per variant")
        label = f"{Path(manifest).name} against {Path(tree).name if tree != 'installed' else 'the installed tree'}"
        for name in names:
            wall = statistics.median(walls[name])
            print(f"  {name:24} {wall:6.3f} s  (min {min(walls[name]):.3f}, max {max(walls[name]):.3f}; "
                  f"exit {sorted(codes[name])})")
            key = f"{Path(manifest).stem}-{'installed' if tree == 'installed' else 'wheel'}-{names.index(name)}"
            figures.append(record.Figure(key, f"`patchkit check` {label}, {name}", wall, "s", 2,
                                         f"median of {args.runs}, {min(walls[name]):.2f}–{max(walls[name]):.2f} s"))
    if args.record:
        record.write("check_tricks", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
