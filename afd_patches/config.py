"""``additional_config["afd"]`` → an immutable, validated ``AfdConfig``.

Present means AFD is on. Keys are checked against ``schemas/afd-config.schema.json``
(unknown keys rejected, by name); the aliases ``afd_role``, ``afd_connector``,
``afd_host`` and ``afd_port`` are accepted, but an alias together with its
canonical key is an error. Topology rules (A ≥ F, A % F == 0, rank within its
role) are checked here too, so every mistake surfaces in the front end, naming
the key, before any worker starts. The rendezvous token is checked here too
(``token_file`` readable and private, or ``AFD_TOKEN`` set, whenever ``host`` is
not loopback; see ``afd_patches.connectors.auth``); its value is never part of the
config.
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import Any

from afd_patches import CONFIG_KEY, AfdConfigError, config_schema

ALIASES = {"afd_role": "role", "afd_connector": "connector", "afd_host": "host", "afd_port": "port"}


@dataclass(frozen=True)
class AfdConfig:
    role: str
    connector: str = "torch_dist"
    host: str = "127.0.0.1"
    port: int = 29611
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    rank: int = 0
    timeout_s: float = 60.0
    connector_extra_config: dict[str, Any] = field(default_factory=dict)
    token_file: str | None = None
    allow_unauthenticated: bool = False
    cpu_cores: str | None = None
    compile_ffn: bool = False  # FFN role: compile its per-layer modules where vLLM compiles (did not pay, measured)

    @property
    def schedule(self) -> str:
        """``connector_extra_config["schedule"]``: how an FFN rank serves its attention ranks
        (``afd_patches.connectors.options.SCHEDULES``).

        ``batched`` (default): one FFN call per layer over every served rank, which
        needs idle attention ranks to send empty steps; ``pingpong``: each rank's
        layer is served as it arrives. ``parse`` and the connector reject other values.
        """
        return str(self.connector_extra_config.get("schedule", "batched"))

    def to_dict(self) -> dict[str, Any]:
        """The keys ``parse`` accepts again (an unset ``token_file`` or ``cpu_cores`` is left out)."""
        d = asdict(self)
        for key in ("token_file", "cpu_cores"):
            if d[key] is None:
                del d[key]
        return d


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


_INT_KEYS = ("port", "num_attention_ranks", "num_ffn_ranks", "rank")


def _check_numbers(values: dict[str, Any]) -> None:
    """What JSON Schema lets through: ``1.0`` counts as an integer there, and NaN passes a minimum."""
    for key in _INT_KEYS:
        if key in values and (isinstance(values[key], bool) or not isinstance(values[key], int)):
            raise _fail(key, f"{values[key]!r} is not an integer")
    if "timeout_s" in values and not math.isfinite(values["timeout_s"]):
        raise _fail("timeout_s", f"{values['timeout_s']!r} is not a finite number of seconds")


def _check_topology(cfg: AfdConfig) -> None:
    a, f = cfg.num_attention_ranks, cfg.num_ffn_ranks
    if a < f:
        raise _fail("num_ffn_ranks", f"{f} FFN ranks for {a} attention ranks; need A >= F")
    if a % f:
        raise _fail("num_attention_ranks", f"{a} is not a multiple of num_ffn_ranks={f}")
    count = a if cfg.role == "attention" else f
    if cfg.rank >= count:
        raise _fail("rank", f"{cfg.rank} is out of range for {count} {cfg.role} rank(s)")


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
