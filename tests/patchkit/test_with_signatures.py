"""``patchkit check`` compares each callable an entry hands patchkit with its target's signature.

The rule (``patchkit.static.signatures.unfit``) on pairs of definitions, then ``run_check`` on a
synthetic ``vllm`` tree and a synthetic plugin package ``sigplug`` (on ``sys.path`` through the
``sandbox`` fixture, parsed, never imported): a wrapper that fits, one that misses a parameter,
renames a keyword or requires one more, ``*args``/``**kwargs`` wrappers; replace, scoped-rebind's
``active_if``, the workers section's ``role_of``, staticmethod and classmethod targets; what is not
compared; and the mismatch in the JSON, text and Markdown outputs.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from patchkit.review.check import run_check
from patchkit.static.signatures import signature, unfit


def sig(source: str, bound: str | None = None) -> inspect.Signature:
    node = ast.parse(textwrap.dedent(source)).body[0]
    assert isinstance(node, ast.FunctionDef)
    return signature(node, bound)


def wrapper_problems(target: str, wrapper: str) -> list[str]:
    """The parameters ``unfit`` names for a method target and a wrap's callable (less its ``original``)."""
    callee = sig(wrapper)
    callee = callee.replace(parameters=list(callee.parameters.values())[1:])
    return [name for name, _ in unfit(callee, sig(target, bound="self"))]


@pytest.mark.parametrize("wrapper", [
    "def w(original, self, batch, *, budget=8): ...",  # the target's own parameters
    "def w(original, engine, batch, *, budget=8): ...",  # self renamed: it is always passed by position
    "def w(original, *args, **kwargs): ...",
    "def w(original, engine, *args, **kwargs): ...",
    "def w(original, engine, batch, **kwargs): ...",
    "def w(original, engine, batch, *, budget=8, trace=False): ...",  # an extra optional keyword
])
def test_wrappers_that_fit(wrapper: str) -> None:
    assert wrapper_problems("def step(self, batch, *, budget=8): ...", wrapper) == []


@pytest.mark.parametrize("wrapper, named", [
    ("def w(original, self, batch): ...", ["budget"]),  # missing keyword-only parameter
    ("def w(original, self): ...", ["batch", "budget"]),  # missing positional parameter
    ("def w(original, self, items, *, budget=8): ...", ["batch"]),  # renamed: step(x, batch=...) fails
    ("def w(original, self, batch, *, limit=8): ...", ["budget"]),  # renamed keyword
    ("def w(original, self, batch, extra, *, budget=8): ...", ["extra"]),  # extra required parameter
    ("def w(original, self, batch, *, budget=8, mode): ...", ["mode"]),  # extra required keyword
    ("def w(original, self, batch, *, budget): ...", ["budget"]),  # optional in the target, required here
    ("def w(original, self, /, batch, *, budget=8): ...", []),
    ("def w(original, self, batch, /, *, budget=8): ...", ["batch"]),  # positional-only: batch= fails
    ("def w(original, self, budget, *, batch=0): ...", ["batch", "budget"]),  # positions swapped
])
def test_wrappers_that_do_not_fit(wrapper: str, named: list[str]) -> None:
    assert sorted(set(wrapper_problems("def step(self, batch, *, budget=8): ...", wrapper))) == named


def test_variadic_targets_need_variadic_callables() -> None:
    target = sig("def build(model, *items, dtype='auto', **extra): ...")
    assert unfit(sig("def r(model, *items, dtype='auto', **extra): ..."), target) == []
    assert unfit(sig("def r(*a, **k): ..."), target) == []
    # no *items, no **extra, and build(m, x, dtype=...) would fill r's positional dtype twice
    assert [n for n, _ in unfit(sig("def r(model, dtype='auto'): ..."), target)] == ["*items", "dtype", "**extra"]
    # a positional parameter past the callable's own: *args takes it by position, **kwargs by keyword
    assert unfit(sig("def r(*args, **kwargs): ..."), sig("def f(a, b=1): ...")) == []
    assert [n for n, _ in unfit(sig("def r(*args): ..."), sig("def f(a, b=1): ..."))] == ["a", "b"]


VLLM = {
    "vllm/__init__.py": "",
    "vllm/version.py": "__version__ = '0.39.0'\n",
    "vllm/engine.py": """
        class Engine:
            def __init__(self, config):
                self.config = config

            def step(self, batch, *, budget=8):
                return batch

            @staticmethod
            def add_args(parser):
                return parser

            @classmethod
            def from_args(cls, args):
                return cls(args)

            def create_config(self, usage=None):
                return usage


        def build(model, dtype="auto"):
            return model


        LIMIT = 4
    """,
}

PLUGIN = {
    "sigplug/__init__.py": "",
    "sigplug/fit.py": """
        def step(original, engine, batch, *, budget=8):
            return original(engine, batch, budget=budget)

        def generic(original, *args, **kwargs):
            return original(*args, **kwargs)

        def add_args(original, parser, *args, **kwargs):
            return original(parser, *args, **kwargs)

        def from_args(original, cls, args):
            return original(cls, args)

        def build(model, dtype="auto", **extra):
            return model

        def active(*args, **kwargs):
            return True

        def role_of(config):
            return None

        class Wrapper:
            def __init__(self, original, engine, batch, *, budget=8):
                self.result = original(engine, batch, budget=budget)

        Built = type("Built", (), {})
    """,
    "sigplug/misfit.py": """
        def step(original, engine, batch):
            return original(engine, batch)

        def step_renamed(original, engine, items, *, budget=8):
            return original(engine, items, budget=budget)

        def build(model):
            return model

        def active(self):
            return True

        def role_of(config, role):
            return role
    """,
}


@pytest.fixture
def tree(tmp_path: Path, sandbox: Callable[[dict[str, str]], Path]) -> Path:
    sandbox(PLUGIN)
    importlib.invalidate_caches()
    root = tmp_path / "vllm-src"
    for rel, text in VLLM.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def write_manifest(path: Path, entries: str) -> Path:
    path.write_text("format: 1\nplugin: sig\npackages: [sigplug]\nvllm: {version: '==0.39.0'}\n"
                    + textwrap.dedent(entries).lstrip("\n"))
    return path


def check(manifest: Path, tree: Path, fmt: str = "json") -> tuple[int, str]:
    code, out = run_check(manifest, str(tree), fmt=fmt)
    assert code in (0, 1), out
    return code, out


def fits_of(out: str) -> dict[str, list[dict]]:
    return {e["id"]: e["signatures"] for e in json.loads(out)["entries"]}


def test_callables_that_fit_pass(tmp_path: Path, tree: Path) -> None:
    manifest = write_manifest(tmp_path / "m.yaml", """
        patches:
          - {id: step, target: "vllm.engine:Engine.step", op: wrap, with: "sigplug.fit:step", why: t}
          - {id: generic, target: "vllm.engine:Engine.create_config", op: wrap, with: "sigplug.fit:generic", why: t}
          - {id: static, target: "vllm.engine:Engine.add_args", op: wrap, with: "sigplug.fit:add_args", why: t}
          - {id: classm, target: "vllm.engine:Engine.from_args", op: wrap, with: "sigplug.fit:from_args", why: t}
          - {id: cls, target: "vllm.engine:Engine.step", op: wrap, with: "sigplug.fit:Wrapper", after: [step], why: t}
          - {id: replace, target: "vllm.engine:build", op: replace, with: "sigplug.fit:build", why: t}
          - id: scoped
            target: "vllm.engine:Engine.__init__"
            op: scoped-rebind
            bind: {LIMIT: "sigplug.fit:Built"}
            active_if: "sigplug.fit:active"
            why: t
        workers:
          at: "vllm.engine:Engine.create_config"
          after: [generic]
          role_of: "sigplug.fit:role_of"
          overrides: [{role: a, class: "sigplug.fit:Built"}]
    """)
    code, out = check(manifest, tree)
    assert code == 0, out
    fits = fits_of(out)
    assert {entry: [f["fits"] for f in found] for entry, found in fits.items()} == {
        "step": [True], "generic": [True], "static": [True], "classm": [True], "cls": [True], "replace": [True],
        "scoped": [True], "workers": [True]}
    assert [f["role"] for f in fits["scoped"]] == ["active_if"] and fits["workers"][0]["role"] == "role_of"
    assert fits["step"][0]["target_signature"] == "vllm.engine:Engine.step(self, /, batch, *, budget=…)"
    assert fits["classm"][0]["target_signature"] == "vllm.engine:Engine.from_args(cls, /, args)"
    assert fits["static"][0]["target_signature"] == "vllm.engine:Engine.add_args(parser)"


def test_a_misfit_fails_naming_file_line_entry_parameters_and_both_signatures(tmp_path: Path, tree: Path) -> None:
    manifest = write_manifest(tmp_path / "m.yaml", """
        patches:
          - {id: missing, target: "vllm.engine:Engine.step", op: wrap, with: "sigplug.misfit:step", why: t}
          - id: renamed
            target: "vllm.engine:Engine.step"
            op: wrap
            with: "sigplug.misfit:step_renamed"
            after: [missing]
            required: false
            why: t
          - {id: replace, target: "vllm.engine:build", op: replace, with: "sigplug.misfit:build", why: t}
          - id: scoped
            target: "vllm.engine:Engine.__init__"
            op: scoped-rebind
            bind: {LIMIT: "sigplug.fit:Built"}
            active_if: "sigplug.misfit:active"
            why: t
        workers:
          at: "vllm.engine:Engine.create_config"
          role_of: "sigplug.misfit:role_of"
          overrides: [{role: a, class: "sigplug.fit:Built"}]
    """)
    code, out = check(manifest, tree)
    assert code == 1
    doc = json.loads(out)
    rows = {e["id"]: e for e in doc["entries"]}
    assert doc["summary"]["misfits"] == ["missing", "renamed", "replace", "scoped", "workers"]
    assert doc["summary"]["failing"] == doc["summary"]["misfits"]  # optional (renamed) fails too
    missing = rows["missing"]
    assert missing["source"] == f"{manifest}:6" and missing["verdict"] == "ok"
    (fit,) = missing["signatures"]
    assert fit["fits"] is False and [p["parameter"] for p in fit["problems"]] == ["budget"]
    assert fit["callable_signature"] == "sigplug.misfit:step(original, engine, batch)"
    assert fit["target_signature"] == "vllm.engine:Engine.step(self, /, batch, *, budget=…)"
    assert rows["renamed"]["source"] == f"{manifest}:7"
    assert [p["parameter"] for p in rows["renamed"]["signatures"][0]["problems"]] == ["batch"]
    assert [p["parameter"] for p in rows["replace"]["signatures"][0]["problems"]] == ["dtype"]
    assert [p["parameter"] for p in rows["scoped"]["signatures"][0]["problems"]] == ["config"]
    assert [p["parameter"] for p in rows["workers"]["signatures"][0]["problems"]] == ["role"]
    assert rows["workers"]["signatures"][0]["target_signature"].startswith("role_of(config, /) ")

    _, text = check(manifest, tree, "text")
    assert (f"SIGNATURE MISMATCH at {manifest}:6 (entry missing): with sigplug.misfit:step does not accept "
            "every call of the target") in text
    assert "target:   vllm.engine:Engine.step(self, /, batch, *, budget=…)" in text
    assert "callable: sigplug.misfit:step(original, engine, batch)" in text
    assert "budget: keyword-only in the target; the callable has no such parameter and no **kwargs" in text
    assert "callables that do not fit: missing, renamed, replace, scoped, workers" in text
    _, markdown = check(manifest, tree, "markdown")
    assert "| `missing` | `vllm.engine:Engine.step` | ok | **yes** |" in markdown
    assert f"SIGNATURE MISMATCH at {manifest}:6 (entry missing)" in markdown


def test_what_is_not_compared_does_not_fail(tmp_path: Path, tree: Path) -> None:
    manifest = write_manifest(tmp_path / "m.yaml", """
        patches:
          - {id: absent, target: "vllm.engine:Engine.step", op: wrap, with: "sigplug.nowhere:step", why: t}
          - {id: built, target: "vllm.engine:build", op: replace, with: "sigplug.fit:Built", why: t}
          - {id: value, target: "vllm.engine:LIMIT", op: set, with: "sigplug.fit:build", why: t}
          - {id: gone, target: "vllm.engine:Engine.vanished", op: wrap, with: "sigplug.misfit:step", required: false,
             why: t}
    """)
    code, out = check(manifest, tree)
    assert code == 0, out
    fits = fits_of(out)
    assert [f["fits"] for f in fits["absent"]] == [None] and "not in sigplug" in fits["absent"][0]["note"]
    assert "is an assignment" in fits["built"][0]["note"]
    assert "is an assignment" in fits["value"][0]["note"]
    assert fits["gone"] == []  # the target is missing: its verdict says so


def test_a_drifted_target_skipped_at_run_time_does_not_fail_on_its_signature(tmp_path: Path, tree: Path) -> None:
    manifest = write_manifest(tmp_path / "m.yaml", """
        patches:
          - {id: skip, target: "vllm.engine:Engine.step", op: wrap, with: "sigplug.misfit:step", on_drift: skip,
             fingerprint: "ast1:0000000000000000:0000000000000000", why: t}
    """)
    code, out = check(manifest, tree)
    row = json.loads(out)["entries"][0]
    assert code == 0 and row["verdict"] == "drifted: signature" and row["signatures"][0]["fits"] is False
