"""Connectors carry hidden states between the attention and FFN roles.

``REGISTRY`` maps a connector name (the ``connector`` key of the AFD config) to
its class as a lazy ``module:Class`` string; nothing is imported until a
connector is built.
"""

from __future__ import annotations

REGISTRY: dict[str, str] = {
    "torch_dist": "afd_patches.connectors.torch_dist:TorchDistConnector",
}
