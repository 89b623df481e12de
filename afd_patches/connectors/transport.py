"""What the connector needs from a tensor transport, and the typed errors every transport raises.

A transport links this rank to its peers (global ranks) once the group formed and moves headers and
tensors between them. ``afd_patches.connectors.tcp`` (plain sockets, the CPU default) and
``afd_patches.connectors.torch_group`` (gloo or NCCL point-to-point) implement it; the connector and
the schedules (``afd_patches.connectors.schedule``) use nothing else.

Contract
    ``send(peer, words, tensor)`` hands one message over: the header ``words`` (``wire.words``; the
    transport sets the inline flag where it has that form) and ``tensor`` (``None``: a bare header). It
    returns a ``Handle`` whose ``wait()`` returns once the bytes left this process (gloo/NCCL sends are
    asynchronous; tcp's are complete on return). The tensor must not change until then.
    ``next_header(peer, timeout_s)`` returns the next header from ``peer``, decoded (``wire.BadMessage``
    on garbage; tcp's keep-alives never show);
    ``payload(peer, header, nbytes, timeout_s)`` the tensor that header announced (``wire.Limits`` checked it
    first). ``first(peers, timeout_s)`` returns the first of ``peers`` whose next header arrived (then
    ``next_header`` returns it at once), or ``None``. ``interrupt(peer)`` makes a wait on ``peer`` return with
    ``LinkInterrupted`` (from any thread); ``drop(peer, words)`` (FFN side, ``schedule: batched``) hands
    ``peer`` the ``KIND_DROP`` header ``words`` without waiting on it and stops taking anything from it: tcp
    closes that link (``TcpTransport.add`` gives a re-joined rank a new one), gloo/NCCL ignore its arrivals
    from then on. ``close(clean)`` ends the transport.

Errors (no caller ever reads an error's text to tell them apart)
    ``LinkClosed``: the peer closed its end or its process died. ``LinkTimeout``: nothing arrived in time.
    ``PeerSilent``: not even a keep-alive arrived for the liveness bound (a frozen or vanished peer).
    ``LinkInterrupted``: this side interrupted the wait (``close()``, a peer reported lost).
    ``BackendError``: the backend itself failed (e.g. NCCL), with its own text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from afd_patches.connectors.base import ConnectorError, ConnectorTimeout

if TYPE_CHECKING:
    import torch

    from afd_patches.connectors.wire import Header


class LinkError(ConnectorError):
    """A link to one peer failed; ``peer`` is its global rank."""

    def __init__(self, peer: int, message: str) -> None:
        super().__init__(message)
        self.peer = peer


class LinkClosed(LinkError):
    """The peer closed its end, or its process ended."""


class LinkTimeout(LinkError, ConnectorTimeout):
    """Nothing arrived from the peer in time."""


class PeerSilent(LinkTimeout):
    """Not even a keep-alive arrived from the peer for the liveness bound: frozen, or gone unannounced."""


class LinkInterrupted(LinkError):
    """This side interrupted the wait (``close()``, or the peer was reported lost)."""


class BackendError(LinkError):
    """The backend failed in a way that says nothing about the peer (an NCCL error, say)."""


class Handle:
    """A completed send (what tcp returns); asynchronous transports return their own."""

    def wait(self, timeout_s: float | None = None) -> None:
        return None


DONE = Handle()


class Transport(ABC):
    """Links from this rank to its peers; see the module docstring for the contract."""

    device_type: str = "cpu"

    @abstractmethod
    def send(self, peer: int, words: list[int], tensor: torch.Tensor | None) -> Handle: ...

    @abstractmethod
    def next_header(self, peer: int, timeout_s: float) -> Header: ...

    @abstractmethod
    def payload(self, peer: int, header: Header, nbytes: int, timeout_s: float) -> torch.Tensor: ...

    @abstractmethod
    def first(self, peers: list[int], timeout_s: float) -> int | None: ...

    @abstractmethod
    def interrupt(self, peer: int) -> None: ...

    @abstractmethod
    def drop(self, peer: int, words: list[int]) -> None: ...

    @abstractmethod
    def close(self, clean: bool) -> None: ...
