"""Property-based fuzzing of manifest reading, activation and the AFD config parser.

Fixed budget, deterministic (``derandomize=True``, no example database), so a run is
reproducible and its cost is known. Properties:

- ``manifest.parse(text, file)`` returns a ``Manifest`` or raises ``ManifestError`` whose
  problems all name ``file``, a line in ``1 .. lines + 1`` and a ``str`` field; never
  any other exception. Inputs: valid manifests mutated at every level (keys dropped,
  added, retyped; wrong enum values; random refs, specifiers and fingerprints; random
  ``after`` graphs with cycles; duplicate ids), random YAML-ish text, random bytes and
  byte flips of real manifests.
- ``patchkit.activate`` on a fuzzed manifest over a throwaway package: an invalid
  manifest patches nothing; after ``patchkit.revert()`` every owner's ``__dict__`` holds
  exactly the original objects again and no import hook is left pending.
- ``afd_patches.config.parse`` returns an ``AfdConfig`` or raises ``AfdConfigError`` that
  names a key as ``additional_config["afd"]["<key>"]``.

``test_zz_fuzz_budget`` checks that at least 10,000 generated inputs were run.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import patchkit
from afd_patches import config as afd_config
from harness.env import REPO
from patchkit import ManifestError, manifest
from patchkit.plan import Manifest, Runtime
from patchkit.runtime import engine
from patchkit.runtime.hooks import pending as pending_imports

REAL_MANIFESTS = sorted((REPO / "manifests" / "afd").glob("*.yaml"))

COUNTS: dict[str, int] = {}
BUDGET = {  # examples per test, sized so the whole fuzz file stays near a minute on 2 cores
    "mutated": 1600,
    "yaml_soup": 4000,
    "bytes": 3000,
    "random_doc": 800,
    "afd_config": 1200,
    "activate": 300,
}
MIN_TOTAL = 10_000


def fuzz_settings(n: int) -> settings:
    return settings(
        max_examples=n, derandomize=True, database=None, deadline=None, print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                               HealthCheck.large_base_example, HealthCheck.function_scoped_fixture],
    )


def count(name: str) -> None:
    COUNTS[name] = COUNTS.get(name, 0) + 1


# -- the property on parse ---------------------------------------------------------------------

def n_lines(text: str | bytes) -> int:
    s = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    return max(1, len(s.splitlines()))


def check_parse(text: str | bytes, file: str = "fuzz.yaml") -> Manifest | None:
    """The parse property; returns the Manifest or None (for a ManifestError)."""
    try:
        result = manifest.parse(text, file)
    except ManifestError as exc:
        assert exc.problems, "a ManifestError must carry at least one problem"
        limit = n_lines(text) + 1
        for p in exc.problems:
            assert p.file == file, p
            assert isinstance(p.line, int) and 1 <= p.line <= limit, (p, limit)
            assert isinstance(p.field, str), p
            assert isinstance(p.message, str) and p.message, p
        return None
    assert isinstance(result, Manifest)
    assert result.file == file
    return result


# -- strategies --------------------------------------------------------------------------------

IDS = ["a", "b", "c", "d", "e", "workers", "a.b-c_1"]
TARGETS = [
    "fzvictim.core:f", "fzvictim.core:g", "fzvictim.core:VALUE", "fzvictim.core:K.attr", "fzvictim.core:K.m",
    "fzvictim.core:K.c", "fzvictim.core:K.s", "fzvictim.core:Sub.m", "fzvictim.core:NEW", "fzvictim.core:K.NEW",
    "fzvictim.core:Missing.x", "fzvictim.lazy:h",
]
WITH_REFS = [
    "fzplug.w:wrap_any", "fzplug.w:repl", "fzplug.w:OBJ", "fzplug.w:nope", "fzplug.broken:x", "fzplug.nomod:x",
    "fzplug.w:NOT_CALLABLE", "fzplug.w:raising_factory", "fzvictim.core:f",
]
TRICKY_STRINGS = [
    "", " ", "0", "1", "==0.32.0", ">=0.32,<0.33", "0.32", "==", "~=1", "!=*", "===x", ">=0", "latest",
    "ast1:0123456789abcdef:fedcba9876543210", "ast1:xyz", "ast2:0:0", "pkg:", ":q", "a:b:c", "a..b:c",
    "os:system", "builtins:eval", "fzplug.w:wrap_any", "fzvictim.core:K.m", "fail", "warn", "skip", "auto",
    "none", "replace", "wrap", "set", "patch", "\x00", "\t", "é", "\u2028", "~", "yes", "null", "*a", "&a",
    "!!python/name:os.system", "x" * 300, "0123456", "ABCDEF0",
]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.sampled_from(TRICKY_STRINGS),
)
json_values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=6,
)
HEX_FP = st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)).map(lambda t: f"ast1:{t[0]:016x}:{t[1]:016x}")
fingerprints = st.one_of(
    HEX_FP, st.sampled_from(TRICKY_STRINGS), st.text(max_size=40),
)


# The strategies the composites below draw from, built once: a strategy made inside a draw is a fresh object
# each time, which Hypothesis validates and sizes up again (``is_empty`` over a ``one_of`` holding ``text`` costs
# about a millisecond), and the composites draw tens of them per example. The draws, and so the examples, are
# the same as from strategies made in place. A choice that is a dict or list is copied on each draw
# (``.map(copy.deepcopy)``, which draws nothing): ``mutated_docs`` edits the document it drew in place.
_ID_LISTS = [st.lists(st.sampled_from(IDS[:5]), min_size=n, max_size=n, unique=True) for n in range(6)]
_TARGET_LISTS = [st.lists(st.sampled_from(TARGETS), min_size=n, max_size=n, unique=True) for n in range(6)]
_OPS = st.sampled_from(["wrap", "replace", "set"])
_WHYS = st.sampled_from(["t", "why x"])
_WITH = {False: st.sampled_from(WITH_REFS), True: st.sampled_from(WITH_REFS[:-1])}  # keyed by activatable
_OPTIONAL_KEYS = [(key, st.sampled_from(choices).map(copy.deepcopy)) for key, choices in (
    ("on_drift", ["fail", "warn", "skip"]), ("rebind", ["auto", "none", ["fzvictim"]]), ("required", [True, False]))]
_WHENS = st.sampled_from([
    {"platform": ["cpu"]}, {"platform": ["cuda"]}, {"vllm": ">=0.33"}, {"python": ">=3"},
    {"env": {"FZ_NEVER_SET": None}}, {"env": {"FZ_NEVER_SET": "1"}}, {"has_param": ["x"]},
    {"has_attr": ["K"]}, {"has_attr": ["Nope"]}, {"commit": ["abcdef0"]},
]).map(copy.deepcopy)
_VERSIONS = st.sampled_from(["==0.32.0", ">=0", ">=0.32,<0.33", "==0.31.0"])
_COMMITS = st.sampled_from([None, "abcdef0", "0123456789abcdef0123456789abcdef01234567"])
_ON_DRIFT = st.sampled_from(["fail", "warn", "skip"])


@st.composite
def valid_docs(draw: st.DrawFn, activatable: bool = False) -> dict[str, Any]:
    """A (mostly) valid manifest over the throwaway packages ``fzvictim`` (targets) and ``fzplug``."""
    n = draw(st.integers(0 if not activatable else 1, 5))
    ids = draw(_ID_LISTS[n])
    targets = draw(_TARGET_LISTS[n])
    patches = []
    for i, (pid, target) in enumerate(zip(ids, targets, strict=True)):
        op = draw(_OPS)
        p: dict[str, Any] = {"id": pid, "target": target, "op": op, "why": draw(_WHYS)}
        if op == "set" and draw(st.booleans()):
            p["value"] = draw(json_values)
        else:
            p["with"] = draw(_WITH[activatable])
        if i and draw(st.booleans()):
            p["after"] = draw(st.lists(st.sampled_from(ids[:i]), max_size=2, unique=True))
        if draw(st.integers(0, 3)) == 0:
            p["fingerprint"] = draw(HEX_FP)
        for key, choices in _OPTIONAL_KEYS:
            if draw(st.booleans()):
                p[key] = draw(choices)
        if draw(st.integers(0, 4)) == 0:
            p["when"] = draw(_WHENS)
        patches.append(p)
    doc: dict[str, Any] = {
        "format": 1, "plugin": "fz", "packages": ["fzplug"], "vllm": {"version": draw(_VERSIONS)},
    }
    if draw(st.booleans()):
        doc["vllm"]["commit"] = draw(_COMMITS)
    if draw(st.booleans()):
        doc["fallback"] = draw(st.booleans())
    if draw(st.booleans()):
        doc["defaults"] = {"on_drift": draw(_ON_DRIFT)}
    if patches or draw(st.booleans()):
        doc["patches"] = patches
    if not activatable and draw(st.integers(0, 2)) == 0:
        doc["models"] = [{"arch": "FzArch", "class": "fzplug.models:Fz", "why": "m"}]
    if not activatable and draw(st.integers(0, 2)) == 0:
        doc["workers"] = {"at": "fzvictim.core:K.m", "role_of": "fzplug.w:role_of",
                          "overrides": [{"role": "attention", "class": "fzplug.w:Worker"}]}
    return doc


def paths_of(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.extend(paths_of(v, (*prefix, k)))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.extend(paths_of(v, (*prefix, i)))
    return out


def get(doc: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


MUTATIONS = ["drop", "add-key", "retype", "enum", "string", "dup-entry", "cycle", "fingerprint", "specifier",
             "after-random", "ref"]
_MUTATIONS = st.sampled_from(MUTATIONS)
_ADDED_KEYS = st.sampled_from(["wiht", "extra", "Op", "", "id", "when", "vllm"])
_STRINGS = st.sampled_from(TRICKY_STRINGS) | st.text(max_size=8)
_SPECIFIERS = st.sampled_from(TRICKY_STRINGS) | st.text(max_size=10)
_REFS = st.sampled_from(TRICKY_STRINGS) | st.sampled_from(WITH_REFS) | st.text(max_size=15)


@st.composite
def mutated_docs(draw: st.DrawFn, base: st.SearchStrategy[dict[str, Any]] | None = None) -> Any:
    doc = draw(base if base is not None else valid_docs())
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(_MUTATIONS)
        path = draw(st.sampled_from(paths_of(doc)))
        if not path:
            if kind == "retype":
                doc = draw(json_values)
            continue
        parent, key = get(doc, path[:-1]), path[-1]
        patches = doc.get("patches") if isinstance(doc, dict) else None
        if kind == "drop":
            del parent[key]
        elif kind == "add-key" and isinstance(parent, dict):
            parent[draw(_ADDED_KEYS)] = draw(json_values)
        elif kind == "retype":
            parent[key] = draw(json_values)
        elif kind in ("enum", "string"):
            parent[key] = draw(_STRINGS)
        elif kind == "dup-entry" and isinstance(patches, list) and patches:
            patches.append(json.loads(json.dumps(draw(st.sampled_from(patches)))))
        elif kind in ("cycle", "after-random") and isinstance(patches, list) and patches:
            for p in patches:
                if isinstance(p, dict) and draw(st.booleans()):
                    others = [q.get("id") for q in patches if isinstance(q, dict)]
                    p["after"] = draw(st.lists(st.sampled_from([*others, "workers", "ghost", 3]), max_size=3))
        elif kind == "fingerprint" and isinstance(parent, dict):
            parent["fingerprint"] = draw(fingerprints)
        elif kind == "specifier":
            spec = draw(_SPECIFIERS)
            if isinstance(doc, dict):
                doc.setdefault("vllm", {})
                if isinstance(doc["vllm"], dict):
                    doc["vllm"]["version"] = spec
            if isinstance(parent, dict):
                parent["when"] = {"vllm": spec, "python": spec}
                parent["retire_when"] = {"vllm": spec}
        elif kind == "ref" and isinstance(parent, dict):
            parent["with"] = draw(_REFS)
    return doc


def render(doc: Any, style: str) -> str:
    if style == "json":
        return json.dumps(doc, indent=2, allow_nan=True)
    return yaml.dump(doc, Dumper=yaml.CSafeDumper, sort_keys=False, allow_unicode=style == "block",
                     default_flow_style=None if style == "mixed" else False)


styles = st.sampled_from(["block", "mixed", "json"])

SOUP_TOKENS = [
    "format: ", "plugin: ", "packages: ", "vllm: ", "version: ", "patches:", "- ", "  ", "    ", "\n", "\r\n", "\r",
    "1", "fz", "[", "]", "{", "}", ", ", ": ", "'", '"', "# c", "&a ", "*a", "<<: *a", "? ", "| ", "> ", "\t",
    "---\n", "...\n", "%YAML 1.1\n", "%TAG !p! tag:yaml.org,2002:python/\n", "!p!name:os.system ",
    "!!python/object/apply:os.system ", "!!int ", "!!float ", "!!bool ", "!!str ", "!!map ", "!!seq ", "!!null ",
    "!!binary ", "!!timestamp ", "!custom ", "!<tag:x> ", "0x1F", "0o17", "1e500", "-.inf", ".nan", "~", "yes",
    "2024-01-01", "12:30:45", "9" * 4400, "\\x", "\u2028", "\x85", "\ufeff", "é", "\x1b", "id: a", "op: wrap",
    "target: fzvictim.core:f", "with: fzplug.w:wrap_any", "why: t", "after: [a]", "value: ", "!!int abc",
    "!!bool maybe", "!!float x",
]
_real_lines = [ln + "\n" for p in REAL_MANIFESTS for ln in p.read_text().splitlines()]
yaml_soup = st.one_of(
    st.lists(st.sampled_from(SOUP_TOKENS), max_size=40).map("".join),
    st.lists(st.sampled_from(_real_lines), max_size=30).map("".join),
    st.text(max_size=200),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=()), max_size=60),
)


@st.composite
def flipped_bytes(draw: st.DrawFn) -> bytes:
    base = bytearray(draw(_BYTE_BASES))
    for _ in range(draw(st.integers(1, 8))):
        if not base:
            break
        i = draw(st.integers(0, len(base) - 1))
        action = draw(st.integers(0, 2))
        if action == 0:
            base[i] = draw(st.integers(0, 255))
        elif action == 1:
            del base[i]
        else:
            base[i:i] = draw(st.binary(min_size=1, max_size=4))
    return bytes(base)


SMALL_VALID = textwrap.dedent("""\
    format: 1
    plugin: fz
    packages: [fzplug]
    vllm: {version: "==0.32.0"}
    patches:
      - {id: a, target: "fzvictim.core:f", op: wrap, with: "fzplug.w:wrap_any", why: t}
      - id: b
        target: fzvictim.core:K.m
        op: replace
        with: fzplug.w:repl
        after: [a]
        when: {vllm: ">=0.32", platform: [cpu]}
        why: t
""")
BYTE_BASES = [SMALL_VALID.encode()] * 6 + [p.read_bytes() for p in REAL_MANIFESTS]
_BYTE_BASES = st.sampled_from(BYTE_BASES)


# -- parse fuzzing -----------------------------------------------------------------------------

def test_small_valid_base_is_valid() -> None:
    assert check_parse(SMALL_VALID) is not None
    for p in REAL_MANIFESTS:
        assert check_parse(p.read_bytes(), str(p)) is not None  # its path: a release file extends base.yaml


@fuzz_settings(BUDGET["mutated"])
@given(doc=mutated_docs(), style=styles)
def test_fuzz_mutated_manifests(doc: Any, style: str) -> None:
    count("mutated")
    check_parse(render(doc, style))


@fuzz_settings(BUDGET["yaml_soup"])
@given(text=yaml_soup)
@example(text="format: !!int abc\n")
@example(text="format: !!bool maybe\n")
@example(text="format: !!int ''\n")
@example(text="format: " + "9" * 5000 + "\n")
@example(text="plugin: x\n\ud800: 1\n")
@example(text="a: " + "[" * 3000 + "]" * 3000 + "\n")
@example(text="a: &a [" + "*a, " * 10 + "]\n")
def test_fuzz_yaml_text(text: str) -> None:
    count("yaml_soup")
    check_parse(text)


@fuzz_settings(BUDGET["bytes"])
@given(data=st.one_of(st.binary(max_size=300), flipped_bytes()))
@example(data=b"\xff\xfe\x00\x00")
@example(data=b"format: 1\r\nplugin: x\r\n\x00")
def test_fuzz_bytes(data: bytes) -> None:
    count("bytes")
    check_parse(data)


@fuzz_settings(BUDGET["random_doc"])
@given(doc=json_values, style=styles)
def test_fuzz_random_documents(doc: Any, style: str) -> None:
    count("random_doc")
    check_parse(render(doc, style))


# -- afd config fuzzing ------------------------------------------------------------------------

AFD_KEYS = ["role", "afd_role", "connector", "afd_connector", "host", "afd_host", "port", "afd_port",
            "num_attention_ranks", "num_ffn_ranks", "rank", "timeout_s", "connector_extra_config"]
afd_values = st.one_of(
    json_values, st.sampled_from(["attention", "ffn", "torch_dist", "127.0.0.1"]), st.integers(-2, 70000),
)
afd_keys = st.one_of(st.sampled_from(AFD_KEYS), st.text(max_size=8), st.integers(-3, 3))


@fuzz_settings(BUDGET["afd_config"])
@given(raw=st.dictionaries(afd_keys, afd_values, max_size=6))
@example(raw={"role": "ffn", "num_ffn_ranks": 2.0, "num_attention_ranks": 4.0})
@example(raw={"role": "attention", "afd_role": "attention"})
@example(raw={'ro"le': 1})
def test_fuzz_afd_config(raw: dict[Any, Any]) -> None:
    count("afd_config")
    try:
        cfg = afd_config.parse(raw)
    except afd_config.AfdConfigError as exc:
        message = str(exc)
        named = {str(k) for k in raw} | set(afd_config.ALIASES.values())
        assert any(f'additional_config["afd"]["{k}"]' in message for k in named), message
        return
    assert isinstance(cfg, afd_config.AfdConfig)
    assert cfg.role in ("attention", "ffn")


@pytest.mark.parametrize("raw", [None, [], "afd", 3, ["role"]])
def test_afd_config_not_a_mapping(raw: Any) -> None:
    with pytest.raises(afd_config.AfdConfigError, match=r'additional_config\["afd"\] must be a mapping'):
        afd_config.parse(raw)


# -- activation fuzzing ------------------------------------------------------------------------

FZVICTIM = {
    "fzvictim/__init__.py": "",
    "fzvictim/core.py": """
        VALUE = 1

        def f(x):
            return x

        def g(x):
            return x

        class K:
            attr = "a"

            def m(self, x):
                return x

            @classmethod
            def c(cls, x):
                return x

            @staticmethod
            def s(x):
                return x

        class Sub(K):
            pass
    """,
    "fzvictim/user.py": "from fzvictim.core import VALUE, f, g\n",
    "fzvictim/lazy.py": "def h(x):\n    return x\n",
    "fzplug/__init__.py": "",
    "fzplug/w.py": """
        OBJ = object()
        NOT_CALLABLE = 42

        def wrap_any(original, *args, **kwargs):
            return original(*args, **kwargs)

        def raising_factory(original, *args, **kwargs):
            raise RuntimeError("factory fails at call time")

        def repl(*args, **kwargs):
            return "replaced"
    """,
    "fzplug/broken.py": "raise RuntimeError('module-level failure')\n",
}


@pytest.fixture(scope="module")
def fz_sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[Any]]]:
    root = tmp_path_factory.mktemp("fz")
    src = root / "src"
    for rel, text in FZVICTIM.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    saved = {k: os.environ.get(k) for k in ("PATCHKIT_CACHE_DIR", "PATCHKIT_DISABLE", "PATCHKIT_REPORT_DIR")}
    os.environ["PATCHKIT_CACHE_DIR"] = str(root / "cache")
    os.environ.pop("PATCHKIT_DISABLE", None)
    os.environ.pop("PATCHKIT_REPORT_DIR", None)
    sys.path.insert(0, str(src))
    before = set(sys.modules)
    patchkit.revert()
    try:
        core = importlib.import_module("fzvictim.core")
        user = importlib.import_module("fzvictim.user")
        yield root, [core, user, core.K, core.Sub]
    finally:
        patchkit.revert()
        sys.path.remove(str(src))
        for name in set(sys.modules) - before:
            del sys.modules[name]
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


Snapshot = list[dict[str, Any]]


def snapshot(owners: list[Any]) -> Snapshot:
    return [dict(vars(o)) for o in owners]


def same(before: Snapshot, owners: list[Any]) -> list[str]:
    """Differences between ``before`` and the owners now (by identity)."""
    diffs = []
    for old, owner in zip(before, owners, strict=True):
        now = vars(owner)
        name = getattr(owner, "__name__", repr(owner))
        for key in old.keys() | now.keys():
            if key not in now or key not in old or now[key] is not old[key]:
                diffs.append(f"{name}.{key}")
    return diffs


@fuzz_settings(BUDGET["activate"])
@given(doc=mutated_docs(base=valid_docs(activatable=True)), style=styles)
def test_fuzz_activate_then_revert(fz_sandbox: tuple[Path, list[Any]], doc: Any, style: str) -> None:
    count("activate")
    root, owners = fz_sandbox
    text = render(doc, style)
    valid = check_parse(text) is not None
    folder = Path(tempfile.mkdtemp(dir=root, prefix="m-"))
    (folder / "m.yaml").write_text(text, encoding="utf-8")
    before = snapshot(owners)
    patchkit._status.clear()
    try:
        status = patchkit.activate("fz", folder, Runtime("0.32.0", None, _platform="cpu"))
        if not valid:
            assert not status.active and status.run is None
            assert status.problem is not None and status.problem.startswith("invalid manifest")
            assert same(before, owners) == [], "an invalid manifest patched something"
        elif status.run is not None and status.active:
            assert status.run.status == "active"
    finally:
        patchkit.revert()
    assert same(before, owners) == [], "revert left a target patched"
    assert not [k for k in engine._LIVE if k[0] == "fz"]
    assert "fzvictim.lazy" not in pending_imports()
    assert "fzvictim.lazy" not in sys.modules, "patchkit must never import a target module"


def test_zz_fuzz_budget() -> None:
    """At least 10,000 generated inputs ran. Needs the whole file: a partial selection fails here."""
    assert set(COUNTS) == set(BUDGET), f"only {sorted(COUNTS)} ran; run the whole file for the budget check"
    total = sum(COUNTS.values())
    print(f"fuzz examples: {total} {COUNTS}")
    assert total >= MIN_TOTAL, COUNTS
