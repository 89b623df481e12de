"""patchkit's own wrappers and import hooks against wrapt's, on the three costs that decide between them.

    pip install --target /tmp/wraptlib wrapt        # wrapt is not a dependency of this project
    PYTHONPATH=/tmp/wraptlib .venv/bin/python benchmarks/wrapt_compare.py [--json OUT]

1. Call overhead: nanoseconds per call (best of 7 repeats of 200,000 calls) of a three-parameter function and of a
   method, bare, wrapped by ``patchkit.runtime.wrappers.make_wrapper`` (what every ``op: wrap`` entry installs)
   and by ``wrapt.FunctionWrapper`` (what ``wrapt.wrap_function_wrapper`` installs), both with a wrapper body that
   only calls the original.
2. Dynamo: ``torch.compile(fullgraph=True, backend="eager")`` of a function that calls a wrapped function, as a
   model's forward calls a patched vLLM function: whether it compiles, and ``torch._dynamo.explain``'s graph and
   graph-break counts.
3. Import: seconds to import wrapt itself after ``import vllm`` (median of 5 fresh interpreters; where the
   plugin hook runs vLLM is imported, and wrapt's import would be paid in every such process, hook budget 10 ms),
   patchkit's runtime modules the same way, and to register a post-import hook for a module not yet imported and
   import it (patchkit's ``hooks.when_imported`` against ``wrapt.register_post_import_hook``), median of 5.

Prints one table; ``--json`` writes the figures (docs/architecture.md quotes them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import wrapt  # noqa: E402  (after the path: this script runs from anywhere)

from patchkit.runtime import hooks  # noqa: E402
from patchkit.runtime.wrappers import make_wrapper  # noqa: E402


def target(a: int, b: int, c: int = 1) -> int:
    return a + b + c


class Owner:
    def method(self, a: int, b: int) -> int:
        return a + b


def pass_through(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """An ``op: wrap`` callable that only delegates."""
    return original(*args, **kwargs)


def wrapt_pass_through(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """The same body in wrapt's wrapper convention."""
    return wrapped(*args, **kwargs)


def _ns_per_call(call: Callable[[], Any], number: int = 200_000) -> float:
    return min(timeit.repeat(call, number=number, repeat=7)) / number * 1e9


def call_overhead() -> dict[str, float]:
    """ns per call: bare, patchkit, wrapt; for a function and for a method looked up on an instance."""
    ours = make_wrapper(pass_through, target, ("bench", "target"))
    theirs = wrapt.FunctionWrapper(target, wrapt_pass_through)

    class Ours(Owner):
        pass

    class Theirs(Owner):
        pass

    Ours.method = make_wrapper(pass_through, Owner.method, ("bench", "method"))  # type: ignore[method-assign]
    Theirs.method = wrapt.FunctionWrapper(Owner.method, wrapt_pass_through)  # type: ignore[method-assign]
    bare_obj, ours_obj, theirs_obj = Owner(), Ours(), Theirs()
    return {
        "function bare": _ns_per_call(lambda: target(1, 2, c=3)),
        "function patchkit": _ns_per_call(lambda: ours(1, 2, c=3)),
        "function wrapt": _ns_per_call(lambda: theirs(1, 2, c=3)),
        "method bare": _ns_per_call(lambda: bare_obj.method(1, 2)),
        "method patchkit": _ns_per_call(lambda: ours_obj.method(1, 2)),
        "method wrapt": _ns_per_call(lambda: theirs_obj.method(1, 2)),
    }


def dynamo() -> dict[str, dict[str, Any]]:
    """Whether a compiled caller traces through each wrapper (fullgraph), and explain()'s counts."""
    import torch
    import torch._dynamo

    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    results: dict[str, dict[str, Any]] = {}
    for name, wrapped in (("bare", scale), ("patchkit", make_wrapper(pass_through, scale, ("bench", "scale"))),
                          ("wrapt", wrapt.FunctionWrapper(scale, wrapt_pass_through))):
        def caller(x: torch.Tensor, f: Callable[..., Any] = wrapped) -> torch.Tensor:
            return f(x).relu() + 3

        torch._dynamo.reset()
        x = torch.randn(8)
        row: dict[str, Any] = {}
        try:
            out = torch.compile(caller, fullgraph=True, backend="eager")(x)
            row["fullgraph"] = bool(torch.equal(out, caller(x)))
        except Exception as e:  # noqa: BLE001  (what dynamo says is the figure)
            row["fullgraph"] = False
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        torch._dynamo.reset()
        explained = torch._dynamo.explain(caller)(x)
        row["graphs"], row["graph_breaks"] = explained.graph_count, explained.graph_break_count
        results[name] = row
    return results


def _import_s(module: str, after: str = "vllm", runs: int = 5) -> float:
    """Median seconds to import ``module`` in a fresh interpreter that imported ``after`` first (wall time of the
    import statement alone, ``runs`` processes)."""
    env_path = ":".join(p for p in sys.path if p)
    code = f"import {after}, time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    return statistics.median(
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={"PYTHONPATH": env_path}, check=True).stdout.split()[-1]) for _ in range(runs))


def hook_cost() -> dict[str, float]:
    """Median seconds: register a post-import hook for a fresh module, then import it (each way)."""
    folder = Path(tempfile.mkdtemp())
    sys.path.insert(0, str(folder))
    times: dict[str, list[float]] = {"patchkit": [], "wrapt": [], "none": []}
    for i in range(5):
        for way in times:
            name = f"bench_hooked_{way}_{i}"
            (folder / f"{name}.py").write_text("VALUE = 1\n")
            seen: list[Any] = []
            t0 = time.perf_counter()
            if way == "patchkit":
                hooks.when_imported(name, seen.append)
            elif way == "wrapt":
                wrapt.register_post_import_hook(seen.append, name)
            __import__(name)
            times[way].append(time.perf_counter() - t0)
            assert (len(seen) == 1) == (way != "none"), (way, seen)
    return {f"hook+import {way}": statistics.median(v) for way, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    figures: dict[str, Any] = {"wrapt": wrapt.__version__, "python": sys.version.split()[0]}
    figures["ns_per_call"] = call_overhead()
    figures["import_s"] = {"wrapt": _import_s("wrapt"), "patchkit.runtime.wrappers": _import_s(
        "patchkit.runtime.wrappers"), "patchkit.runtime.hooks": _import_s("patchkit.runtime.hooks")}
    figures["hook_s"] = hook_cost()
    figures["dynamo"] = dynamo()
    for name, ns in figures["ns_per_call"].items():
        print(f"{name:22s} {ns:8.1f} ns/call")
    for name, s in figures["import_s"].items():
        print(f"import {name:27s} {s * 1e3:7.2f} ms after import vllm")
    for name, s in figures["hook_s"].items():
        print(f"{name:22s} {s * 1e6:8.1f} us")
    for name, row in figures["dynamo"].items():
        print(f"dynamo {name:10s} {row}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
