"""``patchkit diff``: what changed between two manifests, in manifest terms.

``diff_manifests(old, new)`` → ``list[Change]`` compares two validated
``Manifest`` objects (either may be ``None``: a manifest added or deleted).
Defaults are already folded into the entries, so a changed ``defaults.on_drift``
shows as a change of every entry that inherits it. What is compared:

- ``pin``: ``vllm.version``, ``vllm.commit``; ``header``: ``plugin``,
  ``packages``, ``fallback``;
- ``patches``: entries added / removed, and per kept id the fields ``target``,
  ``op``, ``with``, ``value``, ``when``, ``after``, ``fingerprint`` (with
  whether the signature or only the body hash moved), ``rebind``, ``on_drift``,
  ``required``, ``why``, ``upstream``, ``retire_when``, ``reviewed`` (the review note);
- ``order``: the applied order (``patchkit.manifest.select.order``) of the entries
  both manifests have, when their relative order differs;
- ``requires``: requirements added / removed (by target), and per kept
  target ``pin``, ``fingerprint``, ``on_drift``, ``indirect``, ``feature``, ``why``, ``reviewed``;
- ``models``: registrations added / removed / changed (``class``, ``when``);
- ``workers`` (the entry with op ``workers``): ``at``, ``fingerprint``,
  ``after``, ``on_drift``, ``role_of``, ``overrides``, ``reviewed``.

Comments, key order, quoting and blank lines are not compared: two files that
differ only there are equal. ``render(changes, fmt, ...)`` gives ``text``,
``markdown`` (for a pull request) or ``json`` (one object). ``run_diff`` is the
command: exit 0 equal, 1 different, 2 bad input (unreadable or invalid
manifest, git failure). ``run_git_driver`` is the git diff driver form (see
``docs/review.md``): it always exits 0, as git requires of an external diff,
prints the semantic diff and then the plain text diff so that nothing a
reviewer should see (comments included) is hidden, and falls back to the text
diff alone when a side does not validate.
"""

from __future__ import annotations

import difflib
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchkit import fingerprint, manifest
from patchkit.manifest.select import order
from patchkit.plan import (
    WORKERS_ENTRY_ID,
    Manifest,
    ManifestError,
    ModelRegistration,
    Patch,
    Requirement,
    ScopedRebind,
    WorkerOverride,
)
from patchkit.plan import Change as Entry  # diff.py has a Change of its own: a difference

FORMATS = ("text", "markdown", "json")
_ENTRY_FIELDS = ("target", "op", "with", "value", "module", "bind", "active_if", "when", "after", "fingerprint",
                 "rebind", "on_drift", "required", "why", "upstream", "retire_when", "call_paths", "reviewed")
_REQUIRE_FIELDS = ("pin", "fingerprint", "on_drift", "indirect", "feature", "why", "reviewed")
_WORKER_FIELDS = ("at", "fingerprint", "after", "on_drift", "role_of", "overrides", "reviewed")
_NULL_DEVICE = "/dev/null"


class DiffInputError(Exception):
    """A side of the diff cannot be read or is not a valid manifest; the message is for the user.

    ``is_manifest``: the message is a manifest's ``file:line: field: message`` list.
    """

    def __init__(self, message: str, is_manifest: bool = False) -> None:
        super().__init__(message)
        self.is_manifest = is_manifest


@dataclass(frozen=True)
class Change:
    """One semantic difference.

    ``section`` is pin | header | patches | order | models | workers; ``kind`` is
    added | removed | changed; ``subject`` names the entry / model / field;
    ``field`` the changed field of a changed entry (None otherwise).
    """

    section: str
    kind: str
    subject: str
    field: str | None
    old: Any
    new: Any
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"section": self.section, "kind": self.kind, "subject": self.subject, "field": self.field,
                "old": self.old, "new": self.new, "note": self.note}


def _entry_view(e: Entry) -> dict[str, Any]:
    scoped = isinstance(e, ScopedRebind)
    patch = e if isinstance(e, Patch) else None
    return {
        "target": e.target, "op": e.op, "with": patch.with_ if patch else None,
        "value": patch.value if patch and patch.has_value else None,
        "module": e.namespace if scoped else None, "bind": dict(e.bind) if scoped else None,
        "active_if": e.active_if if scoped else None,
        "when": e.when, "after": list(e.after), "fingerprint": e.fingerprint,
        "rebind": list(e.rebind) if isinstance(e.rebind, tuple) else e.rebind, "on_drift": e.on_drift,
        "required": e.required, "why": e.why, "upstream": e.upstream, "retire_when": e.retire_when,
        "call_paths": e.call_paths, "reviewed": e.reviewed,
    }


def _workers_view(e: WorkerOverride) -> dict[str, Any]:
    return {"at": e.target, "fingerprint": e.fingerprint, "after": list(e.after), "on_drift": e.on_drift,
            "role_of": e.role_of, "overrides": list(e.overrides), "reviewed": e.reviewed}


def _requirement_view(e: Requirement) -> dict[str, Any]:
    return {"pin": e.pin, "fingerprint": e.fingerprint, "on_drift": e.on_drift, "indirect": e.indirect,
            "feature": e.feature, "why": e.why, "reviewed": e.reviewed}


def _keyed_changes(section: str, old: dict[str, Any], new: dict[str, Any], view: Any,
                   names: tuple[str, ...]) -> list[Change]:
    """Added / removed / changed items of one keyed section (``view`` turns an item into fields)."""
    out = [Change(section, "removed", key, None, view(item), None) for key, item in old.items() if key not in new]
    for key, item in new.items():
        if key not in old:
            out.append(Change(section, "added", key, None, None, view(item)))
        else:
            out.extend(_fields(section, key, names, view(old[key]), view(item)))
    return out


def _model_view(m: ModelRegistration) -> dict[str, Any]:
    return {"class": m.class_ref, "when": m.when}


def _fp_note(old: Any, new: Any) -> str:
    if isinstance(old, str) and isinstance(new, str):
        verdict = fingerprint.compare(old, new)
        return {"drifted:signature": "signature changed", "drifted:body": "body only"}.get(verdict, "")
    return "pinned" if new else "unpinned"


def _fields(section: str, subject: str, names: tuple[str, ...], old: dict[str, Any],
            new: dict[str, Any]) -> list[Change]:
    out = []
    for name in names:
        if old.get(name) != new.get(name):
            note = _fp_note(old.get(name), new.get(name)) if name == "fingerprint" else ""
            out.append(Change(section, "changed", subject, name, old.get(name), new.get(name), note))
    return out


def diff_manifests(old: Manifest | None, new: Manifest | None) -> list[Change]:
    """Every semantic difference from ``old`` to ``new`` (``None`` = no manifest), in a stable order."""
    changes: list[Change] = []
    if old is None and new is None:
        return changes

    def pins(m: Manifest | None) -> dict[str, Any]:
        return {} if m is None else {"version": m.vllm_version, "commit": m.vllm_commit}

    def header(m: Manifest | None) -> dict[str, Any]:
        return {} if m is None else {"plugin": m.plugin, "packages": list(m.packages), "fallback": m.fallback}

    for section, view in (("pin", pins), ("header", header)):
        a, b = view(old), view(new)
        for name in dict.fromkeys([*a, *b]):
            if a.get(name) != b.get(name):
                changes.append(Change(section, "changed", name, name, a.get(name), b.get(name)))

    old_entries = {e.id: e for e in (old.entries if old else ()) if e.op != "workers"}
    new_entries = {e.id: e for e in (new.entries if new else ()) if e.op != "workers"}
    for eid, e in old_entries.items():
        if eid not in new_entries:
            changes.append(Change("patches", "removed", eid, None, _entry_view(e), None))
    for eid, e in new_entries.items():
        if eid not in old_entries:
            changes.append(Change("patches", "added", eid, None, None, _entry_view(e)))
        else:
            changes.extend(_fields("patches", eid, _ENTRY_FIELDS, _entry_view(old_entries[eid]), _entry_view(e)))

    old_order = [e.id for e in order(old.entries)] if old else []
    new_order = [e.id for e in order(new.entries)] if new else []
    common = set(old_order) & set(new_order)
    if [i for i in old_order if i in common] != [i for i in new_order if i in common]:
        changes.append(Change("order", "changed", "plan order", None, old_order, new_order,
                              "the entries both manifests have are applied in a different order"))

    changes.extend(_keyed_changes("requires", {e.target: e for e in (old.requires if old else ())},
                                  {e.target: e for e in (new.requires if new else ())}, _requirement_view,
                                  _REQUIRE_FIELDS))
    changes.extend(_keyed_changes("models", {m.arch: m for m in (old.models if old else ())},
                                  {m.arch: m for m in (new.models if new else ())}, _model_view,
                                  ("class", "when")))

    old_w = next((e for e in (old.entries if old else ()) if e.op == "workers"), None)
    new_w = next((e for e in (new.entries if new else ()) if e.op == "workers"), None)
    if old_w and not new_w:
        changes.append(Change("workers", "removed", WORKERS_ENTRY_ID, None, _workers_view(old_w), None))
    elif new_w and not old_w:
        changes.append(Change("workers", "added", WORKERS_ENTRY_ID, None, None, _workers_view(new_w)))
    elif old_w and new_w:
        changes.extend(_fields("workers", WORKERS_ENTRY_ID, _WORKER_FIELDS, _workers_view(old_w),
                               _workers_view(new_w)))
    return changes


# -- rendering -----------------------------------------------------------------------------------------------

def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return json.dumps(value)
    return json.dumps(value, sort_keys=True)


def _summary_of(view: dict[str, Any] | None) -> str:
    if not view:
        return ""
    if "op" in view:
        return f"{view['op']} {view['target']}" + (f" with {view['with']}" if view.get("with") else "")
    if "class" in view:
        return view["class"]
    if "pin" in view:
        return f"pin {view['pin']}"
    return f"at {view.get('at')}"


def _counts(changes: list[Change]) -> str:
    if not changes:
        return "no semantic change"
    counts: dict[str, int] = {}
    for c in changes:
        key = f"{c.section} {c.kind}" if c.section != "pin" else "pin changed"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in counts.items())


_SIGN = {"added": "+", "removed": "-", "changed": "~"}


def _text(changes: list[Change], old_name: str, new_name: str) -> str:
    out = [f"patchkit diff {old_name} -> {new_name}"]
    last: tuple[str, str, str] | None = None
    for c in changes:
        if c.section in ("pin", "header"):
            out.append(f"{c.section}: {c.subject} {_show(c.old)} -> {_show(c.new)}")
        elif c.section == "order":
            out.append(f"order: {', '.join(c.old)} -> {', '.join(c.new)}")
        elif c.kind in ("added", "removed"):
            out.append(f"{_SIGN[c.kind]} {c.section} {c.subject}: {_summary_of(c.old or c.new)}")
        else:
            if last != (c.section, c.kind, c.subject):
                out.append(f"~ {c.section} {c.subject}")
            note = f" ({c.note})" if c.note else ""
            out.append(f"    {c.field}: {_show(c.old)} -> {_show(c.new)}{note}")
        last = (c.section, c.kind, c.subject)
    out.append(_counts(changes))
    return "\n".join(out) + "\n"


def _cell(value: Any) -> str:
    return "`" + _show(value).replace("|", "\\|").replace("`", "'") + "`" if value is not None else "—"


def _plain(text: str | None) -> str:
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`" if text else "—"


def _markdown(changes: list[Change], old_name: str, new_name: str) -> str:
    out = [f"### patchkit diff `{old_name}` → `{new_name}`", ""]
    if not changes:
        return "\n".join([*out, "No semantic change.", ""])
    out += ["| section | change | subject | field | old | new | note |", "|---|---|---|---|---|---|---|"]
    for c in changes:
        if c.kind in ("added", "removed") and c.section not in ("pin", "header"):
            old = _summary_of(c.old) if c.old else None
            new = _summary_of(c.new) if c.new else None
            out.append(f"| {c.section} | {c.kind} | `{c.subject}` | — | {_plain(old)} | {_plain(new)} | {c.note} |")
        else:
            out.append(f"| {c.section} | {c.kind} | `{c.subject}` | {c.field or '—'} | {_cell(c.old)} | "
                       f"{_cell(c.new)} | {c.note} |")
    out += ["", f"**{_counts(changes)}**", ""]
    return "\n".join(out)


def render(changes: list[Change], fmt: str, old_name: str, new_name: str,
           old: Manifest | None = None, new: Manifest | None = None) -> str:
    """``changes`` as ``text``, ``markdown`` or ``json`` (``old``/``new`` add the pins to the JSON)."""
    if fmt == "json":
        def side(name: str, m: Manifest | None) -> dict[str, Any]:
            return {"file": name, "version": m.vllm_version if m else None, "commit": m.vllm_commit if m else None,
                    "present": m is not None}
        doc = {"old": side(old_name, old), "new": side(new_name, new), "equal": not changes,
               "changes": [c.to_json() for c in changes]}
        return json.dumps(doc, indent=2) + "\n"
    return _markdown(changes, old_name, new_name) if fmt == "markdown" else _text(changes, old_name, new_name)


# -- inputs --------------------------------------------------------------------------------------------------

def _parse(text: str | None, name: str) -> Manifest | None:
    if text is None:
        return None
    try:
        return manifest.parse(text, name)
    except ManifestError as exc:
        raise DiffInputError(str(exc), is_manifest=True) from None
    except RecursionError:
        raise DiffInputError(f"{name}: document nested too deeply") from None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise DiffInputError(f"{path}: cannot read: {reason}") from None


def git_show(rev: str, path: str) -> str:
    """The text of ``path`` (a file in a git work tree) at revision ``rev``: ``git show REV:./NAME``."""
    p = Path(path)
    if rev.startswith("-"):
        raise DiffInputError(f"--git {rev!r}: not a revision")
    try:
        proc = subprocess.run(["git", "-C", str(p.parent or "."), "show", f"{rev}:./{p.name}"],
                              capture_output=True, check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DiffInputError(f"git show {rev}:{path}: {exc}") from None
    if proc.returncode != 0:
        message = proc.stderr.decode("utf-8", errors="replace").strip().splitlines()
        raise DiffInputError(f"git show {rev}:{path}: {message[-1] if message else 'failed'}")
    try:
        return proc.stdout.decode("utf-8")
    except UnicodeDecodeError:
        raise DiffInputError(f"{path} at {rev}: not UTF-8 text") from None


def run_diff(old_path: str, new_path: str | None = None, fmt: str = "text", git_rev: str | None = None
             ) -> tuple[int, str]:
    """``patchkit diff``: ``(exit code, output)``; with ``git_rev``, ``old_path`` at that revision vs the file."""
    if fmt not in FORMATS:
        return 2, f"patchkit diff: unknown format {fmt!r} (choose from {', '.join(FORMATS)})"
    try:
        if git_rev is not None:
            if new_path is not None:
                return 2, "patchkit diff: --git REV takes one manifest file (compared with its version at REV)"
            old_text, new_text = git_show(git_rev, old_path), _read(old_path)
            old_name, new_name = f"{old_path}@{git_rev}", old_path
        else:
            if new_path is None:
                return 2, "patchkit diff: give OLD and NEW, or one file and --git REV"
            old_text, new_text = _read(old_path), _read(new_path)
            old_name, new_name = old_path, new_path
        old, new = _parse(old_text, old_name), _parse(new_text, new_name)
    except DiffInputError as exc:
        return 2, str(exc) if exc.is_manifest else f"patchkit diff: {exc}"
    changes = diff_manifests(old, new)
    return (1 if changes else 0), render(changes, fmt, old_name, new_name, old, new)


def run_git_driver(args: list[str]) -> tuple[int, str]:
    """git's external diff call: ``path old-file old-hex old-mode new-file new-hex new-mode [new-path info]``.

    Always exit 0 (git treats any other code as a fatal error unless
    ``trustExitCode`` is set); bad usage (wrong argument count) is exit 2.
    """
    if len(args) not in (7, 9):
        return 2, ("patchkit diff --git-driver: expected the 7 (or 9, for a rename) arguments git passes: "
                   "path old-file old-hex old-mode new-file new-hex new-mode")
    path, old_file, new_file = args[0], args[1], args[4]
    new_path = args[7] if len(args) == 9 else path
    texts: list[str | None] = []
    for f in (old_file, new_file):
        if f == _NULL_DEVICE:
            texts.append(None)
            continue
        try:
            texts.append(_read(f))
        except DiffInputError as exc:
            return 0, f"patchkit diff: {exc}\n"
    old_name, new_name = f"a/{path}", f"b/{new_path}"
    text_diff = "".join(difflib.unified_diff(
        (texts[0] or "").splitlines(keepends=True), (texts[1] or "").splitlines(keepends=True),
        old_name if texts[0] is not None else _NULL_DEVICE, new_name if texts[1] is not None else _NULL_DEVICE))
    if text_diff and not text_diff.endswith("\n"):
        text_diff += "\n"
    try:
        old, new = _parse(texts[0], old_name), _parse(texts[1], new_name)
    except DiffInputError as exc:
        return 0, f"patchkit diff: not comparing semantically ({exc})\n{text_diff}"
    semantic = render(diff_manifests(old, new), "text", old_name, new_name)
    return 0, semantic + ("\ntext diff:\n" + text_diff if text_diff else "")
