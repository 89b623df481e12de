"""What judging ``requires:`` at run time costs, and where it is paid.

Prints, for ``manifests/afd/vllm-0.32.yaml`` on the installed vLLM:

1. ``patchkit.review.requirements.verdicts(manifest)`` — what ``Status.requirements`` runs once
   in a process that asks for AFD (afd: the front end, when the engine config is built),
   median of ``--runs`` fresh processes (wall and CPU seconds; imports of the static
   model included, the manifest already parsed);
2. how many requirements, and how many modules the judgement parsed;
3. that the plugin hook itself never judges them: in a fresh process, after
   ``import vllm`` and ``register_afd()``, ``patchkit.review.requirements`` and
   ``patchkit.static`` are not in ``sys.modules``.

Usage: ``python -m benchmarks.requirement_verdicts [--runs N]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_TIMED = """
import json, time
from patchkit import manifest
m = manifest.load({path!r})
wall, cpu = time.perf_counter(), time.process_time()
from patchkit.review import requirements
v = requirements.verdicts(m)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(json.dumps({{"wall": wall, "cpu": cpu, "n": len(v), "ok": sum(x.verdict == "ok" for x in v)}}))
"""

_HOOK = """
import sys, vllm, afd_patches
afd_patches.register_afd()
print(sorted(m for m in sys.modules if m.startswith(("patchkit.review.requirements", "patchkit.static"))))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    path = str(REPO / "manifests" / "afd" / "vllm-0.32.yaml")
    rows = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", _TIMED.format(path=path)], capture_output=True, text=True,
                             check=True, cwd=REPO).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    wall = statistics.median(r["wall"] for r in rows)
    cpu = statistics.median(r["cpu"] for r in rows)
    print(f"requirements.verdicts(vllm-0.32.yaml): {rows[0]['n']} requirements, {rows[0]['ok']} ok; "
          f"median of {args.runs} fresh processes {wall * 1000:.0f} ms wall, {cpu * 1000:.0f} ms CPU")
    env_out = subprocess.run([sys.executable, "-c", _HOOK], capture_output=True, text=True, check=True,
                             cwd=REPO, env={"VLLM_NO_USAGE_STATS": "1", "PATH": "/usr/bin:/bin"}).stdout
    print(f"modules of the requirement judgement loaded by the plugin hook: {env_out.strip().splitlines()[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
