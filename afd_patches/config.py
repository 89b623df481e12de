"""``additional_config["afd"]`` → an immutable, validated ``AfdConfig``; the one source of its keys.

Present means AFD is on. ``AfdConfig`` declares every key once, ``LinkConfig`` every key of its
``connector_extra_config`` (``cfg.link``): its type, its default, its help (the string under the attribute,
as vLLM documents its config dataclasses) and, in the field's metadata (``_key``), its alias, its ``--afd-*``
flag and its JSON Schema constraints, bounds included. ``keys()`` reads that declaration; generated from it
are ``schemas/afd-config.schema.json``, the ``--afd-*`` flags (``afd_patches.patches.cli_flags``) and the key
tables of docs/running.md ("Settings"); ``python -m scripts.afd_config_docs`` rewrites the two files,
tests/afd/test_config_source.py checks that all agree.

Two ways in, one set of rules:

- ``parse(raw)``: the front end's full check, once per engine (``validate_afd_config``). Unknown keys are
  rejected by name; the aliases ``afd_role``, ``afd_connector``, ``afd_host`` and ``afd_port`` are accepted,
  but an alias together with its canonical key is an error. Then every rule ``restore`` checks, then what
  needs I/O: the rendezvous token (``token_file`` readable and private, or ``AFD_TOKEN`` set, whenever
  ``host`` is not loopback; see ``afd_patches.connectors.auth``; its value is never part of the config), the
  host resolving, ``cpu_cores`` within this process's affinity. Every mistake surfaces there, naming the key,
  before any worker starts.
- ``restore(normalized)``: every later reader, in any process, of what the front end stored (``to_dict``)
  back in ``additional_config["afd"]``. No I/O at all (no file, no name resolution, no affinity); it still
  checks every key's type and bound and the rules between keys (topology, the link's backend rules), since
  the mapping comes from another process: a tampered one is refused like a wrong one. The token file and
  the host are read where they are used: forming a group (the connector's ``init``).

Bounds (finding 5 of issue 51): a value that parses must work where it is used. Seconds are at most
``MAX_SECONDS`` (30 days; ``socket.settimeout`` and ``threading`` waits refuse beyond ``threading.TIMEOUT_MAX``,
about 292 years of nanoseconds, and ``timedelta`` beyond 10^9 days), ranks at most ``MAX_RANKS``,
``inline_bytes`` at most ``MAX_INLINE_BYTES``, ports within 0–65535.
"""

from __future__ import annotations

import json
import math
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from functools import cache
from typing import Any, Literal

from afd_patches import CONFIG_KEY, AfdConfigError, topology

BACKENDS = ("tcp", "gloo", "nccl")
HOST_BACKENDS = ("gloo", "tcp")  # messages in host memory; these can serve pingpong
SCHEDULES = ("batched", "pingpong")  # the first is the default
IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # idle is not a failure: an idle server waits as long as a deploy takes
MAX_SECONDS = 30 * 24 * 3600.0  # every seconds value: far below what sockets, waits and timedelta accept
MAX_RANKS = 4096  # engines per role
DEFAULT_INLINE_BYTES = 64 * 1024
MAX_INLINE_BYTES = 1 << 30  # wire.MAX_MESSAGE_BYTES: no tensor larger travels at all
MAX_MICRO_BATCHES = 4
# vLLM's own --dbo-decode-token-threshold default; here a 16-token step split in two did not pay (0.93-1.02x) and a
# 64-token one did (1.11x): docs/benchmarks.md, "Micro-batches inside one attention step"
DEFAULT_MICRO_BATCH_MIN_TOKENS = 32
HOLD_TIMEOUTS = 3  # hold_s unset: a lost FFN's step waits this many timeout_s for the group to re-form


def _key(*, alias: str | None = None, flag: str | bool = False, codec: tuple[Callable[[Any], Any],
         Callable[[Any], Any]] | None = None, **schema: Any) -> dict[str, Any]:
    """A config field's metadata: its alias key, its ``--afd-*`` flag (False: none; True: one whose choices
    are its metavar; a string: the flag's metavar), ``codec`` (for a value whose Python form is not its JSON
    form: ``(decode, encode)``, the JSON form a string) and its JSON Schema keywords beyond the type."""
    return {"alias": alias, "flag": flag, "codec": codec, "schema": schema}


def _address(text: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` too) → ``(host, port)``; ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{text!r} is not 'host:port' (port 1-65535)")
    return host, int(port)


def _address_text(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class LinkConfig:
    """``connector_extra_config`` of the ``torch_dist`` connector, validated (``parse``, ``restore``). Each
    key's help is the string under it. Nothing here imports torch: which backend an unset ``backend`` means
    is decided in the worker (nccl with CUDA, else tcp)."""

    backend: Literal["tcp", "gloo", "nccl"] | None = field(default=None, metadata=_key())
    """How messages travel: 'tcp' (sockets; the CPU default), 'gloo' or 'nccl' (the default with CUDA)."""
    device: str | None = field(default=None, metadata=_key(minLength=1))
    """Device the messages travel from (gloo and nccl only; default: cpu for gloo, the current CUDA device for
    nccl)."""
    idle_timeout_s: float = field(default=IDLE_TIMEOUT_S, metadata=_key(exclusiveMinimum=0, maximum=MAX_SECONDS))
    """Seconds an FFN rank waits for the next step of an idle group, and one formation for its peers (a week:
    a group may take as long as a deploy takes)."""
    inline_bytes: int | None = field(default=None, metadata=_key(minimum=0, maximum=MAX_INLINE_BYTES))
    """gloo only: payloads up to this many bytes travel inside the header message (default 65536 on gloo,
    else 0)."""
    schedule: Literal["batched", "pingpong"] = field(default="batched", metadata=_key())
    """How an FFN rank serves the attention ranks it serves: 'batched' waits for one layer from every rank and
    runs one FFN call on all of them (idle attention ranks send empty steps to keep the lockstep); 'pingpong'
    serves each rank's layer as soon as it arrives (no lockstep, no empty steps; gloo or tcp)."""
    data_port: int = field(default=0, metadata=_key(minimum=0, maximum=65535))
    """tcp, FFN ranks other than 0: the port its attention engines open their data sessions at (0: any free
    one)."""
    advertise: tuple[str, int] | None = field(default=None, metadata=_key(codec=(_address, _address_text),
                                                                          minLength=3))
    """tcp, FFN ranks other than 0: the 'host:port' to publish instead of the address it binds (behind NAT, a
    proxy or a Kubernetes Service)."""
    micro_batches: int = field(default=1, metadata=_key(minimum=1, maximum=MAX_MICRO_BATCHES))
    """Attention steps of at least micro_batch_min_tokens tokens run as this many micro-batches whose attention
    and FFN overlap (gloo or tcp); the same on every engine of the group."""
    micro_batch_min_tokens: int = field(default=DEFAULT_MICRO_BATCH_MIN_TOKENS, metadata=_key(minimum=1))
    """Steps with fewer tokens run unsplit; at least micro_batches (default 32, or micro_batches if larger)."""

    def to_dict(self) -> dict[str, Any]:
        """The keys ``restore`` takes back (JSON values; an unset key is left out)."""
        return _to_dict(self)


@dataclass(frozen=True)
class AfdConfig:
    """``additional_config["afd"]``, validated (``parse``, ``restore``). Each key's help is the string under it:
    one paragraph of plain text (it becomes a JSON Schema description, a ``--help`` line and a Markdown cell)."""

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
    num_attention_ranks: int = field(default=1, metadata=_key(flag="A", minimum=1, maximum=MAX_RANKS))
    """A: number of attention engines."""
    num_ffn_ranks: int = field(default=1, metadata=_key(flag="F", minimum=1, maximum=MAX_RANKS))
    """F: number of FFN engines; A must be a multiple of F (so A >= F)."""
    rank: int = field(default=0, metadata=_key(flag="N", minimum=0, maximum=MAX_RANKS - 1))
    """This engine's 0-based index among the engines of its role."""
    timeout_s: float = field(default=60.0, metadata=_key(flag="SECONDS", exclusiveMinimum=0, maximum=MAX_SECONDS))
    """Seconds connecting or a receive waits for the peer before failing with an error."""
    hold_s: float | None = field(default=None, metadata=_key(flag="SECONDS", minimum=0, maximum=MAX_SECONDS))
    """Attention role: seconds a step whose FFN was lost waits for an FFN to serve the group again, then runs
    again from its first layer (clients see a slower token, not an error); past it the step's requests fail
    naming the FFN. Unset: 3 x timeout_s. 0: fail them at once."""
    connector_extra_config: LinkConfig = field(default_factory=LinkConfig, metadata=_key())
    """Settings of the link between the roles (the torch_dist connector's keys, below). No flag: pass it with
    --additional-config."""
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

    def __post_init__(self) -> None:
        """A mapping given as ``connector_extra_config`` (code that builds a config directly: tests, benchmarks,
        tools) is checked and typed as ``restore`` would; a ``LinkConfig`` is kept as it is."""
        if isinstance(self.connector_extra_config, dict):
            link = _build(LinkConfig, self.connector_extra_config, ("connector_extra_config",))
            object.__setattr__(self, "connector_extra_config", link)

    @property
    def hold_seconds(self) -> float:
        """``hold_s``, its default applied (``HOLD_TIMEOUTS`` x ``timeout_s``)."""
        return self.hold_s if self.hold_s is not None else min(HOLD_TIMEOUTS * self.timeout_s, MAX_SECONDS)

    @property
    def link(self) -> LinkConfig:
        """``connector_extra_config``, typed: the settings of the link between the roles."""
        return self.connector_extra_config

    def to_dict(self) -> dict[str, Any]:
        """The normalized mapping ``restore`` takes back: JSON values, every key set (the link's too), an unset
        one (such as ``token_file`` or ``cpu_cores``) left out. ``parse`` accepts it again as well."""
        return _to_dict(self)


def _to_dict(config: Any) -> dict[str, Any]:
    out = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if value is None:
            continue
        codec = f.metadata["codec"]
        out[f.name] = value.to_dict() if is_dataclass(value) else codec[1](value) if codec else value
    return out


ALIASES = {f.metadata["alias"]: f.name for f in fields(AfdConfig) if f.metadata["alias"]}


@dataclass(frozen=True)
class Key:
    """One key of ``additional_config["afd"]`` (or of its ``connector_extra_config``) as ``AfdConfig``
    (``LinkConfig``) declares it (see ``keys``)."""

    name: str
    kind: type  # the JSON value's type: str, int, float, bool or dict (an optional key's None means "unset")
    choices: tuple[str, ...] | None  # the values of a ``Literal`` type, else None
    default: Any  # None: unset unless given; ``required`` keys have none; a nested config's: {} (its defaults)
    required: bool
    doc: str  # the attribute's string, one line
    alias: str | None
    flag: str | None  # "--afd-<name with dashes>", or None: the key has no flag
    metavar: str | None  # the flag's metavar (None: its choices, or no flag)
    schema: dict[str, Any]  # JSON Schema keywords beyond the type (minimum, maximum, ...)
    keys: tuple[Key, ...] = ()  # a nested config's own keys (``connector_extra_config``), else none

    @property
    def shown_default(self) -> str | None:
        """The default as a flag's help and the docs show it (``60`` for 60.0, JSON otherwise, strings bare);
        None for a required or unset key."""
        if self.default is None:
            return None
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return self.default if isinstance(self.default, str) else json.dumps(self.default)


@dataclass(frozen=True)
class _Field:
    """What ``restore`` checks of one declared key: read from the annotations and metadata, not the docs."""

    name: str
    kind: type  # the Python type: str, int, float, bool, or a nested config class
    choices: tuple[str, ...] | None
    optional: bool  # ``X | None``: None (the key left out) means unset
    default: Any  # MISSING: required
    codec: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None
    schema: dict[str, Any]


@cache
def _fields(cls: type) -> tuple[_Field, ...]:
    """Every field of the config class ``cls``, typed, in declaration order (no I/O: annotations only)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        kind, optional = hints[f.name], False
        args = typing.get_args(kind)
        if type(None) in args:
            optional, (kind,) = True, [a for a in args if a is not type(None)]
        choices = None
        if typing.get_origin(kind) is Literal:
            kind, choices = str, typing.get_args(kind)
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        out.append(_Field(f.name, typing.get_origin(kind) or kind, choices, optional, default, f.metadata["codec"],
                          f.metadata["schema"]))
    return tuple(out)


@cache
def keys(cls: type = AfdConfig) -> tuple[Key, ...]:
    """Every key of ``cls`` (``AfdConfig`` or ``LinkConfig``), in declaration order.

    Reads this module's source for the attribute strings (as vLLM's ``get_attr_docs`` does for its config
    classes; a few ms), so it needs ``afd_patches/config.py`` as a file, which every install ships. Built on
    first use (a parser being built, the generator, the tests), never by ``parse`` or ``restore``."""
    docs = _attribute_docs(cls)
    out = []
    for f, spec in zip(fields(cls), _fields(cls), strict=True):
        nested = is_dataclass(spec.kind)
        kind = dict if nested else str if spec.codec else spec.kind
        default = {} if nested else None if spec.default is MISSING else spec.default
        flag = f.metadata["flag"]
        out.append(Key(f.name, kind, spec.choices, default, spec.default is MISSING, docs[f.name],
                       f.metadata["alias"], f"--afd-{f.name.replace('_', '-')}" if flag else None,
                       flag if isinstance(flag, str) else None, spec.schema, keys(spec.kind) if nested else ()))
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


def _fail(path: tuple[str, ...], message: str) -> AfdConfigError:
    return AfdConfigError(f'additional_config["{CONFIG_KEY}"]' + "".join(f'["{k}"]' for k in path) + f": {message}")


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _value(spec: _Field, value: Any, path: tuple[str, ...]) -> Any:
    """``value`` of the key ``spec`` checked against its declaration (type, choices, bounds) and decoded."""
    if is_dataclass(spec.kind):
        return _build(spec.kind, value, path)  # type: ignore[arg-type]
    if spec.choices is not None:
        if not isinstance(value, str) or value not in spec.choices:
            raise _fail(path, f"{value!r} is not one of {list(spec.choices)}")
        return value
    kind = str if spec.codec else spec.kind
    if kind in (int, float):
        ok = isinstance(value, int if kind is int else int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise _fail(path, f"{value!r} is not " + ("an integer" if kind is int else f"of type {_JSON_TYPES[kind]!r}"))
    if kind is float:
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):
            raise _fail(path, f"{value!r} is not a finite number of seconds")
    bounds = spec.schema
    if "minimum" in bounds and value < bounds["minimum"]:
        raise _fail(path, f"{value!r} is less than the minimum of {bounds['minimum']}")
    if "exclusiveMinimum" in bounds and value <= bounds["exclusiveMinimum"]:
        raise _fail(path, f"{value!r} is less than or equal to the minimum of {bounds['exclusiveMinimum']}")
    if "maximum" in bounds and value > bounds["maximum"]:
        top = bounds["maximum"]
        raise _fail(path, f"{value!r} is greater than the maximum of " + (
            f"{top:.0f} seconds ({top / 86400:g} days)" if kind is float else f"{top}"))
    if "minLength" in bounds and len(value) < bounds["minLength"]:
        raise _fail(path, f"{value!r} should be non-empty" if bounds["minLength"] == 1 else
                    f"{value!r} is shorter than {bounds['minLength']} characters")
    if spec.codec:
        try:
            return spec.codec[0](value)
        except ValueError as e:
            raise _fail(path, str(e)) from None
    return value


def _build(cls: type, raw: Any, path: tuple[str, ...]) -> Any:
    """An instance of the config class ``cls`` from the mapping ``raw``: unknown keys refused by name, each
    key checked (``_value``), absent ones defaulted, then the rules between keys (``_RULES``)."""
    if not isinstance(raw, dict):
        raise _fail(path, f"{raw!r} is not an object") if path else AfdConfigError(
            f'additional_config["{CONFIG_KEY}"] must be a mapping, not {type(raw).__name__}')
    specs = _fields(cls)
    for key in raw:
        if key not in {s.name for s in specs}:
            raise _fail((*path, str(key)), f"unknown key (allowed: {', '.join(sorted(s.name for s in specs))})")
    values = {}
    for spec in specs:
        if spec.name in raw:
            values[spec.name] = _value(spec, raw[spec.name], (*path, spec.name))
        elif spec.default is MISSING:
            raise _fail((*path, spec.name), "is required" + (f" ({' or '.join(spec.choices)})" if spec.choices else ""))
    config = cls(**values)
    return _RULES[cls](config, raw, path)


def _link_rules(link: LinkConfig, raw: dict[str, Any], path: tuple[str, ...]) -> LinkConfig:
    """The rules between the link's keys; ``micro_batch_min_tokens`` defaults to at least ``micro_batches``."""
    backend, micro = link.backend, link.micro_batches
    if link.inline_bytes and backend != "gloo":
        raise _fail((*path, "inline_bytes"), f"{link.inline_bytes} needs backend gloo (other backends send headers "
                                             "alone)")
    if link.device is not None and backend == "tcp":
        raise _fail((*path, "device"), f"{link.device!r}: backend tcp carries host memory only")
    if link.schedule == "pingpong" and backend == "nccl":
        raise _fail((*path, "schedule"), "'pingpong' needs backend gloo or tcp")
    if micro > 1 and backend == "nccl":
        raise _fail((*path, "micro_batches"), "more than 1 needs backend gloo or tcp (the CUDA-stream schedule is "
                                              "not built yet)")
    if "micro_batch_min_tokens" not in raw:
        return replace(link, micro_batch_min_tokens=max(DEFAULT_MICRO_BATCH_MIN_TOKENS, micro))
    if link.micro_batch_min_tokens < micro:
        raise _fail((*path, "micro_batch_min_tokens"), f"{link.micro_batch_min_tokens!r} is less than "
                                                       f"micro_batches ({micro})")
    return link


def _afd_rules(cfg: AfdConfig, raw: dict[str, Any], path: tuple[str, ...]) -> AfdConfig:
    """The topology rules (``afd_patches.topology``), reported on the key at fault; the connector must be
    known."""
    from afd_patches.connectors import REGISTRY

    a, f = cfg.num_attention_ranks, cfg.num_ffn_ranks
    try:
        topology.validate(a, f)
        topology.check_rank(cfg.rank, a if cfg.role == topology.ATTENTION else f, cfg.role)
    except topology.TopologyError as e:
        raise _fail((*path, e.key), str(e)) from None
    if cfg.connector not in REGISTRY:
        raise _fail((*path, "connector"), f"unknown connector {cfg.connector!r} (known: {', '.join(sorted(REGISTRY))})")
    return cfg


_RULES: dict[type, Callable[[Any, dict[str, Any], tuple[str, ...]], Any]] = {
    LinkConfig: _link_rules, AfdConfig: _afd_rules}


def restore(normalized: Any) -> AfdConfig:
    """The config the front end stored (``AfdConfig.to_dict``), rebuilt in any process without I/O.

    Checks every key's type and bound and the rules between keys, as ``parse`` does (the mapping crossed a
    process boundary: validated, never trusted); raises ``AfdConfigError`` naming the offending key. Aliases
    are not accepted (the front end wrote canonical keys). What needs I/O (the token, the host's address,
    the CPUs this process may use) is not checked here: ``parse`` did in the front end, and the connector
    reads the token and resolves the host when it forms a group."""
    return _build(AfdConfig, normalized, ())  # type: ignore[no-any-return]


def parse(raw: Any) -> AfdConfig:
    """The front end's full check of ``additional_config["afd"]`` as given (module docstring); raise
    ``AfdConfigError`` naming the offending key."""
    if not isinstance(raw, dict):
        raise AfdConfigError(f'additional_config["{CONFIG_KEY}"] must be a mapping, not {type(raw).__name__}')
    allowed = {f.name for f in fields(AfdConfig)} | set(ALIASES)
    for key in raw:
        if key not in allowed:
            canonical = sorted(k for k in allowed if k not in ALIASES)
            raise _fail((str(key),), f"unknown key (allowed: {', '.join(canonical)})")
    values = dict(raw)
    for alias, canonical in ALIASES.items():
        if alias in values:
            if canonical in values:
                raise _fail((alias,), f"given together with its canonical key {canonical!r}; use one")
            values[canonical] = values.pop(alias)
    cfg = restore(values)
    _check_auth(cfg)
    _check_cpu_cores(cfg)
    return cfg


def _check_auth(cfg: AfdConfig) -> None:
    """The token must be readable where set and strong, and present unless ``host`` is loopback (see
    ``connectors.auth``); the host is resolved once here, and that address is what the policy judges."""
    from afd_patches.connectors import auth

    try:
        token = auth.load_token(cfg.token_file)
    except auth.TokenError as e:
        raise _fail(("token_file",), str(e)) from None
    try:
        address = auth.resolve(cfg.host)
    except (OSError, UnicodeError) as e:
        raise _fail(("host",), f"{cfg.host!r} does not resolve to an address ({e})") from None
    try:
        auth.check_policy(address, token, cfg.allow_unauthenticated)
    except auth.TokenError as e:
        raise _fail(("host",), str(e)) from None


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
        raise _fail(("cpu_cores",), str(e)) from None
    allowed = os.sched_getaffinity(0)
    outside = sorted({cpu for ids in lists for cpu in ids} - allowed)
    if outside:
        raise _fail(("cpu_cores",), f"CPU(s) {cores.format_cores(outside)} are not among the CPUs this process may "
                                    f"run on ({cores.format_cores(allowed)})")


def from_additional_config(additional_config: dict[str, Any] | None) -> AfdConfig | None:
    """The AFD config an engine's front end stored (``restore``: no I/O), or None when AFD is off."""
    if not additional_config or CONFIG_KEY not in additional_config:
        return None
    return restore(additional_config[CONFIG_KEY])
