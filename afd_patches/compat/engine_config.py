"""Wrappers around ``EngineArgs.create_engine_config`` (the front end builds the config there),
and ``role_of``, which the manifest's worker overrides ask at that call.

Imported in every vLLM process the plugin runs in: ``afd_patches.config`` (a frozen
dataclass, JSON Schema) is loaded only when an engine asks for AFD.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from afd_patches import CONFIG_KEY

_EAGER_LOGGED: list[bool] = []  # the "enforce_eager forced" line is logged once per process


class AfdUnavailable(RuntimeError):
    """AFD was asked for, but this process has no active AFD plan."""


def require_active_plan() -> None:
    """Raise AfdUnavailable unless a pinned afd manifest is active in this process and every
    requirement of it that fails on drift holds for the running vLLM (checked here, once)."""
    import patchkit  # public API only, and only runs that ask for AFD get here

    status = patchkit.status("afd")
    if status is None:
        raise AfdUnavailable("the afd plugin did not run in this process (is VLLM_PLUGINS excluding 'afd'?)")
    if not status.active:
        raise AfdUnavailable(f"the afd patch plan is not active: {status.problem}")
    if status.fallback:
        raise AfdUnavailable(
            f"vLLM {status.vllm_version} is not supported by afd-plugin; supported: {status.supported}"
        )
    drifted = [v for v in status.requirements if v.fails]
    if drifted:
        raise AfdUnavailable(
            f"vLLM {status.vllm_version} no longer has what afd-plugin relies on ("
            + "; ".join(v.describe() for v in drifted)
            + "); AFD is refused, a run without AFD is unaffected. See docs/manifests.md, 'requires'."
        )


def role_of(vllm_config: Any) -> str | None:
    """Role of the engine being configured, or None when AFD is off (the manifest's worker overrides)."""
    additional = getattr(vllm_config, "additional_config", None)
    if not additional or CONFIG_KEY not in additional:
        return None
    from afd_patches.config import parse

    return parse(additional[CONFIG_KEY]).role


def validate_afd_config(original: Callable[..., Any], engine_args: Any, *args: Any, **kwargs: Any) -> Any:
    """Check ``additional_config["afd"]`` before any config is built; store it normalized."""
    additional = getattr(engine_args, "additional_config", None) or {}
    if CONFIG_KEY in additional:
        from afd_patches.config import parse  # only runs that ask for AFD pay for jsonschema

        require_active_plan()
        cfg = parse(additional[CONFIG_KEY])
        engine_args.additional_config = {**additional, CONFIG_KEY: cfg.to_dict()}
        if cfg.role == "ffn":
            engine_args.enable_prefix_caching = False  # the FFN role has no KV cache to share
        _force_eager(engine_args, cfg.role)
    return original(engine_args, *args, **kwargs)


def _force_eager(engine_args: Any, role: str) -> None:
    """AFD runs both roles with ``enforce_eager=True``: the per-layer exchange is a Python call with host
    synchronisation, which torch.compile would trace into and CUDA-graph capture cannot contain."""
    if getattr(engine_args, "enforce_eager", False):
        return
    engine_args.enforce_eager = True
    if not _EAGER_LOGGED:
        _EAGER_LOGGED.append(True)
        logging.getLogger("afd").warning(
            "AFD: enforce_eager=True forced for the %s role (no torch.compile or CUDA graphs across the "
            "per-layer exchange)", role)
