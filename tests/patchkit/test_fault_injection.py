"""Fault injection on the real AFD plan shape: every entry, every way it can fail.

The plan of ``manifests/afd/vllm-0.32.yaml`` (its entries, order, ops, models and
``workers``) is retargeted onto a throwaway tree: ``fkvllm`` mimics vLLM
(``EngineArgs.create_engine_config`` a method, ``add_cli_args`` a staticmethod,
``from_cli_args`` a classmethod, a model registry, ``EngineCore.step``, the async
``AsyncLLM.generate``/``check_health``) and ``fkafd`` the plugin. Three
extra entries add ``replace`` and ``set`` ops. For each position in the plan, the
entry there is made to fail at apply time: its callable's module fails to import,
raises at module level, or lacks the name; its target is missing; its fingerprint
drifted under ``on_drift: fail``. After each: every owner's ``__dict__`` holds the
original objects (descriptors included), ``Status.problem`` names the entry, and a
later clean activation works. A wrap factory that raises does so at call time only.
"""

from __future__ import annotations

import copy
import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import patchkit
from harness.env import REPO
from patchkit import fingerprint, manifest
from patchkit.manifest import select as selection
from patchkit.manifest.validate import resolved
from patchkit.plan import Runtime
from patchkit.runtime import engine
from patchkit.runtime.hooks import pending as pending_imports
from patchkit.runtime.targets import Slot, unwrap_descriptor

REAL = REPO / "manifests" / "afd" / "vllm-0.32.yaml"
PLUGIN = "fkafd"
FACTORY = "def {name}(original, *args, **kwargs):\n    CALLS.append({name!r})\n    return original(*args, **kwargs)\n"

TREE = {
    "fkvllm/__init__.py": "",
    "fkvllm/engine/__init__.py": "",
    "fkvllm/engine/arg_utils.py": """
        class EngineArgs:
            def create_engine_config(self, usage_context=None):
                return {"config": usage_context}

            @staticmethod
            def add_cli_args(parser):
                return parser

            @classmethod
            def from_cli_args(cls, args):
                return cls()

        ORIGINALS = dict(vars(EngineArgs))
    """,
    "fkvllm/utils/__init__.py": """
        LIMIT = 64

        def helper(x):
            return ("helper", x)

        def compute(x):
            return x * 2

        ORIGINALS = dict(globals())
    """,
    "fkvllm/utils/ompmultiprocessing.py": """
        class OMPProcessManager:
            def __init__(self, config=None):
                self.config = config
    """,
    "fkvllm/user.py": "from fkvllm.utils import helper\n",
    "fkvllm/v1/__init__.py": "",
    "fkvllm/v1/engine/__init__.py": "",
    "fkvllm/v1/engine/core.py": """
        class EngineCore:
            def step(self):
                return {}, False
    """,
    "fkvllm/v1/engine/async_llm.py": """
        class AsyncLLM:
            async def generate(self, *args, **kwargs):
                yield args

            async def check_health(self):
                return None
    """,
    "fkvllm/v1/worker/__init__.py": "",
    "fkvllm/v1/worker/gpu_model_runner.py": """
        class GPUModelRunner:
            def _determine_batch_execution_and_padding(self, num_tokens=0, num_reqs=0, num_scheduled_tokens_np=None,
                                                       max_num_scheduled_tokens=0, allow_microbatching=True):
                return None, None, False, None, None
    """,
    "fkvllm/v1/worker/gpu/__init__.py": "",
    "fkvllm/v1/worker/gpu/model_runner.py": """
        def dispatch_cg_and_sync_dp(cudagraph_manager, num_reqs=0, num_tokens=0, allow_ubatching=False):
            return None, None

        def maybe_build_ubatch_runner(vllm_config, device=None, model_state=None):
            return None
    """,
    "fkvllm/model_executor/__init__.py": "",
    "fkvllm/model_executor/models/__init__.py": "",
    "fkvllm/model_executor/models/registry.py": """
        class _Registry:
            fail_arch = None

            def __init__(self):
                self.models = {"Existing": "somewhere:Existing"}

            def register_model(self, arch, ref):
                if arch == self.fail_arch:
                    raise RuntimeError("registry refuses " + arch)
                self.models[arch] = ref

        ModelRegistry = _Registry()
    """,
    "fkafd/__init__.py": "",
    "fkafd/patches/__init__.py": "",
    "fkafd/patches/engine_config.py": "CALLS = []\n\ndef role_of(config):\n    return None\n\n"
    + FACTORY.format(name="validate_afd_config"),
    "fkafd/patches/cli_flags.py": "CALLS = []\n" + FACTORY.format(name="add_afd_cli_args")
    + FACTORY.format(name="afd_from_cli_args"),
    "fkafd/patches/outage.py": "CALLS = []\n" + FACTORY.format(name="step_outliving_ffn")
    + FACTORY.format(name="generate_naming_afd") + FACTORY.format(name="check_health_with_afd_group"),
    "fkafd/patches/micro_batches.py": "CALLS = []\n" + FACTORY.format(name="split_afd_steps"),
    "fkafd/patches/micro_batches_v2.py": "CALLS = []\n" + FACTORY.format(name="split_afd_steps_v2")
    + FACTORY.format(name="build_ubatch_runner"),
    "fkafd/patches/cpu_binding.py": "CALLS = []\n" + FACTORY.format(name="omp_manager_init"),
    "fkafd/extra.py": "CALLS = []\nFLAG = object()\n\ndef helper(x):\n    return ('replaced', x)\n\n"
    + FACTORY.format(name="compute_wrap"),
    "fkafd/fault_import.py": "import fk_no_such_module_anywhere\n\ndef thing(original, *a, **k):\n    return 1\n",
    "fkafd/fault_code.py": "RATIO = 1 / 0\n\ndef thing(original, *a, **k):\n    return 1\n",
    "fkafd/raising.py": "def thing(original, *args, **kwargs):\n    raise LookupError('factory raised')\n",
}

def fk(ref: str) -> str:
    return "fk" + ref if ref.startswith("vllm.") else ref.replace("afd_patches", "fkafd")


def _scoped_tree() -> dict[str, str]:
    """Fake vLLM model modules and fkafd proxies for the real manifest's scoped-rebind entries."""
    files = {"fkafd/models/__init__.py": "",
             "fkafd/models/ffn_proxy.py": "def building_attention_model(*args, **kwargs):\n    return False\n"}
    for entry in (p for p in resolved(REAL).doc["patches"] if p["op"] == "scoped-rebind"):
        module, _, qualname = fk(entry["target"]).partition(":")
        owner = qualname.split(".")[0]
        names = "".join(f"class {name}:\n    pass\n\n\n" for name in entry["bind"])
        files[module.replace(".", "/") + ".py"] = (
            names + f"class {owner}:\n    def __init__(self, *args, **kwargs):\n        self.built = True\n")
        for ref in entry["bind"].values():
            plugin_module, _, proxy = fk(ref).partition(":")
            path = plugin_module.replace(".", "/") + ".py"
            files[path] = files.get(path, "") + f"{proxy} = object\n"
    return files


SCOPED_MODULES = sorted({fk(p["target"]).partition(":")[0] for p in resolved(REAL).doc["patches"]
                         if p["op"] == "scoped-rebind"})

EXTRA = [
    {"id": "x.replace-helper", "target": "fkvllm.utils:helper", "op": "replace", "with": "fkafd.extra:helper",
     "fingerprint": True, "why": "replace a module function (rebind auto reaches fkvllm.user)"},
    {"id": "x.set-flag", "target": "fkvllm.engine.arg_utils:EngineArgs.afd_flag", "op": "set",
     "with": "fkafd.extra:FLAG", "rebind": "none", "why": "a new class attribute"},
    {"id": "x.set-limit", "target": "fkvllm.utils:LIMIT", "op": "set", "value": 128, "why": "a plain value"},
    {"id": "x.wrap-compute", "target": "fkvllm.utils:compute", "op": "wrap", "with": "fkafd.extra:compute_wrap",
     "after": ["afd.cli-flags"], "fingerprint": True, "why": "a module function after a class method"},
]


TREE.update(_scoped_tree())


def live_fingerprint(target: str) -> str:
    raw = Slot.resolve(target).get_raw()
    value = fingerprint.of_object(unwrap_descriptor(raw)[0])
    assert value, target
    return value


def dump(doc: dict[str, Any]) -> str:
    """``doc`` as YAML text, by libyaml's emitter: the same document as ``yaml.safe_dump`` writes, about eight
    times faster on the real plan (about 0.25 s a dump on 2 cores in pure Python, and each case writes two)."""
    return yaml.dump(doc, Dumper=yaml.CSafeDumper, sort_keys=False)


@functools.cache
def _real_doc() -> dict[str, Any]:
    """The real 0.32 manifest with its base (extends), read and resolved once per session: the YAML parse costs
    about 0.1 s and every ``plan_doc`` call (over 200 of them, at collection and per case) starts from it."""
    return resolved(REAL).doc


def plan_doc(with_fingerprints: bool) -> dict[str, Any]:
    """The real 0.32 manifest retargeted onto fkvllm/fkafd, plus EXTRA (a fresh copy: ``inject`` edits it)."""
    real = copy.deepcopy(_real_doc())
    fp = live_fingerprint if with_fingerprints else (lambda _t: "ast1:0000000000000000:0000000000000000")
    patches = []
    for p in real["patches"]:
        q = {**p, "target": fk(p["target"])}
        for key in ("with", "active_if", "module"):
            if key in q:
                q[key] = fk(q[key])
        if "bind" in q:
            q["bind"] = {name: fk(ref) for name, ref in q["bind"].items()}
        if "fingerprint" in q:
            q["fingerprint"] = fp(q["target"])
        patches.append(q)
    for p in EXTRA:
        q = dict(p)
        if q.pop("fingerprint", False):
            q["fingerprint"] = fp(q["target"])
        patches.append(q)
    w = real["workers"]
    workers = {**w, "at": fk(w["at"]), "fingerprint": fp(fk(w["at"])), "role_of": fk(w["role_of"]),
               "overrides": [{**o, "class": fk(o["class"])} for o in w["overrides"]]}
    return {**real, "plugin": PLUGIN, "packages": ["fkafd"], "vllm": {"version": "==0.32.0"},
            "patches": patches, "models": [{**m, "class": fk(m["class"])} for m in real["models"]],
            "workers": workers}


def _plan_order() -> list[str]:
    doc = plan_doc(with_fingerprints=False)
    return [e.id for e in selection.order(manifest.parse(dump(doc), "plan.yaml").entries)]


ORDER = _plan_order()
APPLY_FAULTS = ["import-error", "module-error", "missing-attr", "missing-owner", "missing-target", "drift"]


def inject(doc: dict[str, Any], entry_id: str, fault: str) -> bool:
    """Make ``entry_id`` fail with ``fault``; False when the fault does not apply to that entry."""
    if entry_id == "workers":
        item, ref_key, target_key = doc["workers"], "role_of", "at"
    else:
        item = next(p for p in doc["patches"] if p["id"] == entry_id)
        ref_key, target_key = ("active_if" if item["op"] == "scoped-rebind" else "with"), "target"
    module, _, qualname = item[target_key].partition(":")
    if fault in ("import-error", "module-error", "missing-attr"):
        if ref_key not in item:
            return False  # set with a plain value: no callable to break
        item[ref_key] = {"import-error": "fkafd.fault_import:thing", "module-error": "fkafd.fault_code:thing",
                         "missing-attr": "fkafd.extra:no_such_thing"}[fault]
    elif fault == "missing-owner":
        item[target_key] = f"{module}:NoSuchOwner.{qualname.rpartition('.')[2]}"
    elif fault == "missing-target":
        if item.get("op") == "set":
            return False  # set may create the attribute; a missing owner covers it
        item[target_key] = f"{module}:{qualname}_gone"
    elif fault == "drift":
        if entry_id == "x.set-flag":
            return False  # a new attribute has nothing to fingerprint
        item["fingerprint"] = "ast1:0123456789abcdef:0123456789abcdef"
    item["on_drift"] = "fail"
    return True


@pytest.fixture
def tree(sandbox: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    sandbox(TREE)
    monkeypatch.setattr(engine, "MODEL_REGISTRY_MODULE", "fkvllm.model_executor.models.registry")
    patchkit.revert()
    patchkit._status.clear()
    yield tmp_path
    patchkit.revert()
    patchkit._status.clear()


def import_tree() -> dict[str, Any]:
    return {name: importlib.import_module(name) for name in (
        "fkvllm.engine.arg_utils", "fkvllm.utils", "fkvllm.user", "fkvllm.model_executor.models.registry",
        "fkvllm.v1.engine.core", "fkvllm.v1.engine.async_llm", "fkvllm.v1.worker.gpu_model_runner",
        "fkvllm.v1.worker.gpu.model_runner",
        "fkvllm.utils.ompmultiprocessing", *SCOPED_MODULES)}


def owners(mods: dict[str, Any]) -> list[Any]:
    scoped = [o for name in SCOPED_MODULES for o in (mods[name], *(v for v in vars(mods[name]).values()
                                                                    if isinstance(v, type)))]
    return [mods["fkvllm.engine.arg_utils"].EngineArgs, mods["fkvllm.engine.arg_utils"], mods["fkvllm.utils"],
            mods["fkvllm.user"], mods["fkvllm.v1.engine.core"].EngineCore,
            mods["fkvllm.v1.engine.async_llm"].AsyncLLM, mods["fkvllm.v1.worker.gpu.model_runner"], *scoped]


def snapshot(mods: dict[str, Any]) -> list[dict[str, Any]]:
    registry = mods["fkvllm.model_executor.models.registry"].ModelRegistry.models
    return [dict(vars(o)) for o in owners(mods)] + [dict(registry)]


def diffs(before: list[dict[str, Any]], mods: dict[str, Any]) -> list[str]:
    out = []
    for i, (old, now) in enumerate(zip(before, snapshot(mods), strict=True)):
        for key in old.keys() | now.keys():
            if key not in old or key not in now or old[key] is not now[key]:
                out.append(f"owner{i}.{key}")
    return out


def write(folder: Path, doc: dict[str, Any]) -> Path:
    folder.mkdir(parents=True)
    (folder / "m.yaml").write_text(dump(doc))
    return folder


def assert_pristine(before: list[dict[str, Any]], mods: dict[str, Any]) -> None:
    assert diffs(before, mods) == []
    ea = mods["fkvllm.engine.arg_utils"]
    assert dict(vars(ea.EngineArgs)) == ea.ORIGINALS
    assert type(vars(ea.EngineArgs)["add_cli_args"]) is staticmethod
    assert type(vars(ea.EngineArgs)["from_cli_args"]) is classmethod
    assert mods["fkvllm.user"].helper is mods["fkvllm.utils"].ORIGINALS["helper"]
    assert not [k for k in engine._LIVE if k[0] == PLUGIN]
    assert not [m for m in pending_imports() if m.startswith("fkvllm")]


def clean_activation_works(root: Path, mods: dict[str, Any]) -> None:
    patchkit.revert()
    patchkit._status.clear()
    before = snapshot(mods)
    status = patchkit.activate(PLUGIN, write(root, plan_doc(True)), Runtime("0.32.0", None, _platform="cpu"))
    assert status.active, status.problem
    outcomes = {r["id"]: r["outcome"] for r in patchkit.applied(PLUGIN)}
    assert set(outcomes.values()) == {"applied"}, outcomes
    ea = mods["fkvllm.engine.arg_utils"]
    assert ea.EngineArgs().create_engine_config("u") == {"config": "u"}
    assert mods["fkvllm.user"].helper(1) == ("replaced", 1)
    patchkit.revert()
    assert diffs(before, mods) == []


def test_plan_shape_is_the_real_one() -> None:
    real_ids = [e.id for e in manifest.load(REAL).entries]
    assert set(real_ids) <= set(ORDER) and len(ORDER) == len(real_ids) + len(EXTRA) >= 5
    ops = {e.op for e in manifest.parse(dump(plan_doc(False)), "p.yaml").entries}
    assert ops == {"wrap", "replace", "set", "workers", "scoped-rebind"}


def test_clean_plan_applies_and_reverts(tree: Path) -> None:
    mods = import_tree()
    before = snapshot(mods)
    clean_activation_works(tree / "clean", mods)
    assert_pristine(before, mods)


# Every (position, fault) pair where the fault applies (e.g. no fingerprint drift for a `set` value).
APPLICABLE = [(pos, fault) for fault in APPLY_FAULTS for pos in range(len(ORDER))
              if inject(plan_doc(False), ORDER[pos], fault)]


@pytest.mark.parametrize(("position", "fault"), APPLICABLE, ids=[f"{ORDER[p]}-{f}" for p, f in APPLICABLE])
def test_apply_time_fault_rolls_back_everything(tree: Path, position: int, fault: str) -> None:
    entry_id = ORDER[position]
    mods = import_tree()
    doc = plan_doc(True)
    assert inject(doc, entry_id, fault)
    before = snapshot(mods)
    status = patchkit.activate(PLUGIN, write(tree / "bad", doc), Runtime("0.32.0", None, _platform="cpu"))
    assert not status.active
    assert status.problem is not None and f"'{entry_id}'" in status.problem, status.problem
    records = {r["id"]: r["outcome"] for r in patchkit.applied(PLUGIN)}
    assert records[entry_id] == "failed"
    assert all(o in ("rolled-back", "cancelled", "failed") for o in records.values()), records
    assert_pristine(before, mods)
    clean_activation_works(tree / "clean", mods)
    assert_pristine(before, mods)


@pytest.mark.parametrize("position", range(len(ORDER)), ids=ORDER)
def test_fault_in_import_hook_rolls_back_and_import_succeeds(tree: Path, position: int) -> None:
    """Targets not imported yet: the failure happens inside the import hook, not in activate()."""
    entry_id = ORDER[position]
    import_tree()
    doc = plan_doc(True)  # fingerprints need the live targets once
    for name in [n for n in sys.modules if n.startswith("fkvllm")]:
        del sys.modules[name]
    assert inject(doc, entry_id, "import-error" if entry_id != "x.set-limit" else "missing-owner")
    status = patchkit.activate(PLUGIN, write(tree / "bad", doc), Runtime("0.32.0", None, _platform="cpu"))
    assert status.active  # nothing could be applied yet
    mods = import_tree()  # must not raise: the failure is this plugin's, not the importer's
    late = patchkit.status(PLUGIN)
    assert late is not None and not late.active
    assert late.problem is not None and f"'{entry_id}'" in late.problem, late.problem
    ea = mods["fkvllm.engine.arg_utils"]
    assert dict(vars(ea.EngineArgs)) == ea.ORIGINALS
    utils = mods["fkvllm.utils"]
    # (dunders excluded: the import hook puts the real __loader__ back after the module ran)
    assert all(getattr(utils, k) is v for k, v in utils.ORIGINALS.items() if not k.startswith("__"))
    assert mods["fkvllm.user"].helper is utils.ORIGINALS["helper"]
    assert not [k for k in engine._LIVE if k[0] == PLUGIN]
    clean_activation_works(tree / "clean", mods)


@pytest.mark.parametrize("arch_index", range(3))
def test_model_registration_fault_rolls_back(tree: Path, arch_index: int) -> None:
    mods = import_tree()
    doc = plan_doc(True)
    arch = doc["models"][arch_index]["arch"]
    registry = mods["fkvllm.model_executor.models.registry"].ModelRegistry
    registry.fail_arch = arch
    before = snapshot(mods)
    status = patchkit.activate(PLUGIN, write(tree / "bad", doc), Runtime("0.32.0", None, _platform="cpu"))
    assert not status.active and status.problem is not None and f"'model:{arch}'" in status.problem
    assert_pristine(before, mods)
    registry.fail_arch = None
    clean_activation_works(tree / "clean", mods)


WRAPS = [i for i in ORDER if i != "workers" and next(
    (p for p in plan_doc(False)["patches"] if p["id"] == i), {}).get("op") == "wrap"]


@pytest.mark.parametrize("entry_id", WRAPS)
def test_raising_wrap_factory_fails_at_call_time_only(tree: Path, entry_id: str) -> None:
    mods = import_tree()
    doc = plan_doc(True)
    next(p for p in doc["patches"] if p["id"] == entry_id)["with"] = "fkafd.raising:thing"
    before = snapshot(mods)
    status = patchkit.activate(PLUGIN, write(tree / "bad", doc), Runtime("0.32.0", None, _platform="cpu"))
    assert status.active and status.problem is None
    target = next(p for p in doc["patches"] if p["id"] == entry_id)["target"]
    module, _, qualname = target.partition(":")
    obj: Any = sys.modules[module]
    for part in qualname.split("."):
        obj = getattr(obj, part)
    call_args = {"create_engine_config": (mods["fkvllm.engine.arg_utils"].EngineArgs(),)}.get(
        qualname.rpartition(".")[2], (1,))
    with pytest.raises(LookupError, match="factory raised"):
        obj(*call_args)
    assert patchkit.status(PLUGIN).active  # a call-time error is the caller's, the plan stays
    patchkit.revert()
    assert_pristine(before, mods)


def test_every_position_gets_every_applicable_fault() -> None:
    applicable = sum(inject(plan_doc(False), i, f) for i in ORDER for f in APPLY_FAULTS)
    assert len(ORDER) >= 7 and applicable >= 5 * len(ORDER) - 3
