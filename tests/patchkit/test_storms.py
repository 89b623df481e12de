"""Process and thread storms: many activations of one manifest at once, cold shared cache.

16 spawned and 16 forked processes and 8 threads of this process call ``activate()``
three times each on the same manifest, released together through a start gate,
sharing one ``PATCHKIT_CACHE_DIR`` (cold: they race to write the compiled plan) and one
``PATCHKIT_REPORT_DIR``. Every process must apply every entry exactly once (one
wrapper layer per target: the ``__wrapped__`` chain holds one patchkit wrapper and a
call runs its factory once), every report must carry the same plan digest, and
``patchkit report DIR`` must exit 0. Every wait has a timeout.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import patchkit
from patchkit import cli
from patchkit.plan import Runtime
from tests.support.manifests import header

SPAWNED, FORKED, THREADS, ROUNDS = 16, 16, 8, 3
DEADLINE_S = 90.0

TREE = {
    "stvictim/__init__.py": "",
    "stvictim/core.py": """
        def f(x):
            return x

        def g(x):
            return x

        class K:
            def m(self, x):
                return x

            @classmethod
            def c(cls, x):
                return x
    """,
    "stplug/__init__.py": "",
    "stplug/w.py": """
        CALLS = []

        def count(original, *args, **kwargs):
            CALLS.append(original.__name__)
            return original(*args, **kwargs)

        def g(x):
            return ("replaced", x)
    """,
    "stormworker.py": '''
        """Runs in each storm process: wait for the gate, activate ROUNDS times, describe the result."""

        import json
        import os
        import sys
        import time


        def layers(obj):
            obj = getattr(obj, "__func__", obj)
            n = 0
            while getattr(obj, "__patchkit__", None) is not None:
                n += 1
                obj = obj.__wrapped__
            return n


        def describe(statuses):
            import stplug.w as w
            import stvictim.core as core

            before = len(w.CALLS)
            results = (core.f(1), core.K().m(2), core.K.c(3), core.g(4))
            return {
                "pid": os.getpid(),
                "active": [s.active for s in statuses],
                "problems": [s.problem for s in statuses],
                "same_status": all(s is statuses[0] for s in statuses),
                "layers": {"f": layers(core.f), "m": layers(vars(core.K)["m"]), "c": layers(vars(core.K)["c"])},
                "classmethod_kept": type(vars(core.K)["c"]).__name__,
                "factory_calls": len(w.CALLS) - before,
                "results": [list(r) if isinstance(r, tuple) else r for r in results],
                "outcomes": sorted({r["outcome"] for r in __import__("patchkit").applied("storm")}),
            }


        def activate_rounds(manifest_dir, rounds):
            import patchkit
            from patchkit.plan import Runtime

            return [patchkit.activate("storm", manifest_dir, Runtime("0.32.0", None, _platform="cpu"))
                    for _ in range(rounds)]


        def main(manifest_dir, out_dir, gate, rounds):
            import stvictim.core  # noqa: F401 - the target module is imported, so entries apply at once

            open(os.path.join(out_dir, f"ready-{os.getpid()}"), "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(gate):
                if time.monotonic() > deadline:
                    sys.exit(3)
                time.sleep(0.002)
            statuses = activate_rounds(manifest_dir, rounds)
            with open(os.path.join(out_dir, f"result-{os.getpid()}.json"), "w") as f:
                json.dump(describe(statuses), f)
    ''',
}

MANIFEST = header("storm", "stplug") + """\
patches:
  - {id: wrap-f, target: "stvictim.core:f", op: wrap, with: "stplug.w:count", why: t}
  - {id: wrap-m, target: "stvictim.core:K.m", op: wrap, with: "stplug.w:count", rebind: none, why: t}
  - {id: wrap-c, target: "stvictim.core:K.c", op: wrap, with: "stplug.w:count", rebind: none, after: [wrap-m],
     why: t}
  - {id: replace-g, target: "stvictim.core:g", op: replace, with: "stplug.w:g", why: t}
"""


def check_result(r: dict[str, Any]) -> None:
    assert len(r["active"]) >= ROUNDS and all(r["active"]), r
    assert set(r["problems"]) == {None}, r
    assert r["same_status"], r
    assert r["layers"] == {"f": 1, "m": 1, "c": 1}, r
    assert r["classmethod_kept"] == "classmethod", r
    assert r["factory_calls"] == 3, r
    assert r["results"] == [1, 2, 3, ["replaced", 4]], r
    assert r["outcomes"] == ["applied"], r


@pytest.fixture
def storm(sandbox: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    src = sandbox(TREE)
    dirs = {name: tmp_path / name for name in ("manifests", "cache", "reports", "out")}
    for d in dirs.values():
        d.mkdir()
    (dirs["manifests"] / "storm.yaml").write_text(MANIFEST)
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(dirs["cache"]))
    monkeypatch.setenv("PATCHKIT_REPORT_DIR", str(dirs["reports"]))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])]))
    assert "stvictim.core" not in sys.modules and patchkit.status("storm") is None
    return {**dirs, "src": src}


def _wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _thread_storm(manifest_dir: Path, start: threading.Barrier, results: list[Any]) -> None:
    import stormworker  # type: ignore[import-not-found]

    start.wait(timeout=30)
    results.append(stormworker.activate_rounds(str(manifest_dir), ROUNDS))


def test_process_and_thread_storm(storm: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    import stormworker  # type: ignore[import-not-found]

    started = time.monotonic()
    gate = storm["out"] / "go"
    args = (str(storm["manifests"]), str(storm["out"]), str(gate), ROUNDS)
    procs = []
    for method, n in (("fork", FORKED), ("spawn", SPAWNED)):
        ctx = multiprocessing.get_context(method)
        for _ in range(n):
            p = ctx.Process(target=stormworker.main, args=args, daemon=True)
            p.start()
            procs.append(p)
    try:
        ready = _wait_for(lambda: len(list(storm["out"].glob("ready-*"))) == len(procs), 60)
        assert ready, f"only {len(list(storm['out'].glob('ready-*')))} of {len(procs)} processes started"
        import stvictim.core  # noqa: F401 - after every fork: the children start unpatched

        barrier = threading.Barrier(THREADS + 1)
        statuses: list[Any] = []
        threads = [threading.Thread(target=_thread_storm, args=(storm["manifests"], barrier, statuses), daemon=True)
                   for _ in range(THREADS)]
        for t in threads:
            t.start()
        gate.touch()  # processes and threads go together
        barrier.wait(timeout=30)
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "a thread hung in activate()"
        for p in procs:
            p.join(timeout=max(1.0, DEADLINE_S - (time.monotonic() - started)))
        hung = [p.pid for p in procs if p.is_alive()]
        assert not hung, f"processes still running after {DEADLINE_S} s: {hung}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    assert [p.exitcode for p in procs] == [0] * len(procs)

    # Threads of this process: one Status for all, one wrapper layer per target.
    flat = [s for rounds in statuses for s in rounds]
    assert len(flat) == THREADS * ROUNDS and all(s is flat[0] for s in flat) and flat[0].active
    check_result(stormworker.describe(flat))

    results = [json.loads(p.read_text()) for p in storm["out"].glob("result-*.json")]
    assert len(results) == len(procs)
    for r in results:
        check_result(r)

    reports = [json.loads(p.read_text()) for p in storm["reports"].glob("storm-*.json")]
    assert len(reports) == len(procs) + 1, "one report per process (and this one)"
    assert len({r["digest"] for r in reports}) == 1 and reports[0]["digest"]
    assert {r["pid"] for r in reports} == {*(p.pid for p in procs), os.getpid()}
    assert all({e["outcome"] for e in r["entries"]} == {"applied"} for r in reports)
    assert cli.main(["report", str(storm["reports"])]) == 0
    assert f"OK: {len(procs) + 1} process(es)" in capsys.readouterr().out

    plans = list(storm["cache"].glob("plan-*.json"))
    assert len(plans) == 1, plans
    assert not list(storm["cache"].glob(".tmp-*")), "a racing writer left a temp file"
    assert time.monotonic() - started < DEADLINE_S


def test_thread_storm_on_a_cold_cache_gives_one_wrapper_layer(storm: dict[str, Path]) -> None:
    import stormworker  # type: ignore[import-not-found]
    import stvictim.core as core

    original = core.f
    for round_ in range(ROUNDS):
        patchkit.revert()
        barrier = threading.Barrier(THREADS)
        statuses: list[Any] = []

        def go(results: list[Any] = statuses, b: threading.Barrier = barrier) -> None:
            b.wait(timeout=30)
            results.append(patchkit.activate("storm", storm["manifests"], Runtime("0.32.0", None, _platform="cpu")))

        threads = [threading.Thread(target=go, daemon=True) for _ in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)
        assert len(statuses) == THREADS and all(s is statuses[0] for s in statuses), round_
        check_result(stormworker.describe([statuses[0]] * ROUNDS))
    patchkit.revert()
    assert core.f is original
