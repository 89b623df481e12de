"""The same changes afd's 0.32 manifest makes, written by hand in plain Python (benchmark baseline).

What a careful plugin author writes without patchkit: closures around the four
``EngineArgs`` methods (descriptors kept), the worker override, and the model
registrations. It has no fingerprints, no guards, no reports, no rollback. By
default it registers the models when vLLM's registry module is imported (now,
if it already is; else from a small post-import hook, so that the front end,
which imports the registry later, gets them too); ``register(eager=True)``
imports the registry first, as vLLM's plugin docs show.
Used by ``benchmarks/table.py``; not part of the plugin.
"""

from __future__ import annotations

import sys
from typing import Any

MODELS = {
    "AFDLlamaForCausalLM": "afd_patches.models.simple:AFDLlamaForCausalLM",
    "AFDQwen3ForCausalLM": "afd_patches.models.simple:AFDQwen3ForCausalLM",
    "AFDQwen3MoeForCausalLM": "afd_patches.models.simple:AFDQwen3MoeForCausalLM",
    "AFDDeepseekV2ForCausalLM": "afd_patches.models.deepseek_v2:AFDDeepseekV2ForCausalLM",
    "AFDDeepseekV3ForCausalLM": "afd_patches.models.deepseek_v2:AFDDeepseekV3ForCausalLM",
}
WORKERS = {"attention": "afd_patches.workers.cpu.CpuAttentionWorker", "ffn": "afd_patches.workers.cpu.CpuFfnWorker"}
_done = False


REGISTRY = "vllm.model_executor.models.registry"


def _register_models(module: Any) -> None:
    for arch, ref in MODELS.items():
        module.ModelRegistry.register_model(arch, ref)


class _AfterRegistryImport:
    """A meta-path finder that registers the models right after vLLM's registry module runs."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != REGISTRY:
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            _register_models(module)

        spec.loader.exec_module = exec_then_register
        return spec


def register(eager: bool = False) -> None:
    """Apply the changes once per process. ``eager``: import vLLM's model registry now
    (``from vllm import ModelRegistry``, as vLLM's plugin docs show) and register the models."""
    global _done
    if _done:
        return
    _done = True
    from vllm.engine.arg_utils import EngineArgs

    from afd_patches.patches import cli_flags, engine_config

    create = EngineArgs.create_engine_config

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        was_auto = self.worker_cls == "auto"
        config = engine_config.validate_afd_config(create, self, *args, **kwargs)
        role = engine_config.role_of(config)
        if role is not None and was_auto:
            config.parallel_config.worker_cls = WORKERS[role]
        return config

    add_cli_args = EngineArgs.add_cli_args  # a staticmethod, read through the class: a plain function

    def add(parser: Any) -> Any:
        return cli_flags.add_afd_cli_args(add_cli_args, parser)

    from_cli_args = vars(EngineArgs)["from_cli_args"].__func__

    def from_cli(cls: Any, args: Any) -> Any:
        return cli_flags.afd_from_cli_args(from_cli_args, cls, args)

    EngineArgs.create_engine_config = create_engine_config
    EngineArgs.add_cli_args = staticmethod(add)
    EngineArgs.from_cli_args = classmethod(from_cli)
    if eager:
        from vllm import ModelRegistry  # noqa: F401 - imports vllm.model_executor.models.registry
    if REGISTRY in sys.modules:
        _register_models(sys.modules[REGISTRY])
    else:
        sys.meta_path.insert(0, _AfterRegistryImport())
