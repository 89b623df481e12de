"""One source for the AFD config: ``AfdConfig`` declares every key; the JSON Schema, the ``--afd-*`` flags and
docs/running.md's key table are generated from it (``python -m scripts.afd_config_docs``) and agree."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from typing import Any

import pytest

from afd_patches.config import ALIASES, AfdConfig, AfdConfigError, LinkConfig, keys, parse
from afd_patches.patches import cli_flags
from scripts import afd_config_docs


def test_committed_schema_and_table_are_what_the_dataclass_generates() -> None:
    assert afd_config_docs.SCHEMA.read_text() == afd_config_docs.schema_text(), (
        "schemas/afd-config.schema.json is stale: run `python -m scripts.afd_config_docs` and commit the result")
    current = afd_config_docs.DOC.read_text()
    assert afd_config_docs.doc_text(current) == current, (
        "docs/running.md's key table is stale: run `python -m scripts.afd_config_docs` and commit the result")
    assert afd_config_docs.main(["--check"]) == 0


def test_keys_aliases_and_flags_are_the_released_ones() -> None:
    """The declaration moved; what a user can write did not (but for hold_s, added with issue 53)."""
    assert [k.name for k in keys()] == [f.name for f in fields(AfdConfig)] == [
        "role", "connector", "host", "port", "num_attention_ranks", "num_ffn_ranks", "rank", "timeout_s", "hold_s",
        "connector_extra_config", "token_file", "allow_unauthenticated", "cpu_cores", "compile_ffn"]
    assert all(k.name.endswith("_s") for k in (*keys(), *keys(LinkConfig)) if k.kind is float), (
        "parse names every float key seconds")
    assert ALIASES == {"afd_role": "role", "afd_connector": "connector", "afd_host": "host", "afd_port": "port"}
    assert [f.option for f in cli_flags.flags()] == [
        "--afd-role", "--afd-connector", "--afd-host", "--afd-port", "--afd-num-attention-ranks",
        "--afd-num-ffn-ranks", "--afd-rank", "--afd-timeout-s", "--afd-hold-s", "--afd-token-file",
        "--afd-cpu-cores"]
    assert [k.name for k in keys(LinkConfig)] == [f.name for f in fields(LinkConfig)] == [
        "backend", "device", "idle_timeout_s", "inline_bytes", "schedule", "data_port", "advertise", "micro_batches",
        "micro_batch_min_tokens"]
    assert not any(k.flag or k.alias for k in keys(LinkConfig)), "connector_extra_config has no flags, no aliases"


def test_schema_flags_and_table_agree_with_the_dataclass() -> None:
    defaults = AfdConfig(role="attention")
    properties = json.loads(afd_config_docs.SCHEMA.read_text())["properties"]
    assert set(properties) == {k.name for k in keys()} | set(ALIASES)
    parser = argparse.ArgumentParser()
    group = cli_flags.add_afd_arguments(parser)
    actions = {a.option_strings[0]: a for a in group._group_actions}
    assert list(actions) == [k.flag for k in keys() if k.flag]
    rows = afd_config_docs.table().splitlines()[3:-1]
    assert len(rows) == len(keys())
    for key, row in zip(keys(), rows, strict=True):
        assert key.doc, f"AfdConfig.{key.name} has no string under it"
        prop = properties[key.name]
        assert prop["description"] == key.doc
        assert prop.get("default") == key.default
        assert ("enum" in prop) == bool(key.choices) and prop.get("enum", list(key.choices or ())) == list(
            key.choices or ())
        if key.alias:
            assert {k: v for k, v in properties[key.alias].items() if k != "description"} == {
                k: v for k, v in prop.items() if k not in ("description", "default")}
        if key.keys:  # a nested config: its defaults are its keys' ({} in the schema)
            assert getattr(defaults, key.name) == LinkConfig() and key.default == {}
        elif not key.required:
            assert getattr(defaults, key.name) == key.default
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[1].startswith(f"`{key.name}`") and cells[4] == key.doc.replace("|", "\\|")
        if key.flag is None:
            assert cells[0] == "—"
            continue
        action = actions.pop(key.flag)
        assert cells[0].startswith(f"`{key.flag} ")
        assert action.dest == f"afd_{key.name}" and action.default is argparse.SUPPRESS
        assert action.type is key.kind and action.choices == (list(key.choices) if key.choices else None)
        assert action.help is not None and action.help.replace("%%", "%").startswith(key.doc.removesuffix("."))
        assert (key.shown_default is None) == ("(default: " not in action.help)
    assert not actions


def test_the_link_keys_schema_and_table_agree_with_their_dataclass() -> None:
    """``connector_extra_config``'s keys are declared once (``LinkConfig``): the schema's properties (no others
    allowed) and the docs' sub-table are generated from that declaration."""
    link = json.loads(afd_config_docs.SCHEMA.read_text())["properties"]["connector_extra_config"]
    assert link["type"] == "object" and link["additionalProperties"] is False and link["default"] == {}
    nested = next(k for k in keys() if k.keys)
    assert nested.name == "connector_extra_config" and nested.keys == keys(LinkConfig)
    assert list(link["properties"]) == [k.name for k in keys(LinkConfig)]
    rows = afd_config_docs.link_table().splitlines()[3:-1]
    defaults = LinkConfig()
    for key, row in zip(keys(LinkConfig), rows, strict=True):
        assert key.doc, f"LinkConfig.{key.name} has no string under it"
        prop = link["properties"][key.name]
        assert prop["description"] == key.doc and prop.get("default") == key.default
        assert {k: v for k, v in prop.items() if k not in ("description", "default", "type", "enum")} == key.schema
        assert getattr(defaults, key.name) == key.default
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[0] == f"`{key.name}`" and cells[3] == key.doc.replace("|", "\\|")
    assert len(rows) == len(keys(LinkConfig))


def _below(key: Any) -> Any:
    """A value just outside ``key``'s declared range, or None when it declares none."""
    if "minimum" in key.schema:
        return key.schema["minimum"] - 1
    if "exclusiveMinimum" in key.schema:
        return key.schema["exclusiveMinimum"]
    if "minLength" in key.schema:
        return ""
    return None


def _above(key: Any) -> Any:
    """A value just above ``key``'s declared maximum, or None when it declares none."""
    if "maximum" not in key.schema:
        return None
    return key.schema["maximum"] + (1 if key.kind is int else key.schema["maximum"] * 1e-9)


def _raw(key: Any, value: Any) -> dict[str, Any]:
    """A config that is valid but for ``key`` (a top-level key, or one of connector_extra_config's)."""
    if key in keys():
        return {"role": "ffn", key.name: value}
    return {"role": "ffn", "connector_extra_config": {key.name: value}}


def _path(key: Any) -> str:
    return rf'\["{key.name}"\]' if key in keys() else rf'\["connector_extra_config"\]\["{key.name}"\]'


ALL_KEYS = [*keys(), *keys(LinkConfig)]


@pytest.mark.parametrize("key", [k for k in ALL_KEYS if _below(k) is not None], ids=lambda k: k.name)
def test_parse_enforces_each_declared_constraint_naming_the_key(key: Any) -> None:
    with pytest.raises(AfdConfigError, match=rf'^additional_config\["afd"\]{_path(key)}: '):
        parse(_raw(key, _below(key)))


@pytest.mark.parametrize("key", [k for k in ALL_KEYS if _above(k) is not None], ids=lambda k: k.name)
def test_parse_enforces_each_declared_maximum_naming_the_key_and_the_bound(key: Any) -> None:
    top = key.schema["maximum"]
    shown = f"{top:.0f}" if isinstance(top, float) else str(top)
    with pytest.raises(AfdConfigError, match=rf'^additional_config\["afd"\]{_path(key)}: .* is greater than the '
                                             rf"maximum of {shown}\b"):
        parse(_raw(key, _above(key)))
