"""``patchkit`` command line: validate, plan, fingerprint, report.

Exit codes: 0 success, 1 a check failed (invalid manifest, plan mismatch, ...),
2 bad usage or unreadable input. Errors print as ``file:line: field: message``;
no command prints a traceback for bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from patchkit.plan import ManifestError, PatchkitError


def _manifest_paths(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(sorted(p.glob("*.yaml")) if p.is_dir() else [p])
    return out


def cmd_validate(args: argparse.Namespace) -> int:
    from patchkit import manifest

    paths = _manifest_paths(args.paths) if args.paths else [
        p for d in manifest.registered_manifest_dirs().values() for p in sorted(d.glob("*.yaml"))]
    if not paths:
        print("patchkit validate: no manifest files given or registered", file=sys.stderr)
        return 2
    bad = 0
    for path in paths:
        try:
            m = manifest.load(path)
        except ManifestError as exc:
            bad += 1
            print(exc, file=sys.stderr)
            continue
        pin = "base (extended, never selected)" if m.is_base else f"vllm{m.vllm_version}"
        chain = f", extends {' <- '.join(Path(f).name for f, _ in m.chain[:-1])}" if len(m.chain) > 1 else ""
        print(f"{path}: ok ({len(m.entries)} entries, {len(m.requires)} requirements, {len(m.models)} models, "
              f"{pin}{chain})")
    return 1 if bad else 0


def cmd_plan(args: argparse.Namespace) -> int:
    from patchkit import fingerprint, manifest
    from patchkit.manifest.select import compile_plan
    from patchkit.plan import Runtime, ScopedRebind, runtime_verdict
    from patchkit.runtime.cache import manifest_files
    from patchkit.runtime.targets import Slot, TargetMissing, unwrap_descriptor

    dirs = {args.plugin or "manifest": Path(args.manifests)} if args.manifests else manifest.registered_manifest_dirs()
    if args.plugin and not args.manifests:
        dirs = {k: v for k, v in dirs.items() if k == args.plugin}
    if not dirs:
        print("patchkit plan: no plugin manifests registered (use --manifests DIR)", file=sys.stderr)
        return 2
    runtime = Runtime.detect()
    print(f"vLLM {runtime.vllm_version} commit {runtime.vllm_commit or 'unknown'} "
          f"platform {runtime.platform} python {runtime.python}")
    if runtime.vllm_version is not None:
        from patchkit.runtime.vllm import model_runner_hint

        print(f"model runner: {model_runner_hint()}")
    status = 0
    for plugin, directory in dirs.items():
        compiled = compile_plan(manifest_files(directory), runtime)
        if compiled.manifest is None:
            print(f"{plugin}: {compiled.error}")
            status = 1
            continue
        print(f"{plugin}: {compiled.manifest.file} (plan {compiled.digest})")
        judged = compiled.verdict
        if judged is not None:  # the one every vLLM process applies (patchkit.judge)
            refused = ", ".join(sorted(judged.refused)) or "none"
            print(f"  verdict on {judged.tree} ({judged.digest}): "
                  + (f"the plugin holds; features refused: {refused}" if judged.holds
                     else f"REFUSED: {judged.refusal()}"))
            status = status or (0 if judged.holds else 1)
        origin = _origins(compiled.manifest.file) if args.explain else {}
        if origin:
            print(f"  from {' <- '.join(Path(f).name for f, _ in reversed(compiled.manifest.chain))}")
            print("  " + "; ".join(f"{k}: {v}" for k, v in origin.get("", {}).items()))
        entries = {e.id: e for e in compiled.manifest.entries}
        for n, entry_id in enumerate(compiled.order, 1):
            e = entries[entry_id]
            verdict = compiled.static.get(entry_id) or runtime_verdict(e.when, runtime) or "guards hold"
            if judged is not None and judged.off(e.feature):
                verdict = f"feature-off: feature {e.feature} is refused"
            fp = ""
            if args.fingerprints and e.fingerprint:
                try:
                    __import__(e.module)
                    func, _ = unwrap_descriptor(Slot.resolve(e.target).get_raw())
                    fp = " fingerprint " + fingerprint.compare(e.fingerprint, fingerprint.of_object(func))
                except (ImportError, TargetMissing) as exc:
                    fp = f" target missing ({exc})"
            print(f"  {n:2}. {e.id:32} {e.op:13} {e.target}\n      {verdict}{fp}")
            for key, values in e.when.get("noted", {}).items():
                print(f"      on the running path only where the plugin notes {key} in {values} (decided then)")
            if isinstance(e, ScopedRebind):
                bound = ", ".join(f"{name} -> {ref}" for name, ref in e.bind)
                print(f"      during each call where {e.active_if} holds, binds in {e.namespace}: {bound}")
            if e.id in origin:
                print("      from " + ", ".join(f"{k}: {v}" for k, v in origin[e.id].items()))
        for m in compiled.manifest.models:
            off = judged is not None and judged.off(m.feature)
            said = f"feature-off: feature {m.feature} is refused" if off else None
            said = said or compiled.static.get("model:" + m.arch) or "guards hold"
            print(f"   model {m.arch} -> {m.class_ref}: {said}")
    return status


def _origins(file: str) -> dict[str, dict[str, str]]:
    """Entry id (``""`` for the top level) → field → ``file:line`` it came from, through ``extends``."""
    from patchkit import manifest

    res = manifest.resolved(file)

    def at(path: tuple[str | int, ...]) -> str:
        f, line = res.at(path)
        return f"{Path(f).name}:{line}"

    out: dict[str, dict[str, str]] = {"": {"vllm.version": at(("vllm", "version"))}}
    for i, p in enumerate(res.doc.get("patches", [])):
        out[p["id"]] = {k: at(("patches", i, k)) for k in p}
    if res.doc.get("workers"):
        out["workers"] = {k: at(("workers", k)) for k in res.doc["workers"]}
    return out


def cmd_report(args: argparse.Namespace) -> int:
    """Exit 0 when every report in DIR was read and all agree without failure; 1 otherwise, a file that is not
    this user's own report named with the reason (``report.check``); 2 when DIR cannot be listed."""
    from patchkit.runtime import report

    directory = Path(args.dir)
    if not directory.is_dir():
        print(f"patchkit report: {directory}: not a directory", file=sys.stderr)
        return 2
    try:
        ok, lines = report.check(directory)
    except OSError as exc:
        print(f"patchkit report: {directory}: cannot list: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if ok else 1


def cmd_fingerprint(args: argparse.Namespace) -> int:
    from patchkit import fingerprint
    from patchkit.runtime.targets import Slot, TargetMissing, unwrap_descriptor

    status = 0
    for target in args.targets:
        try:
            __import__(target.partition(":")[0])
            func, _ = unwrap_descriptor(Slot.resolve(target).get_raw())
        except (ImportError, TargetMissing) as exc:
            print(f"{target}: missing ({exc})", file=sys.stderr)
            status = 1
            continue
        print(f"{target} {fingerprint.of_object(func) or 'unverifiable (no source)'}")
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="patchkit", description="Versioned YAML manifests for vLLM plugins.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="schema and semantic checks; errors as file:line: field: message")
    p.add_argument("paths", nargs="*", help="manifest files or folders (default: every registered plugin's)")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("plan", help="the ordered plan for the installed vLLM, with guard verdicts; patches nothing")
    p.add_argument("--manifests", help="a manifest folder (default: every registered plugin's)")
    p.add_argument("--plugin", help="only this registered plugin")
    p.add_argument("--fingerprints", action="store_true", help="import each target module and compare fingerprints")
    p.add_argument("--explain", action="store_true",
                   help="for each entry, the file and line each field came from (through extends)")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("fingerprint", help="print the fingerprint of live targets (imports their modules)")
    p.add_argument("targets", nargs="+", metavar="module:qualname")
    p.set_defaults(func=cmd_fingerprint)
    p = sub.add_parser("report", help="check that every process in DIR applied the same plan")
    p.add_argument("dir")
    p.set_defaults(func=cmd_report)
    from patchkit.cli.review import add_commands
    add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ManifestError as exc:
        print(exc, file=sys.stderr)
        return 1
    except PatchkitError as exc:
        print(f"patchkit: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"patchkit: {exc}", file=sys.stderr)
        return 2


def run() -> None:
    """The ``patchkit`` console script: ``main()``, then exit without freeing the heap.

    A review command holds parsed syntax trees of a whole vLLM tree; freeing them node by node
    at exit took longer than some commands' own work. Output is flushed first; nothing else
    needs an orderly interpreter shutdown (no ``atexit`` handlers of patchkit's own run here).
    """
    from patchkit.cli import review

    review.KEEP = []  # check leaves its trees here instead of freeing them before the exit
    code = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # a closed pipe: the reader went away, the exit code still stands
        pass
    os._exit(code)

