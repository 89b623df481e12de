"""What needs to know vLLM: model registration, worker overrides, and which model runner a process will use.

Neither imports vLLM at module import time. Model registrations run when
``vllm.model_executor.models.registry`` is imported (importing it eagerly costs
about 2 s), and pass the ``"module:Class"`` string through, so vLLM imports the
model class only when a model of that architecture is loaded.

The worker override wraps the function that builds the engine config. It looks
at ``worker_cls`` *before* the platform resolves ``"auto"`` to its default
worker, and only then replaces it; an explicit user choice is kept, with a
warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from patchkit.plan import Runtime, runtime_verdict

logger = logging.getLogger("patchkit")

V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"  # vLLM's V1 model runner (deleted in vLLM 0.34)


def model_runner_hint() -> str:
    """Which vLLM model runner this installation and environment give an engine, as far as it is known before
    an engine config exists (``patchkit plan``).

    ``v2`` when this vLLM has no V1 runner (0.34 on); else what ``VLLM_USE_V2_MODEL_RUNNER`` says, read through
    vLLM's own ``envs``; else vLLM decides per engine (``VllmConfig.use_v2_model_runner``: Triton, the engine's
    features), and only a process's report can say (``facts.model_runner``, noted by the plugin's worker once
    it built its runner). Imports ``vllm.envs``; never raises."""
    import importlib.util

    try:
        if importlib.util.find_spec(V1_RUNNER_MODULE) is None:
            return "v2 (this vLLM has no V1 model runner)"
        from vllm import envs

        chosen = getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", None)
    except Exception as exc:  # noqa: BLE001 - a broken probe must not break the command (e.g. a malformed value)
        return f"unknown (vLLM could not tell: {type(exc).__name__})"
    if chosen is None:
        return "chosen by vLLM per engine (VLLM_USE_V2_MODEL_RUNNER unset); each process's report names it"
    return f"{'v2' if chosen else 'v1'} (VLLM_USE_V2_MODEL_RUNNER)"

def register_model(registry_module: ModuleType, arch: str, class_ref: str) -> Callable[[], None]:
    """Register ``arch`` lazily; return a function that restores the previous registration."""
    registry = registry_module.ModelRegistry
    previous = registry.models.get(arch)
    registry.register_model(arch, class_ref)

    def undo() -> None:
        if previous is None:
            registry.models.pop(arch, None)
        else:
            registry.models[arch] = previous

    return undo


def worker_cls_name(ref: str) -> str:
    """``pkg.mod:Cls`` → ``pkg.mod.Cls`` (the form vLLM's ``worker_cls`` takes)."""
    return ref.replace(":", ".")


def worker_wrapper(role_of: Callable[[Any], str | None], overrides: list[dict[str, Any]], runtime: Runtime,
                   static: list[str | None]) -> Callable[..., Any]:
    """Wrapper for ``EngineArgs.create_engine_config`` that applies the role → worker table.

    ``role_of(config)``: the plugin's function (the manifest's ``role_of``) naming the role, or None.
    ``static[i]``: why override ``i``'s static guards (vLLM, commit, Python) fail, or None; decided
    when the plan was compiled. Its platform/env guards are decided here, at config time."""

    def choose(role: str) -> str:
        for o, static_reason in zip(overrides, static, strict=True):
            if o["role"] == role and not (static_reason or runtime_verdict(o.get("when", {}), runtime)):
                return worker_cls_name(o["class"])
        raise ValueError(f"no worker class for role {role!r} on platform {runtime.platform!r}")

    def create_engine_config(original: Callable[..., Any], engine_args: Any, *args: Any, **kwargs: Any) -> Any:
        was_auto = getattr(engine_args, "worker_cls", "auto") == "auto"
        config = original(engine_args, *args, **kwargs)
        role = role_of(config)
        if role is None:
            return config
        chosen = choose(role)
        if was_auto:
            config.parallel_config.worker_cls = chosen
        else:
            logger.warning("patchkit: worker_cls=%s was set explicitly; not replacing it with %s (role %s)",
                           config.parallel_config.worker_cls, chosen, role)
        return config

    return create_engine_config
