"""``--afd-*`` flags: parser group, mapping into additional_config["afd"], clashes, no-flag passthrough.

Runs on a plain ``argparse`` parser and a fake ``EngineArgs``-like dataclass (no vLLM
import); the last tests apply the two wrappers through patchkit to a throwaway module
shaped like ``vllm.engine.arg_utils`` to show the staticmethod / classmethod descriptors
survive and that a subclass (``AsyncEngineArgs``) inherits the wrapped ``from_cli_args``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import patchkit
from afd_patches.config import AfdConfigError, parse
from afd_patches.patches import cli_flags
from afd_patches.patches.cli_flags import AfdCliError, add_afd_cli_args, afd_from_cli_args, apply_flags
from patchkit.plan import Runtime
from tests.support.manifests import header


@dataclasses.dataclass
class FakeEngineArgs:
    """The shape of vLLM's EngineArgs that the wrappers rely on."""

    model: str = "m"
    additional_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--model", default="m")
        parser.add_argument("--additional-config", dest="additional_config", type=json.loads, default={})
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> FakeEngineArgs:
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})


def _parser() -> argparse.ArgumentParser:
    return add_afd_cli_args(FakeEngineArgs.add_cli_args, argparse.ArgumentParser(prog="t"))


def _engine_args(argv: list[str]) -> tuple[argparse.Namespace, FakeEngineArgs]:
    args = _parser().parse_args(argv)
    return args, afd_from_cli_args(FakeEngineArgs.from_cli_args.__func__, FakeEngineArgs, args)


ALL_FLAGS = ["--afd-role", "--afd-connector", "--afd-host", "--afd-port", "--afd-num-attention-ranks",
             "--afd-num-ffn-ranks", "--afd-rank", "--afd-timeout-s", "--afd-hold-s", "--afd-token-file",
             "--afd-cpu-cores"]


@pytest.fixture(autouse=True)
def _metrics_dir(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An AFD front end exports metrics through a directory named in the environment; give it one here,
    so these tests neither create one nor register a collector in this process."""
    monkeypatch.setenv("AFD_METRICS_DIR", str(tmp_path))


def test_group_lists_every_flag_in_help() -> None:
    parser = _parser()
    group = next(g for g in parser._action_groups if g.title == "AFD")
    assert [a.option_strings[0] for a in group._group_actions] == ALL_FLAGS
    text = parser.format_help()
    for flag in ALL_FLAGS:
        assert flag in text
    assert "None" not in text.split("AFD:", 1)[1], "a flag not given must not advertise a None default"


def test_no_flag_leaves_namespace_and_config_untouched() -> None:
    args = _parser().parse_args(["--model", "x", "--additional-config", '{"other": 1}'])
    assert apply_flags(args) is args
    _, ea = _engine_args(["--model", "x", "--additional-config", '{"other": 1}'])
    assert ea.additional_config == {"other": 1}
    _, plain = _engine_args([])
    assert plain.additional_config == {}


def test_flags_map_to_afd_keys_with_types() -> None:
    _, ea = _engine_args(["--afd-role", "ffn", "--afd-connector", "torch_dist", "--afd-host", "127.0.0.1",
                          "--afd-port", "29700", "--afd-num-attention-ranks", "2", "--afd-num-ffn-ranks", "1",
                          "--afd-rank", "0", "--afd-timeout-s", "30.5"])
    assert ea.additional_config == {"afd": {
        "role": "ffn", "connector": "torch_dist", "host": "127.0.0.1", "port": 29700,
        "num_attention_ranks": 2, "num_ffn_ranks": 1, "rank": 0, "timeout_s": 30.5}}
    assert parse(ea.additional_config["afd"]).port == 29700  # what the flags produce is a valid AFD config


def test_flags_combine_with_additional_config_json() -> None:
    args, ea = _engine_args(["--afd-role", "attention", "--afd-port", "29701", "--additional-config",
                             '{"afd": {"connector_extra_config": {"k": 1}, "timeout_s": 9}, "other": true}'])
    assert ea.additional_config == {"other": True, "afd": {
        "connector_extra_config": {"k": 1}, "timeout_s": 9, "role": "attention", "port": 29701}}
    assert args.additional_config == {"afd": {"connector_extra_config": {"k": 1}, "timeout_s": 9}, "other": True}


def test_additional_config_alone_keeps_working() -> None:
    _, ea = _engine_args(["--additional-config", '{"afd": {"role": "ffn", "port": 29702}}'])
    assert ea.additional_config == {"afd": {"role": "ffn", "port": 29702}}


@pytest.mark.parametrize(("json_key", "flag", "value"), [
    ("role", "--afd-role", "ffn"), ("afd_role", "--afd-role", "ffn"),
    ("port", "--afd-port", "29703"), ("afd_port", "--afd-port", "29703"),
    ("timeout_s", "--afd-timeout-s", "5"), ("num_ffn_ranks", "--afd-num-ffn-ranks", "1"),
])
def test_same_key_both_ways_names_flag_and_key(json_key: str, flag: str, value: str) -> None:
    other = json.dumps({"afd": {json_key: json.loads(value) if value.isdigit() else value}})
    with pytest.raises(AfdCliError) as info:
        _engine_args([flag, value, "--additional-config", other])
    message = str(info.value)
    assert flag in message and f'["{json_key}"]' in message
    assert isinstance(info.value, AfdConfigError)


def test_afd_config_that_is_not_a_mapping_is_an_error() -> None:
    with pytest.raises(AfdCliError, match="must be a mapping"):
        _engine_args(["--afd-role", "ffn", "--additional-config", '{"afd": "yes"}'])


def test_namespace_is_not_mutated_so_a_second_call_agrees() -> None:
    args = _parser().parse_args(["--afd-role", "ffn", "--additional-config", '{"afd": {"port": 29704}}'])
    before = json.dumps(vars(args), sort_keys=True)
    original = FakeEngineArgs.from_cli_args.__func__
    first = afd_from_cli_args(original, FakeEngineArgs, args)
    second = afd_from_cli_args(original, FakeEngineArgs, args)
    assert json.dumps(vars(args), sort_keys=True) == before
    assert first.additional_config == second.additional_config == {"afd": {"port": 29704, "role": "ffn"}}


@pytest.mark.parametrize("argv", [["--afd-role", "both"], ["--afd-port", "abc"], ["--afd-timeout-s", "x"]])
def test_bad_values_are_argparse_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def test_adding_the_group_twice_is_harmless() -> None:
    parser = _parser()
    first = next(g for g in parser._action_groups if g.title == "AFD")
    assert cli_flags.add_afd_arguments(parser) is first
    assert sum(g.title == "AFD" for g in parser._action_groups) == 1


def test_string_additional_config_is_accepted() -> None:
    ns = argparse.Namespace(model="m", additional_config='{"x": 1}', afd_role="ffn")
    assert apply_flags(ns).additional_config == {"x": 1, "afd": {"role": "ffn"}}


ARG_UTILS = {
    "fakevllm/__init__.py": "",
    "fakevllm/arg_utils.py": '''
        import argparse
        import dataclasses
        import json


        @dataclasses.dataclass
        class EngineArgs:
            model: str = "m"
            additional_config: dict = dataclasses.field(default_factory=dict)

            @staticmethod
            def add_cli_args(parser):
                parser.add_argument("--model", default="m")
                parser.add_argument("--additional-config", dest="additional_config", type=json.loads, default={})
                return parser

            @classmethod
            def from_cli_args(cls, args):
                names = [f.name for f in dataclasses.fields(cls)]
                return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})


        @dataclasses.dataclass
        class AsyncEngineArgs(EngineArgs):
            @staticmethod
            def add_cli_args(parser):
                return EngineArgs.add_cli_args(parser)
    ''',
}

MANIFEST = header("clitest", "afd_patches") + """
patches:
  - {id: flags, target: "fakevllm.arg_utils:EngineArgs.add_cli_args", op: wrap,
     with: "afd_patches.patches.cli_flags:add_afd_cli_args", rebind: none, why: t}
  - {id: to-config, target: "fakevllm.arg_utils:EngineArgs.from_cli_args", op: wrap,
     with: "afd_patches.patches.cli_flags:afd_from_cli_args", rebind: none, why: t}
"""


def test_wrappers_applied_by_patchkit_keep_descriptors_and_reach_the_subclass(
        sandbox: Callable[..., Path], manifest_dir: Callable[[str], Path], runtime: Runtime) -> None:
    sandbox(ARG_UTILS)
    au = importlib.import_module("fakevllm.arg_utils")
    status = patchkit.activate("clitest", manifest_dir(MANIFEST), runtime)
    assert status.active, status.problem
    assert isinstance(vars(au.EngineArgs)["add_cli_args"], staticmethod)
    assert isinstance(vars(au.EngineArgs)["from_cli_args"], classmethod)
    parser = au.AsyncEngineArgs.add_cli_args(argparse.ArgumentParser(prog="t"))
    args = parser.parse_args(["--afd-role", "attention", "--afd-rank", "1", "--afd-num-attention-ranks", "2"])
    ea = au.AsyncEngineArgs.from_cli_args(args)
    assert type(ea) is au.AsyncEngineArgs
    assert ea.additional_config == {"afd": {"role": "attention", "rank": 1, "num_attention_ranks": 2}}
    plain = au.AsyncEngineArgs.from_cli_args(parser.parse_args([]))
    assert plain.additional_config == {}
