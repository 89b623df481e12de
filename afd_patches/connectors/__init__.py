"""Connectors carry hidden states between the attention and FFN roles.

``REGISTRY`` maps a connector name (the ``connector`` key of the AFD config) to
its class as a lazy ``module:Class`` string; nothing is imported until a
connector is built. ``OPTIONS`` maps it to the class whose ``parse`` checks its
``connector_extra_config`` (no torch import: the front end calls it).
"""

from __future__ import annotations

REGISTRY: dict[str, str] = {
    "torch_dist": "afd_patches.connectors.torch_dist:TorchDistConnector",
}
OPTIONS: dict[str, str] = {
    "torch_dist": "afd_patches.connectors.options:Options",
}
