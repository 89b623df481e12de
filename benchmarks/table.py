"""The benchmark table, in one run: patchkit against a hand-written plugin, and the other figures.

1. Hook cost per process: patchkit's ``register_afd()`` vs ``handwritten_plugin.register()``
   (the same changes in plain Python), median of N fresh processes, in the front-end
   situation (``vllm.engine.arg_utils`` imported, so both apply their patches now);
   each with the garbage collector as ``import vllm`` left it and after ``gc.collect()``
   (see ``hook_cost.sample``), and the number of tracked objects each hook creates,
   plus the hand-written plugin registering its models the way vLLM's plugin docs
   show (importing ``ModelRegistry`` in the hook).
2. Call overhead of replace / wrap entries (``call_overhead.py``).
3. ``patchkit check`` on the whole installed vLLM tree vs a naive parse (``check_speed.py``).
4. AFD 1A1F vs plain vLLM decode tokens/s (``afd_throughput.py``).

    python -m benchmarks.table [--runs 15] [--skip-afd]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile

from benchmarks.hook_cost import REPO, sample

HERE = REPO / "benchmarks"
# The hand-written hooks as measured since they were written: the probe process finds the plugin module
# through a sys.path entry of its own, inside the timed code, as a plugin found on sys.path would be.
HANDWRITTEN = f"sys.path.insert(0, {str(HERE)!r}); import handwritten_plugin; handwritten_plugin.register()"
DOCUMENTED = f"sys.path.insert(0, {str(HERE)!r}); import handwritten_plugin; handwritten_plugin.register(eager=True)"
PATCHKIT = "import afd_patches; afd_patches.register_afd()"
FRONT_END = "import vllm.engine.arg_utils"
HOOKS = {"patchkit": PATCHKIT, "hand-written": HANDWRITTEN, "hand-written, eager models": DOCUMENTED}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--skip-afd", action="store_true", help="leave out the AFD throughput run (~3 min)")
    args = parser.parse_args()
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "patchkit"), str(REPO / "afd_patches"),
                    str(HERE)], check=True)
    ms: dict[tuple[str, bool], list[float]] = {(h, c): [] for h in HOOKS for c in (False, True)}
    with tempfile.TemporaryDirectory() as cache:
        sample(PATCHKIT, FRONT_END, cache)  # fill the compiled-plan cache
        for _ in range(args.runs):  # interleaved, so every variant sees the same machine
            for (hook, collect), out in ms.items():
                out.append(sample(HOOKS[hook], FRONT_END, cache, collect=collect)["ms"])
        allocated = {h: sample(HOOKS[h], FRONT_END, cache, count=True)["allocated"] for h in HOOKS}
    med = {k: statistics.median(v) for k, v in ms.items()}
    print(f"== hook cost per process, front end, median of {args.runs} fresh processes each (ms)")
    print(f"{'hook':28} {'gc as found':>12} {'gc collected first':>19} {'tracked objects made':>21}")
    for hook in HOOKS:
        print(f"{hook:28} {med[hook, False]:12.2f} {med[hook, True]:19.2f} {allocated[hook]:21d}")
    for collect, label in ((False, "gc as found"), (True, "gc collected first")):
        ratio = med["patchkit", collect] / med["hand-written", collect]
        print(f"ratio patchkit / hand-written, {label}: {ratio:.2f}x")
    print()
    scripts = ["call_overhead", "check_speed"] + ([] if args.skip_afd else ["afd_throughput"])
    for script in scripts:
        print(f"== benchmarks.{script}", flush=True)
        out = subprocess.run([sys.executable, "-m", f"benchmarks.{script}"], capture_output=True, text=True, cwd=REPO)
        lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
        print("\n".join(lines[-6:]) if out.returncode == 0 else f"failed:\n{out.stderr[-2000:]}", flush=True)
        print()


if __name__ == "__main__":
    main()
