"""How an FFN rank takes its served attention ranks' next messages: ``batched`` or ``pingpong``.

``batched`` (default): the next header of every open served rank, in rank order; the first is waited for
as long as the group may idle (``idle_timeout_s``), the others for ``timeout_s``. Every rank must then agree
on layer, step, micro-batch, dtype and trailing dimensions (else ``ConnectorError``), and one FFN call
serves them all. It needs every served rank to step: idle attention ranks send zero-token steps.

``pingpong``: the header of whichever open served rank sent first (``Transport.first``), so one rank's
attention overlaps another's FFN and idle ranks send nothing.

Either way a ``CLOSE`` header marks that rank closed and the wait goes on with the others;
``ConnectorClosed`` once every served rank closed. The connector loads the payloads afterwards.
"""

from __future__ import annotations

from typing import Protocol

from afd_patches.connectors import wire
from afd_patches.connectors.base import ConnectorClosed, ConnectorError


class Inbox(Protocol):
    """What a schedule needs from the connector."""

    def open_peers(self) -> list[int]: ...

    def header(self, peer: int, idle: bool) -> wire.Header | None:
        """``peer``'s next data header, or ``None`` for a ``CLOSE`` (the peer is then closed)."""

    def first(self, peers: list[int]) -> int:
        """The first of ``peers`` whose next header arrived (bounded by the idle timeout)."""

    def describe(self, peer: int) -> str: ...


def batched(inbox: Inbox) -> list[tuple[int, wire.Header]]:
    while True:
        peers = inbox.open_peers()
        if not peers:
            raise ConnectorClosed("every served attention rank closed")
        got = [(p, h) for i, p in enumerate(peers) if (h := inbox.header(p, idle=i == 0)) is not None]
        if got:
            break
    first_peer, first = got[0]
    for peer, other in got[1:]:
        if (other.layer, other.step, other.microbatch) != (first.layer, first.step, first.microbatch):
            raise ConnectorError(f"attention ranks out of step: {inbox.describe(first_peer)} sent layer "
                                 f"{first.layer} step {first.step}, {inbox.describe(peer)} sent layer {other.layer} "
                                 f"step {other.step}")
        if other.dtype != first.dtype or other.shape[1:] != first.shape[1:] or not other.shape:
            raise ConnectorError(f"layer {first.layer} step {first.step}: {inbox.describe(peer)} sent "
                                 f"{other.dtype}{list(other.shape)}, {inbox.describe(first_peer)} sent "
                                 f"{first.dtype}{list(first.shape)}; they cannot be batched")
    return got


def pingpong(inbox: Inbox) -> list[tuple[int, wire.Header]]:
    while True:
        peers = inbox.open_peers()
        if not peers:
            raise ConnectorClosed("every served attention rank closed")
        peer = inbox.first(peers)
        header = inbox.header(peer, idle=True)
        if header is not None:
            return [(peer, header)]


SCHEDULES = {"batched": batched, "pingpong": pingpong}
