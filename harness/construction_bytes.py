"""Bytes allocated while vLLM builds a model, per AFD role, counted in-process with vLLM's own loader.

``measure(model_dir, arch, roles)`` builds a ``VllmConfig`` with ``EngineArgs``
(the AFD plugin loaded, ``hf_overrides`` / ``additional_config`` as an AFD
engine would pass them), initializes a one-rank gloo parallel state, and calls
the model loader's ``create_model`` under the loader's own default dtype and
target device, inside ``AllocationCounter``. No weights are loaded and no engine
is started. Each role is measured against the parameter bytes of a plain vLLM
build of the same checkpoint, split into FFN (a decoder layer's modules named in
``afd_patches.workers.role.FFN_ATTRS``) and non-FFN parameters.

``AllocationCounter`` is a ``TorchDispatchMode``: every ATen call's outputs
whose storage is not one of its inputs' storages count as new allocations, on
every device but ``meta`` (each storage once per call). It counts bytes
allocated over the block, freed or not (not a peak). Limits: tensors made
without an ATen call (``torch.tensor`` from Python data, ``from_numpy``) are not
seen; those are tiny at construction time. vLLM's rotary-embedding cache is
shared across builds in one process, so it is cleared before each build (each
build then pays for its own).

    python -m harness.construction_bytes FAMILY=MODEL_DIR... [--role plain --role attention --role ffn]

prints one ``RESULT {json}`` line per model and role (plain is always built: it is the reference).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from afd_patches.workers.role import FFN_ATTRS
from harness.engine import ARCH
from harness.engine_args import checkpoint_dtype
from harness.env import free_port
from harness.tiny_model import register_configs

ROLES = ("plain", "attention", "ffn")
FFN_PARAM = re.compile(rf"(^|\.)layers\.\d+\.({'|'.join(FFN_ATTRS)})\.")  # a decoder layer's FFN parameter


class AllocationCounter(TorchDispatchMode):
    """Sums the bytes of new storages that ATen calls return while active (``total``, ``by_device``)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_device: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_device.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        known = {_storage_key(t) for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                key = _storage_key(t)
                if key not in known:
                    known.add(key)
                    self.by_device[str(t.device)] += t.untyped_storage().nbytes()
        return out


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    if t.device.type == "meta":
        return ("meta", id(t))
    return (str(t.device), t.untyped_storage().data_ptr())


def param_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of ``model``'s parameters (each storage once): FFN (decoder layers' ``FFN_PARAM``) and the rest."""
    seen: set[int] = set()
    out = {"ffn": 0, "non_ffn": 0}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.device.type == "meta" or p.untyped_storage().data_ptr() in seen:
            continue
        seen.add(p.untyped_storage().data_ptr())
        out["ffn" if FFN_PARAM.search(name) else "non_ffn"] += p.untyped_storage().nbytes()
    return out


def _vllm_config(model_dir: Path, arch: str | None, role: str) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    kwargs: dict[str, Any] = dict(model=str(model_dir), enforce_eager=True, skip_tokenizer_init=True,
                                  dtype=checkpoint_dtype(model_dir))
    if role != "plain":
        kwargs["hf_overrides"] = {"architectures": [arch]}
        kwargs["additional_config"] = {"afd": {"role": role, "connector": "torch_dist", "port": free_port()}}
    return EngineArgs(**kwargs).create_engine_config()


def _init_parallel_state() -> None:
    """A one-rank gloo world; model-parallel groups rebuilt for the current vLLM config (MoE adds EP)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    else:
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                    distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    parallel_state.initialize_model_parallel(1, 1)


def _clear_rope_cache() -> None:
    from vllm.model_executor.layers import rotary_embedding

    cache = getattr(rotary_embedding, "_ROPE_DICT", None)
    if isinstance(cache, dict):
        cache.clear()


def build_counted(model_dir: Path, arch: str | None, role: str) -> tuple[torch.nn.Module, AllocationCounter, Any]:
    """Build ``role``'s model (``arch`` is the AFD architecture; ignored for ``plain``) under the counter."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_config = _vllm_config(model_dir, arch, role)
    with set_current_vllm_config(vllm_config):
        _init_parallel_state()
    _clear_rope_cache()
    model_config = vllm_config.model_config
    loader = get_model_loader(vllm_config.load_config)
    device = vllm_config.load_config.device or vllm_config.device_config.device
    counter = AllocationCounter()
    with set_default_torch_dtype(model_config.dtype), torch.device(device), counter:
        model = loader.create_model(vllm_config=vllm_config, model_config=model_config)
    return model, counter, vllm_config


def measure(model_dir: Path, arch: str, roles: tuple[str, ...] = ROLES) -> dict[str, dict[str, Any]]:
    """Per role: bytes allocated while building, parameter bytes held, and the plain model's parameter split."""
    reference, plain_counter, _ = build_counted(model_dir, None, "plain")
    split = param_bytes(reference)
    results: dict[str, dict[str, Any]] = {}
    for role in roles:
        if role == "plain":
            model, counter, context = reference, plain_counter, None
        else:
            model, counter, vllm_config = build_counted(model_dir, arch, role)
            context = vllm_config.compilation_config.static_forward_context
        held = param_bytes(model)
        results[role] = {
            "allocated": counter.total, "by_device": dict(counter.by_device),
            "params_held": held["ffn"] + held["non_ffn"],
            "plain_ffn_params": split["ffn"], "plain_non_ffn_params": split["non_ffn"],
            "forward_context": sorted(context) if context is not None else None,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", metavar="FAMILY=MODEL_DIR", help=f"FAMILY: {', '.join(ARCH)}")
    parser.add_argument("--role", action="append", choices=ROLES)
    args = parser.parse_args()
    register_configs()
    for item in args.models:
        family, sep, model_dir = item.partition("=")
        if not sep or family not in ARCH:
            parser.error(f"{item!r}: expected FAMILY=MODEL_DIR with FAMILY one of {', '.join(ARCH)}")
        for role, result in measure(Path(model_dir), ARCH[family], tuple(args.role or ROLES)).items():
            print("RESULT " + json.dumps({"family": family, "role": role, **result}), flush=True)


if __name__ == "__main__":
    main()
