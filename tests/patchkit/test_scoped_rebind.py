"""``op: scoped-rebind``: names bound in a module for one call of a target, applied, fingerprinted, reported,
restored and reverted by patchkit like every other entry (synthetic packages; the AFD use is
tests/integration/test_afd_construction.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import patchkit
from patchkit import fingerprint
from patchkit.runtime import scoped
from tests.support.manifests import header

FILES = {
    "zoo/__init__.py": "",
    "zoo/models.py": '''
        class Mlp:
            def __init__(self, size):
                self.kind = "real"


        class Block:
            def __init__(self, size):
                self.mlp = Mlp(size)


        class Model:
            def __init__(self, size, role="plain"):
                self.role = role
                self.block = Block(size)
    ''',
    "zplug/__init__.py": "",
    "zplug/parts.py": '''
        from zoo.models import Mlp

        SEEN = []


        class MlpProxy(Mlp):
            def __init__(self, size):
                self.kind = "proxy"


        def attention_role(self, size, role="plain"):
            SEEN.append(role)
            if role == "explode":
                raise RuntimeError("boom inside")
            return role in ("attention", "explode")
    ''',
}

MODEL_INIT = '''def __init__(self, size, role="plain"):
    self.role = role
    self.block = Block(size)
'''


def entry(fp: str | None = None, bind: str = "Mlp: zplug.parts:MlpProxy", extra: str = "") -> str:
    fp_line = f'    fingerprint: "{fp}"\n' if fp else ""
    return header("zoo", "zplug") + f"""patches:
  - id: zoo.proxies
    target: zoo.models:Model.__init__
    op: scoped-rebind
    module: zoo.models
    bind:
      {bind}
    active_if: zplug.parts:attention_role
{fp_line}    rebind: none
    why: test
{extra}"""


@pytest.fixture
def zoo(sandbox: Callable[..., Path]) -> Path:
    return sandbox(FILES)


def test_names_are_bound_only_during_an_active_call_and_reverted(zoo, manifest_dir, runtime):
    import zoo.models as models

    original_init, original_mlp = vars(models.Model)["__init__"], models.Mlp
    status = patchkit.activate("zoo", manifest_dir(entry(fingerprint.of_source(MODEL_INIT))), runtime)
    assert status.active, status.problem
    assert models.Model(4).block.mlp.kind == "real"  # active_if false: untouched
    assert models.Model(4, role="attention").block.mlp.kind == "proxy"
    assert models.Mlp is original_mlp  # restored after the call
    record = patchkit.applied()[0]
    assert (record["op"], record["outcome"], record["fingerprint"]) == ("scoped-rebind", "applied", "match")
    patchkit.revert()
    assert vars(models.Model)["__init__"] is original_init
    assert models.Model(4, role="attention").block.mlp.kind == "real"


def test_names_are_restored_when_the_call_raises(zoo, manifest_dir, runtime):
    import zoo.models as models

    original_mlp = models.Mlp
    assert patchkit.activate("zoo", manifest_dir(entry()), runtime).active
    with pytest.raises(RuntimeError, match="boom inside"):
        models.Model(4, role="explode")
    assert models.Mlp is original_mlp


def test_a_name_the_module_lacks_fails_the_entry_at_apply_time(zoo, manifest_dir, runtime):
    import zoo.models as models

    original_init = vars(models.Model)["__init__"]
    status = patchkit.activate("zoo", manifest_dir(entry(bind="Dense: zplug.parts:MlpProxy")), runtime)
    assert not status.active
    assert "zoo.models no longer names Dense" in (status.problem or "")
    assert vars(models.Model)["__init__"] is original_init


def test_a_name_removed_after_apply_is_an_error_naming_it_at_call_time(zoo, manifest_dir, runtime):
    import zoo.models as models

    assert patchkit.activate("zoo", manifest_dir(entry()), runtime).active
    saved = models.Mlp
    del models.Mlp
    try:
        with pytest.raises(scoped.NameMissing, match=r"zoo\.models no longer names Mlp .*zoo\.proxies"):
            models.Model(4, role="attention")
    finally:
        models.Mlp = saved


def test_a_drifted_target_is_refused_like_any_entry(zoo, manifest_dir, runtime):
    import zoo.models  # noqa: F401 - imported: applied (and refused) at once

    status = patchkit.activate("zoo", manifest_dir(entry("ast1:0000000000000000:0000000000000000")), runtime)
    assert not status.active and "drifted" in (status.problem or "")


def test_scoped_calls_are_serialized_by_one_process_wide_lock(zoo, manifest_dir, runtime):
    """While one thread's scoped call runs, another's waits: it never sees a half-restored module."""
    import zoo.models as models

    assert patchkit.activate("zoo", manifest_dir(entry()), runtime).active
    inside, release = threading.Event(), threading.Event()
    kinds: list[str] = []
    real_init = vars(models.Block)["__init__"]

    def slow_block(self, size):
        real_init(self, size)
        kinds.append(self.mlp.kind)
        if threading.current_thread().name == "first":
            inside.set()
            release.wait(5)

    models.Block.__init__ = slow_block
    try:
        first = threading.Thread(target=models.Model, args=(4, "attention"), name="first")
        second = threading.Thread(target=models.Model, args=(4, "attention"), name="second")
        first.start()
        assert inside.wait(5)
        second.start()
        second.join(0.3)
        assert second.is_alive() and kinds == ["proxy"]  # waiting for the lock
        release.set()
        first.join(5)
        second.join(5)
        assert kinds == ["proxy", "proxy"]
    finally:
        models.Block.__init__ = real_init
    assert not scoped.LOCK._is_owned()  # type: ignore[attr-defined]


def test_bad_scoped_rebind_entries_name_the_field(tmp_path):
    from patchkit import ManifestError, manifest

    cases = {
        "with": ("    with: zplug.parts:MlpProxy\n", "patches[0].with: op 'scoped-rebind' takes no 'with'"),
        "outside": (None, "patches[0].bind.Mlp: 'elsewhere.x:Y' is outside the declared packages"),
    }
    for name, (extra, message) in cases.items():
        text = entry(extra=extra) if extra else entry(bind="Mlp: elsewhere.x:Y")
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        with pytest.raises(ManifestError, match=message.replace("[", r"\[").replace("]", r"\]")):
            manifest.load(path)
    path = tmp_path / "bind-on-wrap.yaml"
    path.write_text(header("zoo", "zplug") + "patches:\n  - {id: w, target: 'zoo.models:Model.__init__', op: wrap,"
                    " with: 'zplug.parts:attention_role', bind: {Mlp: 'zplug.parts:MlpProxy'}, why: t}\n")
    with pytest.raises(ManifestError, match=r"patches\[0\].bind: 'bind' is for op 'scoped-rebind' only"):
        manifest.load(path)
