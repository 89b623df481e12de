"""``patchkit check``'s results kept per entry: run again on the same trees, it redoes only what changed.

A check spends its time parsing vLLM's files; a maintainer runs it again and again while reviewing one
release's manifest, and most entries give the same row each time. ``RowCache`` keeps each entry's row (the
object ``check --format json`` prints for it, ``schemas/check-entry.schema.json``) under a key made of
everything the row depends on:

- patchkit's own code (the SHA-256 of its ``.py`` files) and this cache's format;
- the trees: ``SourceTree.identity()`` of the vLLM tree and of ``--base`` (content by CRC-32 and size in a
  wheel, by size and modification time in a folder), with how each was named;
- the entry itself as declared, less where (``source``: editing one entry shifts the lines of the others),
  and the manifest's ``packages``;
- for an entry that hands patchkit callables, the identity of the plugin packages they are read from.

Where and how: the cache directory and its file rules of ``patchkit.runtime.cache`` (a file of this user,
mode 0600, read without following links or waiting on a FIFO); one file per manifest path and pair of trees,
``check-<key>.json``, rewritten with the rows of the last run. What is read back is data: the file is used
only if every row in it has the shape of ``check_rows.Row``, and a row only for the entry it names (id,
target, op); anything else is computed again. The problems
(files that do not parse) stored with the rows are shown with them.

Limits: a tree without an identity (a folder file modified in the last two seconds) or a plugin package
without one is not cached. A folder file rewritten with the same size and modification time (set back on
purpose) reads as unchanged, as it does for git. ``--no-cache`` (``use_cache=False``) neither reads nor writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from patchkit.plan import Entry
from patchkit.review.check_rows import Row
from patchkit.runtime import cache
from patchkit.static import SourceTree
from patchkit.static.signatures import plugin_tree

FORMAT = "patchkit-check-1"
_PATCHKIT = Path(__file__).resolve().parents[1]


def _code_digest() -> str:
    """SHA-256 of patchkit's ``.py`` files (names and content) and of the Python minor version (fingerprints of
    the AST may change with it): a changed checker never reads old rows."""
    h = hashlib.sha256(f"{FORMAT}|{sys.version_info[0]}.{sys.version_info[1]}".encode())  # AST shapes: per minor
    for path in sorted(_PATCHKIT.rglob("*.py")):
        h.update(f"{path.relative_to(_PATCHKIT)}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, default=repr, sort_keys=True).encode()).hexdigest()


def _package_identity(package: str) -> str | None:
    """The identity of a plugin package's folder, the one ``patchkit.static.signatures`` reads."""
    tree = plugin_tree(package)
    return "absent" if tree is None else tree.identity()  # absent: its callables are not compared


class RowCache:
    """The stored rows of one manifest file checked against one pair of trees."""

    def __init__(self, manifest_file: str, packages: Sequence[str], tree: SourceTree, base: SourceTree | None) -> None:
        self.packages = tuple(packages)
        trees = [tree.identity(), None if base is None else base.identity()]
        # False when a tree has no identity: then nothing is read or stored
        self.usable = trees[0] is not None and (base is None or trees[1] is not None)
        self.name = f"check-{_digest(_code_digest(), os.path.abspath(manifest_file), trees)[:40]}.json"
        self._plugins: str | bool | None = False  # False: not computed yet
        self._stored: dict[str, Row] = {}
        self.problems: list[str] = []

    def _plugin_identity(self) -> str | None:
        if self._plugins is False:
            ids = [_package_identity(top) for top in sorted({p.split(".")[0] for p in self.packages})]
            self._plugins = None if None in ids else _digest(ids)
        return self._plugins or None

    def key(self, entry: Entry) -> str | None:
        """The row key of ``entry``; None when it cannot be cached (see the module docstring)."""
        declared = entry.to_json()
        declared.pop("source", None)
        refs = entry.refs() if hasattr(entry, "refs") else ()
        plugins = self._plugin_identity() if refs else ""
        if plugins is None:
            return None
        return _digest(declared, self.packages, plugins)

    def load(self) -> None:
        """Read the stored rows: all of them valid (``check_rows.Row``, decoded and checked by ``msgspec``),
        or none (a miss, for any reason). Only for a ``usable`` cache."""
        raw = cache.read_private(self.name)
        if raw is None:
            return
        try:
            stored = msgspec.json.decode(raw, type=_Stored)
        except msgspec.DecodeError:  # not JSON, or not the shape of a stored file (ValidationError)
            return
        if stored.format == FORMAT:
            self._stored, self.problems = stored.rows, stored.problems

    def row(self, entry: Entry, key: str | None) -> dict[str, Any] | None:
        """The stored row of ``entry`` under ``key`` if it names this entry, with the entry's ``source`` as
        declared now; else None."""
        stored = self._stored.get(key) if key is not None else None
        if stored is None or (stored.id, stored.target, stored.op) != (entry.id, entry.target, entry.op):
            return None
        row: dict[str, Any] = msgspec.to_builtins(stored)
        row["source"] = entry.source
        return row

    def save(self, rows: dict[str, dict[str, Any]], problems: list[str]) -> None:
        """Store ``rows`` (key → row) and the trees' problems in place of what was stored. Only for a
        ``usable`` cache."""
        data = json.dumps({"format": FORMAT, "rows": rows, "problems": problems}).encode()
        if len(data) <= cache.MAX_BYTES:
            cache.write_private(self.name, data)


class _Stored(msgspec.Struct):
    format: str
    rows: dict[str, Row]
    problems: list[str]
