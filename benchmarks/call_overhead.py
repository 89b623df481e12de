"""Per-call overhead of patched functions: ``replace`` vs a direct call, ``wrap`` vs a hand-written closure.

Both sides are measured side by side in one process, interleaved, best of
several repeats (the minimum is the least noisy estimate of the true cost).

    python benchmarks/call_overhead.py
"""

from __future__ import annotations

import sys
import tempfile
import textwrap
import timeit
from pathlib import Path

MODULES = {
    "bench_target.py": """
        def work(x):
            return x + 1
    """,
    "bench_plug.py": """
        def replacement(x):
            return x + 1

        def wrapper(original, x):
            return original(x)
    """,
}
MANIFEST = """
format: 1
plugin: bench
packages: [bench_plug]
vllm: {version: ">=0"}
patches:
  - {id: rep, target: "bench_target:work", op: replace, with: "bench_plug:replacement", why: bench}
"""
WRAP = MANIFEST.replace("op: replace, with: \"bench_plug:replacement\"", "op: wrap, with: \"bench_plug:wrapper\"")


def best(fn, number: int = 500_000, repeat: int = 7) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e9


def main() -> None:
    import patchkit
    from patchkit.planning import Runtime

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, text in MODULES.items():
            (root / name).write_text(textwrap.dedent(text))
        sys.path.insert(0, str(root))
        import bench_plug
        import bench_target

        runtime = Runtime("0.32.0", None, _platform="cpu")
        original = bench_target.work

        def hand_written(x, _orig=original, _w=bench_plug.wrapper):
            return _w(_orig, x)

        (root / "m").mkdir()
        (root / "m" / "a.yaml").write_text(MANIFEST)
        assert patchkit.activate("bench", root / "m", runtime).active
        replaced = bench_target.work
        direct = bench_plug.replacement
        t_direct = best(lambda: direct(1))
        t_replaced = best(lambda: replaced(1))
        patchkit.revert()

        (root / "m" / "a.yaml").write_text(WRAP)
        assert patchkit.activate("bench", root / "m", runtime).active
        wrapped = bench_target.work
        t_hand = best(lambda: hand_written(1))
        t_wrapped = best(lambda: wrapped(1))
        patchkit.revert()

    print("call overhead, ns per call (best of 7 x 500k), python", sys.version.split()[0])
    print(f"replace: direct call {t_direct:6.1f}  patched {t_replaced:6.1f}  ratio {t_replaced / t_direct:.2f}x")
    print(f"wrap:    hand-written {t_hand:6.1f}  patchkit {t_wrapped:6.1f}  ratio {t_wrapped / t_hand:.2f}x")


if __name__ == "__main__":
    main()
