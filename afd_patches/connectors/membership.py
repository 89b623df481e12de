"""``Membership``: which of an FFN rank's served attention ranks take part in the group's steps.

A served rank is a *member* unless it closed (its ``CLOSE`` header) or was dropped. A member is dropped
(``drop``) when it missed a ``batched`` step by ``timeout_s`` (``schedule``), or, while others remain, when its
link timed out under any schedule: silent for ``alive_s`` (frozen: not even its keep-alive thread runs), or a
header not complete ``timeout_s`` after its first byte (a trickle); on tcp also when its link closed without its
``CLOSE`` (its process died). A dropped rank is logged once and sent a
``KIND_DROP`` header naming the step it missed (in its own numbering), its link is closed, and it is not waited
for again; on FFN rank 0 of a tcp group serving several ranks (``GroupSpec.takes_back``) it re-joins the live
group (``readmit``, through ``rendezvous.Rejoins``) with a new link.

Step numbering: a re-joined rank numbers its steps its own way, and so does every member of a new group under
``batched`` with several members (attention engines that outlived an FFN restart keep counting from where their
last group ended, each from its own number). Until its first header fixes its offset (``align``, ``batched``
only) it is not *aligned*; headers held for a later batch (``hold``) are returned first
(``take_held``). ``to_group``/``to_own`` convert a step between the rank's numbering and the group's.

Threads: one, the FFN rank's serving thread (``is_dropped`` may be read from the heartbeat thread).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from afd_patches import LOGGER, topology
from afd_patches.connectors import rendezvous, wire
from afd_patches.connectors.spec import GroupSpec
from afd_patches.connectors.transport import Transport

logger = logging.getLogger(LOGGER)


class Membership:
    """The FFN side's members (see the module docstring). ``forget(peer)``: stop watching a peer's liveness
    (heartbeats on gloo/NCCL) once it closed or was dropped."""

    def __init__(self, spec: GroupSpec, transport: Transport, rejoins: rendezvous.Rejoins | None,
                 forget: Callable[[int], None]) -> None:
        self.spec, self._transport, self._rejoins, self._forget = spec, transport, rejoins, forget
        self._closed: set[int] = set()
        self._dropped: dict[int, str] = {}  # peer -> why
        self._offset: dict[int, int | None] = {}  # peer -> its step minus the group's (None: not aligned yet)
        if spec.schedule == "batched" and len(spec.peers) > 1:
            # a new group's attention ranks keep their own step numbers from earlier groups (an FFN restart): each
            # is aligned at its first header, as a re-joined rank is
            self._offset = dict.fromkeys(spec.peers, None)
        self._held: dict[int, wire.Header] = {}  # re-joined peers' headers waiting for a step boundary
        self._next_step = 0  # the group's step after the last one served

    # ---------------------------------------------------------------- who
    def members(self) -> list[int]:
        """Served ranks neither closed nor dropped, in rank order."""
        return [p for p in self.spec.peers if p not in self._closed and p not in self._dropped]

    def all_closed(self) -> bool:
        return set(self.spec.peers) <= self._closed

    def is_dropped(self, peer: int) -> bool:
        return peer in self._dropped

    @property
    def rejoining(self) -> bool:
        """A dropped rank may come back (so an idle wait looks for it every ``REJOIN_POLL_S``)."""
        return self._rejoins is not None and bool(self._dropped)

    def closed(self, peer: int) -> None:
        """``peer`` sent ``CLOSE``: no longer a member, no longer watched."""
        self._closed.add(peer)
        self._forget(peer)

    # ---------------------------------------------------------------- steps
    @property
    def next_step(self) -> int:
        """The group's step after the last one served."""
        return self._next_step

    def served(self, step: int) -> None:
        """The group's ``step`` was served."""
        self._next_step = max(self._next_step, step + 1)

    def aligned(self, peer: int) -> bool:
        """False for a re-joined rank whose step offset is not fixed yet."""
        return peer not in self._offset or self._offset[peer] is not None

    def align(self, peer: int, header: wire.Header, step: int) -> wire.Header:
        """Fix ``peer``'s offset so that ``header`` is the group's ``step``; the header in that numbering."""
        self._offset[peer] = header.step - step
        return header._replace(step=step)

    def to_group(self, peer: int, header: wire.Header) -> wire.Header:
        """``peer``'s ``header`` with its step in the group's numbering (unchanged while not aligned)."""
        offset = self._offset.get(peer)
        return header._replace(step=header.step - offset) if offset else header

    def to_own(self, peer: int, step: int) -> int:
        """The group's ``step`` in ``peer``'s own numbering."""
        return step + (self._offset.get(peer) or 0)

    def hold(self, peer: int, header: wire.Header) -> None:
        """Keep ``header`` for a later batch (``take_held`` returns it first)."""
        self._held[peer] = header

    def holding(self, peers: list[int]) -> int | None:
        """The first of ``peers`` with a held header, or ``None``."""
        return next((p for p in peers if p in self._held), None)

    def take_held(self, peer: int) -> wire.Header | None:
        """``peer``'s held header (its step is the rank's own), or ``None``."""
        return self._held.pop(peer, None)

    # ---------------------------------------------------------------- drop and take back
    def drop(self, peer: int, at: wire.Header, why: str) -> None:
        """Drop ``peer`` (see the module docstring); ``at``: the step it missed, in the group's numbering once it
        is aligned (else its own header). Logged once; the peer is sent ``KIND_DROP`` naming that step in its own
        numbering; its link is closed."""
        if peer in self._dropped:
            return  # dropped already (its link timed out before the schedule's own bound)
        spec = self.spec
        back = ("once it re-joins (FFN rank 0 takes it back at a step boundary)" if self._rejoins is not None else
                f"with the next group (a {spec.backend} group, or one hosted by another FFN rank, takes no member "
                "back; the next forms once the other ranks closed)")
        logger.warning("AFD %s: dropped %s from the group's steps: %s; the other ranks are served on, it is served "
                       "again %s", spec.me(), spec.describe(peer), why, back)
        self._dropped[peer] = why
        self._held.pop(peer, None)
        step = at.step + (self._offset.pop(peer, 0) or 0)  # not aligned yet: ``at`` is its own header
        self._forget(peer)
        self._transport.drop(peer, wire.words(wire.KIND_DROP, at.layer, step, microbatch=at.microbatch))

    def readmit(self) -> bool:
        """FFN rank 0 on tcp: answer re-join sessions (``rendezvous.Rejoins``); give each dropped rank that
        re-joined its new link, not aligned yet. True if one came back."""
        if self._rejoins is None:
            return False
        from afd_patches.connectors.tcp import TcpTransport

        a, f = self.spec.num_attention_ranks, self.spec.num_ffn_ranks
        dropped = {topology.role_of_global(p, a, f): p for p in self._dropped}
        back = self._rejoins.take(set(dropped))
        for key, joined in back.items():
            peer = dropped[key]
            assert isinstance(self._transport, TcpTransport)
            self._transport.add(peer, *joined.session.detach())
            del self._dropped[peer]
            self._offset[peer] = None if self.spec.schedule == "batched" else 0
            logger.warning("AFD %s: %s re-joined the group; it is served again from its next step boundary",
                           self.spec.me(), self.spec.describe(peer))
        return bool(back)

    def close(self) -> None:
        """Stop taking ranks back."""
        if self._rejoins is not None:
            self._rejoins.close()
