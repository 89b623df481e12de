"""How an FFN rank takes its served attention ranks' next messages: ``batched`` or ``pingpong``.

``batched`` (default): one header from every member (an open served rank not dropped), one FFN call for
them all. Liveness is progress, not keep-alives: the first header of any member starts the clock (until
then the wait is bounded by ``idle_timeout_s`` only) and every other member has ``timeout_s`` from that
moment. A member that misses it is dropped (``Inbox.drop``): logged once naming the rank, what was awaited
and the bound, its link ended with a ``KIND_DROP`` header, so the rank gets ``ConnectorDropped`` when it
wakes; the others are served at once, their rows untouched. No member waits longer than ``timeout_s``
behind another. The members served must agree on layer, step, micro-batch, dtype and trailing dimensions
(else ``ConnectorError``). It needs every member to step: idle attention ranks send zero-token steps.

Re-joined ranks (see ``afd_patches.connectors.torch_dist``): a rank that re-joined numbers its steps its
own way, so it is *aligned* at its first header, which must start a step (layer 0, micro-batch 0; else it is
dropped again): it is merged into the first batch at a step boundary (its header is held meanwhile, at most
one step) and its step offset is fixed there (``Inbox.align``); steps are compared in the group's numbering.

``pingpong``: the header of whichever open served rank sent first (``Inbox.first``), so one rank's
attention overlaps another's FFN, idle ranks send nothing and a stalled rank blocks nobody.

Either way a ``CLOSE`` header marks that rank closed and the wait goes on with the others;
``ConnectorClosed`` once every member closed. The connector loads the payloads afterwards.
"""

from __future__ import annotations

import time
from typing import Protocol

from afd_patches.connectors import wire
from afd_patches.connectors.base import ConnectorClosed, ConnectorError


class Inbox(Protocol):
    """What a schedule needs from the connector."""

    timeout_s: float

    def open_peers(self) -> list[int]:
        """The members: served ranks neither closed nor dropped, in rank order."""

    def header(self, peer: int, idle: bool) -> wire.Header | None:
        """``peer``'s next data header (a held one first; the step in the group's numbering once aligned), or
        ``None`` for a ``CLOSE`` (the peer is then closed) or when the peer was dropped (its link timed out)."""

    def first(self, peers: list[int], timeout_s: float | None = None, lone: bool = False) -> int | None:
        """The first of ``peers`` whose next header arrived (a held one at once; a peer no longer a member is
        not waited for). ``timeout_s`` ``None``: the idle wait (``ConnectorTimeout`` at ``idle_timeout_s``;
        ``None`` when the members changed: a dropped rank re-joined, or a member was dropped because its link
        timed out); else ``None`` after ``timeout_s``. ``lone``: ``peers`` are all the members and no
        receive of theirs is in flight, so a single one may be returned at once (``header(peer, idle=True)``
        then waits for it)."""

    def drop(self, peer: int, at: wire.Header, why: str) -> None:
        """Drop ``peer`` from the group's steps (see the module docstring): ``at`` is the step it missed (in the
        group's numbering, or its own header before it is aligned); ``why`` completes the log line."""

    def aligned(self, peer: int) -> bool:
        """False for a re-joined rank whose step offset is not fixed yet."""

    def align(self, peer: int, header: wire.Header, step: int) -> wire.Header:
        """Fix ``peer``'s offset so that ``header`` is the group's ``step``; the header in that numbering."""

    def hold(self, peer: int, header: wire.Header) -> None:
        """Keep ``header`` for a later batch (``first`` and ``header`` return it first)."""

    def next_step(self) -> int:
        """The group's step after the last one served."""

    def describe(self, peer: int) -> str: ...


def batched(inbox: Inbox) -> list[tuple[int, wire.Header]]:
    while True:
        members = inbox.open_peers()
        if not members:
            raise ConnectorClosed("every served attention rank closed")
        got = _gather(inbox, members)
        batch = _align(inbox, got) if got else []
        if batch:
            return batch


def _gather(inbox: Inbox, members: list[int]) -> dict[int, wire.Header]:
    """One header per member: the first ends the idle wait, the rest get ``timeout_s`` from it, or are dropped."""
    got: dict[int, wire.Header] = {}
    waiting, deadline = list(members), 0.0
    while waiting:
        clock = None if not got else max(deadline - time.monotonic(), 0.0)
        peer = inbox.first(waiting, clock, lone=len(waiting) == len(members))
        if peer is None:
            if clock is None:
                return got  # a dropped rank re-joined during the idle wait: the members changed
            first_peer, first = next(iter(got.items()))
            for late in waiting:
                inbox.drop(late, first, f"it sent no layer {first.layer} step {first.step} micro-batch "
                                        f"{first.microbatch} within timeout_s={inbox.timeout_s:g}s of "
                                        f"{inbox.describe(first_peer)}")
            break
        waiting.remove(peer)
        header = inbox.header(peer, idle=not got)
        if header is None:
            continue
        if not got:
            deadline = time.monotonic() + inbox.timeout_s
        got[peer] = header
    return got


def _align(inbox: Inbox, got: dict[int, wire.Header]) -> list[tuple[int, wire.Header]]:
    """The headers served together: the aligned ranks' (which must agree), and re-joined ranks' at a step
    boundary; a re-joined rank's header at another layer is held."""
    batch: list[tuple[int, wire.Header]] = []
    for peer, header in sorted(got.items(), key=lambda item: not inbox.aligned(item[0])):  # aligned first
        if not inbox.aligned(peer):
            if (header.layer, header.microbatch) != (0, 0):
                inbox.drop(peer, header, f"its first message after re-joining was layer {header.layer} micro-batch "
                                 f"{header.microbatch}, not the start of a step")
                continue
            if batch and (batch[0][1].layer, batch[0][1].microbatch) != (0, 0):
                inbox.hold(peer, header)
                continue
            header = inbox.align(peer, header, batch[0][1].step if batch else inbox.next_step())
        if batch:
            _agree(inbox, batch[0], (peer, header))
        batch.append((peer, header))
    return batch


def _agree(inbox: Inbox, first: tuple[int, wire.Header], other: tuple[int, wire.Header]) -> None:
    (first_peer, a), (peer, b) = first, other
    if (b.layer, b.step, b.microbatch) != (a.layer, a.step, a.microbatch):
        raise ConnectorError(f"attention ranks out of step: {inbox.describe(first_peer)} sent layer {a.layer} step "
                             f"{a.step}, {inbox.describe(peer)} sent layer {b.layer} step {b.step}")
    if b.dtype != a.dtype or b.shape[1:] != a.shape[1:] or not b.shape:
        raise ConnectorError(f"layer {a.layer} step {a.step}: {inbox.describe(peer)} sent {b.dtype}{list(b.shape)}, "
                             f"{inbox.describe(first_peer)} sent {a.dtype}{list(a.shape)}; they cannot be batched")


def pingpong(inbox: Inbox) -> list[tuple[int, wire.Header]]:
    while True:
        peers = inbox.open_peers()
        if not peers:
            raise ConnectorClosed("every served attention rank closed")
        peer = inbox.first(peers)
        header = inbox.header(peer, idle=True) if peer is not None else None
        if header is not None:
            return [(peer, header)]  # type: ignore[list-item]


SCHEDULES = {"batched": batched, "pingpong": pingpong}
