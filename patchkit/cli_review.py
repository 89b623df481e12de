"""Review commands of the ``patchkit`` command line (those that read vLLM without importing it).

``add_commands(subparsers)`` registers:

- ``check MANIFEST --vllm SRC [--base SRC] [--format text|markdown|json]`` —
  see ``patchkit.check``. SRC is ``installed``, a folder or a ``.whl``. Exit 0
  nothing would fail, 1 a required entry would fail, 2 bad input. Results go to
  stdout; bad-input messages to stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def cmd_check(args: argparse.Namespace) -> int:
    """Run ``patchkit check`` and print its output (stderr for exit 2)."""
    from patchkit.check import run_check

    code, output = run_check(args.manifest, args.vllm, args.base, args.format)
    stream = sys.stderr if code == 2 else sys.stdout
    stream.write(output if output.endswith("\n") else output + "\n")
    return code


def add_commands(subparsers: Any) -> None:
    """Add the review commands to ``patchkit``'s subparsers (an ``argparse`` subparsers action)."""
    p = subparsers.add_parser(
        "check", help="a manifest against a vLLM tree (installed, folder or wheel) without importing it")
    p.add_argument("manifest", help="the manifest file")
    p.add_argument("--vllm", required=True, metavar="SRC", help="'installed', a vLLM source folder or a .whl file")
    p.add_argument("--base", metavar="SRC", help="the tree the manifest was written against: diff drifted targets")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    p.set_defaults(func=cmd_check)
