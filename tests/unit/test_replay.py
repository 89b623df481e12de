"""Replay programs (the warm path): a replay ends in the state the engine reaches, or changes nothing.

Each test activates a plan once with the engine (which records the program),
reverts, and activates again in the same situation, as a later process would.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import patchkit
from patchkit import cache_dir, fingerprint, pending_imports, recording
from patchkit.planning import Runtime
from patchkit.vllm_adapter import MODEL_REGISTRY_MODULE

CORE = '''
    class Meta(type):
        frozen = False

        def __setattr__(cls, name, value):
            if Meta.frozen and name == "make":
                raise TypeError("frozen class")
            super().__setattr__(name, value)

    class Engine(metaclass=Meta):
        def run(self, x, y=1, *, z=0):
            return x + y + z

        @staticmethod
        def double(x):
            return x * 2

        @classmethod
        def make(cls, tag="t"):
            return (cls.__name__, tag)

        def configure(self, role):
            from types import SimpleNamespace

            return SimpleNamespace(role=role, parallel_config=SimpleNamespace(worker_cls="platform.Default"))
'''
FILES = {
    "rv/__init__.py": "",
    "rv/core.py": CORE,
    "rv/late.py": '''
        class Late:
            def go(self):
                return "go"
    ''',
    "rplug/__init__.py": "",
    "rplug/patches.py": '''
        def times_ten(original, self, x, y=1, *, z=0):
            return original(self, x, y, z=z) * 10

        def outer(original, self, *args, **kwargs):
            return ("outer", original(self, *args, **kwargs))

        def plus_one(original, x):
            return original(x) + 1

        def plus_two(original, x):
            return original(x) + 2

        def tagged(original, cls, tag="t"):
            return (*original(cls, tag), "tagged")

        def late_go(original, self):
            return "late " + original(self)

        def role_of(config):
            return config.role

        def replacement(self, role):
            return "replaced"
    ''',
}


def manifest(run_fp: str) -> str:
    return f"""
format: 1
plugin: rp
packages: [rplug]
vllm: {{version: "==0.32.0"}}
patches:
  - {{id: outer, target: "rv.core:Engine.run", op: wrap, with: "rplug.patches:outer", after: [run], why: t}}
  - {{id: run, target: "rv.core:Engine.run", op: wrap, with: "rplug.patches:times_ten", fingerprint: "{run_fp}",
     why: t}}
  - {{id: double, target: "rv.core:Engine.double", op: wrap, with: "rplug.patches:plus_one", why: t}}
  - {{id: make, target: "rv.core:Engine.make", op: wrap, with: "rplug.patches:tagged", why: t}}
  - {{id: late, target: "rv.late:Late.go", op: wrap, with: "rplug.patches:late_go", why: t}}
models:
  - {{arch: RpModel, class: "rplug.patches:replacement", why: t}}
workers:
  at: rv.core:Engine.configure
  role_of: rplug.patches:role_of
  overrides:
    - {{role: attention, class: "rplug.patches:CpuAttention", when: {{platform: [cpu]}}}}
"""


@pytest.fixture
def plan(sandbox: Callable[..., Path], manifest_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    # The front end's situation: vLLM's model registry not imported yet (other tests may have imported it).
    monkeypatch.delitem(sys.modules, MODEL_REGISTRY_MODULE, raising=False)
    sandbox(FILES)
    core = importlib.import_module("rv.core")
    yield manifest_dir(manifest(fingerprint.of_object(core.Engine.run) or ""))
    core.Meta.frozen = False


def activate(d: Path, runtime: Runtime) -> patchkit.Status:
    return patchkit.activate("rp", d, runtime)


def behaviour() -> dict[str, Any]:
    from rv.core import Engine

    return {
        "run": Engine().run(1, 2, z=3), "double": Engine.double(4), "make": Engine.make(),
        "configure": Engine().configure("attention").parallel_config.worker_cls,
        "run_signature": str(inspect.signature(Engine.run)), "run_defaults": Engine.run.__defaults__,
        "make_kind": type(vars(Engine)["make"]).__name__, "double_kind": type(vars(Engine)["double"]).__name__,
        "files": sorted({f.__code__.co_filename for f in (Engine.run, Engine.double, Engine.make)}),
    }


def records() -> list[tuple[str, ...]]:
    return [(r["id"], r["outcome"], r["fingerprint"], r["reason"]) for r in patchkit.applied("rp")]


def forget_late() -> None:
    sys.modules.pop("rv.late", None)
    sys.modules["rv"].__dict__.pop("late", None)


def originals() -> dict[str, Any]:
    from rv.core import Engine

    return dict(vars(Engine))


def recorded_by_engine(d: Path, runtime: Runtime) -> tuple[dict[str, Any], list[tuple[str, ...]]]:
    """Activate with the engine (recording the program), note what it did, and revert."""
    first = activate(d, runtime)
    assert first.active and not first.replayed, first.problem
    importlib.import_module("rv.late")
    seen = behaviour(), records()
    patchkit.revert()
    forget_late()
    return seen


def test_a_replay_reaches_the_engines_state(plan, runtime):
    from rv.core import Engine

    before = originals()
    by_engine, engine_records = recorded_by_engine(plan, runtime)
    assert originals() == before
    second = activate(plan, runtime)
    assert second.active and second.replayed and second._run is None, "the engine is not needed yet"
    assert behaviour() == by_engine
    assert by_engine["run"] == ("outer", 60) and by_engine["files"] == [
        "<patchkit wrapper double>", "<patchkit wrapper make>", "<patchkit wrapper outer>"]
    assert Engine.run.__wrapped__.__wrapped__ is before["run"]
    assert pending_imports() == {"rv.late": 1, MODEL_REGISTRY_MODULE: 1}
    late = importlib.import_module("rv.late")  # the engine takes over at this import
    assert late.Late().go() == "late go"
    assert second._run is not None and second.run.replayed
    assert pending_imports() == {MODEL_REGISTRY_MODULE: 1}  # the engine's own hook
    assert records() == engine_records
    patchkit.revert()
    assert originals() == before


def test_reading_the_status_hands_over_to_the_engine(plan, runtime):
    recorded_by_engine(plan, runtime)
    second = activate(plan, runtime)
    assert second.replayed
    outcomes = {r[0]: r[1] for r in records()}  # applied() builds the Run
    assert outcomes == {"workers": "applied", "run": "applied", "outer": "applied", "double": "applied",
                        "make": "applied", "late": "pending", "model:RpModel": "pending"}
    assert pending_imports() == {"rv.late": 1, MODEL_REGISTRY_MODULE: 1}
    assert patchkit.status("rp") is second and second.active


def test_another_situation_gets_its_own_program(plan, runtime):
    recorded_by_engine(plan, runtime)
    importlib.import_module("rv.late")  # now rv.late is imported at activation: no program fits yet
    third = activate(plan, runtime)
    assert third.active and not third.replayed
    patchkit.revert()
    assert activate(plan, runtime).replayed
    [key] = [p.name[len("replay-"):-len(".bin")] for p in cache_dir().glob("replay-*.bin")]
    assert len(patchkit.programs(key)) == 2


@pytest.mark.parametrize("damage", ["garbage", "group-writable", "wrong-format"])
def test_a_damaged_or_untrusted_program_is_not_run(plan, runtime, damage):
    recorded_by_engine(plan, runtime)
    [path] = cache_dir().glob("replay-*.bin")
    if damage == "garbage":
        path.write_bytes(b"\x00not marshal")
    elif damage == "group-writable":
        os.chmod(path, 0o664)
    else:
        import marshal

        path.write_bytes(marshal.dumps(("patchkit-replay-0", b"", [])))
    status = activate(plan, runtime)
    assert status.active and not status.replayed
    assert behaviour()["run"] == ("outer", 60)


def test_an_edited_manifest_finds_no_old_program_even_with_size_and_mtime_put_back(plan, runtime):
    recorded_by_engine(plan, runtime)
    path = plan / "m.yaml"
    before = path.stat()
    edited = path.read_text().replace("rplug.patches:plus_one", "rplug.patches:plus_two")
    assert len(edited) == len(path.read_text())
    path.write_text(edited)  # as `cp -p` or a reproducible build would leave it: same size, same mtime
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns
    status = activate(plan, runtime)
    assert status.active and not status.replayed, "the ctime moved: the old program's key no longer fits"
    assert behaviour()["double"] == 10
    patchkit.revert()
    again = activate(plan, runtime)
    assert again.replayed and behaviour()["double"] == 10, "the engine recorded a program for the edit"


def test_changed_source_falls_back_to_the_engine_which_judges_the_fingerprint(plan, runtime, sandbox):
    from rv.core import Engine

    recorded_by_engine(plan, runtime)
    untouched = dict(vars(Engine))
    # Same code, new file stat (as after a reinstall): the recorded source key no longer holds.
    path = Path(sys.modules["rv.core"].__file__)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    status = activate(plan, runtime)
    assert status.active and not status.replayed, "the engine re-checked the fingerprint: it still matches"
    patchkit.revert()
    assert activate(plan, runtime).replayed, "the engine recorded a program for the new source"
    patchkit.revert()
    # Drifted code: replay declines, the engine fails the entry and changes nothing.
    del sys.modules["rv.core"]
    sandbox({"rv/core.py": CORE.replace("return x + y + z", "return x - y - z")})
    from rv.core import Engine as Drifted

    untouched = dict(vars(Drifted))
    status = activate(plan, runtime)
    assert not status.active and not status.replayed
    assert "run" in status.problem and "drift" in status.problem
    assert dict(vars(Drifted)) == untouched


def test_a_callable_that_no_longer_imports_falls_back_and_is_named(plan, runtime, sandbox):
    recorded_by_engine(plan, runtime)
    from rv.core import Engine

    untouched = dict(vars(Engine))
    del sys.modules["rplug.patches"]
    sandbox({"rplug/patches.py": "raise ImportError('broken plugin module')\n"})
    status = activate(plan, runtime)
    assert not status.active and not status.replayed
    assert "broken plugin module" in status.problem
    assert dict(vars(Engine)) == untouched


def test_a_failing_install_restores_what_the_replay_had_installed(plan, runtime):
    import rv.core as core

    recorded_by_engine(plan, runtime)
    untouched = dict(vars(core.Engine))
    [key] = [p.name[len("replay-"):-len(".bin")] for p in cache_dir().glob("replay-*.bin")]
    program = patchkit.load_program(key)
    assert program is not None
    core.Meta.frozen = True  # "make" cannot be set any more; it comes after run, outer and double
    assert patchkit.apply_program(program, "rp", runtime) is None
    assert dict(vars(core.Engine)) == untouched
    status = activate(plan, runtime)
    assert not status.active and not status.replayed and "make" in status.problem
    assert dict(vars(core.Engine)) == untouched


def test_patchkit_disable_turns_replay_off(plan, runtime, monkeypatch):
    recorded_by_engine(plan, runtime)
    monkeypatch.setenv("PATCHKIT_DISABLE", "double")
    status = activate(plan, runtime)
    assert status.active and not status.replayed
    assert {r[0]: r[1] for r in records()}["double"] == "disabled"


def test_a_replayed_process_reports_like_any_other(plan, runtime, tmp_path, monkeypatch):
    recorded_by_engine(plan, runtime)
    reports = tmp_path / "reports"
    monkeypatch.setenv("PATCHKIT_REPORT_DIR", str(reports))
    status = activate(plan, runtime)
    assert status.replayed and status._run is not None, "a report needs the Run at once"
    [report] = [json.loads(p.read_text()) for p in reports.glob("*.json")]
    assert report["replayed"] is True and report["status"] == "active"
    assert {e["id"]: e["outcome"] for e in report["entries"]}["run"] == "applied"


def test_recording_declines_what_it_cannot_repeat(sandbox, manifest_dir, runtime):
    sandbox({**FILES, "rv/funcs.py": "def greet(name):\n    return name\n",
             "rplug/more.py": "def loud(original, name):\n    return original(name).upper()\n"})
    importlib.import_module("rv.funcs")
    d = manifest_dir("""
format: 1
plugin: rp
packages: [rplug]
vllm: {version: "==0.32.0"}
patches:
  - {id: module-level, target: "rv.funcs:greet", op: wrap, with: "rplug.more:loud", why: t}
""")
    status = activate(d, runtime)
    assert status.active and not status.replayed
    assert recording.record(status.run) is None  # module attributes need rebinding: the engine's job
    assert not list(cache_dir().glob("replay-*.bin"))


WARM_PROCESS = """
import sys
from types import SimpleNamespace
sys.path[:0] = [{src!r}, {repo!r}]
import patchkit
import rv.core  # the targets' module is imported, rv.late and the model registry are not: the front end
before = set(sys.modules)
status = patchkit.activate("rp", {plan!r}, {runtime})
print(status.active, status.replayed, rv.core.Engine.double(4))
print(" ".join(sorted(m for m in set(sys.modules) - before if m.startswith("patchkit"))))
"""


def test_a_replaying_process_loads_no_patchkit_submodule(plan, sandbox, tmp_path):
    import subprocess

    src = str(sandbox({}))
    repo = str(Path(patchkit.__file__).parents[1])

    def process(runtime: str) -> list[str]:
        code = WARM_PROCESS.format(src=src, repo=repo, plan=str(plan), runtime=runtime)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PATCHKIT_CACHE_DIR": str(tmp_path / "cache")})
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    first = process('__import__("patchkit.planning").planning.Runtime("0.32.0", None, _platform="cpu")')
    assert first[0] == "True False 9" and "patchkit.engine" in first[1].split()
    # Only the identity is read before a replay; the engine (which would need a full Runtime) never runs.
    second = process('SimpleNamespace(vllm_version="0.32.0", vllm_commit=None)')
    assert second[0] == "True True 9"
    assert second[1].split() == [], second  # the warm path is patchkit itself: no submodule
