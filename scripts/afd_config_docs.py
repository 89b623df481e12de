"""What is generated from ``AfdConfig`` (``afd_patches.config.keys``): the JSON Schema and the docs' key tables.

    python -m scripts.afd_config_docs [--check]

Writes ``schemas/afd-config.schema.json`` (the keys, types and bounds ``afd_patches.config.parse`` and
``restore`` check, for editors and other tools) and the tables between the ``afd-config`` and
``afd-link-config`` markers of docs/running.md ("Settings": the keys, then those of
``connector_extra_config``, ``afd_patches.config.LinkConfig``). ``--check`` writes nothing and exits 1 when
either file differs from what it would write (tests/afd/test_config_source.py asserts the same). The
``--afd-*`` flags are generated at run time (``afd_patches.patches.cli_flags.flags``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from afd_patches.config import Key, keys

REPO = Path(__file__).resolve().parents[1]
SCHEMA = REPO / "schemas" / "afd-config.schema.json"
DOC = REPO / "docs" / "running.md"
BEGIN = "<!-- afd-config: generated from afd_patches.config.AfdConfig by `python -m scripts.afd_config_docs` -->"
END = "<!-- afd-config: end -->"
LINK_BEGIN = ("<!-- afd-link-config: generated from afd_patches.config.LinkConfig by "
              "`python -m scripts.afd_config_docs` -->")
LINK_END = "<!-- afd-link-config: end -->"
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object"}


def value_schema(key: Key) -> dict[str, Any]:
    """The JSON Schema of ``key``'s value: its type (an enum for choices) and its declared keywords; a nested
    config's keys as its ``properties`` (no others allowed)."""
    kind: dict[str, Any] = {"enum": list(key.choices)} if key.choices else {"type": JSON_TYPES[key.kind]}
    nested = {"additionalProperties": False, "properties": _properties(key.keys)} if key.keys else {}
    return {**kind, **key.schema, **nested}


def _properties(declared: tuple[Key, ...]) -> dict[str, Any]:
    """Each key (its help the description, its default where it has one) and, right after it, its alias."""
    properties: dict[str, Any] = {}
    for key in declared:
        default = {} if key.default is None else {"default": key.default}
        properties[key.name] = {"description": key.doc, **value_schema(key), **default}
        if key.alias:
            properties[key.alias] = {"description": f"Alias of {key.name!r}.", **value_schema(key)}
    return properties


def schema() -> dict[str, Any]:
    """The JSON Schema of ``additional_config["afd"]`` (``_properties``). No key is required here: ``parse``
    names a missing ``role`` itself."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "afd-plugin:afd-config.schema.json",
        "title": 'additional_config["afd"]',
        "description": "Attention-FFN Disaggregation settings. Present means AFD is on for this engine.",
        "type": "object",
        "additionalProperties": False,
        "properties": _properties(keys()),
    }


def schema_text() -> str:
    return json.dumps(schema(), indent=2, ensure_ascii=False) + "\n"


def _type(key: Key) -> str:
    """``key``'s type as the table shows it, with a numeric range where it declares one."""
    if key.choices:
        return " or ".join(f"`{c}`" for c in key.choices)
    low, high, above = (key.schema.get(k) for k in ("minimum", "maximum", "exclusiveMinimum"))
    top = f"{high:.0f}" if isinstance(high, float) else high
    bound = f" {low}–{top}" if low is not None and high is not None else (
        f" > {above}, ≤ {top}" if above is not None and high is not None else
        f" ≥ {low}" if low is not None else f" > {above}" if above is not None else "")
    return JSON_TYPES[key.kind] + bound


def _default(key: Key) -> str:
    return "required" if key.required else "unset" if key.shown_default is None else f"`{key.shown_default}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table() -> str:
    """The Markdown table of every key, between the markers (both included)."""
    rows = [BEGIN, "| `--afd-*` flag | `additional_config[\"afd\"]` key | type | default | meaning |",
            "|---|---|---|---|---|"]
    for key in keys():
        flag = "—" if key.flag is None else f"`{key.flag} {key.metavar or '{' + ','.join(key.choices or ()) + '}'}`"
        name = f"`{key.name}`" + (f" (alias `{key.alias}`)" if key.alias else "")
        rows.append(f"| {flag} | {name} | {_type(key)} | {_default(key)} | {_cell(key.doc)} |")
    return "\n".join([*rows, END])


def link_table() -> str:
    """The Markdown table of ``connector_extra_config``'s keys, between its markers (both included)."""
    link = next(key for key in keys() if key.keys)
    rows = [LINK_BEGIN, f"| `{link.name}` key | type | default | meaning |", "|---|---|---|---|"]
    rows += [f"| `{key.name}` | {_type(key)} | {_default(key)} | {_cell(key.doc)} |" for key in link.keys]
    return "\n".join([*rows, LINK_END])


def _replace(current: str, begin: str, end: str, text: str) -> str:
    head, found_begin, rest = current.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found_begin or not found_end:
        raise SystemExit(f"{DOC}: the markers {begin!r} ... {end!r} are missing")
    return head + text + tail


def doc_text(current: str) -> str:
    """``current`` (docs/running.md) with the text between each pair of markers replaced by ``table()`` and
    ``link_table()``."""
    return _replace(_replace(current, BEGIN, END, table()), LINK_BEGIN, LINK_END, link_table())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file is stale")
    args = parser.parse_args(argv)
    stale = []
    for path, text in ((SCHEMA, schema_text()), (DOC, doc_text(DOC.read_text()))):
        if path.read_text() != text:
            stale.append(path.relative_to(REPO))
            if not args.check:
                path.write_text(text)
    if stale:
        print(("stale: " if args.check else "rewrote: ") + ", ".join(map(str, stale)))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
