"""One manifest entry against one tree: verdict, fingerprints, alias sites, overriding subclasses, call paths.

Verdicts:

- ``ok`` — the target is where the entry says and its fingerprint matches (or
  none is pinned: a note says so);
- ``drifted: signature`` / ``drifted: body`` — found, but the fingerprint's
  signature (arguments, decorators, bases) or only its body changed;
- ``moved`` — not at the target, but definitions with the same qualname (or one
  ending in it) exist elsewhere: ``candidates`` lists them;
- ``missing`` — neither.

The alias-site and override lists follow ``patchkit.runtime.rebind`` and
``patchkit.runtime.targets``: only module-level targets have from-import aliases that
rebinding can reach; only methods have overriding subclasses that a patch of the
base class never reaches. Call paths (``patchkit.static.callpaths``) are looked for on every entry that
changes vLLM (not on requirements: nothing is patched there).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from patchkit import fingerprint
from patchkit.plan import Entry, ScopedRebind
from patchkit.runtime import rebind
from patchkit.static.callpaths import CallPath, call_paths
from patchkit.static.resolve import Definition, Override, Resolution, Resolver
from patchkit.static.sites import AliasSite, alias_sites

_REBINDING_OPS = ("replace", "wrap", "workers")


@dataclass
class TargetReport:
    """Everything ``patchkit check`` says about one target in one tree."""

    target: str
    verdict: str
    pinned: str | None
    found: str | None
    definition: Definition | None
    owner_exists: bool
    candidates: list[Definition] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sites: list[AliasSite] = field(default_factory=list)
    overrides: list[Override] = field(default_factory=list)
    call_paths: list[CallPath] = field(default_factory=list)

    @property
    def uncovered(self) -> list[AliasSite]:
        return [s for s in self.sites if not s.covered]


def decorator_names(node: ast.AST) -> set[str]:
    """The last name of each decorator of ``node`` (``functools.cache`` → ``cache``; a call: its callee's)."""
    names = set()
    for dec in getattr(node, "decorator_list", []):
        expr = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(expr, ast.Attribute):
            names.add(expr.attr)
        elif isinstance(expr, ast.Name):
            names.add(expr.id)
    return names


def _absent(resolver: Resolver, entry: Entry, resolution: Resolution) -> TargetReport:
    """The report of a target not found where the entry says: ``moved`` (with candidates) or ``missing``."""
    candidates = resolver.find_definitions(entry.qualname, exclude_module=entry.module)
    report = TargetReport(entry.target, "moved" if candidates else "missing", entry.fingerprint, None, None,
                          resolution.owner is not None, candidates)
    if resolution.reason:
        report.notes.append(resolution.reason)
    return report


def analyze_requirement(resolver: Resolver, entry: Entry) -> TargetReport:
    """The ``TargetReport`` of a requirement (op ``require``): its pin decides which fingerprint half counts.

    A class member the class only inherits counts as found (the runtime looks it
    up along the bases too); no alias sites or overrides: nothing is patched.
    """
    resolution = resolver.resolve_target(entry.target)
    definition = resolution.definition or resolution.inherited
    if definition is None:
        return _absent(resolver, entry, resolution)
    found = fingerprint.of_node(definition.node)
    comparison = fingerprint.compare_pinned(entry.pin, entry.fingerprint, found)
    report = TargetReport(entry.target, "ok" if comparison == "match" else comparison.replace(":", ": "),
                          entry.fingerprint, found, definition, True)
    report.notes.append(f"pin {entry.pin}")
    if (definition.module, definition.qualname) != (entry.module, entry.qualname):
        report.notes.append(f"defined as {definition.ref} (reached through imports or bases)")
    return report


def analyze(resolver: Resolver, entry: Entry, packages: tuple[str, ...], details: bool = True) -> TargetReport:
    """The ``TargetReport`` of ``entry`` in the resolver's tree (parses only what it needs). ``details=False``
    leaves out what informs a reviewer but no verdict (alias sites, overriding subclasses): the runtime's
    verdict (``patchkit.judge``) needs only the verdict."""
    if entry.op == "require":
        return analyze_requirement(resolver, entry)
    resolution = resolver.resolve_target(entry.target)
    definition = resolution.definition
    if definition is None:
        return _absent(resolver, entry, resolution)

    found = fingerprint.of_node(definition.node)
    if entry.fingerprint:
        comparison = fingerprint.compare(entry.fingerprint, found)
        verdict = "ok" if comparison == "match" else comparison.replace(":", ": ")
    else:
        verdict = "ok"
    report = TargetReport(entry.target, verdict, entry.fingerprint, found, definition, True)
    if not entry.fingerprint:
        report.notes.append("no fingerprint pinned: presence checked only")
    if (definition.module, definition.qualname) != (entry.module, entry.qualname):
        report.notes.append(f"defined as {definition.ref} (reached through imports)")
    if entry.fingerprint and definition.kind == "attribute":
        report.notes.append("an assignment: at run time its value has no source, so a pinned fingerprint "
                            "reads as 'unverifiable' there")
    if decorator_names(definition.node) & {"property", "cached_property"}:
        report.notes.append("a property: at run time the fingerprint of the property object is 'unverifiable'")

    if isinstance(entry, ScopedRebind):
        absent = [name for name, _ in entry.bind
                  if resolver.resolve_target(f"{entry.namespace}:{name}").definition is None]
        if absent:
            report.verdict = "missing"
            report.notes.append(f"{entry.namespace} no longer names {', '.join(absent)} (scoped-rebind)")
    parts = entry.qualname.split(".")
    if not details:
        return report
    if len(parts) == 1:
        prefixes = rebind.scope(entry.module, entry.rebind, packages)
        defining = (definition.module, definition.qualname) if "." not in definition.qualname else None
        report.sites = alias_sites(resolver, entry.module, entry.qualname, defining, prefixes,
                                   rebinds=entry.op in _REBINDING_OPS)
    elif (isinstance(resolution.owner, Definition) and isinstance(resolution.owner.node, ast.ClassDef)
          and definition.kind == "function"):
        report.overrides = resolver.overrides(resolution.owner, parts[-1])
    report.call_paths = call_paths(resolver, entry.target)
    return report
