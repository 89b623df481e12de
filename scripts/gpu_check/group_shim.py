"""A standalone torch.distributed group without vLLM, for ``scripts/gpu_check`` on a machine that has torch
with CUDA but no vLLM wheel.

``install()`` registers a module ``vllm.distributed.utils`` whose only member is
``stateless_init_torch_distributed_process_group`` with the keyword interface the
AFD connector calls (``host``, ``port``, ``rank``, ``world_size``, ``backend``,
``timeout``). It builds the group from torch's own classes: a ``TCPStore`` at
``host:port`` (``multi_tenant``, so rank 0 reuses the store the connector's
handshake already started there), a ``PrefixStore``, and one gloo or NCCL backend
registered on a ``ProcessGroup``; the NCCL backend gets ``timeout`` as its
options' ``_timeout`` (the watchdog's bound), as vLLM's CUDA platform does. It is
installed only where ``import vllm`` fails (or when forced), so a machine with
vLLM checks vLLM's helper instead. Not for production use: the connector uses
vLLM's helper inside vLLM.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def stateless_init_torch_distributed_process_group(*, host: str, port: int, rank: int, world_size: int,
                                                   backend: str, timeout: timedelta) -> Any:
    """A process group of ``world_size`` ranks that touches no global torch.distributed state."""
    store = dist.TCPStore(host, port, world_size, rank == 0, timeout, wait_for_workers=False, multi_tenant=True)
    prefixed = dist.PrefixStore(f"tcp://{host}:{port}", store)
    group = dist.ProcessGroup(prefixed, rank, world_size)
    if backend == "gloo":
        impl: Any = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        kind, device = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        impl = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        kind, device = dist.ProcessGroup.BackendType.NCCL, torch.device("cuda")
    else:
        raise ValueError(f"backend {backend!r}: gloo or nccl")
    group._set_default_backend(kind)
    group._register_backend(device, kind, impl)
    return group


def install(force: bool = False) -> bool:
    """Register the shim as ``vllm.distributed.utils`` unless vLLM is importable (or ``force``); True if it did."""
    if not force and importlib.util.find_spec("vllm") is not None:
        return False
    module = types.ModuleType("vllm.distributed.utils")
    module.stateless_init_torch_distributed_process_group = stateless_init_torch_distributed_process_group  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.distributed"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["vllm.distributed.utils"] = module
    return True
