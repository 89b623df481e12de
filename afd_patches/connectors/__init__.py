"""Connectors carry hidden states between the attention and FFN roles.

``REGISTRY`` maps a connector name (the ``connector`` key of the AFD config) to
its class as a lazy ``module:Class`` string; nothing is imported until a
connector is built. Its ``connector_extra_config`` is declared and checked with
the rest of the config (``afd_patches.config.LinkConfig``).
"""

from __future__ import annotations

REGISTRY: dict[str, str] = {
    "torch_dist": "afd_patches.connectors.torch_dist:TorchDistConnector",
}
