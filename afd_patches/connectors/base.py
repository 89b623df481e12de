"""The connector contract between the attention role and the FFN role.

Per decoder layer and forward step, an attention rank sends the hidden states
that would enter the layer's MLP/MoE (``send_attn_output``) and receives the
MLP output back (``recv_ffn_output``). An FFN rank receives from every attention
rank it serves (``recv_attn_output``), runs the FFN once on all of them, and
sends each rank its slice back (``send_ffn_output``).

Every message carries ``Meta`` (layer, step, shape, dtype, micro-batch), so a mismatch
between the roles is detected instead of silently mixing tensors. Every receive
waits at most ``timeout_s`` and then raises ``ConnectorTimeout`` naming the
peer; a peer that closed raises ``ConnectorClosed``.

Before the roles exchange anything, ``init()`` checks that both sides were
configured alike (rank counts, transport settings, and the model identity the
creator passed as ``identity``); a difference raises ``ConnectorMismatch`` on
both sides, naming the field and both values.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from afd_patches.config import AfdConfig


class ConnectorError(RuntimeError):
    """Base of connector failures."""


class ConnectorTimeout(ConnectorError):
    """The peer did not answer within ``timeout_s``."""


class ConnectorClosed(ConnectorError):
    """The peer shut down (normal end of an FFN loop)."""


class ConnectorDropped(ConnectorError):
    """The FFN rank dropped this attention rank from a batched step it did not send within ``timeout_s`` of the
    other ranks (a stalled worker); this connector is unusable, a new one re-joins the group."""


class ConnectorMismatch(ConnectorError):
    """The two sides were configured differently; the message names each field and both values."""


class ConnectorAuthError(ConnectorError):
    """The rendezvous' shared secret differs between the two sides (nothing else was revealed)."""


@dataclass(frozen=True)
class Meta:
    layer: int
    step: int
    shape: tuple[int, ...]
    dtype: str
    microbatch: int = 0


class Connector(ABC):
    """One endpoint. Built from the AFD config; ``init()`` connects, ``close()`` releases.

    ``identity`` describes the model this side runs (JSON values, e.g.
    ``architecture``, ``num_hidden_layers``, ``hidden_size``, ``dtype``; see
    ``afd_patches.workers.connection.model_identity``). Connectors compare it with
    the peer's in ``init()``: keys both sides supplied must be equal.
    """

    def __init__(self, config: AfdConfig, identity: Mapping[str, Any] | None = None) -> None:
        self.config = config
        self.identity: dict[str, Any] = dict(identity or {})
        self.messages_sent = 0
        self.messages_received = 0

    @abstractmethod
    def init(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    # attention side
    @abstractmethod
    def send_attn_output(self, hidden: torch.Tensor, layer: int, step: int, microbatch: int = 0) -> None: ...

    @abstractmethod
    def recv_ffn_output(self, layer: int, step: int, microbatch: int = 0) -> torch.Tensor: ...

    # FFN side: one tensor per served attention rank, in rank order
    @abstractmethod
    def recv_attn_output(self) -> tuple[Meta, list[torch.Tensor]]: ...

    @abstractmethod
    def send_ffn_output(self, outputs: list[torch.Tensor], meta: Meta) -> None: ...
