"""Cost of the plugin hook per vLLM process: ``register_afd()`` timed after ``import vllm``.

Each sample is a fresh Python process (as every vLLM process is). Two situations:
- "after import vllm": the entries wait for their modules (deferred);
- "front end": also ``vllm.engine.arg_utils`` imported first, as when vLLM's
  front end calls the hook, so the entries are applied now and their fingerprints checked.
Also shown: the first process after a manifest change (cold cache: YAML and
schema validation), a naive hook that imports yaml + jsonschema and validates the
manifest in every process, which modules the hook adds that vLLM had not imported,
and what the cache directory holds afterwards (JSON data only: nothing executable).
Goal: <= 10 ms after ``import vllm`` (issue 29; it was 3 ms, with <= 6 ms in the front end, before).

    python -m benchmarks.hook_cost [--runs 15] [--record]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import record

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import gc, json, sys, time
import vllm
{pre}
if {collect}:
    gc.collect()  # see sample(): start every hook from the same collector state
if {count}:
    gc.disable()  # count the hook's tracked allocations (no collection resets the counter)
collections = [g["collections"] for g in gc.get_stats()]
allocated = gc.get_count()[0]
before = set(sys.modules)
t0 = time.perf_counter()
{hook}
t1 = time.perf_counter()
allocated = gc.get_count()[0] - allocated
collected = [g["collections"] for g in gc.get_stats()] != collections
added = sorted(m for m in set(sys.modules) - before if not m.startswith(("patchkit", "afd_patches")))
print("PROBE " + json.dumps({{"ms": (t1 - t0) * 1000, "added": added, "allocated": allocated,
                              "collected": collected}}))
"""

HOOKS = {
    "patchkit": "import afd_patches; afd_patches.register_afd()",
    "naive": (
        "import yaml, jsonschema, pathlib\n"
        "schema = json.loads(pathlib.Path({schema!r}).read_text())\n"
        "doc = yaml.safe_load(pathlib.Path({manifest!r}).read_text())\n"
        "doc = {{**yaml.safe_load(pathlib.Path({base!r}).read_text()), **doc}}\n"  # 0.32's file: extends + pin
        "del doc['extends']\n"
        "jsonschema.Draft202012Validator(schema).validate(doc)"
    ),
}


def sample(hook: str, pre: str, cache_dir: str, collect: bool = False, count: bool = False) -> dict:
    """Time ``hook`` in a fresh process after ``import vllm`` and ``pre``.

    ``collect``: run ``gc.collect()`` first. After ``import vllm`` the collector
    is a few hundred allocations short of a generation-1 collection (about 2 ms
    here), so whichever hook allocates more than that pays it, although vLLM
    would pay the same collection a moment later anyway. Collecting first
    measures the hook's own work; without it the figure is "as found".
    ``count``: also collect first, then switch the collector off, so that
    ``allocated`` is the number of tracked objects the hook created (the
    figure that decides whether it tips the collector over).
    The result also says whether a collection ran during the hook (``collected``).
    """
    code = PROBE.format(pre=pre, hook=hook, collect=collect or count, count=count)
    env = {**os.environ, "PATCHKIT_CACHE_DIR": cache_dir, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    env.pop("PATCHKIT_REPORT_DIR", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    for line in out.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    raise RuntimeError(out.stderr[-2000:])


def main() -> None:
    parser = record.parser(__doc__, recorded=True, runs=15)
    args = parser.parse_args()
    # What a wheel install does: byte-compile the package (this sandbox sets PYTHONDONTWRITEBYTECODE).
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "patchkit"), str(REPO / "afd_patches")],
                   check=True)
    naive = HOOKS["naive"].format(schema=str(REPO / "schemas" / "manifest.schema.json"),
                                  manifest=str(REPO / "manifests" / "afd" / "vllm-0.32.yaml"),
                                  base=str(REPO / "manifests" / "afd" / "base.yaml"))
    situations = {"after import vllm": "", "front end": "import vllm.engine.arg_utils"}
    with tempfile.TemporaryDirectory() as cache_dir:
        rows = []
        for label, pre in situations.items():
            cold = sample(HOOKS["patchkit"], pre, tempfile.mkdtemp(dir=cache_dir))
            warm_dir = tempfile.mkdtemp(dir=cache_dir)
            sample(HOOKS["patchkit"], pre, warm_dir)  # fills the cache
            warm = [sample(HOOKS["patchkit"], pre, warm_dir) for _ in range(args.runs)]
            base = [sample(naive, pre, warm_dir) for _ in range(args.runs)]
            med = statistics.median(s["ms"] for s in warm)
            med_naive = statistics.median(s["ms"] for s in base)
            rows.append((label, med, max(s["ms"] for s in warm), cold["ms"], med_naive, warm[0]["added"]))
            cached = sorted(os.listdir(warm_dir))
            for name in cached:  # raises unless every cache file is JSON
                json.loads(Path(warm_dir, name).read_bytes())
    print(f"hook cost per process, median of {args.runs} fresh processes (python {sys.version.split()[0]})")
    print(f"{'situation':20} {'patchkit ms':>12} {'max ms':>8} {'cold ms':>8} {'naive ms':>9}  modules added")
    for label, med, mx, cold, med_naive, added in rows:
        print(f"{label:20} {med:12.2f} {mx:8.2f} {cold:8.1f} {med_naive:9.1f}  {', '.join(added) or 'none'}")
    print(f"cache directory holds: {', '.join(cached)} (all JSON; goal: <= 10 ms after import vllm)")
    if args.record:
        _, med, mx, cold, _, _ = rows[0]
        front = rows[1]
        record.write("hook_cost", [
            record.Figure("hook_ms", "what the plugin costs a vLLM process when AFD is off (`register_afd()` after "
                          "`import vllm`)", med, "ms", 1, f"median of {args.runs} processes, max {mx:.1f} ms; "
                          f"the first after a manifest change {cold:.0f} ms", readme=2),
            record.Figure("front_end_ms", "the same in vLLM's front end (entries applied at once, fingerprints "
                          "checked)", front[1], "ms", 1, f"max {front[2]:.1f} ms"),
        ])


if __name__ == "__main__":
    main()
