"""Wrappers around ``EngineArgs.create_engine_config`` (the front end builds the config there),
and ``role_of``, which the manifest's worker overrides ask at that call.

Imported in every vLLM process the plugin runs in: ``afd_patches.config`` (a frozen
dataclass, JSON Schema) is loaded only when an engine asks for AFD.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from afd_patches import CONFIG_KEY


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
    """Check ``additional_config["afd"]`` before any config is built (with vLLM's data-parallel settings,
    ``afd_patches.compat.data_parallel``); store it normalized; apply AFD's compilation rules around
    vLLM's (``afd_patches.compat.compilation``)."""
    additional = getattr(engine_args, "additional_config", None) or {}
    if CONFIG_KEY in additional:
        from afd_patches.compat import data_parallel
        from afd_patches.config import parse  # only runs that ask for AFD pay for jsonschema

        require_active_plan()
        cfg = parse(data_parallel.check_front_end(engine_args, additional[CONFIG_KEY]))
        engine_args.additional_config = {**additional, CONFIG_KEY: cfg.to_dict()}
        if cfg.role == "ffn":
            engine_args.enable_prefix_caching = False  # the FFN role has no KV cache to share
        from vllm.platforms import current_platform

        from afd_patches.compat import compilation

        compilation.before_config(engine_args, cfg.role, current_platform.is_cuda())
        vllm_config = original(engine_args, *args, **kwargs)
        compilation.after_config(vllm_config, cfg.role)
        return vllm_config
    return original(engine_args, *args, **kwargs)
