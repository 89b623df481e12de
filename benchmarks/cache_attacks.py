"""Time to a normal activation when the cache directory holds a planted file, per kind of plant.

For every file name patchkit reads from its cache (the compiled plan, the
fingerprints) and every kind of plant the attack suite uses (symlink to a
victim-owned payload, FIFO, hard link, foreign owner, group/world-writable,
huge, garbage), a fresh process activates a small plan; the figure is the time
``activate()`` took there (plan recompiled on the miss), and whether the payload
ran (it must not). The planting code is the attack suite's own
(``tests/patchkit/test_runtime_trust.py``), imported from it.

    python -m benchmarks.cache_attacks
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    from tests.patchkit import test_runtime_trust as suite

    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        src, folder, genuine = base / "src", base / "manifests", base / "genuine"
        suite._write_tree(src)
        probe = subprocess.run([sys.executable, "-c", "import tvictim.core, patchkit.fingerprint as f;"
                                "print(f.of_object(tvictim.core.Engine.run))"],
                               env={"PYTHONPATH": f"{src}:{REPO}"}, capture_output=True, text=True, check=True)
        folder.mkdir()
        (folder / "m.yaml").write_text(suite.MANIFEST.replace("{fingerprint}", probe.stdout.strip()))
        clean = suite.run_child(src, folder, genuine, base / "m0")
        warm = suite.run_child(src, folder, genuine, base / "m0")
        names = sorted(p.name for p in genuine.iterdir())
        print(f"activate() in a fresh process: empty cache {clean['seconds'] * 1000:.0f} ms, "
              f"warm cache {warm['seconds'] * 1000:.1f} ms")
        print(f"{'planted':16} {'file':44} {'activate ms':>12} {'applied':>8} {'payload ran':>12}")
        worst = 0.0
        for kind in suite.KINDS:
            for name in names:
                cache, marker = base / f"c-{kind}-{name}", base / f"m-{kind}-{name}"
                suite.plant(cache, name, kind, suite.poisoned(genuine, name), base)
                r = suite.run_child(src, folder, cache, marker)
                worst = max(worst, r["seconds"])
                print(f"{kind:16} {name:44} {r['seconds'] * 1000:12.0f} {r['run'] == ['loud', 2]!s:>8} "
                      f"{marker.exists()!s:>12}")
        print(f"worst: {worst * 1000:.0f} ms (goal: under 1 s, payload never runs)")


if __name__ == "__main__":
    main()
