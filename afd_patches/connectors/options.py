"""``connector_extra_config`` of the ``torch_dist`` connector: every key, its type, its default, its rules.

``Options.parse`` is called once in the front end (``afd_patches.config.parse`` asks the connector named by
the config, through ``REGISTRY``), so a wrong key or value fails before any engine process starts, naming
the key; the connector parses the same mapping again and cannot disagree. Nothing here imports torch:
which backend ``auto`` means (``nccl`` with CUDA, else ``tcp``) is decided in the worker.

Keys
    ``backend``: ``tcp`` (CPU default), ``gloo`` or ``nccl``. ``device``: where messages travel (gloo and
    NCCL only). ``idle_timeout_s``: how long an FFN rank waits for the next step of an idle group, and for
    a new group (default a week). ``inline_bytes``: gloo only, payloads up to this size travel inside the
    header message. ``schedule``: ``batched`` or ``pingpong`` (gloo or tcp). ``data_port``: the port an FFN
    rank other than 0 listens on for its attention ranks (default: any free one). ``advertise``:
    ``"host:port"`` that FFN rank publishes instead of the address it binds (behind NAT, a proxy, a
    Kubernetes Service). ``micro_batches``: 1 (default) to ``MAX_MICRO_BATCHES``; an attention rank splits
    each step of at least ``micro_batch_min_tokens`` tokens (default ``DEFAULT_MICRO_BATCH_MIN_TOKENS``, at
    least ``micro_batches``) into that many micro-batches whose attention and FFN overlap
    (``afd_patches.models.microbatch``). Both roles must agree on it (the rendezvous compares it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

BACKENDS = ("tcp", "gloo", "nccl")
HOST_BACKENDS = ("gloo", "tcp")  # messages in host memory; these can serve pingpong
SCHEDULES = ("batched", "pingpong")  # the first is the default
IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # idle is not a failure: an idle server waits as long as a deploy takes
DEFAULT_INLINE_BYTES = 64 * 1024
MAX_MICRO_BATCHES = 4
# vLLM's own --dbo-decode-token-threshold default; here a 16-token step split in two did not pay (0.93-1.02x) and a
# 64-token one did (1.11x): docs/benchmarks.md, "Micro-batches inside one attention step"
DEFAULT_MICRO_BATCH_MIN_TOKENS = 32


class OptionError(ValueError):
    """A bad ``connector_extra_config``; the message starts with the key."""


@dataclass(frozen=True)
class Options:
    backend: str | None = None  # None: decided where the worker runs (nccl with CUDA, else tcp)
    device: str | None = None
    idle_timeout_s: float = IDLE_TIMEOUT_S
    inline_bytes: int | None = None  # None: DEFAULT_INLINE_BYTES on gloo, else 0
    schedule: str = SCHEDULES[0]
    data_port: int = 0
    advertise: tuple[str, int] | None = None
    micro_batches: int = 1
    micro_batch_min_tokens: int = DEFAULT_MICRO_BATCH_MIN_TOKENS

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> Options:
        """Check every key; ``OptionError`` naming the first bad one."""
        extra = dict(extra or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise OptionError(f"{unknown[0]}: unknown key for connector torch_dist (known: {', '.join(sorted(known))})")
        backend = _choice(extra, "backend", BACKENDS, None)
        schedule = _choice(extra, "schedule", SCHEDULES, SCHEDULES[0])
        idle = extra.get("idle_timeout_s", IDLE_TIMEOUT_S)
        if isinstance(idle, bool) or not isinstance(idle, (int, float)) or not 0 < idle < float("inf"):
            raise OptionError(f"idle_timeout_s: {idle!r} is not a positive number of seconds")
        inline = extra.get("inline_bytes")
        if inline is not None and (isinstance(inline, bool) or not isinstance(inline, int) or inline < 0):
            raise OptionError(f"inline_bytes: {inline!r} is not a byte count >= 0")
        if inline and backend != "gloo":
            raise OptionError(f"inline_bytes: {inline} needs backend gloo (other backends send headers alone)")
        device = extra.get("device")
        if device is not None and (not isinstance(device, str) or backend == "tcp"):
            raise OptionError(f"device: {device!r} must be a device name, and backend tcp carries host memory only")
        if schedule == "pingpong" and backend == "nccl":
            raise OptionError("schedule: 'pingpong' needs backend gloo or tcp")
        port = extra.get("data_port", 0)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise OptionError(f"data_port: {port!r} is not a port number")
        micro = extra.get("micro_batches", 1)
        if isinstance(micro, bool) or not isinstance(micro, int) or not 1 <= micro <= MAX_MICRO_BATCHES:
            raise OptionError(f"micro_batches: {micro!r} is not an integer from 1 to {MAX_MICRO_BATCHES}")
        if micro > 1 and backend == "nccl":
            raise OptionError("micro_batches: more than 1 needs backend gloo or tcp (the CUDA-stream schedule "
                              "is not built yet)")
        least = extra.get("micro_batch_min_tokens", max(DEFAULT_MICRO_BATCH_MIN_TOKENS, micro))
        if isinstance(least, bool) or not isinstance(least, int) or least < micro:
            raise OptionError(f"micro_batch_min_tokens: {least!r} is not an integer >= micro_batches ({micro})")
        return cls(backend, device, float(idle), inline, schedule, port, _address(extra.get("advertise")), micro,
                   least)


def _choice(extra: dict[str, Any], key: str, allowed: tuple[str, ...], default: str | None) -> Any:
    value = extra.get(key, default)
    if value is not None and value not in allowed:
        raise OptionError(f"{key}: {value!r} is not one of {', '.join(allowed)}")
    return value


def _address(value: Any) -> tuple[str, int] | None:
    """``"host:port"`` (``"[v6]:port"`` too) → ``(host, port)``."""
    if value is None:
        return None
    host, sep, port = str(value).rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not isinstance(value, str) or not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise OptionError(f"advertise: {value!r} is not 'host:port'")
    return host, int(port)
