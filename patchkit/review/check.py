"""``patchkit check``: a manifest against a vLLM tree, without importing vLLM.

``run_check(manifest_path, vllm_src, base_src=None, fmt="text")`` returns
``(exit_code, output)``. Per entry it reports the verdict (``ok``, ``drifted:
signature``, ``drifted: body``, ``moved``, ``missing``), the pinned and found
fingerprints, where the definition is, every alias site that binds the target
and whether ``rebind`` covers it, the subclasses that override a method target,
whether ``retire_when`` holds for the tree's version, the call paths that choose between the target and
a same-named sibling of another module (``patchkit.static.callpaths``; ``sibling_patched`` says whether an
entry of the manifest patches that sibling), and — given ``base_src``,
the tree the manifest was written against — a unified diff of each drifted or
moved target. Requirements (``requires:``, entries with op ``require`` and id
``require:<target>``) get the same verdicts, judged by their ``pin``. A failing member of a ``feature``
does not fail the check: it is listed as refusing that feature (``[feature-off]``, and
``summary.features_refused`` per feature), since the plugin still runs without it. Each callable an entry hands
patchkit (``with``, ``active_if``, ``role_of``) is compared with its target's signature
(``patchkit.static.signatures``: the rule per op, and what is not compared); a callable that does not
fit names the manifest file and line, the parameters and both signatures.

Exit codes, from the verdict (``patchkit.judge``, the one the runtime applies): 0 the plugin holds, with
any features refused that are not ``required``; 1 a member without a feature fails (a required entry with
``on_drift: fail`` drifted, moved or missing — an ``op: set`` whose owner exists may create a missing
attribute —, or a callable that does not fit its target, whatever ``required`` says, unless ``on_drift: skip``
leaves a drifted target unpatched), or a feature the manifest marks ``required`` is refused, or a call path
leads to a sibling no entry patches from an entry with ``call_paths: fail`` (from any entry with
``--strict-call-paths``; by default such siblings are listed and counted in ``summary.unpatched_siblings``
only: docs/review.md says why; call paths are a review gate, the runtime's verdict does not judge them); 2 bad input —
missing path, not a vLLM tree, corrupt wheel, invalid manifest, unknown format.
For exit 2 the output is the error text (for an invalid manifest, the
``file:line: field: message`` lines); no input produces a traceback.

Output formats: ``text`` for terminals, ``markdown`` for a pull request,
``json`` (one object; each of ``entries`` is a ``check_rows.Row``,
``schemas/check-entry.schema.json``) for tools.

Run again on the same trees, the rows of entries unchanged since the last check of the
file come from ``patchkit.review.check_cache`` (``use_cache=False``: none); the output is
the same but for the summary's ``seconds``, ``parsed`` and ``cached``.
"""

from __future__ import annotations

import difflib
import gc
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchkit.judge import FAILING as _FAILING
from patchkit.judge import assess, describe
from patchkit.plan import Entry, Manifest, ManifestError
from patchkit.review import check_text, forked
from patchkit.review.check_cache import RowCache
from patchkit.static import Resolver, SourceTree, TargetReport, TreeError, analyze, open_tree, source_segment
from patchkit.static.signatures import Checker, Fit
from patchkit.verdict import Member, Verdict

FORMATS = ("text", "markdown", "json")


@dataclass
class EntryCheck:
    """One entry's result: the static report plus the policy view (would it fail?) and extras."""

    entry: Entry
    report: TargetReport
    fails: bool
    retire: dict[str, Any] | None
    diff: str | None
    file: str | None
    line: int | None
    signatures: list[Fit]
    refuses: str | None = None  # the feature a failing feature-scoped requirement refuses (then ``fails`` is False)

    def to_json(self) -> dict[str, Any]:
        r = self.report
        return {
            "id": self.entry.id, "target": self.entry.target, "op": self.entry.op,
            "pin": self.entry.pin if self.entry.op == "require" else None,
            "required": self.entry.required, "on_drift": self.entry.on_drift, "source": self.entry.source,
            "verdict": r.verdict, "fails": self.fails,
            "feature": self.entry.feature, "refuses_feature": self.refuses,
            "fingerprint": {"pinned": r.pinned, "found": r.found},
            "definition": None if r.definition is None else {
                "ref": r.definition.ref, "kind": r.definition.kind, "file": self.file, "line": self.line},
            "candidates": [c.ref for c in r.candidates],
            "notes": r.notes,
            "alias_sites": [s.to_json() for s in r.sites],
            "uncovered_sites": len(r.uncovered),
            "overrides": [{"ref": o.definition.ref, "file": o.file, "line": o.definition.first_line,
                           "calls_super": o.calls_super} for o in r.overrides],
            "call_paths": [p.to_json() for p in r.call_paths],
            "unpatched_siblings": len(r.call_paths),  # until ``_mark_siblings`` has seen every entry
            "retire": self.retire,
            "diff": self.diff,
            "signatures": [f.to_json() for f in self.signatures],
        }


def _version_holds(spec: str, version: str | None) -> bool | None:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    if version is None:
        return None
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return None


def _diff(entry: Entry, report: TargetReport, tree: SourceTree, base: Resolver | None) -> str | None:
    if base is None or report.verdict not in _FAILING:
        return None
    resolution = base.resolve_target(entry.target)
    old = resolution.definition or (resolution.inherited if entry.op == "require" else None)
    new = report.definition or (report.candidates[0] if report.candidates else None)
    if old is None and new is None:
        return None
    old_text = source_segment(base.tree, old) if old else ""
    new_text = source_segment(tree, new) if new else ""
    old_name = f"base/{old.ref}" if old else "base/(absent)"
    new_name = f"new/{new.ref}" if new else "new/(absent)"
    lines = difflib.unified_diff(old_text.splitlines(keepends=True), new_text.splitlines(keepends=True),
                                 old_name, new_name)
    text = "".join(line if line.endswith("\n") else line + "\n" for line in lines)
    return text or None


def check_entries(manifest: Manifest, tree: SourceTree, base: SourceTree | None = None,
                  entries: Sequence[Entry] | None = None) -> list[EntryCheck]:
    """Analyze ``entries`` (default: every entry and requirement of ``manifest``) in ``tree`` (and diff
    drifted ones against ``base``)."""
    resolver = Resolver(tree)
    base_resolver = Resolver(base) if base is not None else None
    signatures = Checker(resolver)
    results = []
    for entry in (*manifest.entries, *manifest.requires) if entries is None else entries:
        report = analyze(resolver, entry, manifest.packages)
        fits = signatures.check(entry, report.definition)
        fails, _ = assess(entry, report, fits)  # the verdict's rule (patchkit.judge)
        refuses = entry.feature if fails else None
        fails = fails and refuses is None
        retire = None
        retire_when = getattr(entry, "retire_when", {})  # changes have it, requirements do not
        if "vllm" in retire_when:
            spec = retire_when["vllm"]
            retire = {"vllm": spec, "met": _version_holds(spec, tree.version)}
        d = report.definition
        file = tree.path_of(d.module) if d else None
        results.append(EntryCheck(entry, report, fails, retire, _diff(entry, report, tree, base_resolver),
                                  file, d.first_line if d else None, fits, refuses))
    return results


def _halves(entries: Sequence[Entry], tree: SourceTree) -> tuple[list[int], list[int]]:
    """Entry indexes in two halves of about equal work: entries grouped by target module, the
    heaviest group placed first, each on the half with less work so far. A group's work is its
    module's size, doubled when it patches a class member (the overriding-subclass search parses
    more files)."""
    groups: dict[str, list[int]] = {}
    for i, entry in enumerate(entries):
        groups.setdefault(entry.module, []).append(i)

    work = {module: tree.size(module) * (2 if any(entries[i].op != "require" and "." in entries[i].qualname
                                                  for i in members) else 1)
            for module, members in groups.items()}
    halves: tuple[list[int], list[int]] = ([], [])
    load = [0, 0]
    for module in sorted(groups, key=lambda m: (-work[m], m)):
        side = 0 if load[0] <= load[1] else 1
        halves[side].extend(groups[module])
        load[side] += work[module]
    return sorted(halves[0]), sorted(halves[1])


def _check_json(manifest: Manifest, tree: SourceTree, base: SourceTree | None,
                entries: Sequence[Entry]) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """``check_entries`` as JSON: (entry objects, modules of ``tree`` parsed, problems of both trees)."""
    rows = [r.to_json() for r in check_entries(manifest, tree, base, entries)]
    return rows, tree.parsed, tree.problems + (base.problems if base else [])


def _compute(manifest: Manifest, tree: SourceTree, base: SourceTree | None, vllm_src: str, base_src: str | None,
             entries: list[Entry]) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """The JSON rows of ``entries``, the modules of ``tree`` parsed, and the problems met.

    With a second core, half of the entries (by target module) are checked in a forked child
    (``patchkit.review.forked``) that opens the trees itself; the halves' output is merged in
    order, so the result is the same as in one process."""
    mine, theirs = _halves(entries, tree) if forked.available() else (list(range(len(entries))), [])
    child = None
    if theirs:
        def other_half() -> tuple[list[dict[str, Any]], list[str], list[str]]:
            return _check_json(manifest, open_tree(vllm_src), open_tree(base_src) if base_src else None,
                               [entries[i] for i in theirs])
        child = forked.start(other_half)
    try:
        rows, parsed, problems = _check_json(manifest, tree, base, [entries[i] for i in mine])
    except BaseException:
        if child is not None:
            child.result()  # let it finish and reap it (it may be blocked writing) before the error goes on
        raise
    by_index = dict(zip(mine, rows, strict=True))
    if child is not None:
        got = child.result()
        if not (isinstance(got, list) and len(got) == 3 and len(got[0]) == len(theirs)):
            # the child failed: do its half here, where its error surfaces
            got = _check_json(manifest, tree, base, [entries[i] for i in theirs])
        by_index.update(zip(theirs, got[0], strict=True))
        parsed = parsed + got[1]
        problems = problems + [p for p in got[2] if p not in problems]
    return [by_index[i] for i in range(len(entries))], parsed, problems


def _check_all(manifest: Manifest, tree: SourceTree, base: SourceTree | None, vllm_src: str,
               base_src: str | None, use_cache: bool) -> tuple[list[dict[str, Any]], int, int, list[str]]:
    """Every entry's JSON row, the number of distinct modules parsed, how many rows came from the cache
    (``patchkit.review.check_cache``), and the problems met."""
    entries = [*manifest.entries, *manifest.requires]
    store = RowCache(manifest.file, manifest.packages, tree, base) if use_cache else None
    if store is not None and not store.usable:
        store = None
    keys: list[str | None] = [None] * len(entries)
    rows: dict[int, dict[str, Any]] = {}
    if store is not None:
        store.load()
        for i, entry in enumerate(entries):
            keys[i] = store.key(entry)
            found = store.row(entry, keys[i])
            if found is not None:
                rows[i] = found
    todo = [i for i in range(len(entries)) if i not in rows]
    parsed: list[str] = []
    problems = list(store.problems) if store is not None and rows else []
    if todo:
        computed, parsed, met = _compute(manifest, tree, base, vllm_src, base_src, [entries[i] for i in todo])
        rows.update(zip(todo, computed, strict=True))
        problems += [p for p in met if p not in problems]
    if store is not None and todo:
        store.save({key: rows[i] for i, key in enumerate(keys) if key is not None}, problems)
    return [rows[i] for i in range(len(entries))], len(set(parsed)), len(entries) - len(todo), problems


def verdict_of_rows(manifest: Manifest, rows: list[dict[str, Any]], tree: SourceTree) -> Verdict:
    """The ``patchkit.verdict.Verdict`` of check's rows (each judged by ``patchkit.judge.assess``): the one
    check's exit code and "features refused" come from, equal to what ``patchkit.judge.judge`` gives the
    runtime for the same tree (``verdict_digest`` in the JSON summary, the runtime's report has it too)."""
    members = tuple(Member(r["id"], r["op"], r["target"], r["verdict"], bool(r["fails"] or r["refuses_feature"]),
                           r["feature"]) for r in rows)
    return Verdict(manifest.file, describe(tree), members, manifest.features)


def _mark_siblings(rows: list[dict[str, Any]], entries: Sequence[Entry]) -> int:
    """Set each call path's ``sibling_patched`` (and each row's ``unpatched_siblings``) from every entry of the
    manifest: a sibling is patched when an entry that changes vLLM names it as its target or resolves to it.
    A row whose entry opts in (``call_paths: fail``) fails when one is not. Done after the rows are assembled,
    cached ones included, as it depends on the other entries. Returns the number of unpatched siblings (each
    sibling counted once)."""
    patched = set()
    for row in rows:
        if row["op"] != "require":
            patched.add(row["target"])
            if row["definition"]:
                patched.add(row["definition"]["ref"])
    unpatched = set()
    for row in rows:
        for path in row["call_paths"]:
            path["sibling_patched"] = path["sibling"] in patched
            if not path["sibling_patched"]:
                unpatched.add(path["sibling"])
        row["unpatched_siblings"] = sum(not p["sibling_patched"] for p in row["call_paths"])
    for row, entry in zip(rows, entries, strict=True):
        if row["unpatched_siblings"] and getattr(entry, "call_paths", "warn") == "fail":
            row["fails"] = True
    return len(unpatched)


def _header(manifest: Manifest, tree: SourceTree, base: SourceTree | None) -> dict[str, Any]:
    return {
        "manifest": manifest.file,
        "manifest_vllm": manifest.vllm_version,
        "vllm": {"source": tree.describe(), "version": tree.version,
                 "selected_by_manifest": _version_holds(manifest.vllm_version, tree.version)},
        "base": None if base is None else {"source": base.describe(), "version": base.version},
    }


def run_check(manifest_path: str | Path, vllm_src: str, base_src: str | None = None,
              fmt: str = "text", keep: list[object] | None = None, use_cache: bool = True,
              strict_call_paths: bool = False) -> tuple[int, str]:
    """Check a manifest against a tree; ``(exit_code, output)`` as described in the module docstring.

    ``keep``, when given, receives the parsed trees instead of their being freed on return (the
    command line passes a list that lives until it exits without freeing them). ``use_cache``: reuse
    and store the rows of entries unchanged since the last check on the same trees
    (``patchkit.review.check_cache``). ``strict_call_paths``: a call path to a sibling no entry patches
    makes the exit code 1 (default: it is reported and counted only)."""
    from patchkit import manifest as manifest_mod

    if fmt not in FORMATS:
        return 2, f"patchkit check: unknown format {fmt!r} (choose from {', '.join(FORMATS)})"
    started = time.perf_counter()
    try:
        loaded = manifest_mod.load(manifest_path)
    except ManifestError as exc:
        return 2, str(exc)
    collecting = gc.isenabled()
    gc.disable()  # parsing builds large acyclic trees: cyclic GC passes would only scan them
    try:
        tree = open_tree(vllm_src)
        base = open_tree(base_src) if base_src is not None else None
        rows, parsed, cached, problems = _check_all(loaded, tree, base, vllm_src, base_src, use_cache)
        if keep is not None:
            keep.append((tree, base))
    except TreeError as exc:
        return 2, f"patchkit check: {exc}"
    except RecursionError:
        return 2, "patchkit check: a source file nests too deeply to analyze"
    finally:
        if collecting:
            gc.enable()
    unpatched = _mark_siblings(rows, [*loaded.entries, *loaded.requires])
    verdict = verdict_of_rows(loaded, rows, tree)
    holds = verdict.holds and not set(verdict.refused) & set(loaded.required_features)
    code = 0 if holds and not (strict_call_paths and unpatched) else 1
    doc = _header(loaded, tree, base)
    doc["entries"] = rows
    doc["problems"] = problems
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    doc["summary"] = {"entries": len(rows), "requirements": len(loaded.requires),
                      "features_refused": verdict.refused, "verdict_digest": verdict.digest,
                      "verdicts": counts, "failing": [row["id"] for row in rows if row["fails"]],
                      "misfits": [row["id"] for row in rows if any(f["fits"] is False for f in row["signatures"])],
                      "uncovered_sites": sum(row["uncovered_sites"] for row in rows),
                      "unpatched_siblings": unpatched,
                      "modules": len(tree.modules), "parsed": parsed, "cached": cached,
                      "seconds": round(time.perf_counter() - started, 3)}
    doc["exit_code"] = code
    if fmt == "json":
        return code, json.dumps(doc, indent=2)
    return code, (check_text.markdown(doc) if fmt == "markdown" else check_text.text(doc))
