"""The runtime's trust properties: a cache nobody else can steer, nothing half-patched, a complete revert.

- Cache attacks: under every file name patchkit reads in its cache directory, a planted
  symlink, FIFO, hard link, foreign-owned, group/world-writable, huge or garbage file is a
  miss: a fresh process applies the plan normally, quickly, and the planted payload (a plan
  naming a module that writes a marker file when imported) never runs. The same for a cache
  directory that is a symlink, owned by someone else or writable by others.
- Fault injection in import callbacks, rebinding and undo steps: originals restored by
  identity, the importer gets its module, the status names the entry, a clean activation works.
- Revert restores aliases bound after the patch; ``unreachable`` names captured references.
- A module another thread is importing during activation is patched, not left pending.
- Oversized manifests are refused quickly with a clear message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import patchkit
from harness.env import REPO
from patchkit import ManifestError, manifest
from patchkit.plan import Runtime
from patchkit.runtime import hooks, rebind, targets
from tests.support.manifests import header

NOBODY = 65534

TREE = {
    "tvictim/__init__.py": "",
    "tvictim/core.py": """
        class Engine:
            def run(self, x):
                return x + 1
    """,
    "tvictim/funcs.py": """
        def greet(name):
            return f"hi {name}"
    """,
    "tplug/__init__.py": "",
    "tplug/w.py": """
        def loud(original, *args, **kwargs):
            return ("loud", original(*args, **kwargs))
    """,
    # The payload: importing it is the "code ran" signal.
    "tpayload/__init__.py": """
        import os
        open(os.environ["PAYLOAD_MARKER"], "w").close()

        def boom(original, *args, **kwargs):
            return "owned"
    """,
}
HEAD = header("trust", "tplug")
MANIFEST = HEAD + """patches:
  - id: run
    target: tvictim.core:Engine.run
    op: wrap
    with: tplug.w:loud
    fingerprint: "{fingerprint}"
    rebind: none
    why: t
"""

CHILD = r"""
import json, sys, time
import patchkit
from patchkit.plan import Runtime
t0 = time.perf_counter()
status = patchkit.activate("trust", sys.argv[1], Runtime("0.32.0", None, _platform="cpu"),
                           packages=tuple(p for p in sys.argv[2].split(",") if p))
import tvictim.core
seconds = time.perf_counter() - t0
print("RESULT " + json.dumps({"active": status.active, "problem": status.problem, "seconds": seconds,
                              "run": tvictim.core.Engine().run(1), "records": patchkit.applied("trust")}))
"""


def _write_tree(root: Path) -> None:
    for rel, text in TREE.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A throwaway tree, its manifest (with the live fingerprint), and the genuine cache file names."""
    base = tmp_path_factory.mktemp("trust")
    src = base / "src"
    _write_tree(src)
    probe = subprocess.run(
        [sys.executable, "-c", "import tvictim.core, patchkit.fingerprint as f;"
         "print(f.of_object(tvictim.core.Engine.run))"],
        env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True, check=True)
    folder = base / "manifests"
    folder.mkdir()
    (folder / "m.yaml").write_text(MANIFEST.replace("{fingerprint}", probe.stdout.strip()))
    genuine = base / "genuine-cache"
    result = run_child(src, folder, genuine, base / "unused-marker")
    assert result["active"] and result["run"] == ["loud", 2], result
    names = sorted(p.name for p in genuine.iterdir())
    assert [n for n in names if n.startswith("plan-")] and "fingerprints.json" in names, names
    return {"base": base, "src": src, "folder": folder, "genuine": genuine, "names": names}


def run_child(src: Path, folder: Path, cache: Path, marker: Path, packages: str = "tplug") -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(REPO)]), "PATCHKIT_CACHE_DIR": str(cache),
           "PAYLOAD_MARKER": str(marker), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PATCHKIT_DISABLE", None)
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder), packages], env=env, capture_output=True,
                         text=True, timeout=60)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(f"child failed (rc {out.returncode}):\n{out.stderr[-3000:]}")


def poisoned(genuine: Path, name: str) -> bytes:
    """The genuine file under ``name``, made to name the payload module (declared, so it passes the
    packages rule: only the file checks can keep it out), or to claim every target matches."""
    data = json.loads((genuine / name).read_text())
    if name.startswith("plan-"):
        m = data["plan"]["manifest"]
        m["packages"] = [*m["packages"], "tpayload"]
        for e in m["entries"]:
            e["with_"] = "tpayload:boom"
    else:  # read, these would make the pinned target look drifted and the plan fail
        data = {k: "ast1:0000000000000000:0000000000000000" for k in data}
    return json.dumps(data).encode()


def plant(cache: Path, name: str, kind: str, payload: bytes, elsewhere: Path) -> None:
    cache.mkdir(mode=0o700)
    path = cache / name
    victim_file = elsewhere / f"victim-{kind}-{name}"
    if kind == "symlink":  # to a file the victim owns that holds the payload
        victim_file.write_bytes(payload)
        victim_file.chmod(0o600)
        path.symlink_to(victim_file)
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "hardlink":
        victim_file.write_bytes(payload)
        victim_file.chmod(0o600)
        os.link(victim_file, path)
    elif kind == "foreign-owner":
        path.write_bytes(payload)
        path.chmod(0o600)
        os.chown(path, NOBODY, NOBODY)
    elif kind in ("group-writable", "world-writable"):
        path.write_bytes(payload)
        path.chmod(0o620 if kind == "group-writable" else 0o602)
    elif kind == "huge":
        path.write_bytes(payload + b" " * (2 << 20))  # still valid JSON, but far too big
        path.chmod(0o600)
    elif kind == "garbage":
        path.write_bytes(os.urandom(4096))
        path.chmod(0o600)
    else:
        raise AssertionError(kind)


KINDS = ["symlink", "fifo", "hardlink", "foreign-owner", "group-writable", "world-writable", "huge", "garbage"]


@pytest.mark.parametrize("kind", KINDS)
def test_planted_cache_files_are_misses(world: dict[str, Any], tmp_path: Path, kind: str) -> None:
    if kind == "foreign-owner" and os.geteuid() != 0:
        pytest.fail("this attack needs root to chown the planted file (the suite runs as root here)")
    for name in world["names"]:
        cache = tmp_path / f"cache-{name}"
        marker = tmp_path / f"marker-{name}"
        plant(cache, name, kind, poisoned(world["genuine"], name), tmp_path)
        result = run_child(world["src"], world["folder"], cache, marker)
        assert result["active"], result["problem"]
        assert result["run"] == ["loud", 2], f"{kind} {name}: the plan was not applied normally"
        assert result["records"][0]["fingerprint"] == "match"
        assert not marker.exists(), f"{kind} {name}: planted bytes ran"
        assert result["seconds"] < 5, result["seconds"]  # benchmarks/cache_attacks.py measures the figure


def test_a_private_planted_plan_that_adds_a_package_is_refused(world: dict[str, Any], tmp_path: Path) -> None:
    """A plan file that passes every file check (this user's, 0600, one link) but adds a package to its own
    list and names code there: judged against the packages the plugin declared at ``activate``, not the
    list in the file, so it is a miss, compiled again, and the planted code never runs."""
    name = next(n for n in world["names"] if n.startswith("plan-"))
    cache, marker = tmp_path / "cache", tmp_path / "marker"
    cache.mkdir(mode=0o700)
    planted = poisoned(world["genuine"], name)
    assert b'"tpayload:boom"' in planted and b'"tpayload"' in planted  # it names the payload, and declares it
    (cache / name).write_bytes(planted)
    (cache / name).chmod(0o600)
    result = run_child(world["src"], world["folder"], cache, marker)
    assert result["active"] and result["run"] == ["loud", 2], result
    assert not marker.exists(), "the planted plan's code ran"
    planted_again = json.loads((cache / name).read_text())  # the genuine plan replaced it
    assert "tpayload" not in planted_again["plan"]["manifest"]["packages"]


@pytest.mark.parametrize("kind", ["foreign-owner", "world-writable", "symlink"])
def test_a_cache_directory_that_is_not_ours_alone_is_not_used(world: dict[str, Any], tmp_path: Path,
                                                             kind: str) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    for name in world["names"]:
        (real / name).write_bytes(poisoned(world["genuine"], name))
        (real / name).chmod(0o600)
    cache = real
    if kind == "foreign-owner":
        for p in [real, *real.iterdir()]:
            os.chown(p, NOBODY, NOBODY)
    elif kind == "world-writable":
        real.chmod(0o777)
    else:
        cache = tmp_path / "link"
        cache.symlink_to(real)
    marker = tmp_path / "marker"
    result = run_child(world["src"], world["folder"], cache, marker)
    assert result["active"] and result["run"] == ["loud", 2], result
    assert not marker.exists()


def test_a_root_owned_cache_is_not_trusted_by_another_user(world: dict[str, Any], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Owner must be the effective uid, not "or root": files root wrote are misses for anyone else."""
    from patchkit.runtime import cache as patchkit_cache

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    for name in world["names"]:
        (cache / name).write_bytes(poisoned(world["genuine"], name))
        (cache / name).chmod(0o600)
    assert os.stat(cache).st_uid == os.geteuid()
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(cache))
    assert patchkit_cache.read_private(world["names"][0]) is not None  # this user's own file is read
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(cache).st_uid + 1)  # the same files, another user
    for name in world["names"]:
        assert patchkit_cache.read_private(name) is None
    patchkit_cache.write_private("other.json", b"{}")
    assert not (cache / "other.json").exists()


def test_the_cache_holds_json_data_only(world: dict[str, Any]) -> None:
    for name in world["names"]:
        data = (world["genuine"] / name).read_bytes()
        json.loads(data)  # parses: data, no bytecode
        assert (world["genuine"] / name).stat().st_mode & 0o077 == 0
    assert (world["genuine"].stat().st_mode & 0o777) == 0o700


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from patchkit.runtime.cache import cache_dir

    monkeypatch.delenv("PATCHKIT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")
    assert cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "patchkit")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == str(tmp_path / "patchkit")


# -- fault injection -------------------------------------------------------------------------------

FAULT_TREE = {
    "fvictim/__init__.py": "",
    "fvictim/funcs.py": "def greet(name):\n    return 'hi ' + name\n\ndef other(x):\n    return x\n",
    "fvictim/user.py": "from fvictim.funcs import greet, other\n",
    "fvictim/deferred.py": "def later(x):\n    return x\n",
    "fvictim/deferred_user.py": "from fvictim.deferred import later\n",
    "fplug/__init__.py": "",
    "fplug/w.py": "def loud(original, *a, **k):\n    return ('loud', original(*a, **k))\n",
}
FAULT_HEAD = header("fault", "fplug")


def fault_manifest(*entries: str) -> str:
    return FAULT_HEAD + "patches:\n" + "".join(entries)


GREET = "  - {id: greet, target: 'fvictim.funcs:greet', op: wrap, with: 'fplug.w:loud', why: t}\n"
OTHER = "  - {id: other, target: 'fvictim.funcs:other', op: wrap, with: 'fplug.w:loud', why: t, after: [greet]}\n"
LATER = "  - {id: later, target: 'fvictim.deferred:later', op: wrap, with: 'fplug.w:loud', why: t, after: [other]}\n"


def activate(folder: Path, runtime: Runtime, plugin: str = "fault") -> patchkit.Status:
    patchkit._status.pop(plugin, None)
    return patchkit.activate(plugin, folder, runtime)


def test_a_rebind_that_fails_half_way_in_an_import_callback_is_rolled_back(
        sandbox: Callable[..., Path], manifest_dir: Callable[[str], Path], runtime: Runtime,
        monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox(FAULT_TREE)
    import fvictim.funcs
    import fvictim.user

    originals = (fvictim.funcs.greet, fvictim.funcs.other)
    folder = manifest_dir(fault_manifest(GREET, OTHER, LATER))
    real_rebind = rebind.rebind
    calls = []

    def flaky(name: str, old: Any, new: Any, prefixes: Any, owner: Any, into: list[str]) -> None:
        calls.append(name)
        real_rebind(name, old, new, prefixes, owner, into)  # rebinds fvictim.user, then fails
        if name == "later":
            raise RuntimeError("injected rebind failure")

    monkeypatch.setattr(rebind, "rebind", flaky)
    status = activate(folder, runtime)
    assert status.active and fvictim.user.greet is not originals[0]
    import fvictim.deferred  # the callback fails inside this import: the importer still gets its module
    import fvictim.deferred_user

    assert fvictim.deferred.later(1) == 1
    assert (fvictim.funcs.greet, fvictim.funcs.other) == originals
    assert (fvictim.user.greet, fvictim.user.other) == originals
    assert not hasattr(fvictim.deferred.later, "__patchkit__")
    assert not hasattr(fvictim.deferred_user.later, "__patchkit__")
    s = patchkit.status("fault")
    assert s is not None and not s.active and "later" in (s.problem or "") and "injected" in (s.problem or "")
    outcomes = {r["id"]: r["outcome"] for r in patchkit.applied("fault")}
    assert outcomes == {"greet": "rolled-back", "other": "rolled-back", "later": "failed"}
    monkeypatch.setattr(rebind, "rebind", real_rebind)
    patchkit.revert()
    again = activate(folder, runtime)
    assert again.active and fvictim.user.greet("x") == ("loud", "hi x") and fvictim.deferred.later(2) == ("loud", 2)


def test_an_unexpected_error_while_applying_is_named_and_rolled_back(
        sandbox: Callable[..., Path], manifest_dir: Callable[[str], Path], runtime: Runtime,
        monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox(FAULT_TREE)
    import fvictim.funcs

    original = fvictim.funcs.greet
    real = targets.new_object

    def broken(entry: Any, func: Any, *args: Any) -> Any:
        if entry.id == "other":
            raise KeyError("not an error patchkit expects")
        return real(entry, func, *args)

    monkeypatch.setattr(targets, "new_object", broken)
    status = activate(manifest_dir(fault_manifest(GREET, OTHER)), runtime)
    assert not status.active and "other" in (status.problem or "") and "KeyError" in (status.problem or "")
    assert fvictim.funcs.greet is original


def test_an_undo_step_that_raises_does_not_stop_the_rollback(
        sandbox: Callable[..., Path], manifest_dir: Callable[[str], Path], runtime: Runtime,
        caplog: pytest.LogCaptureFixture) -> None:
    sandbox({**FAULT_TREE, "fvictim/sticky.py": """
        class Sticky(type):
            writes = 0

            def __setattr__(cls, name, value):
                if name == "run":
                    type(cls).writes += 1
                    if type(cls).writes == 2:
                        raise RuntimeError("the undo of run is refused")
                super().__setattr__(name, value)

        class Box(metaclass=Sticky):
            def run(self, x):
                return x
    """})
    import fvictim.funcs
    import fvictim.sticky

    original_greet = fvictim.funcs.greet
    entries = fault_manifest(
        GREET,
        "  - {id: box, target: 'fvictim.sticky:Box.run', op: wrap, with: 'fplug.w:loud', why: t, after: [greet],"
        " rebind: none}\n",
        "  - {id: gone, target: 'fvictim.funcs:missing', op: wrap, with: 'fplug.w:loud', why: t, after: [box]}\n")
    status = activate(manifest_dir(entries), runtime)
    assert not status.active and "gone" in (status.problem or "")
    assert fvictim.funcs.greet is original_greet  # restored although the undo after it (box) raised
    outcomes = {r["id"]: (r["outcome"], r["reason"]) for r in patchkit.applied("fault")}
    assert outcomes["box"][0] == "undo-failed" and "refused" in outcomes["box"][1]
    assert outcomes["greet"][0] == "rolled-back" and outcomes["gone"][0] == "failed"
    assert "restoring fvictim.sticky:Box.run failed" in caplog.text


def test_a_callback_that_raises_still_hands_the_importer_its_module(
        sandbox: Callable[..., Path], caplog: pytest.LogCaptureFixture) -> None:
    sandbox(FAULT_TREE)
    seen = []

    def bad(module: Any) -> None:
        seen.append(module.__name__)
        raise ValueError("callback bug")

    assert hooks.when_imported("fvictim.deferred", bad) is False
    import fvictim.deferred

    assert fvictim.deferred.later(3) == 3 and seen == ["fvictim.deferred"]
    assert "a callback for the import of fvictim.deferred failed" in caplog.text


# -- revert and the residual report ----------------------------------------------------------------

def test_revert_restores_aliases_bound_after_the_patch(
        sandbox: Callable[..., Path], manifest_dir: Callable[[str], Path], runtime: Runtime) -> None:
    sandbox({**FAULT_TREE,
             "fvictim/late_user.py": "from fvictim.funcs import greet\nfrom fvictim.funcs import greet as hello\n"})
    import fvictim.funcs

    original = fvictim.funcs.greet
    assert activate(manifest_dir(fault_manifest(GREET, OTHER, LATER)), runtime).active
    import fvictim.deferred  # deferred apply
    import fvictim.deferred_user  # its user, after the patch
    import fvictim.late_user  # a late user of an immediate patch, under two names

    later = sys.modules["fvictim.deferred"].later
    assert fvictim.late_user.greet is fvictim.funcs.greet is not original
    assert fvictim.late_user.hello is fvictim.funcs.greet and fvictim.deferred_user.later is later
    patchkit.revert("fault")
    assert fvictim.funcs.greet is original
    assert fvictim.late_user.greet is original and fvictim.late_user.hello is original
    assert fvictim.deferred_user.later is fvictim.deferred.later and not hasattr(fvictim.deferred.later,
                                                                                  "__patchkit__")


def test_unreachable_names_references_captured_in_containers_and_defaults(
        sandbox: Callable[..., Path], manifest_dir: Callable[[str], Path], runtime: Runtime) -> None:
    sandbox({**FAULT_TREE, "fvictim/captured.py": """
        from fvictim.funcs import greet

        HANDLERS = {"greet": greet, "other": len}
        PIPELINE = [len, greet]
        PAIR = (greet,)
        NAMES = {greet}

        def call(f=greet):
            return f("x")

        def call_kw(*, f=greet):
            return f("x")
    """})
    import fvictim.captured  # noqa: F401 - imported before the patch: its references are what is reported

    assert activate(manifest_dir(fault_manifest(GREET)), runtime).active
    record = next(r for r in patchkit.applied("fault") if r["id"] == "greet")
    assert "fvictim.captured" in record["rebound"]
    assert set(record["unreachable"]) >= {
        "fvictim.captured.HANDLERS['greet']", "fvictim.captured.PIPELINE[1]", "fvictim.captured.PAIR[0]",
        "fvictim.captured.NAMES (a set member)", "fvictim.captured.call.__defaults__[0]",
        "fvictim.captured.call_kw.__kwdefaults__['f']"}, record["unreachable"]


# -- concurrency ------------------------------------------------------------------------------------

def test_a_module_another_thread_is_importing_is_patched_not_left_pending(
        sandbox: Callable[..., Path], manifest_dir: Callable[[str], Path], runtime: Runtime) -> None:
    sandbox({**FAULT_TREE, "fvictim/slow.py": """
        import threading, time
        STARTED = threading.Event()
        import sys
        sys.modules[__name__].STARTED.set()
        time.sleep(0.5)

        def later(x):
            return x
    """})
    folder = manifest_dir(fault_manifest(
        "  - {id: slow, target: 'fvictim.slow:later', op: wrap, with: 'fplug.w:loud', why: t}\n"))
    errors: list[BaseException] = []

    def importer() -> None:
        try:
            import fvictim.slow  # noqa: F401
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=importer)
    thread.start()
    deadline = time.monotonic() + 10
    while "fvictim.slow" not in sys.modules and time.monotonic() < deadline:
        time.sleep(0.005)
    assert "fvictim.slow" in sys.modules  # found by the import system, its body still running
    status = activate(folder, runtime)
    thread.join(10)
    assert not errors and status.active
    outcomes = {r["id"]: r["outcome"] for r in patchkit.applied("fault")}
    assert outcomes == {"slow": "applied"}, outcomes
    assert sys.modules["fvictim.slow"].later(1) == ("loud", 1)
    assert "fvictim.slow" not in hooks.pending()


# -- input limits -----------------------------------------------------------------------------------

def test_a_huge_manifest_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    entry = "  - {id: e%d, target: 'a.b:c', op: wrap, with: 'p.m:f', why: padding padding padding}\n"
    with path.open("w") as f:
        f.write(FAULT_HEAD + "patches:\n")
        for i in range(200_000):
            f.write(entry % i)
    assert path.stat().st_size > 15_000_000
    started = time.perf_counter()
    with pytest.raises(ManifestError) as caught:
        manifest.load(path)
    assert time.perf_counter() - started < 5  # benchmarks/manifest_limits.py measures the figure
    assert f"{path}:1: <document>: larger than 256 KiB" in str(caught.value)


def test_many_writers_of_one_target_are_refused_quickly_with_a_bounded_message(tmp_path: Path) -> None:
    text = FAULT_HEAD + "patches:\n" + "".join(
        f"  - {{id: e{i}, target: 'fvictim.funcs:greet', op: wrap, with: 'fplug.w:loud', why: t}}\n"
        for i in range(1200))
    started = time.perf_counter()
    with pytest.raises(ManifestError) as caught:
        manifest.parse(text, "many.yaml")
    assert time.perf_counter() - started < 5
    message = str(caught.value)
    assert len(caught.value.problems) == 50 and "... and 1149 more problems" in message
    assert "many.yaml:7: patches[1].target: 'e1' and 'e0' both write fvictim.funcs:greet" in message
    assert len(message) < 20_000


def test_a_document_with_too_many_nodes_is_refused_while_composing(tmp_path: Path) -> None:
    text = FAULT_HEAD + "patches: [" + ", ".join("1" for _ in range(30_000)) + "]\n"
    assert len(text) < 256 * 1024
    with pytest.raises(ManifestError, match="more than 20000 YAML nodes"):
        manifest.parse(text, "nodes.yaml")


# -- the public surface -----------------------------------------------------------------------------

def test_the_package_exports_the_public_api_only() -> None:
    expected = {"activate", "status", "applied", "note", "revert", "Status",
                "PatchkitError", "ManifestError", "PatchError", "UnsupportedRelease"}
    assert set(patchkit.__all__) == expected
    public = {n for n, v in vars(patchkit).items()
              if not n.startswith("_") and not isinstance(v, type(sys)) and n != "annotations"}
    assert public == expected, public - expected


def test_versions_in_code_match_the_distribution() -> None:
    import tomllib

    import afd_patches

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert patchkit.__version__ == afd_patches.__version__ == version
