"""The one judge of a manifest against a vLLM tree: ``judge(manifest, tree) -> patchkit.verdict.Verdict``.

Every member is judged statically, whether its module is imported at start or much later (deferred
entries included): the target's presence and fingerprint by its pin (``patchkit.static.analyze``) and the
fit of each callable the entry hands patchkit (``patchkit.static.signatures``). ``assess`` holds the policy
that turns one such result into "fails", and is what ``patchkit check`` applies too:

- a required change with ``on_drift: fail`` fails when its target is drifted, moved or missing (an
  ``op: set`` whose owner exists creates a missing attribute and does not fail);
- a requirement fails the same way by its pin;
- a callable that does not fit its target fails, whatever ``required`` says, unless ``on_drift: skip``
  leaves a drifted target unpatched (a wrapper that is installed breaks every call).

Optional entries, ``on_drift: warn``/``skip`` and the guards decided per process (platform, environment,
``PATCHKIT_DISABLE``, noted facts) do not make a member fail here: they are applied, or left out, live.
Model registrations are plugin code and are judged only through their feature.

The verdict then refuses by feature (``patchkit.verdict``). Members whose target lies outside the ``vllm``
package are not judged here (``unjudged``): the static tree models vLLM only; they are applied live as
before.

Cost: the analysis of a release manifest parses the modules that hold its targets and those that name
them (about 0.6 s for afd's 171 members on vLLM 0.32); the runtime does it once per manifest and tree and
stores the result with the compiled plan.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import TYPE_CHECKING

from patchkit.plan import Entry, Manifest
from patchkit.verdict import Member, Verdict

if TYPE_CHECKING:
    from patchkit.static import Resolver, SourceTree, TargetReport
    from patchkit.static.signatures import Fit

FAILING = ("drifted: signature", "drifted: body", "moved", "missing")


def assess(entry: Entry, report: TargetReport, fits: Iterable[Fit]) -> tuple[bool, str]:
    """(fails, reason) of one member by the rules in the module docstring; ``report`` and ``fits`` are its
    static analysis. Appends the note "op 'set' creates the attribute" to ``report.notes`` where it applies."""
    creates = entry.op == "set" and report.verdict == "missing" and report.owner_exists
    if creates:
        report.notes.append("op 'set' creates the attribute: not a failure")
    drifted = entry.required and entry.on_drift == "fail" and report.verdict in FAILING and not creates
    installed = not (entry.on_drift == "skip" and report.verdict != "ok")
    misfits = [f for f in fits if f.fits is False] if installed else []
    if drifted:
        pin = f"pin {entry.pin}; " if entry.op == "require" else ""  # type: ignore[attr-defined]
        return True, (f"{report.verdict} ({pin}pinned {report.pinned or '-'}, found {report.found or '-'})")
    if misfits:
        f = misfits[0]
        why = "; ".join(f"{p}: {m}" for p, m in f.problems[:3])
        return True, (f"{f.role} {f.ref}{f.callable_signature or ''} does not fit the target "
                      f"{f.target_signature or ''}: {why}")
    return False, ""


def member(entry: Entry, report: TargetReport | None, fits: Iterable[Fit], where: str | None) -> Member:
    """The verdict row of ``entry`` (``report`` None: not judged, outside the tree)."""
    if report is None:
        return Member(entry.id, entry.op, entry.target, "unjudged: outside the vLLM tree", False, entry.feature)
    fails, reason = assess(entry, report, fits)
    return Member(entry.id, entry.op, entry.target, report.verdict, fails, entry.feature, reason, where)


def judge(manifest: Manifest, tree: SourceTree, resolver: Resolver | None = None) -> Verdict:
    """The verdict on ``manifest`` (its changes and requirements, in file order) against ``tree``. The alias
    sites and overriding subclasses ``patchkit check`` also shows are not searched: no verdict depends on them."""
    from patchkit.static import Resolver, analyze
    from patchkit.static.signatures import Checker
    from patchkit.static.tree import in_package

    collecting = gc.isenabled()
    gc.disable()  # parsing builds large acyclic trees: cyclic GC passes would only scan them
    try:
        resolver = resolver or Resolver(tree)
        checker = Checker(resolver)
        members = []
        for entry in (*manifest.entries, *manifest.requires):
            if not in_package(entry.module):
                members.append(member(entry, None, (), None))
                continue
            report = analyze(resolver, entry, manifest.packages, details=False)
            d = report.definition
            where = f"{tree.path_of(d.module)}:{d.first_line}" if d else None
            members.append(member(entry, report, checker.check(entry, report.definition), where))
        inputs = (*(tree.inputs() or ()), *checker.inputs())
    finally:
        if collecting:
            gc.enable()
    return Verdict(manifest.file, describe(tree), tuple(members), manifest.features, inputs)


def describe(tree: SourceTree) -> str:
    """``vLLM 0.32.0 (directory /…/site-packages)``: the tree, for verdict messages."""
    return f"vLLM {tree.version or '(unknown version)'} ({tree.describe()})"
