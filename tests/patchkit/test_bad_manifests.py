"""Malformed manifests: each one fails with file, line, field and message, and patches nothing.

Every case is checked three ways:

- ``manifest.load`` raises ``ManifestError`` (and nothing else); every problem names
  the file and a line inside it, and the expected problems are among them;
- ``patchkit validate`` exits 1 and prints ``file:line: field: message``, no traceback;
- ``patchkit.activate`` on a folder holding only that manifest returns an inactive
  ``Status`` naming the file, and the throwaway target ``pkvictim:f`` is untouched.
"""

from __future__ import annotations

import importlib
import random
import re
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import patchkit
from patchkit import ManifestError, cli, manifest, plan
from patchkit.manifest.problems import Problem
from patchkit.plan import Runtime
from patchkit.runtime.hooks import pending as pending_imports

PLUGIN = "victimplugin"

# Lines 1-7 of most cases; the first patch entry starts on line 8.
HEAD = """\
format: 1
plugin: victim
packages: [pkvictim]
vllm:
  version: ">=0"
fallback: true
patches:
"""

# A valid entry on lines 8-12 (when it follows HEAD).
ENTRY_A = """\
  - id: a
    target: pkvictim:f
    op: wrap
    with: pkvictim.repl:shout
    why: make f loud
"""

VICTIM_INIT = "def f(x):\n    return x\n"
VICTIM_REPL = textwrap.dedent("""\
    def shout(original, x):
        return ("loud", original(x))

    def g(x):
        return -x

    def role_of(config):
        return None

    class Foo:
        pass
""")


@dataclass(frozen=True)
class Exp:
    """One expected problem: line (None: any), field ('' is the document), message fragment."""

    line: int | None
    field: str | None  # None: any field
    fragment: str

    def matches(self, p: Problem) -> bool:
        return ((self.line is None or p.line == self.line) and (self.field is None or p.field == self.field)
                and self.fragment in p.message)


@dataclass(frozen=True)
class Case:
    id: str
    text: str | bytes
    expect: tuple[Exp, ...]


def m(body: str, head: str = HEAD) -> str:
    """HEAD followed by ``body`` (dedented), so line numbers in cases are easy to count."""
    return head + textwrap.dedent(body)


def e(line: int | None, field: str | None, fragment: str) -> tuple[Exp, ...]:
    return (Exp(line, field, fragment),)


def _billion_laughs() -> str:
    rows = ["format: 1", "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        rows.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    return "\n".join(rows) + "\n"


def _deep_lists(depth: int) -> str:
    return HEAD + "  - " + "[" * depth + "]" * depth + "\n"


CASES: list[Case] = [
    # -- YAML syntax and encoding -------------------------------------------------------------
    Case("yaml-mapping-value-in-plain-scalar", "format: 1\nplugin: victim: x\npackages: [pkvictim]\n",
         e(2, "", "invalid YAML: mapping values are not allowed here")),
    Case("yaml-unclosed-flow-sequence", "format: 1\nplugin: victim\npackages: [pkvictim\nvllm: {version: '>=0'}\n",
         e(4, "", "expected ',' or ']'")),
    Case("yaml-tab-indentation", "format: 1\nplugin: victim\nvllm:\n\tversion: '>=0'\n",
         e(4, "", "found character '\\t' that cannot start any token")),
    Case("yaml-unclosed-quote", "format: 1\nplugin: 'victim\npackages: [pkvictim]\n",
         e(None, "", "while scanning a quoted scalar found unexpected end of stream")),
    Case("yaml-unclosed-quote-line", "format: 1\nplugin: 'victim\npackages: [pkvictim]\n",
         e(2, "", "quoted scalar")),
    Case("yaml-bad-indentation", "format: 1\nvllm:\n    version: '>=0'\n  commit: null\n",
         e(4, "", "invalid YAML")),
    Case("empty-file", "", e(1, "", "empty document")),
    Case("only-a-comment", "# nothing here yet\n\n", e(1, "", "empty document")),
    Case("document-is-a-list", "- format: 1\n- plugin: victim\n", e(1, "", "a manifest is a mapping, not list")),
    Case("document-is-a-string", "just some words\n", e(1, "", "a manifest is a mapping, not str")),
    Case("two-documents", HEAD + ENTRY_A + "---\nformat: 1\n",
         e(13, "", "expected a single document in the stream")),
    Case("nul-byte", b"format: 1\nplugin: victim\npackages: [pk\x00victim]\n", e(3, "", "NUL byte")),
    Case("random-binary", random.Random(20261129).randbytes(600) + b"\x00\x00",
         e(1, "", "not UTF-8 text")),
    Case("invalid-utf8", b"plugin: vic\xfftim\nformat: 1\n", e(1, "", "not UTF-8 text")),
    Case("invalid-utf8-line", b"format: 1\nplugin: victim\npackages: [pk\xc3\x28victim]\n",
         e(3, "", "not UTF-8 text")),
    Case("control-character", "format: 1\nplugin: victim\npackages: [pkvictim]\nvllm: {version: '>=0'}\n"
         "patches: []\n# pasted from a terminal: \x1b[31mred\x1b[0m\n",
         e(6, "", "character")),
    # -- tags, keys, anchors ------------------------------------------------------------------
    Case("python-object-tag", m("""\
          - id: a
            target: pkvictim:f
            op: set
            value: !!python/object:pkvictim.repl.Foo {}
            why: x
        """), e(11, "patches[0].value", "YAML tag 'tag:yaml.org,2002:python/object:pkvictim.repl.Foo' is not allowed")),
    Case("python-object-apply-tag", "format: 1\nplugin: !!python/object/apply:os.system ['echo pwned']\n",
         e(2, "plugin", "tag:yaml.org,2002:python/object/apply:os.system")),
    Case("custom-tag", m("""\
          - id: a
            target: !ref pkvictim:f
            op: wrap
            with: pkvictim.repl:shout
            why: x
        """), e(9, "patches[0].target", "YAML tag '!ref' is not allowed")),
    Case("implicit-timestamp", "format: 1\nplugin: 2026-11-29\n",
         e(2, "plugin", "tag:yaml.org,2002:timestamp")),
    Case("duplicate-key", m("""\
          - id: a
            target: pkvictim:f
            op: wrap
            with: pkvictim.repl:shout
            op: replace
            why: x
        """), e(12, "patches[0].op", "duplicate key")),
    Case("duplicate-top-level-key", HEAD + ENTRY_A + "plugin: other\n", e(13, "plugin", "duplicate key")),
    Case("non-string-key", "format: 1\n1: one\n", e(2, "", "mapping keys must be plain strings")),
    Case("merge-key", "format: 1\nbase: &b {version: '>=0'}\nvllm:\n  <<: *b\n",
         e(4, "vllm", "mapping keys must be plain strings")),
    Case("billion-laughs", _billion_laughs(), e(None, None, "document expands to more than 100000 values")),
    Case("deeply-nested-lists", _deep_lists(3000), e(1, "", "document nested too deeply")),
    Case("recursive-alias", "format: 1\nplugin: victim\npackages: &p [pkvictim, *p]\n",
         e(1, "", "document nested too deeply")),
    # -- wrong types at every level -----------------------------------------------------------
    Case("format-string", HEAD.replace("format: 1", 'format: "1"') + ENTRY_A, e(1, "format", "1 was expected")),
    Case("format-2", HEAD.replace("format: 1", "format: 2") + ENTRY_A, e(1, "format", "1 was expected")),
    Case("format-true", HEAD.replace("format: 1", "format: true") + ENTRY_A, e(1, "format", "1 was expected")),
    Case("plugin-pattern", HEAD.replace("plugin: victim", "plugin: Victim Plugin") + ENTRY_A,
         e(2, "plugin", "does not match")),
    Case("packages-string", HEAD.replace("[pkvictim]", "pkvictim") + ENTRY_A,
         e(3, "packages", "'pkvictim' is not of type 'array'")),
    Case("packages-empty", HEAD.replace("[pkvictim]", "[]") + ENTRY_A, e(3, "packages", "should be non-empty")),
    Case("packages-dotted", HEAD.replace("[pkvictim]", "[pkvictim.repl]") + ENTRY_A,
         e(3, "packages[0]", "does not match")),
    Case("vllm-list", HEAD.replace('vllm:\n  version: ">=0"', 'vllm: [">=0", null]') + ENTRY_A,
         e(4, "vllm", "is not of type 'object'")),
    Case("fallback-string", HEAD.replace("fallback: true", "fallback: 'true'") + ENTRY_A,
         e(6, "fallback", "'true' is not of type 'boolean'")),
    Case("patches-mapping", m("""\
          a:
            target: pkvictim:f
            op: wrap
            with: pkvictim.repl:shout
            why: x
        """), e(7, "patches", "is not of type 'array'")),
    Case("patches-null", HEAD, e(7, "patches", "None is not of type 'array'")),
    Case("patch-is-a-string", m("  - a\n"), e(8, "patches[0]", "'a' is not of type 'object'")),
    Case("id-int", m(ENTRY_A.replace("id: a", "id: 7")), e(8, "patches[0].id", "7 is not of type 'string'")),
    Case("id-pattern", m(ENTRY_A.replace("id: a", "id: a b")), e(8, "patches[0].id", "does not match")),
    Case("op-unknown", m(ENTRY_A.replace("op: wrap", "op: patch")), e(10, "patches[0].op", "is not one of")),
    Case("after-string", m(ENTRY_A + "    after: b\n"), e(13, "patches[0].after", "'b' is not of type 'array'")),
    Case("after-repeated", m(ENTRY_A + "    after: [b, b]\n"), e(13, "patches[0].after", "non-unique")),
    Case("required-string", m(ENTRY_A + '    required: "yes"\n'),
         e(13, "patches[0].required", "'yes' is not of type 'boolean'")),
    Case("on-drift-unknown", m(ENTRY_A + "    on_drift: ignore\n"), e(13, "patches[0].on_drift", "is not one of")),
    Case("rebind-unknown", m(ENTRY_A + "    rebind: always\n"),
         e(13, "patches[0].rebind", "is not valid under any of the given schemas")),
    Case("why-empty", m(ENTRY_A.replace("why: make f loud", 'why: ""')),
         e(12, "patches[0].why", "should be non-empty")),
    Case("when-string", m(ENTRY_A + "    when: cuda\n"), e(13, "patches[0].when", "'cuda' is not of type 'object'")),
    Case("when-platform-string", m(ENTRY_A + "    when:\n      platform: cuda\n"),
         e(14, "patches[0].when.platform", "'cuda' is not of type 'array'")),
    Case("when-env-int", m(ENTRY_A + "    when:\n      env: {VLLM_USE_V1: 1}\n"),
         e(14, "patches[0].when.env.VLLM_USE_V1", "1 is not of type 'string', 'null'")),
    Case("when-has-param-pattern", m(ENTRY_A + "    when: {has_param: [x.y]}\n"),
         e(13, "patches[0].when.has_param[0]", "does not match")),
    Case("defaults-on-drift-unknown", HEAD.replace("patches:\n", "defaults: {on_drift: explode}\npatches:\n") + ENTRY_A,
         e(7, "defaults.on_drift", "'explode' is not one of")),
    Case("defaults-required-string", HEAD.replace("patches:\n", "defaults:\n  required: 'no'\npatches:\n") + ENTRY_A,
         e(8, "defaults.required", "'no' is not of type 'boolean'")),
    Case("retire-when-string", m(ENTRY_A + "    retire_when: '>=0.40'\n"),
         e(13, "patches[0].retire_when", "is not of type 'object'")),
    # -- unknown keys ---------------------------------------------------------------------
    Case("unknown-top-level-key", HEAD.replace("patches:\n", "patchez: []\npatches:\n") + ENTRY_A,
         e(7, "patchez", "unknown key 'patchez' (allowed: defaults, fallback, features, format, models")),
    Case("unknown-key-in-vllm", HEAD.replace('  version: ">=0"\n', '  version: ">=0"\n  versoin: "==0.32.0"\n')
         + ENTRY_A, e(6, "vllm.versoin", "unknown key 'versoin' (allowed: commit, version)")),
    Case("unknown-key-in-defaults", HEAD.replace("patches:\n", "defaults: {ondrift: warn}\npatches:\n") + ENTRY_A,
         e(7, "defaults.ondrift", "unknown key 'ondrift'")),
    Case("unknown-key-in-patch", m(ENTRY_A + "    wiht: pkvictim.repl:g\n"),
         e(13, "patches[0].wiht", "unknown key 'wiht'")),
    Case("unknown-key-in-when", m(ENTRY_A + "    when:\n      platfrom: [cpu]\n"),
         e(14, "patches[0].when.platfrom", "unknown key 'platfrom'")),
    Case("unknown-key-in-retire-when", m(ENTRY_A + "    retire_when: {python: '>=3.12'}\n"),
         e(13, "patches[0].retire_when.python", "unknown key 'python' (allowed: vllm)")),
    Case("unknown-key-in-models", HEAD.replace("patches:\n", """\
models:
  - arch: FooForCausalLM
    class: pkvictim.repl:Foo
    klass: pkvictim.repl:Foo
"""), e(10, "models[0].klass", "unknown key 'klass' (allowed: arch, class, feature, when, why)")),
    Case("unknown-key-in-workers", HEAD.replace("patches:\n", """\
workers:
  at: pkvictim:f
  role_of: pkvictim.repl:role_of
  role: attention
  overrides:
    - {role: attention, class: pkvictim.repl:Foo}
"""), e(10, "workers.role",
        "unknown key 'role' (allowed: after, at, feature, fingerprint, on_drift, overrides, reviewed, role_of)")),
    Case("unknown-key-in-worker-override", HEAD.replace("patches:\n", """\
workers:
  at: pkvictim:f
  role_of: pkvictim.repl:role_of
  overrides:
    - role: attention
      class: pkvictim.repl:Foo
      platform: [cpu]
"""), e(13, "workers.overrides[0].platform", "unknown key 'platform' (allowed: class, role, when)")),
    # -- missing required fields ----------------------------------------------------------
    Case("missing-id", m(ENTRY_A.replace("  - id: a\n    target", "  - target")),
         e(8, "patches[0]", "'id' is required")),
    Case("missing-target", m(ENTRY_A.replace("    target: pkvictim:f\n", "")),
         e(8, "patches[0]", "'target' is required")),
    Case("missing-op", m(ENTRY_A.replace("    op: wrap\n", "")), e(8, "patches[0]", "'op' is required")),
    Case("missing-why", m(ENTRY_A.replace("    why: make f loud\n", "")), e(8, "patches[0]", "'why' is required")),
    Case("missing-packages", HEAD.replace("packages: [pkvictim]\n", "") + ENTRY_A, e(1, "", "'packages' is required")),
    Case("missing-vllm-version", HEAD.replace('  version: ">=0"', "  commit: null") + ENTRY_A,
         e(4, "vllm", "'version' is required")),
    Case("missing-workers-overrides", HEAD.replace("patches:\n", "workers:\n  at: pkvictim:f\n"
                                                   "  role_of: pkvictim.repl:role_of\n"),
         e(7, "workers", "'overrides' is required")),
    Case("missing-model-class", HEAD.replace("patches:\n", "models:\n  - arch: FooForCausalLM\n"),
         e(8, "models[0]", "'class' is required")),
    # -- references ---------------------------------------------------------------------------
    Case("target-without-colon", m(ENTRY_A.replace("target: pkvictim:f", "target: pkvictim.f")),
         e(9, "patches[0].target", "does not match")),
    Case("with-with-spaces", m(ENTRY_A.replace("with: pkvictim.repl:shout", 'with: "pkvictim.repl: shout"')),
         e(11, "patches[0].with", "does not match")),
    Case("model-class-without-colon", HEAD.replace("patches:\n", "models:\n  - arch: FooForCausalLM\n"
                                                   "    class: pkvictim.repl.Foo\n"),
         e(9, "models[0].class", "does not match")),
    Case("with-outside-packages", m(ENTRY_A.replace("with: pkvictim.repl:shout", "with: os:system")),
         e(11, "patches[0].with", "'os:system' is outside the declared packages (pkvictim)")),
    Case("model-class-outside-packages", HEAD.replace("patches:\n", "models:\n  - arch: FooForCausalLM\n"
                                                      "    class: othermodels.foo:Foo\n"),
         e(9, "models[0].class", "outside the declared packages")),
    Case("worker-role-of-outside-packages", HEAD.replace("patches:\n", """\
workers:
  at: pkvictim:f
  role_of: os.path:exists
  overrides:
    - {role: attention, class: pkvictim.repl:Foo}
"""), e(9, "workers.role_of", "'os.path:exists' is outside the declared packages")),
    # -- ids, order, conflicts ------------------------------------------------------------
    Case("duplicate-ids", m(ENTRY_A + ENTRY_A.replace("pkvictim:f", "pkvictim:h")),
         e(13, "patches[1].id", "duplicate id 'a'")),
    Case("unknown-after-id", m(ENTRY_A + "    after: [b]\n"), e(13, "patches[0].after", "unknown id 'b'")),
    Case("self-after", m(ENTRY_A + "    after: [a]\n"), e(13, "patches[0].after", "an entry cannot come after itself")),
    Case("cycle-of-two", m(ENTRY_A + "    after: [b]\n" + ENTRY_A.replace("id: a", "id: b").replace(":f", ":h")
                           + "    after: [a]\n"),
         e(13, "patches[0].after", "order cycle: a -> b -> a")),
    Case("cycle-of-three", m(ENTRY_A + "    after: [c]\n"
                             + ENTRY_A.replace("id: a", "id: b").replace(":f", ":h") + "    after: [a]\n"
                             + ENTRY_A.replace("id: a", "id: c").replace(":f", ":k") + "    after: [b]\n"),
         e(13, "patches[0].after", "order cycle: a -> c -> b -> a")),
    Case("cycle-through-workers", m(ENTRY_A + "    after: [workers]\n") + """\
workers:
  at: pkvictim:h
  role_of: pkvictim.repl:role_of
  after: [a]
  overrides:
    - {role: attention, class: pkvictim.repl:Foo}
""", e(13, "patches[0].after", "order cycle: a -> workers -> a")),
    Case("two-unordered-writers", m(ENTRY_A + ENTRY_A.replace("id: a", "id: b")),
         e(14, "patches[1].target", "'b' and 'a' both write pkvictim:f with no order between them")),
    Case("two-ordered-replaces", m(ENTRY_A.replace("op: wrap", "op: replace").replace("repl:shout", "repl:g")
                                   + ENTRY_A.replace("id: a", "id: b").replace("op: wrap", "op: replace")
                                   .replace("repl:shout", "repl:g") + "    after: [a]\n"),
         e(14, "patches[1].target", "'b' (replace) comes after 'a' (replace) on pkvictim:f and would discard it")),
    Case("replace-then-set", m(ENTRY_A.replace("op: wrap", "op: replace").replace("repl:shout", "repl:g")
                               + "  - {id: b, target: 'pkvictim:f', op: set, value: 3, after: [a], why: x}\n"),
         e(13, "patches[1].target", "'b' (set) comes after 'a' (replace) on pkvictim:f")),
    Case("patch-and-workers-unordered", m(ENTRY_A) + """\
workers:
  at: pkvictim:f
  role_of: pkvictim.repl:role_of
  overrides:
    - {role: attention, class: pkvictim.repl:Foo}
""", e(14, "workers.at", "'workers' and 'a' both write pkvictim:f with no order")),
    # -- fields each op needs ---------------------------------------------------------------
    Case("replace-without-with", m(ENTRY_A.replace("op: wrap", "op: replace").replace(
        "    with: pkvictim.repl:shout\n", "")), e(8, "patches[0]", "op 'replace' needs 'with'")),
    Case("wrap-without-with", m(ENTRY_A.replace("    with: pkvictim.repl:shout\n", "")),
         e(8, "patches[0]", "op 'wrap' needs 'with'")),
    Case("wrap-with-value", m(ENTRY_A + "    value: 3\n"), e(13, "patches[0].value", "op 'wrap' takes no 'value'")),
    Case("set-with-value-and-with", m(ENTRY_A.replace("op: wrap", "op: set") + "    value: 3\n"),
         e(8, "patches[0]", "op 'set' needs exactly one of 'value' and 'with'")),
    Case("set-without-value", m(ENTRY_A.replace("op: wrap", "op: set").replace(
        "    with: pkvictim.repl:shout\n", "")), e(8, "patches[0]", "op 'set' needs exactly one of")),
    # -- version specifiers, fingerprints, commits ------------------------------------------
    Case("vllm-version-not-a-specifier", HEAD.replace('version: ">=0"', "version: latest") + ENTRY_A,
         e(5, "vllm.version", "'latest' is not a PEP 440 version specifier")),
    Case("vllm-version-empty", HEAD.replace('version: ">=0"', 'version: ""') + ENTRY_A,
         e(5, "vllm.version", "should be non-empty")),
    Case("vllm-version-number", HEAD.replace('version: ">=0"', "version: 0.32") + ENTRY_A,
         e(5, "vllm.version", "0.32 is not of type 'string'")),
    Case("when-vllm-not-a-specifier", m(ENTRY_A + "    when:\n      vllm: '0.32'\n"),
         e(14, "patches[0].when.vllm", "'0.32' is not a PEP 440 version specifier")),
    Case("when-python-not-a-specifier", m(ENTRY_A + "    when: {python: '>= 3.10 <4'}\n"),
         e(13, "patches[0].when.python", "is not a PEP 440 version specifier")),
    Case("retire-when-vllm-not-a-specifier", m(ENTRY_A + "    retire_when: {vllm: soon}\n"),
         e(13, "patches[0].retire_when.vllm", "'soon' is not a PEP 440 version specifier")),
    Case("fingerprint-format", m(ENTRY_A + "    fingerprint: ast1:5b214cce:6f73b0f8\n"),
         e(13, "patches[0].fingerprint", "does not match")),
    Case("fingerprint-unknown-algorithm", m(ENTRY_A + '    fingerprint: "ast2:5b214cce2617ed43:6f73b0f889da317f"\n'),
         e(13, "patches[0].fingerprint", "does not match")),
    Case("vllm-commit-not-hex", HEAD.replace('  version: ">=0"\n', '  version: ">=0"\n  commit: HEAD\n') + ENTRY_A,
         e(6, "vllm.commit", "'HEAD' does not match")),
    Case("when-commit-too-short", m(ENTRY_A + "    when: {commit: [abc]}\n"),
         e(13, "patches[0].when.commit[0]", "'abc' does not match")),
    # -- holes found in an earlier validator, now closed --------------------------------------------------------
    Case("model-when-vllm-not-a-specifier", HEAD.replace("patches:\n", """\
models:
  - arch: FooForCausalLM
    class: pkvictim.repl:Foo
    when: {vllm: latest}
"""), e(10, "models[0].when.vllm", "'latest' is not a PEP 440 version specifier")),
    Case("worker-override-when-python-not-a-specifier", HEAD.replace("patches:\n", """\
workers:
  at: pkvictim:f
  role_of: pkvictim.repl:role_of
  overrides:
    - role: attention
      class: pkvictim.repl:Foo
      when: {python: three}
"""), e(13, "workers.overrides[0].when.python", "'three' is not a PEP 440 version specifier")),
    Case("replace-ordered-after-wrap", m(ENTRY_A + ENTRY_A.replace("id: a", "id: b").replace("op: wrap", "op: replace")
                                         .replace("repl:shout", "repl:g") + "    after: [a]\n"),
         e(14, "patches[1].target", "'b' (replace) comes after 'a' (wrap)")),
    Case("duplicate-model-arch", HEAD.replace("patches:\n", """\
models:
  - {arch: FooForCausalLM, class: "pkvictim.repl:Foo"}
  - {arch: FooForCausalLM, class: "pkvictim.repl:g"}
"""), e(9, "models[1].arch", "duplicate")),
]


def _params(check: str) -> list[Any]:
    return [pytest.param(case, id=case.id) for case in CASES]


def _write(case: Case, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "victim.yaml"
    if isinstance(case.text, bytes):
        path.write_bytes(case.text)
    else:
        path.write_text(case.text, encoding="utf-8")
    return path


def _line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n") + 1


def _check_problems(case: Case, path: Path, problems: list[Problem]) -> None:
    assert problems, "a ManifestError with no problems"
    last = _line_count(path)
    for p in problems:
        assert p.file == str(path), p
        assert isinstance(p.line, int) and 1 <= p.line <= last, p
        assert isinstance(p.field, str) and isinstance(p.message, str) and p.message, p
    for exp in case.expect:
        assert any(exp.matches(p) for p in problems), f"expected {exp}, got:\n" + "\n".join(map(str, problems))


@pytest.mark.parametrize("case", _params("load"))
def test_load_names_file_line_and_field(case: Case, tmp_path: Path) -> None:
    path = _write(case, tmp_path)
    with pytest.raises(ManifestError) as info:
        manifest.load(path)
    _check_problems(case, path, info.value.problems)
    printed = str(info.value).splitlines()
    assert len(printed) == len(info.value.problems)
    for line, p in zip(printed, info.value.problems, strict=True):
        assert line.startswith(f"{path}:{p.line}: {p.field or '<document>'}: ")


@pytest.mark.parametrize("case", _params("cli"))
def test_cli_validate_fails_without_traceback(case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(case, tmp_path)
    assert cli.main(["validate", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert re.search(re.escape(str(path)) + r":\d+: ", err), err
    for exp in case.expect:
        if exp.line is not None and exp.field is not None:
            assert f"{path}:{exp.line}: {exp.field or '<document>'}: " in err, err


@pytest.fixture
def victim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """A throwaway package ``pkvictim`` (``f``, ``h``, ``k`` and ``repl``), imported, with a private cache dir."""
    src = tmp_path / "src"
    (src / "pkvictim").mkdir(parents=True)
    (src / "pkvictim" / "__init__.py").write_text(VICTIM_INIT + "\n\ndef h(x):\n    return x\n\n\ndef k(x):\n"
                                                  "    return x\n")
    (src / "pkvictim" / "repl.py").write_text(VICTIM_REPL)
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PATCHKIT_DISABLE", raising=False)
    monkeypatch.delenv("PATCHKIT_REPORT_DIR", raising=False)
    _forget_victim()
    patchkit.revert(PLUGIN)
    try:
        yield importlib.import_module("pkvictim")
    finally:
        patchkit.revert(PLUGIN)
        _forget_victim()


def _forget_victim() -> None:
    for name in [n for n in sys.modules if n == "pkvictim" or n.startswith("pkvictim.")]:
        del sys.modules[name]


def _runtime() -> Runtime:
    return Runtime("0.32.0", None, _platform="cpu")


@pytest.mark.parametrize("case", _params("activate"))
def test_activate_patches_nothing(case: Case, tmp_path: Path, victim: ModuleType) -> None:
    path = _write(case, tmp_path / "manifests")
    original = victim.f
    status = patchkit.activate(PLUGIN, path.parent, runtime=_runtime())
    assert not status.active
    assert status.run is None
    assert status.problem is not None and str(path) in status.problem
    assert patchkit.status(PLUGIN) is status
    assert victim.f is original
    assert patchkit.applied(PLUGIN) == []
    assert "pkvictim" not in pending_imports()
    assert not list((tmp_path / "cache").glob("plan-*.json")), "an invalid manifest must not be cached"


# -- controls: the same skeleton, valid, does patch; so the cases above test something --------

VALID = HEAD + ENTRY_A


def test_control_manifest_is_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(Case("valid", VALID, ()), tmp_path)
    m_ = manifest.load(path)
    assert [x.id for x in m_.entries] == ["a"]
    assert cli.main(["validate", str(path)]) == 0
    assert "ok (1 entries" in capsys.readouterr().out


def test_control_manifest_patches_and_reverts(tmp_path: Path, victim: ModuleType) -> None:
    path = _write(Case("valid", VALID, ()), tmp_path / "manifests")
    original = victim.f
    status = patchkit.activate(PLUGIN, path.parent, runtime=_runtime())
    assert status.active, status.problem
    assert victim.f is not original and victim.f(2) == ("loud", 2)
    patchkit.revert(PLUGIN)
    assert victim.f is original


def test_activate_with_detected_runtime_reports_bad_manifest(
        tmp_path: Path, victim: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    # The default path (what a vLLM plugin hook calls), without importing vLLM. Regression: at 1496816
    # ``Runtime`` was imported only under TYPE_CHECKING and this call raised NameError.
    monkeypatch.setattr(plan.Runtime, "detect", classmethod(lambda cls: _runtime()))
    path = _write(CASES[0], tmp_path / "manifests")
    original = victim.f
    status = patchkit.activate(PLUGIN, path.parent)
    assert not status.active and status.problem is not None and str(path) in status.problem
    assert victim.f is original


def test_enough_cases() -> None:
    assert len(CASES) >= 35
    assert len({c.id for c in CASES}) == len(CASES)


def test_a_lone_surrogate_in_a_key_is_named_printably(tmp_path: Path) -> None:
    """A YAML escape can make a lone surrogate, which no UTF-8 log or terminal takes: the problem escapes it."""
    path = tmp_path / "m.yaml"
    path.write_text(m('''
        - id: a
          "x\\ud800y": 1
          target: pkvictim:f
          op: wrap
          with: pkvictim.repl:shout
          why: make f loud
        '''))
    with pytest.raises(ManifestError) as caught:
        manifest.load(path)
    message = str(caught.value)
    message.encode("utf-8")
    assert f"{path}:10: patches[0].x\\ud800y: unknown key" in message, message
