"""Manifest inheritance: a file that ``extends:`` another, resolved into one document with provenance.

``resolve(raw, file)`` reads one manifest file's bytes and, following ``extends``
(a file name in the same folder), every file above it, and returns a ``Resolved``:
the merged document (``extends`` and ``remove`` gone), ``where`` (each field path of
the merged document → the file and line its value came from) and ``chain`` (every
file read, root base first, with the SHA-256 of its content).

Merge rules (docs/manifests.md, *Inheritance*): the child's top-level keys replace
the parent's, ``defaults``, ``vllm`` and ``workers`` merge key by key; ``patches``
(by ``id``), ``requires`` (by ``target``) and ``models`` (by ``arch``) merge entry by
entry, a matched entry field by field, an unmatched one appended; ``remove`` drops
inherited entries by key. Only the shape the merge needs is checked here (mappings,
lists of mappings with their key); the merged document then goes through the schema
and the semantic checks like any manifest, so a wrong value is reported at the file
and line it came from.

Limits: ``extends`` is a plain file name (no folder part), so a chain never leaves
its folder; a chain is at most ``MAX_DEPTH`` files.
"""

from __future__ import annotations

import hashlib
import pathlib
import re
from dataclasses import dataclass
from typing import Any

from patchkit.manifest.problems import FieldPath, Problem, field_name
from patchkit.plan import ManifestError

MAX_DEPTH = 8
MAX_FILE_BYTES = 256 * 1024
KEYED = {"patches": "id", "requires": "target", "models": "arch"}  # list section → the field that names an entry
MERGED = ("defaults", "features", "vllm", "workers")  # mappings merged key by key
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\.yaml$")

Where = tuple[str, int]  # (file, 1-based line)


@dataclass(frozen=True, slots=True)
class Resolved:
    """A manifest document after ``extends``: its data, where each value came from, and the files read."""

    doc: dict[str, Any]
    where: dict[FieldPath, Where]
    chain: tuple[tuple[str, str], ...]  # (file, sha256 of its content), root base first

    def at(self, path: FieldPath) -> Where:
        """File and line of ``path``, or of its nearest ancestor that has one."""
        while path and path not in self.where:
            path = path[:-1]
        return self.where.get(path, (self.chain[-1][0], 1))


def read_bytes(path: pathlib.Path, named_by: Where | None = None) -> bytes:
    """A manifest file's bytes (refused unread past ``MAX_FILE_BYTES``); ManifestError naming the file
    (and ``named_by``, the ``extends`` that asked for it) when it cannot be read."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        if named_by is not None:
            raise ManifestError([Problem(named_by[0], named_by[1], "extends",
                                         f"base {str(path)!r} cannot be read: {exc.strerror}")]) from None
        raise ManifestError([Problem(str(path), 1, "", f"cannot read: {exc.strerror}")]) from None
    if len(raw) > MAX_FILE_BYTES:
        raise ManifestError([Problem(str(path), 1, "", f"larger than {MAX_FILE_BYTES // 1024} KiB: not read"
                                                      " (a manifest is a few KB)")])
    return raw


def resolve(raw: bytes, file: str, _seen: tuple[str, ...] = ()) -> Resolved:
    """Read ``raw`` (the content of ``file``) and the files it extends; see the module docstring."""
    from patchkit.manifest import source as yamlsrc

    try:
        doc, lines = yamlsrc.load(raw, file)
    except RecursionError:
        raise ManifestError([Problem(file, 1, "", "document nested too deeply")]) from None
    if not isinstance(doc, dict):
        raise ManifestError([Problem(file, 1, "", f"a manifest is a mapping, not {type(doc).__name__}")])
    where = {path: (file, line) for path, line in lines.items()}
    own = ((file, hashlib.sha256(raw).hexdigest()),)
    base_name = doc.pop("extends", None)
    remove = doc.pop("remove", None)
    if base_name is None:
        if remove is not None:
            raise ManifestError([Problem(file, lines.get(("remove",), 1), "remove",
                                         "'remove' needs 'extends' (there is nothing to remove from)")])
        return Resolved(doc, where, own)
    at = (file, lines.get(("extends",), 1))
    if not isinstance(base_name, str) or not _FILE_NAME.match(base_name):
        raise ManifestError([Problem(*at, "extends", f"{base_name!r} is not a .yaml file name in this folder"
                                                     " (no folder part)")])
    base_path = pathlib.Path(file).parent / base_name
    chain_so_far = (*_seen, file)
    if str(base_path) in chain_so_far or base_path.resolve() in {pathlib.Path(f).resolve() for f in chain_so_far}:
        cycle = " -> ".join([*chain_so_far, str(base_path)])
        raise ManifestError([Problem(*at, "extends", f"inheritance cycle: {cycle}")])
    if len(chain_so_far) >= MAX_DEPTH:
        raise ManifestError([Problem(*at, "extends", f"more than {MAX_DEPTH} files in one extends chain")])
    if not base_path.is_file():
        raise ManifestError([Problem(*at, "extends", f"base {str(base_path)!r} does not exist"
                                                     f" (named by {file})")])
    base = resolve(read_bytes(base_path, at), str(base_path), chain_so_far)
    merged, merged_where = _merge(base, doc, where, remove, file)
    return Resolved(merged, merged_where, (*base.chain, *own))


# -- merging -----------------------------------------------------------------------------------------------

def _sub(where: dict[FieldPath, Where], prefix: FieldPath) -> dict[FieldPath, Where]:
    """The provenance below ``prefix``, with ``prefix`` cut off the paths."""
    n = len(prefix)
    return {path[n:]: w for path, w in where.items() if path[:n] == prefix}


def _items(where: dict[FieldPath, Where], key: str) -> dict[Any, dict[FieldPath, Where]]:
    """``_sub(where, (key, i))`` for every item ``i`` of section ``key`` at once (one pass, not one per item)."""
    items: dict[Any, dict[FieldPath, Where]] = {}
    for path, w in where.items():
        if len(path) >= 2 and path[0] == key:
            items.setdefault(path[1], {})[path[2:]] = w
    return items


def _put(where: dict[FieldPath, Where], prefix: FieldPath, sub: dict[FieldPath, Where]) -> None:
    where.update({(*prefix, *path): w for path, w in sub.items()})


def _merge(base: Resolved, child: dict[str, Any], child_where: dict[FieldPath, Where], remove: Any,
           file: str) -> tuple[dict[str, Any], dict[FieldPath, Where]]:
    problems: list[Problem] = []

    def fail(path: FieldPath, message: str) -> None:
        problems.append(Problem(*child_where.get(path, (file, 1)), field_name(path), message))

    doc = dict(base.doc)
    where = {path: w for path, w in base.where.items() if path and path[0] not in child and path[0] not in KEYED}
    for key, value in child.items():
        if key in KEYED:
            continue
        if key in MERGED and isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
            inherited = {p: w for p, w in _sub(base.where, (key,)).items() if p and p[0] not in value}
            _put(where, (key,), inherited)
            where.update({p: w for p, w in child_where.items() if p[:1] == (key,) and len(p) > 1})
            where[(key,)] = child_where.get((key,), (file, 1))
        else:
            doc[key] = value
            where.update({p: w for p, w in child_where.items() if p[:1] == (key,)})
    if remove is not None and not isinstance(remove, dict):
        fail(("remove",), "must be a mapping of section -> list of keys (patches: ids, requires: targets,"
                          " models: archs)")
        remove = {}
    for key, section in (remove or {}).items():
        if key not in KEYED or not isinstance(section, list):
            fail(("remove", key), f"unknown section {key!r} or not a list (allowed: {', '.join(KEYED)})")
    for key, name in KEYED.items():
        _merge_section(base, child, child_where, key, name, (remove or {}).get(key) or [], doc, where, fail)
    if problems:
        raise ManifestError(problems)
    return doc, where


def _merge_section(base: Resolved, child: dict[str, Any], child_where: dict[FieldPath, Where], key: str,
                   name: str, removed: list[Any], doc: dict[str, Any], where: dict[FieldPath, Where],
                   fail: Any) -> None:
    inherited = base.doc.get(key)
    own = child.get(key)
    if inherited is None and own is None:
        return
    items: list[tuple[dict[str, Any], dict[FieldPath, Where]]] = []
    index: dict[Any, int] = {}
    inherited_where = _items(base.where, key)
    for i, item in enumerate(inherited if isinstance(inherited, list) else []):
        if isinstance(item, dict) and name in item:
            index.setdefault(item[name], len(items))
        items.append((dict(item) if isinstance(item, dict) else item, inherited_where.get(i, {})))
    for j, gone in enumerate(removed):
        if gone not in index:
            fail(("remove", key, j), f"{gone!r} is not among the inherited {key} (by {name})")
    if own is not None and not isinstance(own, list):
        fail((key,), f"must be a list of {key} entries (matched to the base's by {name!r})")
        own = []
    own_where = _items(child_where, key)
    for j, item in enumerate(own or []):
        item_where = own_where.get(j, {})
        if not isinstance(item, dict) or name not in item:
            fail((key, j), f"an entry of {key} needs {name!r} (to match the base's or to add one)")
            continue
        at = index.get(item[name])
        if at is None:
            index[item[name]] = len(items)
            items.append((dict(item), item_where))
            continue
        merged, merged_where = items[at]
        merged.update(item)
        merged_where = {p: w for p, w in merged_where.items() if not p or p[0] not in item}
        merged_where.update({p: w for p, w in item_where.items() if p})
        items[at] = (merged, merged_where)
    dropped = {index[g] for g in removed if g in index}
    doc[key] = []
    for item, item_where in (pair for i, pair in enumerate(items) if i not in dropped):
        _put(where, (key, len(doc[key])), item_where)
        doc[key].append(item)
    where[(key,)] = child_where.get((key,)) or base.where.get((key,)) or (base.chain[-1][0], 1)
