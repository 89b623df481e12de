"""How a role worker makes its connector: ``model_identity`` and ``build_connector``.

Contract: ``model_identity`` is what both roles must agree on before they exchange (read from vLLM's configs
and the AFD model, the same on both roles for the same checkpoint and settings); ``build_connector`` makes,
without connecting, the connector class that ``cfg.connector`` names in ``afd_patches.connectors.REGISTRY``,
carrying that identity. Both role workers (``afd_patches.workers.attention``, ``afd_patches.workers.ffn``)
build every connector of every group through it (``afd_patches.workers.regroup.FormationLoop``).
"""

from __future__ import annotations

import importlib
from typing import Any

from afd_patches.config import AfdConfig
from afd_patches.connectors import REGISTRY
from afd_patches.connectors.base import Connector


def model_identity(vllm_config: Any, model: Any = None) -> dict[str, Any]:
    """What both roles must agree on: architecture, layer count, hidden size, dtype, max batched tokens, and
    with the AFD ``model`` the exchanges per step (``afd_exchanges_per_step``: the bound of a header's layer).

    Read from vLLM's model and scheduler config (after ``hf_overrides``), so it
    costs nothing and is the same on both roles for the same checkpoint and
    settings. A value vLLM does not expose is ``None`` and is then not
    compared. The connector also bounds every received tensor header by
    ``hidden_size``, ``dtype`` and ``max_num_batched_tokens`` before it allocates.
    """
    mc = vllm_config.model_config
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    archs = list(getattr(mc, "architectures", None) or getattr(hf, "architectures", None) or [])
    identity = {
        "architecture": archs[0] if archs else None,
        "num_hidden_layers": getattr(hf, "num_hidden_layers", None),
        "hidden_size": getattr(hf, "hidden_size", None),
        "dtype": str(getattr(mc, "dtype", "")).removeprefix("torch.") or None,
        "max_num_batched_tokens": getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens",
                                          None),
    }
    if model is not None:
        identity["exchanges_per_step"] = model.afd_exchanges_per_step()
    return identity


def build_connector(cfg: AfdConfig, identity: dict[str, Any] | None = None) -> Connector:
    """Instantiate (not yet ``init()``) the connector named by ``cfg.connector``, with the model's identity."""
    ref = REGISTRY[cfg.connector]
    module, _, name = ref.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(cfg, identity=identity)  # type: ignore[no-any-return]
