"""patchkit's engine on small throwaway packages: order, guards, drift, rollback, revert, aliases."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import patchkit
from patchkit import cli, fingerprint
from patchkit.manifest import select as selection
from patchkit.plan import Runtime
from patchkit.runtime import cache, engine
from tests.support.manifests import header

VICTIM = {
    "victim/__init__.py": "",
    "victim/core.py": '''
        def greet(name):
            """Say hello."""
            return f"hi {name}"

        def other(x):
            return x

        class Engine:
            mode = "plain"

            def run(self, x):
                return x + 1

            @classmethod
            def make(cls):
                return cls()

            @staticmethod
            def double(x):
                return x * 2

        class Sub(Engine):
            pass
    ''',
    "victim/user.py": '''
        from victim.core import greet

        def call():
            return greet("u")
    ''',
    "victim/renamed.py": "from victim.core import greet as hello\n",
    "victim/holder.py": "from victim.core import other\nALIAS = other\n",
    "victim/late.py": "def late(x):\n    return x\n",
    "victim/late_user.py": "from victim.late import late\n",
    "plug/__init__.py": "",
    "plug/patches.py": '''
        CALLS = []

        def loud(original, name):
            return original(name).upper()

        def exclaim(original, name):
            return original(name) + "!"

        def run_times_ten(original, self, x):
            return original(self, x) * 10

        def make_tagged(original, cls):
            obj = original(cls)
            obj.tagged = True
            return obj

        def double_plus_one(original, x):
            return original(x) + 1

        def replacement(name):
            return "replaced"

        def late_wrap(original, x):
            return ("late", original(x))

        def role_of(config):
            return config.role
    ''',
}

HEADER = header("testplug", "plug")


def greet_fp() -> str:
    return fingerprint.of_source('def greet(name):\n    return f"hi {name}"\n')


@pytest.fixture
def victim(sandbox: Callable[..., Path]) -> Path:
    root = sandbox(VICTIM)
    importlib.import_module("victim.user")
    importlib.import_module("victim.renamed")
    return root


def activate(manifest_dir: Path, runtime: Runtime, plugin: str = "testplug") -> patchkit.Status:
    return patchkit.activate(plugin, manifest_dir, runtime)


def outcomes() -> dict[str, str]:
    return {r["id"]: r["outcome"] for r in patchkit.applied()}


def test_wrap_applies_and_rebinds_from_import_alias(victim, manifest_dir, runtime):
    import victim.core as core
    import victim.user as user

    original = core.greet
    d = manifest_dir(HEADER + f"""
patches:
  - id: loud
    target: victim.core:greet
    op: wrap
    with: plug.patches:loud
    fingerprint: "{greet_fp()}"
    why: test
""")
    status = activate(d, runtime)
    assert status.active, status.problem
    assert core.greet("a") == "HI A"
    assert user.call() == "HI U", "the alias bound by 'from victim.core import greet' must be rebound"
    assert core.greet.__wrapped__ is original
    record = patchkit.applied()[0]
    assert record["fingerprint"] == "match"
    assert record["rebound"] == ["victim.user"]
    assert record["unreachable"] == ["victim.renamed.hello"]
    patchkit.revert()
    assert core.greet is original and user.greet is original


def test_order_follows_after_not_file_order(victim, manifest_dir, runtime):
    import victim.core as core

    d = manifest_dir(HEADER + """
patches:
  - id: second
    target: victim.core:greet
    op: wrap
    with: plug.patches:exclaim
    after: [first]
    why: test
  - id: first
    target: victim.core:greet
    op: wrap
    with: plug.patches:loud
    why: test
""")
    assert activate(d, runtime).active
    # first is applied first (inner), second wraps it: exclaim(loud(greet))
    assert core.greet("a") == "HI A!"
    assert [r["id"] for r in patchkit.applied()] == ["first", "second"]


def test_twice_in_one_process_gives_one_wrapper(victim, manifest_dir, runtime):
    import victim.core as core

    original = core.greet
    d = manifest_dir(HEADER + """
patches:
  - {id: loud, target: "victim.core:greet", op: wrap, with: "plug.patches:loud", why: t}
""")
    first = activate(d, runtime)
    again = activate(d, runtime)
    assert again is first
    # Even a second, independent plan (e.g. patchkit's own state lost) must not stack a wrapper.
    patchkit._status.clear()
    third = activate(d, runtime)
    assert third is not first and third.active
    assert outcomes() == {"loud": "already-applied"}
    assert core.greet.__wrapped__ is original
    assert core.greet("a") == "HI A"
    first.run.revert()
    assert core.greet is original


def test_deferred_until_import_and_importer_sees_patch(victim, manifest_dir, runtime):
    assert "victim.late" not in sys.modules
    d = manifest_dir(HEADER + """
patches:
  - {id: late, target: "victim.late:late", op: wrap, with: "plug.patches:late_wrap", why: t}
""")
    assert activate(d, runtime).active
    assert outcomes() == {"late": "pending"}
    import victim.late_user as late_user  # does `from victim.late import late`

    assert late_user.late(1) == ("late", 1)
    assert outcomes() == {"late": "applied"}


def test_after_waits_for_a_deferred_predecessor(victim, manifest_dir, runtime):
    import victim.core as core

    d = manifest_dir(HEADER + """
patches:
  - {id: late, target: "victim.late:late", op: wrap, with: "plug.patches:late_wrap", why: t}
  - {id: loud, target: "victim.core:greet", op: wrap, with: "plug.patches:loud", after: [late], why: t}
""")
    assert activate(d, runtime).active
    assert outcomes() == {"late": "pending", "loud": "pending"}
    assert core.greet("a") == "hi a"
    importlib.import_module("victim.late")
    assert outcomes() == {"late": "applied", "loud": "applied"}
    assert core.greet("a") == "HI A"


@pytest.mark.parametrize("policy", ["fail", "warn", "skip"])
def test_drift_policies(victim, manifest_dir, runtime, policy):
    import victim.core as core

    original = core.greet
    drifted = fingerprint.of_source("def greet(name, loud=False):\n    return name\n")
    d = manifest_dir(HEADER + f"""
patches:
  - id: loud
    target: victim.core:greet
    op: wrap
    with: plug.patches:loud
    fingerprint: "{drifted}"
    on_drift: {policy}
    why: test
""")
    status = activate(d, runtime)
    record = patchkit.applied()[0]
    assert record["fingerprint"] == "drifted:signature"
    if policy == "fail":
        assert not status.active
        assert "loud" in status.problem and "drifted:signature" in status.problem
        assert core.greet is original
    elif policy == "warn":
        assert status.active and record["outcome"] == "applied"
        assert core.greet("a") == "HI A"
    else:
        assert status.active and record["outcome"] == "skipped"
        assert core.greet is original


def test_body_drift_is_told_apart():
    a = fingerprint.of_source("def f(x):\n    return x\n")
    b = fingerprint.of_source("def f(x):\n    '''doc'''\n    # comment\n    return x\n")
    c = fingerprint.of_source("def f(x):\n    return x + 1\n")
    assert a == b, "docstrings, comments and layout are not part of the fingerprint"
    assert fingerprint.compare(a, c) == "drifted:body"
    assert fingerprint.compare(a, None) == "unverifiable"


@pytest.mark.parametrize("policy,active", [("fail", False), ("skip", True), ("warn", True)])
def test_missing_target(victim, manifest_dir, runtime, policy, active):
    d = manifest_dir(HEADER + f"""
patches:
  - {{id: gone, target: "victim.core:vanished", op: wrap, with: "plug.patches:loud", on_drift: {policy}, why: t}}
""")
    status = activate(d, runtime)
    assert status.active is active
    assert outcomes()["gone"] == ("failed" if policy == "fail" else "skipped")


def test_inherited_method_is_not_patched_through_subclass(victim, manifest_dir, runtime):
    import victim.core as core

    d = manifest_dir(HEADER + """
patches:
  - {id: sub, target: "victim.core:Sub.run", op: wrap, with: "plug.patches:run_times_ten", why: t}
""")
    status = activate(d, runtime)
    assert not status.active and "inherited" in status.problem
    assert "run" not in vars(core.Sub)


def test_rollback_after_injected_failure_restores_every_target(victim, manifest_dir, runtime):
    import victim.core as core
    import victim.user as user

    before = (core.greet, vars(core.Engine)["run"], vars(core.Engine)["make"], core.Engine.mode, user.greet)
    d = manifest_dir(HEADER + """
patches:
  - {id: a, target: "victim.core:greet", op: wrap, with: "plug.patches:loud", why: t}
  - {id: b, target: "victim.core:Engine.run", op: wrap, with: "plug.patches:run_times_ten", why: t}
  - {id: c, target: "victim.core:Engine.mode", op: set, value: "afd", why: t}
  - {id: d, target: "victim.core:Engine.make", op: wrap, with: "plug.patches:does_not_exist", why: t}
  - {id: e, target: "victim.core:other", op: wrap, with: "plug.patches:loud", why: t}
""")
    status = activate(d, runtime)
    assert not status.active
    assert "'d'" in status.problem and "does_not_exist" in status.problem
    after = (core.greet, vars(core.Engine)["run"], vars(core.Engine)["make"], core.Engine.mode, user.greet)
    assert all(x is y for x, y in zip(before, after, strict=True))
    assert outcomes() == {"a": "rolled-back", "b": "rolled-back", "c": "rolled-back", "d": "failed",
                          "e": "cancelled"}
    # a later clean apply works
    patchkit.revert()
    ok = manifest_dir(HEADER + """
patches:
  - {id: a, target: "victim.core:greet", op: wrap, with: "plug.patches:loud", why: t}
""")
    assert activate(ok, runtime).active and core.greet("x") == "HI X"


def test_failure_in_deferred_entry_rolls_back_eager_ones(victim, manifest_dir, runtime):
    import victim.core as core

    original = core.greet
    d = manifest_dir(HEADER + """
patches:
  - {id: a, target: "victim.core:greet", op: wrap, with: "plug.patches:loud", why: t}
  - {id: b, target: "victim.late:late", op: wrap, with: "plug.patches:missing", why: t}
""")
    assert activate(d, runtime).active
    assert core.greet("a") == "HI A"
    importlib.import_module("victim.late")  # must not raise into the importer
    status = patchkit.status("testplug")
    assert not status.active and "'b'" in status.problem
    assert core.greet is original


def test_descriptors_survive_wrapping(victim, manifest_dir, runtime):
    import victim.core as core

    d = manifest_dir(HEADER + """
patches:
  - {id: run, target: "victim.core:Engine.run", op: wrap, with: "plug.patches:run_times_ten", why: t}
  - {id: make, target: "victim.core:Engine.make", op: wrap, with: "plug.patches:make_tagged", why: t}
  - {id: dbl, target: "victim.core:Engine.double", op: wrap, with: "plug.patches:double_plus_one", why: t}
""")
    assert activate(d, runtime).active
    assert core.Engine().run(1) == 20
    assert core.Engine.make().tagged is True
    assert isinstance(vars(core.Engine)["make"], classmethod)
    assert isinstance(vars(core.Engine)["double"], staticmethod)
    assert core.Engine.double(3) == 7 and core.Engine().double(3) == 7


def test_replace_and_set_then_revert(victim, manifest_dir, runtime):
    import victim.core as core
    import victim.user as user

    original = core.greet
    d = manifest_dir(HEADER + """
patches:
  - {id: rep, target: "victim.core:greet", op: replace, with: "plug.patches:replacement", why: t}
  - {id: new, target: "victim.core:Engine.flavour", op: set, value: {kind: afd}, why: t}
""")
    assert activate(d, runtime).active
    assert core.greet is sys.modules["plug.patches"].replacement, "replace installs the object itself (1.00x)"
    assert user.call() == "replaced"
    assert core.Engine.flavour == {"kind": "afd"}
    patchkit.revert()
    assert core.greet is original and user.greet is original
    assert not hasattr(core.Engine, "flavour")


def test_revert_of_a_replace_leaves_the_replacements_own_aliases(victim, manifest_dir, runtime):
    """Replacing ``greet`` by an existing function (``other``): revert gives every ``greet`` alias back and
    leaves the names that held ``other`` before the patch as they were."""
    import victim.core as core
    import victim.holder as holder
    import victim.user as user

    greet, other = core.greet, core.other
    d = manifest_dir(header("testplug", "plug, victim") + """
patches:
  - {id: rep, target: "victim.core:greet", op: replace, with: "victim.core:other", why: t}
""")
    assert activate(d, runtime).active
    assert core.greet is other and user.greet is other
    patchkit.revert()
    assert core.greet is greet and user.greet is greet
    assert holder.other is other and holder.ALIAS is other and core.other is other


def test_disable_by_env(victim, manifest_dir, runtime, monkeypatch, caplog):
    import victim.core as core

    monkeypatch.setenv("PATCHKIT_DISABLE", "loud, other")
    d = manifest_dir(HEADER + """
patches:
  - {id: loud, target: "victim.core:greet", op: wrap, with: "plug.patches:loud", why: t}
  - {id: run, target: "victim.core:Engine.run", op: wrap, with: "plug.patches:run_times_ten", why: t}
""")
    assert activate(d, runtime).active
    assert outcomes() == {"loud": "disabled", "run": "applied"}
    assert core.greet("a") == "hi a"
    assert "disabled by PATCHKIT_DISABLE" in caplog.text


@pytest.mark.parametrize("when,reason", [
    ('{platform: [cuda]}', "platform cpu"),
    ('{vllm: ">=0.33"}', "vllm 0.32.0"),
    ('{python: "<3"}', "python"),
    ('{env: {PK_TEST_FLAG: "1"}}', "PK_TEST_FLAG"),
    ('{has_param: [loud]}', "lacks loud"),
    ('{has_attr: [Engine.nothing]}', "Engine.nothing"),
])
def test_guards(victim, manifest_dir, runtime, when, reason):
    import victim.core as core

    original = core.greet
    d = manifest_dir(HEADER + f"""
patches:
  - {{id: g, target: "victim.core:greet", op: wrap, with: "plug.patches:loud", when: {when}, why: t}}
""")
    assert activate(d, runtime).active
    record = patchkit.applied()[0]
    assert record["outcome"] == "guarded-out" and reason in record["reason"]
    assert core.greet is original


def test_guards_that_hold(victim, manifest_dir, runtime, monkeypatch):
    import victim.core as core

    monkeypatch.setenv("PK_TEST_FLAG", "1")
    d = manifest_dir(HEADER + """
patches:
  - id: g
    target: victim.core:greet
    op: wrap
    with: plug.patches:loud
    when: {platform: [cpu], vllm: ">=0.32,<0.33", env: {PK_TEST_FLAG: "1"}, has_param: [name], has_attr: [Engine]}
    why: t
""")
    assert activate(d, runtime).active
    assert core.greet("a") == "HI A"


def test_selection_commit_then_version_then_fallback(tmp_path, runtime):
    from patchkit.manifest.select import select

    d = tmp_path / "m"
    d.mkdir()
    body = "packages: [plug]\npatches: []\n"
    (d / "a.yaml").write_text(f"format: 1\nplugin: p\nvllm: {{version: '==0.30.0', commit: abcdef1}}\n{body}")
    (d / "b.yaml").write_text(f"format: 1\nplugin: p\nvllm: {{version: '==0.32.0'}}\n{body}")
    (d / "z.yaml").write_text(f"format: 1\nplugin: p\nfallback: true\nvllm: {{version: '>=0'}}\n{body}")
    from patchkit import manifest

    ms = [manifest.load(p) for p in sorted(d.glob("*.yaml"))]
    assert select(ms, Runtime("0.32.0", "abcdef1234")).file.endswith("a.yaml")
    assert select(ms, Runtime("0.32.0", None)).file.endswith("b.yaml")
    assert select(ms, Runtime("0.99.0", None)).fallback
    with pytest.raises(patchkit.UnsupportedRelease, match=r"supported: vllm==0.30.0, vllm==0.32.0"):
        select(ms[:2], Runtime("0.99.0", None))


def test_unsupported_release_applies_nothing(victim, manifest_dir, caplog):
    import victim.core as core

    original = core.greet
    d = manifest_dir(HEADER + """
patches:
  - {id: loud, target: "victim.core:greet", op: wrap, with: "plug.patches:loud", why: t}
""")
    status = activate(d, Runtime("0.99.0", None, _platform="cpu"))
    assert not status.active and "not supported" in status.problem and "vllm==0.32.0" in status.supported
    assert core.greet is original
    assert "nothing applied" in caplog.text


def test_invalid_manifest_at_runtime_patches_nothing(victim, manifest_dir, runtime):
    import victim.core as core

    original = core.greet
    d = manifest_dir(HEADER + """
patches:
  - {id: loud, target: "victim.core:greet", op: wrap, with: "plug.patches:loud", why: t, colour: red}
""")
    status = activate(d, runtime)
    assert not status.active and "m.yaml:7: patches[0].colour: unknown key" in status.problem
    assert core.greet is original


def test_compiled_plan_is_cached(victim, manifest_dir, runtime, monkeypatch):
    d = manifest_dir(HEADER + """
patches:
  - {id: loud, target: "victim.core:greet", op: wrap, with: "plug.patches:loud", why: t}
""")
    first = cache.compiled(d, runtime, "", selection.compile_plan)

    def no_compile(*args, **kwargs):
        raise AssertionError("the cached plan should have been used")

    second = cache.compiled(d, runtime, "", no_compile)
    assert second.digest == first.digest and second.order == ["loud"]
    # editing the manifest invalidates the cache
    (d / "m.yaml").write_text((d / "m.yaml").read_text() + "\n# edited, longer\n")
    with pytest.raises(AssertionError, match="cached plan"):
        cache.compiled(d, runtime, "", no_compile)


def test_models_register_lazily_and_revert(sandbox, manifest_dir, runtime, monkeypatch):
    sandbox({
        "plug/__init__.py": "",
        "plug/models.py": "class AFDToy:\n    pass\n",
        "fakereg/__init__.py": "",
        "fakereg/registry.py": '''
            class _Registry:
                def __init__(self):
                    self.models = {"Existing": "vllm-own"}

                def register_model(self, arch, cls):
                    assert isinstance(cls, str) and ":" in cls
                    self.models[arch] = cls

            ModelRegistry = _Registry()
        ''',
    })
    monkeypatch.setattr(engine, "MODEL_REGISTRY_MODULE", "fakereg.registry")
    d = manifest_dir(HEADER + """
models:
  - {arch: AFDToy, class: "plug.models:AFDToy"}
  - {arch: Existing, class: "plug.models:AFDToy"}
""")
    assert activate(d, runtime).active
    assert "fakereg.registry" not in sys.modules, "registering must not import the registry"
    assert "plug.models" not in sys.modules, "the model class is passed as a string"
    reg = importlib.import_module("fakereg.registry").ModelRegistry
    assert reg.models == {"Existing": "plug.models:AFDToy", "AFDToy": "plug.models:AFDToy"}
    patchkit.revert()
    assert reg.models == {"Existing": "vllm-own"}


def test_worker_override_only_when_auto(sandbox, manifest_dir, runtime, caplog):
    sandbox({
        **{k: v for k, v in VICTIM.items() if k.startswith("plug/")},
        "eng/__init__.py": "",
        "eng/args.py": '''
            from types import SimpleNamespace

            class EngineArgs:
                def __init__(self, worker_cls="auto", role=None):
                    self.worker_cls = worker_cls
                    self.role = role

                def create_engine_config(self):
                    resolved = "platform.Default" if self.worker_cls == "auto" else self.worker_cls
                    return SimpleNamespace(role=self.role, parallel_config=SimpleNamespace(worker_cls=resolved))
        ''',
    })
    d = manifest_dir(HEADER + """
workers:
  at: eng.args:EngineArgs.create_engine_config
  role_of: plug.patches:role_of
  overrides:
    - {role: attention, class: "plug.workers:CudaAttention", when: {platform: [cuda]}}
    - {role: attention, class: "plug.workers:CpuAttention", when: {platform: [cpu]}}
""")
    assert activate(d, runtime).active
    from eng.args import EngineArgs

    assert EngineArgs(role="attention").create_engine_config().parallel_config.worker_cls == "plug.workers.CpuAttention"
    assert EngineArgs(role=None).create_engine_config().parallel_config.worker_cls == "platform.Default"
    explicit = EngineArgs("my.Worker", role="attention").create_engine_config()
    assert explicit.parallel_config.worker_cls == "my.Worker"
    assert "set explicitly" in caplog.text


def test_reports_and_cross_process_check(victim, manifest_dir, runtime, tmp_path, monkeypatch, capsys):
    reports = tmp_path / "reports"
    monkeypatch.setenv("PATCHKIT_REPORT_DIR", str(reports))
    monkeypatch.setenv("PK_SECRET_TOKEN", "hunter2")
    d = manifest_dir(HEADER + """
patches:
  - {id: loud, target: "victim.core:greet", op: wrap, with: "plug.patches:loud", why: t}
""")
    assert activate(d, runtime).active
    files = list(reports.glob("*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data["digest"] and data["role"] == "main" and data["entries"][0]["outcome"] == "applied"
    assert "hunter2" not in files[0].read_text()
    assert cli.main(["report", str(reports)]) == 0
    assert "OK: 1 process(es)" in capsys.readouterr().out
    (reports / "testplug-1.json").write_text(json.dumps({**data, "pid": 1, "digest": "other"}))
    assert cli.main(["report", str(reports)]) == 1
    assert "MISMATCH" in capsys.readouterr().out
    # the same plan, but another verdict, or another member left out by it: not one verdict
    verdict = {"holds": True, "features_refused": {"micro": ["loud"]}, "plugin_failures": [], "digest": "v2"}
    (reports / "testplug-1.json").write_text(json.dumps({**data, "pid": 1, "verdict": verdict}))
    assert cli.main(["report", str(reports)]) == 1
    assert "different verdicts" in capsys.readouterr().out
    off = [{**data["entries"][0], "outcome": "feature-off"}]
    (reports / "testplug-1.json").write_text(json.dumps({**data, "pid": 1, "entries": off}))
    assert cli.main(["report", str(reports)]) == 1
    assert "the verdict's outcomes differ between processes: none; loud: feature-off" in capsys.readouterr().out


def test_a_noted_fact_goes_into_the_report(victim, manifest_dir, runtime, tmp_path, monkeypatch, capsys):
    reports = tmp_path / "reports"
    monkeypatch.setenv("PATCHKIT_REPORT_DIR", str(reports))
    d = manifest_dir(HEADER + """
patches:
  - {id: loud, target: "victim.core:greet", op: wrap, with: "plug.patches:loud", why: t}
""")
    assert activate(d, runtime).active
    patchkit.note("testplug", "model_runner", "v2 (pkg.mod:Runner)")
    patchkit.note("nobody", "model_runner", "v1")  # a plugin without a plan here: nothing
    (report,) = reports.glob("*.json")
    assert json.loads(report.read_text())["facts"] == {"model_runner": "v2 (pkg.mod:Runner)"}
    assert cli.main(["report", str(reports)]) == 0
    assert "1 applied; model_runner v2 (pkg.mod:Runner)" in capsys.readouterr().out


@pytest.mark.parametrize("noted,outcome", [(None, "applied"), ("v1", "applied"), ("v2", "off-path")])
def test_a_noted_fact_puts_an_entry_off_path(victim, manifest_dir, runtime, noted, outcome):
    """``when.noted``: applied at start; a fact noted later that the guard does not list makes it ``off-path``
    (installed, never reached); reverting restores the target as for any applied entry."""
    d = manifest_dir(HEADER + """
patches:
  - {id: v1-only, target: "victim.core:Engine.run", op: wrap, with: "plug.patches:loud", rebind: none,
     when: {noted: {model_runner: [v1]}}, why: t}
""")
    original = importlib.import_module("victim.core").Engine.__dict__["run"]
    assert activate(d, runtime).active
    assert sys.modules["victim.core"].Engine.__dict__["run"] is not original
    if noted is not None:
        patchkit.note("testplug", "model_runner", noted)
    (record,) = patchkit.applied("testplug")
    assert record["outcome"] == outcome
    if outcome == "off-path":
        assert record["reason"] == ("noted model_runner v2 not in ['v1']: the target is not on this process's "
                                    "running path")
    patchkit.revert()
    assert sys.modules["victim.core"].Engine.__dict__["run"] is original


def test_generated_wrapper_forwards_every_parameter_kind():
    from patchkit.runtime.wrappers import make_wrapper

    def original(a, b=2, /, c=3, *rest, d, e=5, **extra):
        return (a, b, c, rest, d, e, extra)

    calls = []

    def spy(orig, *args, **kwargs):
        calls.append((args, kwargs))
        return orig(*args, **kwargs)

    patched = make_wrapper(spy, original, ("t", "t"))
    assert patched(1, d=4) == original(1, d=4)
    assert patched(1, 9, 8, 7, 6, d=4, e=0, z=1) == original(1, 9, 8, 7, 6, d=4, e=0, z=1)
    assert str(__import__("inspect").signature(patched)) == str(__import__("inspect").signature(original))
    with pytest.raises(TypeError):
        patched(1)  # d is required, as in the original
    assert patched.__wrapped__ is original and patched.__name__ == "original"


def test_commit_ids_are_normalized():
    from patchkit.plan import normalize_commit

    assert normalize_commit("gced6857af") == "ced6857af"  # CUDA wheels' git-describe form
    assert normalize_commit("CED6857AF") == "ced6857af"
    assert normalize_commit("None") is None and normalize_commit("abc") is None


def test_non_function_callables_get_a_generic_wrapper():
    import functools

    from patchkit.runtime.wrappers import make_wrapper

    def add(a, b):
        return a + b

    partial = functools.partial(add, 10)
    patched = make_wrapper(lambda orig, *a, **k: orig(*a, **k) * 2, partial, ("t", "p"))
    assert patched(5) == 30 and patched.__wrapped__ is partial
    builtin = make_wrapper(lambda orig, *a, **k: orig(*a, **k), len, ("t", "len"))
    assert builtin([1, 2, 3]) == 3
