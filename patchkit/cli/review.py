"""Review commands of the ``patchkit`` command line (those that read vLLM without importing it).

``add_commands(subparsers)`` registers:

- ``check MANIFEST --vllm SRC [--base SRC] [--format text|markdown|json] [--no-cache]
  [--strict-call-paths]`` — see ``patchkit.review.check``. SRC is ``installed``, a folder or a ``.whl``.
  Exit 0 nothing would fail, 1 a required entry would fail (or, with ``--strict-call-paths``, a call
  path leads to a sibling no entry patches), 2 bad input.
- ``retarget MANIFEST --vllm SRC --out NEW [--version SPEC] [--commit SHA]
  [--reviewed FILE] [--base SRC]`` — see ``patchkit.review.retarget``. Exit 0 nothing needs a
  human, 1 entries flagged for review (NEW is written), 2 bad input.
- ``diff OLD NEW [--format text|markdown|json]``, ``diff FILE --git REV`` and
  ``diff --git-driver ARGS…`` (git's seven diff-driver arguments; also
  recognised when exactly seven paths are given) — see ``patchkit.review.diff``.
  Exit 0 equal, 1 different, 2 bad input; the driver form always exits 0.
- ``deps MANIFEST [--vllm SRC] [--src DIR] [--format text|json] [--suggest]`` —
  see ``patchkit.review.deps``. Exit 0 every used vLLM symbol declared and every
  requirement used, 1 a gap, 2 bad input.
- ``docs [--check] [--out PATH]`` — see ``patchkit.review.docs``. Exit 0 written /
  current, 1 stale (``--check``), 2 bad input.

Results go to stdout; bad-input messages (exit 2) to stderr. No bad input
produces a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _emit(code: int, output: str, error_codes: tuple[int, ...] = (2,)) -> int:
    stream = sys.stderr if code in error_codes else sys.stdout
    if output:
        stream.write(output if output.endswith("\n") else output + "\n")
    return code


KEEP: list[object] | None = None  # set by ``patchkit.cli.run``: what to leave unfreed until its hard exit


def cmd_check(args: argparse.Namespace) -> int:
    """Run ``patchkit check`` and print its output (stderr for exit 2)."""
    from patchkit.review.check import run_check

    code, output = run_check(args.manifest, args.vllm, args.base, args.format, keep=KEEP,
                             use_cache=not args.no_cache, strict_call_paths=args.strict_call_paths)
    return _emit(code, output)


def cmd_retarget(args: argparse.Namespace) -> int:
    """Run ``patchkit retarget``: write the new manifest, print what needs a human."""
    from patchkit.review.retarget import run_retarget

    code, output = run_retarget(args.manifest, args.vllm, args.out, args.version, args.commit, args.reviewed,
                                args.base)
    return _emit(code, output)


def cmd_diff(args: argparse.Namespace) -> int:
    """Run ``patchkit diff`` in its file, ``--git REV`` or git-driver form."""
    from patchkit.review.diff import run_diff, run_git_driver

    paths: list[str] = args.paths
    if args.git_driver or (len(paths) == 7 and args.git is None):
        code, output = run_git_driver(paths)
        return _emit(code, output)
    if args.git is not None:
        if len(paths) != 1:
            return _emit(2, "patchkit diff: --git REV takes exactly one manifest file")
        code, output = run_diff(paths[0], None, args.format, args.git)
    elif len(paths) != 2:
        return _emit(2, "patchkit diff: give OLD and NEW manifest files (or one file and --git REV)")
    else:
        code, output = run_diff(paths[0], paths[1], args.format)
    return _emit(code, output)


def cmd_docs(args: argparse.Namespace) -> int:
    """Run ``patchkit docs``: write docs/patches.md, or with ``--check`` say whether it is current."""
    from patchkit.review.docs import run_docs

    code, output = run_docs(Path(args.out), args.check)
    return _emit(code, output, (1, 2))


def cmd_deps(args: argparse.Namespace) -> int:
    """Run ``patchkit deps``: the plugin's vLLM symbols against the manifest's ``requires:``."""
    from patchkit.review.deps import run_deps

    code, output = run_deps(args.manifest, args.vllm, args.src, args.format, args.suggest)
    return _emit(code, output)


def add_commands(subparsers: Any) -> None:
    """Add the review commands to ``patchkit``'s subparsers (an ``argparse`` subparsers action)."""
    p = subparsers.add_parser(
        "check", help="a manifest against a vLLM tree (installed, folder or wheel) without importing it")
    p.add_argument("manifest", help="the manifest file")
    p.add_argument("--vllm", required=True, metavar="SRC", help="'installed', a vLLM source folder or a .whl file")
    p.add_argument("--base", metavar="SRC", help="the tree the manifest was written against: diff drifted targets")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    p.add_argument("--no-cache", action="store_true",
                   help="judge every entry again (by default the rows of entries unchanged since the last check "
                        "of this manifest on the same trees are reused)")
    p.add_argument("--strict-call-paths", action="store_true",
                   help="exit 1 when a caller chooses between a patched target and a same-named sibling that no "
                        "entry patches (by default such siblings are reported and counted only)")
    p.set_defaults(func=cmd_check)

    p = subparsers.add_parser(
        "retarget", help="write a manifest for another vLLM release; flag drifted entries for review")
    p.add_argument("manifest", help="the manifest to start from")
    p.add_argument("--vllm", required=True, metavar="SRC", help="the new release: 'installed', a folder or a .whl")
    p.add_argument("--out", required=True, metavar="NEW", help="where to write the new manifest")
    p.add_argument("--version", metavar="SPEC", help="vllm.version of the new manifest (default '==<tree version>')")
    p.add_argument("--commit", metavar="SHA", help="vllm.commit (default: the tree's commit, else null)")
    p.add_argument("--reviewed", metavar="FILE",
                   help="an earlier reviewed output for this release: the output is that file brought up to date "
                        "(its comments, order, remove: and reviews kept)")
    p.add_argument("--base", metavar="SRC", help="the tree of the old pin: show each flagged entry's source diff")
    p.set_defaults(func=cmd_retarget)

    p = subparsers.add_parser(
        "diff", help="semantic diff of two manifests (pins, entries, order, guards, fingerprints)")
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="OLD NEW; or FILE with --git REV; or git's 7 driver arguments with --git-driver")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    p.add_argument("--git", metavar="REV", help="compare FILE with its version at git revision REV")
    p.add_argument("--git-driver", action="store_true",
                   help="act as a git diff driver (git config diff.patchkit.command 'patchkit diff --git-driver')")
    p.set_defaults(func=cmd_diff)

    p = subparsers.add_parser(
        "deps", help="every vLLM symbol the plugin's packages use, against the manifest's requires:")
    p.add_argument("manifest", help="the manifest file (its 'packages' are scanned)")
    p.add_argument("--vllm", default="installed", metavar="SRC", help="'installed' (default), a folder or a .whl")
    p.add_argument("--src", metavar="DIR", help="a folder holding the packages (default: where they import from)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--suggest", action="store_true", help="print YAML for undeclared symbols, with fingerprints")
    p.set_defaults(func=cmd_deps)

    p = subparsers.add_parser("docs", help="write docs/patches.md from the registered manifests")
    p.add_argument("--check", action="store_true", help="exit 1 if the file is stale instead of writing it")
    p.add_argument("--out", default="docs/patches.md", metavar="PATH", help="the file (default docs/patches.md)")
    p.set_defaults(func=cmd_docs)
