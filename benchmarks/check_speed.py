"""How fast is ``patchkit check`` on a whole vLLM tree, next to parsing every file?

Times, in one process and one run:

1. ``run_check(manifests/afd/vllm-0.32.yaml, "installed")`` — the shipped manifest
   (its patches and its ``requires:``), and the same manifest without ``requires:``
   (what the requirements add);
2. ``run_check`` of a synthetic manifest with 12 plausible targets (methods with
   overriding subclasses, functions bound by from-import in many modules, a
   re-export, a dataclass field);
3. the naive baseline: ``ast.parse`` of every ``.py`` file of the same tree
   (files read inside the timing too; cyclic GC off, as in ``run_check``, so the
   difference is the work avoided, not a GC setting).

4. the whole command as a user runs it, ``python -m patchkit.cli check
   MANIFEST --vllm SRC`` in a fresh process (interpreter start, imports and exit
   included): with ``--no-cache`` (every entry judged, as on the first check of a
   tree), and again with the check cache primed (the entries unchanged since the
   last check on the same tree read back, as while a maintainer reviews).

In-process runs (1-3) do not use the check cache. The command's cache lives in a
temporary folder (``PATCHKIT_CACHE_DIR``), so the user's own is neither read nor
changed.

Each figure is the median of ``--repeat`` runs (default 5) after one untimed
warm-up run of ``run_check`` (imports, page cache). Wall time is what a user
waits; CPU time (this process and its children: ``check`` forks one to use a
second core) is printed too because a busy machine inflates wall time.

Usage: ``python -m benchmarks.check_speed [--vllm SRC] [--manifest FILE] [--repeat N] [--record]``
(default: the installed tree and ``manifests/afd/vllm-0.32.yaml``).
"""

from __future__ import annotations

import ast
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import record
from patchkit.review.check import run_check
from patchkit.static import open_tree

REPO = Path(__file__).resolve().parents[1]

SYNTHETIC_TARGETS = [
    ("vllm.engine.arg_utils:EngineArgs.create_engine_config", "wrap"),
    ("vllm.plugins:load_general_plugins", "wrap"),
    ("vllm.v1.worker.gpu_worker:Worker.init_device", "wrap"),
    ("vllm.platforms.interface:Platform.check_and_update_config", "wrap"),
    ("vllm.forward_context:set_forward_context", "wrap"),
    ("vllm.distributed.parallel_state:init_distributed_environment", "wrap"),
    ("vllm.distributed:init_distributed_environment", "wrap"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model", "wrap"),
    ("vllm.v1.engine.core:EngineCore.__init__", "wrap"),
    ("vllm.model_executor.models.registry:ModelRegistry", "wrap"),
    ("vllm.config.vllm:VllmConfig.additional_config", "set"),
    ("vllm.v1.core.kv_cache_utils:get_kv_cache_configs", "wrap"),
]


def synthetic_manifest(directory: Path) -> Path:
    """A valid manifest naming ``SYNTHETIC_TARGETS`` (no fingerprints: presence, sites and overrides only)."""
    lines = ["format: 1", "plugin: bench", "packages: [afd_patches]", "vllm: {version: '==0.32.0'}",
             "defaults: {on_drift: warn}", "patches:"]
    for i, (target, op) in enumerate(SYNTHETIC_TARGETS):
        lines += [f"  - id: bench.{i}", f"    target: '{target}'", f"    op: {op}", "    why: benchmark"]
        lines.append("    value: 1" if op == "set" else "    with: 'afd_patches.bench:f'")
    path = directory / "bench.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def without_requires(shipped: Path, directory: Path) -> Path:
    """``shipped`` resolved (with its base) and with its ``requires:`` left out, as one file."""
    import yaml

    from patchkit import manifest

    doc = dict(manifest.resolved(shipped).doc)
    doc.pop("requires", None)
    path = directory / "no-requires.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _cpu() -> float:
    """CPU seconds of this process and of its waited-for children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def command(manifest: Path, src: str, cache_dir: str, cached: bool) -> int:
    """``patchkit check`` as a user runs it, in a fresh interpreter (``--no-cache`` unless ``cached``); its
    exit code."""
    argv = [sys.executable, "-m", "patchkit.cli", "check", str(manifest), "--vllm", src,
            *(() if cached else ("--no-cache",))]
    return subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
                          env={**os.environ, "PATCHKIT_CACHE_DIR": cache_dir}).returncode


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, float, object]:
    """Median wall and CPU seconds of ``fn`` over ``repeat`` runs, and its last result."""
    walls, cpus = [], []
    result: object = None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), _cpu()
        result = fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(_cpu() - cpu)
    return statistics.median(walls), statistics.median(cpus), result


def naive_parse_all(src: str) -> int:
    """Read and ``ast.parse`` every ``.py`` file of the tree; return how many parsed."""
    tree = open_tree(src)
    collecting = gc.isenabled()
    gc.disable()
    try:
        count = 0
        for module in tree.modules:
            try:
                ast.parse(tree.data(module))
                count += 1
            except (SyntaxError, ValueError):
                pass
        return count
    finally:
        if collecting:
            gc.enable()


def main(argv: list[str] | None = None) -> int:
    parser = record.parser(__doc__, recorded=True)
    parser.add_argument("--vllm", default="installed", help="tree to check: installed, a folder or a wheel")
    parser.add_argument("--manifest", type=Path, default=REPO / "manifests" / "afd" / "vllm-0.32.yaml")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    tree = open_tree(args.vllm)
    print(f"vLLM {tree.version} at {tree.location}: {len(tree.modules)} modules")
    shipped = args.manifest.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        synthetic = synthetic_manifest(Path(tmp))
        run_check(shipped, args.vllm, use_cache=False)  # warm-up: imports, page cache
        rows = []
        cases = ((shipped.name, shipped), ("same, without requires:", without_requires(shipped, Path(tmp))),
                 (f"synthetic ({len(SYNTHETIC_TARGETS)} targets)", synthetic))
        for label, manifest in cases:
            wall, cpu, result = timed(lambda m=manifest: run_check(m, args.vllm, fmt="json", use_cache=False),
                                      args.repeat)
            code, _ = result  # type: ignore[misc]
            rows.append((label, wall, cpu, code))
        naive_wall, naive_cpu, parsed = timed(lambda: naive_parse_all(args.vllm), args.repeat)
        cache_dir = str(Path(tmp) / "cache")
        cmd_wall, cmd_cpu, cmd_code = timed(lambda: command(shipped, args.vllm, cache_dir, False), args.repeat)
        command(shipped, args.vllm, cache_dir, True)  # primes the check cache
        warm_wall, warm_cpu, warm_code = timed(lambda: command(shipped, args.vllm, cache_dir, True), args.repeat)

    print(f"median of {args.repeat} runs (wall / CPU seconds):")
    for label, wall, cpu, code in rows:
        print(f"  patchkit check, {label:28} {wall:6.3f} / {cpu:6.3f}  (exit {code})"
              f"  naive/ours {naive_wall / wall:5.1f}x wall, {naive_cpu / cpu:5.1f}x CPU")
    print(f"  naive: ast.parse of all {parsed} files      {naive_wall:6.3f} / {naive_cpu:6.3f}")
    print(f"  the command, {shipped.name}, --no-cache    {cmd_wall:6.3f} / {cmd_cpu:6.3f}  (exit {cmd_code})")
    print(f"  the command, {shipped.name}, cache primed  {warm_wall:6.3f} / {warm_cpu:6.3f}  (exit {warm_code})")
    if args.record:
        where = "the installed vLLM tree" if args.vllm == "installed" else Path(args.vllm).name
        figures = [record.Figure("command_s", f"`patchkit check` of {shipped.name} against {where}, the whole "
                                 "command, every entry judged", cmd_wall, "s", 2, f"median of {args.repeat}, "
                                 f"{cmd_cpu:.2f} s CPU; {len(tree.modules):,} modules in the tree"),
                   record.Figure("command_cached_s", "the same command again, entries unchanged since the last "
                                 "check read from the cache", warm_wall, "s", 2,
                                 f"median of {args.repeat}, {warm_cpu:.2f} s CPU")]
        figures += [record.Figure(f"in_process_{i}", f"`run_check`, {label}, in process", wall, "s", 2,
                                  f"{cpu:.2f} s CPU") for i, (label, wall, cpu, _) in enumerate(rows)]
        figures.append(record.Figure("naive_s", f"naive baseline: `ast.parse` of all {parsed:,} files", naive_wall,
                                     "s", 1, f"{naive_cpu:.1f} s CPU"))
        record.write("check_speed", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
