"""``--afd-*`` command-line flags for vLLM's argument parser (``vllm serve``, the API server, …).

Two wrappers, both declared in the manifest:

- ``add_afd_cli_args`` wraps ``EngineArgs.add_cli_args`` (a staticmethod) and adds an
  ``AFD`` argument group: one flag per ``AfdConfig`` key that declares one (``afd_patches.config.keys``:
  ``--afd-<key with dashes>``, its type, choices, metavar and help, which shows the key's default).
  ``--afd-token-file`` is a path; the secret itself is never a command-line value, so it does not
  show in ``ps``. A flag not given leaves no attribute on the namespace (``argparse.SUPPRESS``), so
  ``--help`` shows AFD's own defaults, not ``None``.
- ``afd_from_cli_args`` wraps ``EngineArgs.from_cli_args`` (a classmethod) and maps the
  given flags into ``additional_config["afd"]``.

Contract:

- No ``--afd-*`` flag given → the namespace reaches vLLM untouched (a plain run is unchanged).
- Flags given → their values are merged into ``additional_config["afd"]`` (created if
  absent); ``--additional-config '{"afd": {...}}'`` keeps working and both forms combine.
- The same key both ways (its alias counts: ``afd_role`` for ``--afd-role``) is an
  ``AfdCliError`` naming the flag and the key.
- The caller's namespace is never mutated: vLLM gets a copy, so a second
  ``from_cli_args`` on the same namespace sees the same input (and no false conflict).
- Values are only type-checked here (``choices``/``int``/``float``); the full check
  (topology, connector name, ranges) is ``afd_patches.config.parse``, run later by
  ``validate_afd_config`` in the same process, before any engine process starts.

Limits: the flags exist only where vLLM's plugin hook ran before the parser was built
(``AsyncEngineArgs.add_cli_args`` calls it first, so every vLLM entry point that builds
its parser that way has them); a parser built from ``EngineArgs.add_cli_args`` in a
process that never loaded the plugins lacks them. ``connector_extra_config`` has no flag:
pass it with ``--additional-config``.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable, Mapping
from typing import Any

from afd_patches import CONFIG_KEY, AfdConfigError

GROUP_TITLE = "AFD"
GROUP_DESCRIPTION = (
    "Attention-FFN Disaggregation (afd-plugin). Giving any --afd-* flag turns AFD on for this engine "
    'and fills additional_config["afd"]; start the FFN role first, then the attention role(s). '
    "Use with --hf-overrides '{\"architectures\": [\"AFD<Arch>\"]}'."
)


class AfdCliError(AfdConfigError):
    """A ``--afd-*`` flag that clashes with ``--additional-config``; the message names both."""


class Flag:
    """One ``--afd-*`` flag and the ``additional_config["afd"]`` key it sets.

    A plain class: this module is imported in every vLLM process that loads the
    plugin, and a dataclass would generate its methods with ``exec`` each time.
    """

    __slots__ = ("choices", "help", "key", "metavar", "option", "type")

    def __init__(self, option: str, key: str, type: Callable[[str], Any], help: str,
                 choices: tuple[str, ...] | None = None, metavar: str | None = None) -> None:
        self.option = option
        self.key = key
        self.type = type
        self.help = help
        self.choices = choices
        self.metavar = metavar

    @property
    def dest(self) -> str:
        """Attribute name on the parsed namespace (``--afd-num-ffn-ranks`` → ``afd_num_ffn_ranks``)."""
        return self.option.lstrip("-").replace("-", "_")


@functools.cache
def flags() -> tuple[Flag, ...]:
    """Every ``--afd-*`` flag, generated from ``AfdConfig`` (``afd_patches.config.keys``): its help is the
    key's help plus its default.

    Built on first use (a parser being built, or arguments being read): this module is
    imported in every vLLM process the plugin runs in, ``afd_patches.config`` is not."""
    from afd_patches.config import keys

    return tuple(Flag(key.flag, key.name, key.kind, _help(key.doc, key.shown_default), choices=key.choices,
                      metavar=key.metavar) for key in keys() if key.flag)


def _help(doc: str, default: str | None) -> str:
    """``doc`` with ``(default: …)`` before its final period when the key has a default; ``%`` escaped for
    argparse, which formats help strings."""
    text = doc if default is None else f"{doc.removesuffix('.')} (default: {default})."
    return text.replace("%", "%%")


def add_afd_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the ``AFD`` group with every flag of ``flags()`` to ``parser``; return the group.

    Idempotent: a parser that already has ``--afd-role`` is left as it is (the existing group
    is returned), so a second wrap or a second plugin load does not raise "conflicting option".
    """
    for group in parser._action_groups:
        if group.title == GROUP_TITLE and any("--afd-role" in a.option_strings for a in group._group_actions):
            return group
    group = parser.add_argument_group(title=GROUP_TITLE, description=GROUP_DESCRIPTION)
    for flag in flags():
        kwargs: dict[str, Any] = {"dest": flag.dest, "type": flag.type, "default": argparse.SUPPRESS, "help": flag.help}
        if flag.choices:
            kwargs["choices"] = list(flag.choices)
        if flag.metavar:
            kwargs["metavar"] = flag.metavar
        group.add_argument(flag.option, **kwargs)
    return group


def flag_values(args: argparse.Namespace) -> dict[str, tuple[Flag, Any]]:
    """``{afd key: (flag, value)}`` for each ``--afd-*`` flag given on ``args`` (absent or None: not given)."""
    given: dict[str, tuple[Flag, Any]] = {}
    for flag in flags():
        value = getattr(args, flag.dest, None)
        if value is not None:
            given[flag.key] = (flag, value)
    return given


def _as_dict(additional: Any) -> dict[str, Any]:
    """``--additional-config`` as a fresh dict (vLLM parses it to a dict; a JSON string is accepted too)."""
    if additional is None:
        return {}
    if isinstance(additional, str):
        additional = json.loads(additional) if additional.strip() else {}
    if not isinstance(additional, Mapping):
        raise AfdCliError(f"--additional-config must be a JSON object, not {type(additional).__name__}")
    return dict(additional)


def merge_flags(additional: Any, given: Mapping[str, tuple[Flag, Any]]) -> dict[str, Any]:
    """A new additional_config with ``given`` merged into its ``"afd"`` mapping.

    Neither input is mutated. Raises ``AfdCliError`` when a key (or its alias) is set both
    by a flag and by ``--additional-config``, or when ``additional_config["afd"]`` is not a mapping.
    """
    from afd_patches.config import ALIASES

    merged = _as_dict(additional)
    afd_raw = merged.get(CONFIG_KEY, {})
    if afd_raw is None:
        afd_raw = {}
    if not isinstance(afd_raw, Mapping):
        raise AfdCliError(
            f'additional_config["{CONFIG_KEY}"] must be a mapping to combine it with --afd-* flags, '
            f"not {type(afd_raw).__name__}"
        )
    afd = dict(afd_raw)
    for key, (flag, value) in given.items():
        spellings = [key, *(alias for alias, canonical in ALIASES.items() if canonical == key)]
        clash = next((s for s in spellings if s in afd), None)
        if clash is not None:
            raise AfdCliError(
                f'{flag.option} and --additional-config both set additional_config["{CONFIG_KEY}"]["{clash}"] '
                f"({value!r} vs {afd[clash]!r}); give it one way only"
            )
        afd[key] = value
    merged[CONFIG_KEY] = afd
    return merged


def apply_flags(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` itself when no ``--afd-*`` flag was given, else a copy whose additional_config holds them."""
    given = flag_values(args)
    if not given:
        return args
    copy = argparse.Namespace(**vars(args))
    copy.additional_config = merge_flags(getattr(args, "additional_config", None), given)
    return copy


def add_afd_cli_args(original: Callable[..., Any], parser: Any, *args: Any, **kwargs: Any) -> Any:
    """Wrapper of ``EngineArgs.add_cli_args``: vLLM's arguments, then the ``AFD`` group."""
    result = original(parser, *args, **kwargs)
    add_afd_arguments(result if result is not None else parser)
    return result


def afd_from_cli_args(original: Callable[..., Any], cls: type, args: argparse.Namespace,
                      *rest: Any, **kwargs: Any) -> Any:
    """Wrapper of ``EngineArgs.from_cli_args``: fold the ``--afd-*`` flags into additional_config first.

    When AFD is on, this process (the API server's front end) also exports the engine's
    ``vllm:afd_*`` metrics on its ``/metrics`` (``afd_patches.metrics``).
    """
    args = apply_flags(args)
    try:
        afd_on = CONFIG_KEY in _as_dict(getattr(args, "additional_config", None))
    except (AfdCliError, ValueError):
        afd_on = False  # vLLM reports a malformed --additional-config itself
    if afd_on:
        from afd_patches.metrics import export_from_front_end

        export_from_front_end()
    return original(cls, args, *rest, **kwargs)
