"""``patchkit retarget``'s edits of a manifest as a round-trip YAML document (ruamel.yaml); used by
``patchkit.review.retarget`` only (its names are private to that pair).

- read and write: ``_load(text, file)`` → a ``CommentedMap`` (``RetargetError`` when the text is not a
  mapping), ``_dump(doc)`` → text in the manifests' layout (two-space mappings, list items indented two spaces,
  no line wrapping, quotes as written, ``null`` for None);
- find: ``_entries(doc)`` → entry id (``require:<target>``, ``workers``) → (mapping, list, index) for the
  entries the file itself writes;
- edit: ``_set`` (a changed value is written double-quoted and loses its end-of-line comment), ``_flag``
  (``# REVIEW:`` lines above an entry's key), ``_override`` (pin a fingerprint on an inherited entry's
  override, made if absent), ``_set_pin``/``_rename_release`` (the ``vllm:`` pin and the header),
  ``_drop_review_lines``, ``_append`` (to a section, moving the trailing comments), ``_absorb`` (bring a
  reviewed file up to date with the source: added entries and top-level keys, notes for differing fields).

It decides nothing (which entries need review is ``retarget.retarget_text``'s job) and never reads a tree.
Limits: those of ruamel.yaml's round trip, stated in ``patchkit.review.retarget``'s docstring (re-indentation
to the layout above, a flow mapping's end-of-line comment moved one space after it, an anchor left as it was
when the value given through its alias changes).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from patchkit.plan import WORKERS_ENTRY_ID, PatchkitError

REVIEW_MARK = "# REVIEW:"


class RetargetError(PatchkitError):
    """Bad input for ``retarget``: the message is one line for the user."""


_SECTIONS = {"patches": "id", "requires": "target", "models": "arch"}  # list sections and the key naming an entry
_ITEM_INDENT, _KEY_INDENT = 2, 4  # where a section's "- " and its items' keys start (the layout _yaml() writes)


def _yaml() -> Any:
    """ruamel.yaml in round-trip mode with the manifests' layout: two-space mappings, list items indented two
    spaces (``  - id: …``), no line wrapping, quotes as written, ``None`` written ``null``."""
    from ruamel.yaml import YAML

    rt = YAML(typ="rt")
    rt.preserve_quotes = True
    rt.width = 1 << 16
    rt.indent(mapping=2, sequence=4, offset=2)
    rt.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    return rt


def _load(text: str, file: str) -> Any:
    """The round-trip document of a manifest's text (a ``CommentedMap``); ``RetargetError`` if it is not one."""
    from ruamel.yaml import YAMLError
    from ruamel.yaml.comments import CommentedMap

    try:
        doc = _yaml().load(text)
    except YAMLError as exc:  # parse() already accepted the text; this is a safety net
        raise RetargetError(f"{file}: invalid YAML: {exc}") from None
    if not isinstance(doc, CommentedMap):
        raise RetargetError(f"{file}: a manifest is a mapping")
    return doc


def _dump(doc: Any) -> str:
    """The text of a round-trip document, in the layout of ``_yaml()``."""
    import io

    out = io.StringIO()
    _yaml().dump(doc, out)
    return out.getvalue()


def _entries(doc: Any) -> dict[str, tuple[Any, Any, int]]:
    """Entry id (``require:<target>`` for a requirement, ``workers``) → (its mapping, the list holding it or
    None, its index there) for the entries this file itself writes."""
    out: dict[str, tuple[Any, Any, int]] = {}
    for section, prefix in (("patches", ""), ("requires", "require:")):
        items = doc.get(section)
        for i, item in enumerate(items if isinstance(items, list) else []):
            key = item.get(_SECTIONS[section]) if isinstance(item, dict) else None
            if isinstance(key, str):
                out[prefix + key] = (item, items, i)
    if isinstance(doc.get("workers"), dict):
        out[WORKERS_ENTRY_ID] = (doc["workers"], None, 0)
    return out


def _tokens(node: Any) -> Iterator[Any]:
    """Every comment token held by ``node`` and the collections under it."""
    from ruamel.yaml.comments import CommentedBase
    from ruamel.yaml.tokens import CommentToken

    todo = [node]
    while todo:
        n = todo.pop()
        if isinstance(n, CommentToken):
            yield n
        elif isinstance(n, CommentedBase):
            todo.extend([n.ca.comment or [], n.ca.end or [], *n.ca.items.values()])
            todo.extend(n.values() if isinstance(n, dict) else n)
        elif isinstance(n, list):  # a slot list of ``ca``
            todo.extend(x for x in n if x is not None)


def _drop_review_lines(doc: Any) -> None:
    """Delete every ``# REVIEW:`` comment line (about another tree). Text of a block scalar is content, never
    a comment token, so a ``# REVIEW:`` inside one stays."""
    for token in _tokens(doc):
        lines = token.value.splitlines(keepends=True)
        kept = [ln for ln in lines if not ln.lstrip().startswith(REVIEW_MARK)]
        if len(kept) != len(lines):
            token.value = "".join(kept)


def _set(mapping: Any, key: str, value: str | None) -> None:
    """``mapping[key] = value`` as a double-quoted string or ``null``; an equal value is left as written.

    A changed value loses the comment at the end of its line: it was about the old value."""
    from ruamel.yaml.scalarstring import DoubleQuotedScalarString

    if mapping.get(key) == value:
        return
    mapping[key] = None if value is None else DoubleQuotedScalarString(value)
    slot = mapping.ca.items.get(key)
    if slot and slot[2] is not None and not slot[2].value.startswith("\n"):
        slot[2].value = "\n" + slot[2].value.partition("\n")[2]


def _comment_above(container: Any, key: str | int, lines: list[str], indent: int) -> None:
    """Put ``lines`` (``# …``) on the lines above ``key`` of a mapping (or item ``key`` of a list), at ``indent``."""
    container.yaml_set_comment_before_after_key(key, before="\n".join(ln[2:] for ln in lines), indent=indent)


def _flag(where: tuple[Any, Any, int] | None, anchors: tuple[str, ...], lines: list[str]) -> None:
    """Put ``lines`` above the first of ``anchors`` the entry has; above the entry itself where that key opens a
    list item (or the entry has none of them)."""
    if where is None:
        return
    mapping, items, index = where
    key = next((k for k in anchors if k in mapping), None)
    if items is not None and (key is None or key == next(iter(mapping))):
        _comment_above(items, index, lines, _ITEM_INDENT)
    elif key is not None:
        _comment_above(mapping, key, lines, _KEY_INDENT if items is not None else _ITEM_INDENT)


def _tail(node: Any) -> Any:
    """The comment token after the last value of a block collection (its trailing comments and blank lines)."""
    from ruamel.yaml.comments import CommentedBase

    while isinstance(node, CommentedBase) and len(node) and not node.fa.flow_style():
        last = next(reversed(node)) if isinstance(node, dict) else len(node) - 1
        value = node[last]
        if isinstance(value, CommentedBase) and len(value) and not value.fa.flow_style():
            node = value
            continue
        slot = node.ca.items.get(last)
        index = 2 if isinstance(node, dict) else 0
        return slot[index] if slot and len(slot) > index else None
    return None


def _append(doc: Any, section: str, item: Any) -> None:
    """Append ``item`` (complete) to list ``section``, creating the section at the end of the file if needed.
    The comments and blank lines that followed the old last item now follow ``item``."""
    from ruamel.yaml.comments import CommentedSeq
    from ruamel.yaml.error import CommentMark
    from ruamel.yaml.tokens import CommentToken

    items = doc.get(section)
    if not isinstance(items, list):
        doc[section] = items = CommentedSeq()
    items.fa.set_block_style()
    previous = _tail(items)
    if previous is not None:
        eol, newline, rest = previous.value.partition("\n")
        if rest:
            previous.value = eol + newline
            key = next(reversed(item))
            item.ca.items[key] = [None, None, CommentToken("\n" + rest, CommentMark(0)), None]
    items.append(item)


def _override(doc: Any, entries: dict[str, tuple[Any, Any, int]], entry: Any, comments: list[str],
              fingerprint: str | None) -> None:
    """Pin ``fingerprint`` (with ``comments`` above it) for an entry this release file inherits: on the file's
    own override of that entry (which sets other fields), else on a new override ``- id: …`` / ``- target: …``
    / ``workers:`` appended to its section. ``fingerprint`` None (the entry pins none): only ``comments``, above
    the override, which then names the entry alone (a patch or requirement; never ``workers``)."""
    from ruamel.yaml.comments import CommentedMap

    where = entries.get(entry.id)
    if where is None:
        mapping = CommentedMap()
        if entry.op == "workers":
            _set(mapping, "fingerprint", fingerprint)
            doc["workers"] = mapping
            where = (mapping, None, 0)
        else:
            section = "requires" if entry.op == "require" else "patches"
            mapping[_SECTIONS[section]] = entry.target if section == "requires" else entry.id
            if fingerprint is not None:
                _set(mapping, "fingerprint", fingerprint)
            _append(doc, section, mapping)
            where = (mapping, doc[section], len(doc[section]) - 1)
        entries[entry.id] = where
    elif fingerprint is not None:
        _set(where[0], "fingerprint", fingerprint)
    if comments:
        _flag(where, ("fingerprint", "target", "at"), comments)


def _set_pin(doc: Any, version: str, commit: str | None) -> None:
    """Set ``vllm.version`` and ``vllm.commit`` (inserted after ``version`` where absent and not null)."""
    pin = doc["vllm"]
    _set(pin, "version", version)
    if "commit" in pin:
        _set(pin, "commit", commit)
    elif commit is not None:  # absent means null
        pin.insert(list(pin).index("version") + 1, "commit", None)
        _set(pin, "commit", commit)


def _release(spec: str | None) -> str | None:
    """The release an ``==X`` pin names (``X``), else None."""
    return spec[2:].strip() if spec and spec.startswith("==") and "," not in spec else None


def _rename_release(doc: Any, old: str | None, new: str | None) -> None:
    """In the comment lines above the first key (the file's header), name release ``new`` where ``old`` stood."""
    if not old or not new or old == new:
        return
    for token in _tokens(doc.ca.comment or []):
        token.value = re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w])", new, token.value)


_RELEASE_OWN = {"fingerprint", "reviewed"}  # an entry's fields that belong to the release file, not the source


def _absorb(doc: Any, source: Any) -> tuple[set[str], list[str]]:
    """Add to the reviewed document ``doc`` what the source manifest has and it lacks: top-level keys, and
    list entries (patches by id, requires by target, models by arch), appended at the end of their section.
    Returns (the entry ids added, notes naming each entry both have whose fields other than ``fingerprint`` and
    ``reviewed``, which are the release's own, differ: the reviewed file's values are kept)."""
    added: set[str] = set()
    notes: list[str] = []
    for key, value in source.items():
        if key not in doc:
            doc[key] = value
            added.update(_entries({key: value}))
            continue
        if key not in _SECTIONS or not isinstance(value, list) or not isinstance(doc[key], list):
            continue
        name = _SECTIONS[key]
        have = {item.get(name): item for item in doc[key] if isinstance(item, dict)}
        for item in value:
            ident = item.get(name) if isinstance(item, dict) else None
            if ident not in have:
                _append(doc, key, item)
                added.update(_entries({key: [item]}))
                continue
            differ = sorted(f for f in {*item, *have[ident]} - _RELEASE_OWN if item.get(f) != have[ident].get(f))
            if differ:
                notes.append(f"{key} {ident}: the reviewed file's {', '.join(differ)} kept (the source differs)")
    return added, notes
