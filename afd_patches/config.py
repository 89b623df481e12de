"""``additional_config["afd"]`` → an immutable, validated ``AfdConfig``; the one source of its keys.

Present means AFD is on. ``AfdConfig`` declares every key once: its type, its default, its help (the
string under the attribute, as vLLM documents its config dataclasses) and, in the field's metadata
(``_key``), its alias, its ``--afd-*`` flag and its JSON Schema constraints. ``keys()`` reads that
declaration; generated from it are ``schemas/afd-config.schema.json``, the ``--afd-*`` flags
(``afd_patches.patches.cli_flags``) and the key table of docs/running.md ("Settings"); ``python -m
scripts.afd_config_docs`` rewrites the two files, tests/afd/test_config_source.py checks that all agree.

``parse`` checks a mapping against the generated schema (unknown keys rejected, by name); the aliases
``afd_role``, ``afd_connector``, ``afd_host`` and ``afd_port`` are accepted, but an alias together with
its canonical key is an error. Topology rules (A ≥ F, A % F == 0, rank within its role) are checked here
too, so every mistake surfaces in the front end, naming the key, before any worker starts. The rendezvous
token is checked here too (``token_file`` readable and private, or ``AFD_TOKEN`` set, whenever ``host`` is
not loopback; see ``afd_patches.connectors.auth``); its value is never part of the config.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from functools import cache
from typing import Any, Literal

from afd_patches import CONFIG_KEY, AfdConfigError, config_schema, topology
from afd_patches.connectors.options import SCHEDULES


def _key(*, alias: str | None = None, flag: str | bool = False, **schema: Any) -> dict[str, Any]:
    """An ``AfdConfig`` field's metadata: its alias key, its ``--afd-*`` flag (False: none; True: one whose
    choices are its metavar; a string: the flag's metavar) and its JSON Schema keywords beyond the type."""
    return {"alias": alias, "flag": flag, "schema": schema}


@dataclass(frozen=True)
class AfdConfig:
    """``additional_config["afd"]``, validated (``parse``). Each key's help is the string under it: one
    paragraph of plain text (it becomes a JSON Schema description, a ``--help`` line and a Markdown cell)."""

    role: Literal["attention", "ffn"] = field(metadata=_key(alias="afd_role", flag=True))
    """This engine's AFD role: 'attention' (keeps the KV cache, schedules requests, serves clients) or 'ffn'
    (holds the MLP/expert weights). Required when AFD is on."""
    connector: str = field(default="torch_dist", metadata=_key(alias="afd_connector", flag="NAME", minLength=1))
    """Name of the connector that carries hidden states between the roles: 'torch_dist' (tcp sockets on CPU,
    NCCL on GPU; connector_extra_config.backend 'gloo' also works)."""
    host: str = field(default="127.0.0.1", metadata=_key(alias="afd_host", flag="HOST", minLength=1))
    """Address of the rendezvous both roles meet at (where FFN rank 0 runs)."""
    port: int = field(default=29611, metadata=_key(alias="afd_port", flag="PORT", minimum=1, maximum=65535))
    """TCP port of the rendezvous; the same on every engine of the group."""
    num_attention_ranks: int = field(default=1, metadata=_key(flag="A", minimum=1))
    """A: number of attention engines."""
    num_ffn_ranks: int = field(default=1, metadata=_key(flag="F", minimum=1))
    """F: number of FFN engines; A must be a multiple of F (so A >= F)."""
    rank: int = field(default=0, metadata=_key(flag="N", minimum=0))
    """This engine's 0-based index among the engines of its role."""
    timeout_s: float = field(default=60.0, metadata=_key(flag="SECONDS", exclusiveMinimum=0))
    """Seconds connecting or a receive waits for the peer before failing with an error."""
    connector_extra_config: dict[str, Any] = field(default_factory=dict, metadata=_key(properties={"schedule": {
        "description": "How an FFN rank serves the attention ranks it serves: 'batched' waits for one layer from "
                       "every rank and runs one FFN call on all of them (idle attention ranks send empty steps to "
                       "keep the lockstep); 'pingpong' serves each rank's layer as soon as it arrives (no "
                       "lockstep, no empty steps).",
        "enum": list(SCHEDULES)}}))
    """Connector settings, checked by the connector before any engine process starts (torch_dist: backend,
    device, idle_timeout_s, inline_bytes, schedule, data_port, advertise, micro_batches, micro_batch_min_tokens;
    afd_patches/connectors/options.py). No flag: pass it with --additional-config."""
    token_file: str | None = field(default=None, metadata=_key(flag="PATH", minLength=1))
    """File holding the group's shared secret (owned by the user, mode 0600); else the AFD_TOKEN environment
    variable. Required unless host is loopback or allow_unauthenticated is true. The secret itself is never a
    flag."""
    allow_unauthenticated: bool = field(default=False, metadata=_key())
    """Let the group form on a non-loopback host without a token (anyone who reaches the port can join)."""
    cpu_cores: str | None = field(default=None, metadata=_key(flag="LIST", minLength=1))
    """CPUs this engine's worker(s) run on, in the syntax of vLLM's VLLM_CPU_OMP_THREADS_BIND: ids and ranges
    ('0-3,8'), one list per worker separated by '|'. Overrides that variable for this engine. Unset: that
    variable if it is not 'auto', else, when host is loopback, a share of the allowed CPUs derived from role
    and rank (docs/running.md, "Placing the roles on cores")."""
    compile_ffn: bool = field(default=False, metadata=_key())
    """FFN role: compile each layer's MLP/MoE module the way vLLM compiles a model on this platform (CPU:
    dynamo + inductor). Off by default: it did not pay in the benchmarks (docs/benchmarks.md); the attention
    role is compiled as vLLM compiles any model either way."""

    @property
    def schedule(self) -> str:
        """``connector_extra_config["schedule"]``: how an FFN rank serves its attention ranks
        (``afd_patches.connectors.options.SCHEDULES``).

        ``batched`` (default): one FFN call per layer over every served rank, which
        needs idle attention ranks to send empty steps; ``pingpong``: each rank's
        layer is served as it arrives. ``parse`` and the connector reject other values.
        """
        return str(self.connector_extra_config.get("schedule", SCHEDULES[0]))

    def to_dict(self) -> dict[str, Any]:
        """The keys ``parse`` accepts again (an unset key, such as ``token_file`` or ``cpu_cores``, is left out)."""
        return {key: value for key, value in asdict(self).items() if value is not None}


ALIASES = {f.metadata["alias"]: f.name for f in fields(AfdConfig) if f.metadata["alias"]}


@dataclass(frozen=True)
class Key:
    """One key of ``additional_config["afd"]`` as ``AfdConfig`` declares it (see ``keys``)."""

    name: str
    kind: type  # the value's type: str, int, float, bool or dict (an optional key's None means "unset")
    choices: tuple[str, ...] | None  # the values of a ``Literal`` type, else None
    default: Any  # None: unset unless given; ``required`` keys have none
    required: bool
    doc: str  # the attribute's string, one line
    alias: str | None
    flag: str | None  # "--afd-<name with dashes>", or None: the key has no flag
    metavar: str | None  # the flag's metavar (None: its choices, or no flag)
    schema: dict[str, Any]  # JSON Schema keywords beyond the type (minimum, properties, ...)

    @property
    def shown_default(self) -> str | None:
        """The default as a flag's help and the docs show it (``60`` for 60.0, JSON otherwise, strings bare);
        None for a required or unset key."""
        if self.default is None:
            return None
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return self.default if isinstance(self.default, str) else json.dumps(self.default)


@cache
def keys() -> tuple[Key, ...]:
    """Every key of ``AfdConfig``, in declaration order.

    Reads this module's source for the attribute strings (as vLLM's ``get_attr_docs`` does for its config
    classes; a few ms), so it needs ``afd_patches/config.py`` as a file, which every install ships. Built on
    first use (a parser being built, the generator, the tests), never by ``parse``."""
    import typing

    hints = typing.get_type_hints(AfdConfig)
    docs = _attribute_docs(AfdConfig)
    out = []
    for f in fields(AfdConfig):
        kind = hints[f.name]
        choices = None
        if typing.get_origin(kind) is Literal:
            kind, choices = str, typing.get_args(kind)
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if args and typing.get_origin(kind) is not dict:  # ``X | None``: the value's type is X
            kind = args[0]
        kind = typing.get_origin(kind) or kind
        flag = f.metadata["flag"]
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        out.append(Key(f.name, kind, choices, None if default is MISSING else default, default is MISSING,
                       docs[f.name], f.metadata["alias"], f"--afd-{f.name.replace('_', '-')}" if flag else None,
                       flag if isinstance(flag, str) else None, f.metadata["schema"]))
    return tuple(out)


def _attribute_docs(cls: type) -> dict[str, str]:
    """``{attribute: the string literal right under its annotated assignment}`` in the body of ``cls`` (a
    top-level class of its module, read from the module's file), each string's lines joined into one; an
    attribute without one is left out."""
    import ast
    import inspect
    import itertools

    with open(inspect.getsourcefile(cls) or "", encoding="utf-8") as f:
        tree = ast.parse(f.read())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
    docs = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


@cache
def _validator() -> Any:
    import jsonschema

    return jsonschema.Draft202012Validator(json.loads(config_schema().read_text()))


def _fail(key: str, message: str, *inner: str) -> AfdConfigError:
    path = "".join(f'["{k}"]' for k in (key, *inner))
    return AfdConfigError(f'additional_config["afd"]{path}: {message}')


def parse(raw: Any) -> AfdConfig:
    """Validate and normalize; raise AfdConfigError naming the offending key."""
    if not isinstance(raw, dict):
        raise AfdConfigError(f'additional_config["afd"] must be a mapping, not {type(raw).__name__}')
    allowed = set(_validator().schema["properties"])
    for key in raw:
        if key not in allowed:
            raise _fail(key, f"unknown key (allowed: {', '.join(sorted(k for k in allowed if k not in ALIASES))})")
    errors = sorted(_validator().iter_errors(raw), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        e = errors[0]
        key, *inner = [str(k) for k in e.absolute_path] or ["?"]
        raise _fail(key, e.message, *inner)
    values = dict(raw)
    for alias, canonical in ALIASES.items():
        if alias in values:
            if canonical in values:
                raise _fail(alias, f"given together with its canonical key {canonical!r}; use one")
            values[canonical] = values.pop(alias)
    if "role" not in values:
        raise _fail("role", "is required (attention or ffn)")
    _check_numbers(values)
    cfg = AfdConfig(**values)
    _check_topology(cfg)
    _check_connector(cfg)
    _check_auth(cfg)
    _check_cpu_cores(cfg)
    return cfg


# What JSON Schema lets through, by the keys' declared types (``AfdConfig``'s annotations are strings here)
_INT_KEYS = tuple(f.name for f in fields(AfdConfig) if f.type == "int")
_SECONDS_KEYS = tuple(f.name for f in fields(AfdConfig) if f.type == "float")  # every float key is seconds


def _check_numbers(values: dict[str, Any]) -> None:
    """``1.0`` counts as an integer in JSON Schema, and NaN passes a minimum."""
    for key in _INT_KEYS:
        if key in values and (isinstance(values[key], bool) or not isinstance(values[key], int)):
            raise _fail(key, f"{values[key]!r} is not an integer")
    for key in _SECONDS_KEYS:
        if key in values and not math.isfinite(values[key]):
            raise _fail(key, f"{values[key]!r} is not a finite number of seconds")


def _check_topology(cfg: AfdConfig) -> None:
    """The rules of ``afd_patches.topology``, reported on the key at fault."""
    a, f = cfg.num_attention_ranks, cfg.num_ffn_ranks
    try:
        topology.validate(a, f)
        topology.check_rank(cfg.rank, a if cfg.role == topology.ATTENTION else f, cfg.role)
    except topology.TopologyError as e:
        raise _fail(e.key, str(e)) from None


def _check_connector(cfg: AfdConfig) -> None:
    """The connector must be known, and its ``connector_extra_config`` valid (the connector's own check)."""
    from afd_patches.connectors import OPTIONS, REGISTRY

    if cfg.connector not in REGISTRY:
        raise _fail("connector", f"unknown connector {cfg.connector!r} (known: {', '.join(sorted(REGISTRY))})")
    module, _, name = OPTIONS[cfg.connector].partition(":")
    try:
        getattr(importlib.import_module(module), name).parse(cfg.connector_extra_config)
    except ValueError as e:
        key, _, why = str(e).partition(": ")
        raise _fail("connector_extra_config", why, key) from None


def _check_auth(cfg: AfdConfig) -> None:
    """The token must be readable where set and strong, and present unless ``host`` is loopback (see
    ``connectors.auth``); the host is resolved once here, and that address is what the policy judges."""
    from afd_patches.connectors import auth

    try:
        token = auth.load_token(cfg.token_file)
    except auth.TokenError as e:
        raise _fail("token_file", str(e)) from None
    try:
        address = auth.resolve(cfg.host)
    except (OSError, UnicodeError) as e:
        raise _fail("host", f"{cfg.host!r} does not resolve to an address ({e})") from None
    try:
        auth.check_policy(address, token, cfg.allow_unauthenticated)
    except auth.TokenError as e:
        raise _fail("host", str(e)) from None


def _check_cpu_cores(cfg: AfdConfig) -> None:
    """``cpu_cores`` must be vLLM's CPU-list syntax (``afd_patches.cores``) and name only CPUs this process
    may run on (the engine's workers inherit its affinity; a CPU outside it would not bind)."""
    if cfg.cpu_cores is None:
        return
    import os

    from afd_patches import cores

    try:
        lists = cores.parse_core_lists(cfg.cpu_cores)
    except ValueError as e:
        raise _fail("cpu_cores", str(e)) from None
    allowed = os.sched_getaffinity(0)
    outside = sorted({cpu for ids in lists for cpu in ids} - allowed)
    if outside:
        raise _fail("cpu_cores", f"CPU(s) {cores.format_cores(outside)} are not among the CPUs this process may "
                                 f"run on ({cores.format_cores(allowed)})")


def from_additional_config(additional_config: dict[str, Any] | None) -> AfdConfig | None:
    """The AFD config of an engine, or None when AFD is off."""
    if not additional_config or CONFIG_KEY not in additional_config:
        return None
    return parse(additional_config[CONFIG_KEY])
