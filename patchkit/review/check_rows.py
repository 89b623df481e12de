"""The shape of one entry's result in ``patchkit check --format json``, declared once.

``Row`` is what ``EntryCheck.to_json`` produces (a test holds the two equal on real checks); the check
cache decodes its stored rows into it (``msgspec`` validates while it decodes: about 6 ms for the 164 rows
of the 0.34 manifest, where ``jsonschema`` took about 320 ms), and ``schemas/check-entry.schema.json``, for
tools that read the output, is generated from it: ``python -m patchkit.review.check_rows``.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

import msgspec


class _Strict(msgspec.Struct, forbid_unknown_fields=True):
    pass


class Fingerprint(_Strict):
    """The fingerprint the entry pins and the one found in the tree."""

    pinned: str | None
    found: str | None


class Definition(_Strict):
    """Where the target is defined in the tree."""

    ref: str
    kind: str
    file: str | None
    line: int | None


class AliasSite(_Strict):
    """A statement in another module that binds the target, and whether ``rebind`` covers it."""

    module: str
    file: str
    line: int
    kind: str
    bound: str
    source: str
    covered: bool
    note: str


class Override(_Strict):
    """A subclass that defines a patched method itself."""

    ref: str
    file: str
    line: int
    calls_super: bool


class CallPath(_Strict):
    """A caller that chooses, by a condition, between the target and a same-named object of another module."""

    caller: Annotated[str, msgspec.Meta(description="module:qualname of the function (or the module) that chooses")]
    file: str
    line: Annotated[int, msgspec.Meta(description="the if/try that chooses, or the function-local import")]
    kind: Literal["if-branch", "try-except", "global-vs-local"]
    via: Literal["from-import", "module-alias"]
    condition: Annotated[str, msgspec.Meta(description="when the target is chosen, in the source's words")]
    sibling_condition: Annotated[str, msgspec.Meta(description="when the sibling is chosen")]
    chosen: Annotated[str, msgspec.Meta(description="the entry's target")]
    sibling: Annotated[str, msgspec.Meta(description="module:qualname of the other object")]
    sibling_patched: Annotated[bool, msgspec.Meta(description="whether an entry of the manifest patches it")]


class Retire(_Strict):
    """The entry's ``retire_when`` and whether the tree meets it (None: its version is unknown)."""

    vllm: str
    met: bool | None


class Misfit(_Strict):
    """One parameter of the target that a call could pass and the callable cannot take."""

    parameter: str
    message: str


class Fit(_Strict):
    """A callable the entry hands patchkit, against its target's signature (``fits`` None: not compared)."""

    role: str
    callable: str
    fits: bool | None
    callable_signature: str | None
    target_signature: str | None
    problems: list[Misfit]
    note: str | None


class Row(_Strict):
    """One manifest entry or requirement judged against a vLLM tree: an item of ``entries`` in the output of
    ``patchkit check --format json``."""

    id: str
    target: Annotated[str, msgspec.Meta(description="module:qualname")]
    op: Annotated[str, msgspec.Meta(description="wrap, replace, set, scoped-rebind, workers or require")]
    pin: Literal["signature", "full", "exists"] | None
    required: bool
    on_drift: str
    source: Annotated[str, msgspec.Meta(description="where the entry is declared: file:line")]
    verdict: Literal["ok", "drifted: signature", "drifted: body", "moved", "missing"]
    fails: Annotated[bool, msgspec.Meta(description="whether this entry makes the check exit 1")]
    feature: str | None
    refuses_feature: Annotated[str | None, msgspec.Meta(
        description="the feature this tree refuses because of this requirement")]
    fingerprint: Fingerprint
    definition: Definition | None
    candidates: Annotated[list[str], msgspec.Meta(description="where a moved target is defined now")]
    notes: list[str]
    alias_sites: list[AliasSite]
    uncovered_sites: Annotated[int, msgspec.Meta(ge=0)]
    overrides: list[Override]
    call_paths: list[CallPath]
    unpatched_siblings: Annotated[int, msgspec.Meta(ge=0, description="call paths to a sibling no entry patches")]
    retire: Retire | None
    diff: Annotated[str | None, msgspec.Meta(description="unified diff of a drifted target against --base")]
    signatures: list[Fit]


def schema_text() -> str:
    """``schemas/check-entry.schema.json`` as it should read."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "check-entry.schema.json",
              **msgspec.json.schema(Row)}
    return json.dumps(schema, indent=2) + "\n"


if __name__ == "__main__":
    print(schema_text(), end="")
