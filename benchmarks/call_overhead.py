"""Per-call overhead of patched functions: ``replace`` vs a direct call, ``wrap`` vs a hand-written closure.

Both sides are measured side by side in one process, in alternating rounds,
best of each (the minimum is the least noisy estimate of the true cost).

    python -m benchmarks.call_overhead
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


def paired(a, b, number: int = 200_000, rounds: int = 25) -> tuple[float, float]:
    """Best ns per call of ``a`` and ``b``, measured in alternating rounds (fair under a noisy machine)."""
    best_a = best_b = float("inf")
    for _ in range(rounds):
        best_a = min(best_a, timeit.timeit(a, number=number))
        best_b = min(best_b, timeit.timeit(b, number=number))
    return best_a / number * 1e9, best_b / number * 1e9


def main() -> None:
    import patchkit
    from patchkit.plan import Runtime

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
        assert replaced is direct, "a replace entry installs the replacement itself, no wrapper"
        t_direct, t_replaced = paired(lambda: direct(1), lambda: replaced(1))
        patchkit.revert()

        (root / "m" / "a.yaml").write_text(WRAP)
        assert patchkit.activate("bench", root / "m", runtime).active
        wrapped = bench_target.work
        t_hand, t_wrapped = paired(lambda: hand_written(1), lambda: wrapped(1))
        patchkit.revert()

    print("call overhead, ns per call (best of 25 alternating rounds x 200k), python", sys.version.split()[0])
    print(f"replace: direct call {t_direct:6.1f}  patched {t_replaced:6.1f}  ratio {t_replaced / t_direct:.2f}x"
          "  (the same function object: any difference is timing noise)")
    print(f"wrap:    hand-written {t_hand:6.1f}  patchkit {t_wrapped:6.1f}  ratio {t_wrapped / t_hand:.2f}x")


if __name__ == "__main__":
    main()
