"""What is generated from ``AfdConfig`` (``afd_patches.config.keys``): the JSON Schema and the docs' key table.

    python -m scripts.afd_config_docs [--check]

Writes ``schemas/afd-config.schema.json`` (what ``afd_patches.config.parse`` validates against) and the
table between the ``afd-config`` markers of docs/running.md ("Settings"). ``--check`` writes nothing and
exits 1 when either file differs from what it would write (tests/afd/test_config_source.py asserts the
same). The ``--afd-*`` flags are generated at run time (``afd_patches.patches.cli_flags.flags``).

Limits: only ``AfdConfig``'s own keys; ``connector_extra_config``'s keys are the connector's
(``afd_patches.connectors.options``) and keep their hand-written table below the generated one.
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
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object"}


def value_schema(key: Key) -> dict[str, Any]:
    """The JSON Schema of ``key``'s value: its type (an enum for choices) and its declared keywords."""
    kind: dict[str, Any] = {"enum": list(key.choices)} if key.choices else {"type": JSON_TYPES[key.kind]}
    return {**kind, **key.schema}


def schema() -> dict[str, Any]:
    """The JSON Schema of ``additional_config["afd"]``: each key (its help the description, its default where it
    has one) and, right after it, its alias. No key is required here: ``parse`` names a missing ``role`` itself."""
    properties: dict[str, Any] = {}
    for key in keys():
        default = {} if key.default is None else {"default": key.default}
        properties[key.name] = {"description": key.doc, **value_schema(key), **default}
        if key.alias:
            properties[key.alias] = {"description": f"Alias of {key.name!r}.", **value_schema(key)}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "afd-plugin:afd-config.schema.json",
        "title": 'additional_config["afd"]',
        "description": "Attention-FFN Disaggregation settings. Present means AFD is on for this engine.",
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
    }


def schema_text() -> str:
    return json.dumps(schema(), indent=2, ensure_ascii=False) + "\n"


def _type(key: Key) -> str:
    """``key``'s type as the table shows it, with a numeric range where it declares one."""
    if key.choices:
        return " or ".join(f"`{c}`" for c in key.choices)
    low, high, above = (key.schema.get(k) for k in ("minimum", "maximum", "exclusiveMinimum"))
    bound = f" {low}–{high}" if low is not None and high is not None else (
        f" ≥ {low}" if low is not None else f" > {above}" if above is not None else "")
    return JSON_TYPES[key.kind] + bound


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table() -> str:
    """The Markdown table of every key, between the markers (both included)."""
    rows = [BEGIN, "| `--afd-*` flag | `additional_config[\"afd\"]` key | type | default | meaning |",
            "|---|---|---|---|---|"]
    for key in keys():
        flag = "—" if key.flag is None else f"`{key.flag} {key.metavar or '{' + ','.join(key.choices or ()) + '}'}`"
        name = f"`{key.name}`" + (f" (alias `{key.alias}`)" if key.alias else "")
        default = "required" if key.required else "unset" if key.shown_default is None else f"`{key.shown_default}`"
        rows.append(f"| {flag} | {name} | {_type(key)} | {default} | {_cell(key.doc)} |")
    return "\n".join([*rows, END])


def doc_text(current: str) -> str:
    """``current`` (docs/running.md) with the text between the markers replaced by ``table()``."""
    head, begin, rest = current.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"{DOC}: the afd-config markers are missing")
    return head + table() + tail


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
