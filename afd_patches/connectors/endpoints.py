"""The two halves of the ``torch_dist`` connector's exchange, over one ``Transport``: the attention side's send and
receive (``AttentionEndpoint``) and the FFN side's (``FfnEndpoint``), on the shared plumbing of ``Endpoint``.

``Endpoint`` runs every transport call as a wait ``close()`` can interrupt (``_io``) and turns the transport's
typed errors into the connector's, naming this rank, the peer the error is about (the error's own peer where it
names one) and what was awaited; after a failure the connector is broken. The lifecycle (forming the group,
liveness, ``close()``) is ``afd_patches.connectors.torch_dist``'s.

The FFN side serves its members through a ``schedule`` and a ``Membership`` (its own state: closed, dropped,
held, aligned). While more than one member is open, a member whose link times out (silent for ``alive_s``:
frozen; or a header trickled past its bound) is dropped like one that missed a ``batched`` step, and the others
are served on; a lone member's timeout fails the connector as before (nothing else would be served).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from afd_patches import topology
from afd_patches.connectors import schedule, wire
from afd_patches.connectors.base import (
    Connector,
    ConnectorClosed,
    ConnectorDropped,
    ConnectorError,
    ConnectorTimeout,
    Meta,
)
from afd_patches.connectors.spec import GroupSpec
from afd_patches.connectors.transport import (
    BackendError,
    LinkClosed,
    LinkError,
    LinkInterrupted,
    LinkTimeout,
    PeerSilent,
    Transport,
)
from afd_patches.metrics import METRICS

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from afd_patches.config import AfdConfig
    from afd_patches.connectors.membership import Membership

REJOIN_POLL_S = 0.1  # while a rank is dropped, an idle FFN rank 0 looks for its re-join this often


class _Spared(Exception):
    """A member's link timed out and the member was dropped instead of failing the connector."""


class Endpoint(Connector):
    """Plumbing shared by both halves: the transport, the bounded and interruptible waits, the typed errors."""

    def __init__(self, config: AfdConfig, identity: Mapping[str, Any] | None, spec: GroupSpec) -> None:
        super().__init__(config, identity)
        self.spec = spec
        self._transport: Transport | None = None
        self._membership: Membership | None = None  # FFN side, once the group formed
        self._pending: list[Any] = []  # send handles not yet known complete
        self._closed_peers: set[int] = set()  # attention side: the FFN rank sent CLOSE
        self._lost: dict[int, str] = {}
        self._broken: str | None = None
        self._cancel = threading.Event()
        self._lock = threading.Lock()  # guards _busy (threads inside a transport call) and the cancel check
        self._busy = 0
        self._sent_at: dict[int, float] = {}  # attention side: micro-batch -> when its hidden states were sent
        self._out_device = spec.device  # attention side: where the answer goes (the hidden states' device)
        self._answer: list[int] = []  # FFN side: the peers whose inputs the last recv_attn_output returned
        self._received_at = 0.0

    def describe(self, peer: int) -> str:
        return self.spec.describe(peer)

    def me(self) -> str:
        return self.spec.me()

    def _check(self, role: str) -> Transport:
        if self.spec.role != role:
            raise ConnectorError(f"{self.me()} cannot call a {role}-side method")
        if self._cancel.is_set():
            raise ConnectorClosed(f"AFD connector of {self.me()} was closed by this side")
        lost = next((p for p in self.spec.peers if p in self._lost), None)
        if lost is not None and self._broken is None:
            self._broken = f"lost {self.describe(lost)}"
            raise PeerSilent(lost, f"AFD {self.me()}: lost {self.describe(lost)}: {self._lost[lost]}")
        if self._broken is not None:
            raise ConnectorError(f"AFD connector of {self.me()} is unusable: {self._broken}")
        if self._transport is None:
            raise ConnectorError(f"AFD connector of {self.me()} is not initialised (call init())")
        return self._transport

    def _io(self, what: str, peer: int, call: Callable[[], Any],
            spare: Callable[[LinkError], bool] | None = None) -> Any:
        """Run one transport call, counted as a wait ``close()`` interrupts; errors named and typed. ``spare(err)``
        True: the error cost its peer its membership, not the connector (``_Spared`` is raised)."""
        with self._lock:
            if self._cancel.is_set():
                raise ConnectorClosed(f"AFD connector of {self.me()} was closed by this side")
            self._busy += 1
        try:
            return call()
        except LinkError as e:
            if spare is not None and not self._cancel.is_set() and spare(e):
                raise _Spared from e
            raise self._fail(e, e.peer, what) from e
        except wire.BadMessage as e:
            raise self._fail(e, peer, what) from e
        finally:
            with self._lock:
                self._busy -= 1

    def _fail(self, err: ConnectorError, peer: int, what: str) -> ConnectorError:
        """Mark the connector broken; ``err`` (typed, see ``transport``) with this rank, the peer and ``what``."""
        self._broken = f"{type(err).__name__} with {self.describe(peer)}"
        me, who = self.me(), self.describe(peer)
        if self._cancel.is_set():
            return ConnectorClosed(f"AFD {me}: closed by this side while waiting for {what}")
        if isinstance(err, LinkInterrupted) and peer in self._lost:
            return PeerSilent(peer, f"AFD {me}: lost {who} during {what}: {self._lost[peer]}")
        if isinstance(err, LinkClosed) and self.spec.role == topology.ATTENTION:
            farewell = self._farewell(peer)
            if farewell is not None:
                return self._dropped_error(peer, farewell)
        if isinstance(err, LinkClosed):
            text = f"lost {who} during {what}: its connection closed, so the process crashed or exited ({err})"
        elif isinstance(err, PeerSilent):
            text = f"lost {who} during {what}: {err}"
        elif isinstance(err, LinkTimeout):
            text = f"no {what} from/to {who} in time ({err})"
        elif isinstance(err, BackendError):
            text = f"{err} during {what} with {who} (a backend failure, not a lost connection)"
        else:
            text = f"{what} with {who}: {err}"
        return type(err)(peer, f"AFD {me}: {text}") if isinstance(err, LinkError) else type(err)(f"AFD {me}: {text}")

    def _drain(self) -> None:
        """Wait until this side's own sends completed. Called before the next send and after a received payload,
        never between a header and its payload: a send above ``inline_bytes`` completes only once the peer posts
        its receive, and with two micro-batches in flight each side may be waiting for the other's payload."""
        pending, self._pending = self._pending, []
        for handle in pending:
            self._io("a send", self.spec.peers[0], lambda h=handle: h.wait(self.spec.timeout_s))

    def _send(self, transport: Transport, peer: int, tensor: torch.Tensor, layer: int, step: int,
              microbatch: int) -> None:
        words = wire.words(wire.KIND_DATA, layer, step, tensor, microbatch=microbatch)
        self._pending.append(self._io(f"the send of layer {layer} step {step}", peer,
                                      lambda: transport.send(peer, words, tensor)))
        nbytes = tensor.numel() * tensor.element_size()
        self.messages_sent += 1
        METRICS.add("bytes_sent", nbytes)
        if layer == 0 and nbytes == 0 and microbatch == 0:
            METRICS.add("idle_steps")

    def _payload(self, transport: Transport, peer: int, header: wire.Header, what: str,
                 spare: Callable[[LinkError], bool] | None = None) -> torch.Tensor:
        try:
            nbytes = self.spec.limits.check(header)
        except wire.BadMessage as e:
            raise self._fail(e, peer, what) from e
        return self._io(what, peer,  # type: ignore[no-any-return]
                        lambda: transport.payload(peer, header, nbytes, self.spec.timeout_s), spare)

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(self.spec.device).contiguous()

    def _farewell(self, peer: int) -> wire.Header | None:
        """After the link to ``peer`` closed: its ``KIND_DROP`` header, if that already arrived (read without
        waiting), else ``None``."""
        assert self._transport is not None
        try:
            header = self._transport.next_header(peer, 0.0)
        except (LinkError, wire.BadMessage):
            return None
        return header if header.kind == wire.KIND_DROP else None

    def _dropped_error(self, peer: int, header: wire.Header) -> ConnectorDropped:
        self._broken = f"dropped by {self.describe(peer)}"
        return ConnectorDropped(
            f"AFD {self.me()}: {self.describe(peer)} dropped this rank from the group's steps: it sent nothing for "
            f"layer {header.layer} step {header.step} micro-batch {header.microbatch} within the FFN's timeout_s of "
            "the other attention ranks (this worker stalled or froze); the others were served on, and a new "
            "connector re-joins the group")


class AttentionEndpoint(Endpoint):
    """The attention side: one FFN rank, ``spec.peers[0]``."""

    def send_attn_output(self, hidden: torch.Tensor, layer: int, step: int, microbatch: int = 0) -> None:
        """Send this rank's MLP input of ``layer`` at ``step`` (``(0, hidden)`` when idle) to its FFN rank."""
        transport = self._check(topology.ATTENTION)
        self._drain()
        self._sent_at[microbatch], self._out_device = time.perf_counter(), hidden.device
        self._send(transport, self.spec.peers[0], self._wire(hidden), layer, step, microbatch)

    def recv_ffn_output(self, layer: int, step: int, microbatch: int = 0) -> torch.Tensor:
        """The FFN's output for ``layer``/``step``/``microbatch``, on the device the hidden states were sent
        from. Answers come in the order the messages were sent (the FFN serves them in arrival order)."""
        transport = self._check(topology.ATTENTION)
        peer, what = self.spec.peers[0], f"the FFN output of layer {layer} step {step} micro-batch {microbatch}"
        header = self._io(what, peer, lambda: transport.next_header(peer, self.spec.answer_s))
        if header.kind == wire.KIND_CLOSE:
            self._closed_peers.add(peer)
            self._broken = f"{self.describe(peer)} closed"
            raise ConnectorClosed(f"AFD {self.me()}: {self.describe(peer)} closed while {what} was awaited")
        if header.kind == wire.KIND_DROP:
            raise self._dropped_error(peer, header)
        if (header.layer, header.step, header.microbatch) != (layer, step, microbatch):
            self._broken = "layer/step/micro-batch mismatch"
            raise ConnectorError(f"AFD {self.me()}: expected {what}, got layer {header.layer} step {header.step} "
                                 f"micro-batch {header.microbatch} from {self.describe(peer)}")
        out = self._payload(transport, peer, header, what)
        self._drain()  # after the payload: the FFN takes a later micro-batch's payload only once this answer went
        self.messages_received += 1
        METRICS.add("exchanges")
        METRICS.add("bytes_received", out.numel() * out.element_size())
        METRICS.observe(time.perf_counter() - self._sent_at.get(microbatch, 0.0))
        return out.to(self._out_device)


class FfnEndpoint(Endpoint):
    """The FFN side: the attention ranks in ``spec.peers``, served through ``spec.schedule``."""

    def recv_attn_output(self) -> tuple[Meta, list[torch.Tensor]]:
        """One layer's MLP inputs from the served attention ranks, in rank order (``schedule``).

        ``Meta.shape`` is the shape of their concatenation. A rank not part of this batch (closed, dropped, or
        not first under ``pingpong``) gets a zero-row slot and is sent nothing. ``ConnectorClosed`` once every
        member closed.
        """
        transport = self._check(topology.FFN)
        assert self._membership is not None
        received: dict[int, torch.Tensor] = {}
        while not received:  # empty only when the one member taken was dropped for its payload (``spare``)
            inbox = _Inbox(self, transport, self._membership)
            got = self._next_batch(inbox)
            first = got[0][1]
            what = f"the attention output of layer {first.layer} step {first.step}"
            for peer, header in got:  # a member whose payload does not come within timeout_s may be dropped
                try:
                    received[peer] = self._payload(transport, peer, header, what, inbox.spare)
                except _Spared:
                    continue
        self._drain()  # after the payloads: an attention rank takes this answer only once its next input went
        self.messages_received += len(received)
        METRICS.add("bytes_received", sum(t.numel() * t.element_size() for t in received.values()))
        self._received_at = time.perf_counter()
        self._answer = list(received)
        self._membership.served(first.step)
        template = next(iter(received.values()))
        tensors = [received.get(p, template.new_empty((0, *template.shape[1:]))) for p in self.spec.peers]
        rows = sum(t.shape[0] for t in tensors)
        return Meta(first.layer, first.step, (rows, *first.shape[1:]), first.dtype, first.microbatch), tensors

    def _next_batch(self, inbox: _Inbox) -> list[tuple[int, wire.Header]]:
        try:
            return schedule.SCHEDULES[self.spec.schedule](inbox)
        except ConnectorClosed:
            self._broken = "all served attention ranks closed"
            raise ConnectorClosed(f"AFD {self.me()}: every served attention rank closed") from None
        except ConnectorError as e:
            if self._broken is None:
                self._broken = str(e)
                raise type(e)(f"AFD {self.me()}: {e}") from e
            raise

    def send_ffn_output(self, outputs: list[torch.Tensor], meta: Meta) -> None:
        """Send ``outputs[i]`` to the i-th served attention rank, tagged with ``meta``'s layer, step and
        micro-batch (only to the ranks whose inputs the last ``recv_attn_output`` returned)."""
        transport = self._check(topology.FFN)
        assert self._membership is not None
        peers = self.spec.peers
        if len(outputs) != len(peers):
            raise ConnectorError(f"AFD {self.me()}: {len(outputs)} outputs for {len(peers)} attention ranks")
        # The FFN's own time stops here: a send that wakes the attention rank can hand it this core.
        elapsed = time.perf_counter() - self._received_at
        self._drain()
        for tensor, peer in zip(outputs, peers, strict=True):
            if peer in self._answer:
                step = self._membership.to_own(peer, meta.step)  # in the peer's own numbering
                self._send(transport, peer, self._wire(tensor), meta.layer, step, meta.microbatch)
        METRICS.add("exchanges")
        METRICS.observe(elapsed)


class _Inbox:
    """The FFN endpoint and its membership as a ``schedule.Inbox``."""

    def __init__(self, endpoint: FfnEndpoint, transport: Transport, membership: Membership) -> None:
        self.endpoint, self.transport, self.members = endpoint, transport, membership
        self.timeout_s = endpoint.spec.timeout_s
        self.last: wire.Header | None = None  # the last header this call took: the step a dropped member missed

    def open_peers(self) -> list[int]:
        return self.members.members()

    def header(self, peer: int, idle: bool) -> wire.Header | None:
        held = self.members.take_held(peer)
        if held is not None:
            return held  # held before alignment: its step is the rank's own
        spec = self.endpoint.spec
        bound = spec.idle_timeout_s if idle else spec.timeout_s
        try:
            header = self.endpoint._io("the next attention output", peer,
                                       lambda: self.transport.next_header(peer, bound), self.spare)
        except _Spared:
            return None
        if header.kind == wire.KIND_CLOSE:
            self.members.closed(peer)
            return None
        self.last = self.members.to_group(peer, header)
        return self.last

    def first(self, peers: list[int], timeout_s: float | None = None, lone: bool = False) -> int | None:
        members = self.members
        peers = [p for p in peers if p in members.members()]  # one may have been dropped since the caller looked
        if not peers:
            return None
        held = members.holding(peers)
        if held is not None:
            return held
        if timeout_s is not None:
            return self._first(peers, timeout_s)
        idle_s = self.endpoint.spec.idle_timeout_s
        end = time.monotonic() + idle_s
        while not members.readmit():
            peers = [p for p in peers if p in members.members()]
            if not peers:
                return None  # a member was dropped: the members changed
            rejoining = members.rejoining
            if lone and len(peers) == 1 and not rejoining:
                return peers[0]  # header(idle=True) waits for it: one wait instead of two
            left = end - time.monotonic()
            if left <= 0:
                raise ConnectorTimeout(f"no attention rank sent anything within {idle_s:g}s")
            peer = self._first(peers, min(left, REJOIN_POLL_S) if rejoining else left)
            if peer is not None:
                return peer
        return None

    def _first(self, peers: list[int], timeout_s: float) -> int | None:
        """The first of ``peers`` whose header arrived within ``timeout_s``; a member dropped meanwhile (``spare``)
        leaves the others waiting until the same deadline."""
        deadline = time.monotonic() + timeout_s
        while peers:
            left = max(deadline - time.monotonic(), 0.0)
            try:
                return self.endpoint._io(  # type: ignore[no-any-return]
                    "the next attention output", peers[0],
                    lambda p=peers, s=left: self.transport.first(p, s), self.spare)
            except _Spared:
                peers = [p for p in peers if p in self.members.members()]
        return None

    def spare(self, err: LinkError) -> bool:
        """A member's link timed out, or (on tcp, where each member has its own socket) closed because its process
        died, while others remain: drop it (True) instead of failing the connector."""
        members = self.members.members()
        lost = isinstance(err, LinkTimeout) or (isinstance(err, LinkClosed) and self.endpoint.spec.backend == "tcp")
        if not lost or err.peer not in members or len(members) < 2:
            return False
        at = self.last or wire.Header(wire.KIND_DATA, 0, self.members.next_step, 0, (), "", False)
        bound = f" (its link's bound: timeout_s={self.timeout_s:g}s)" if isinstance(err, LinkTimeout) else ""
        self.members.drop(err.peer, at, f"{err}{bound}")
        return True

    def drop(self, peer: int, at: wire.Header, why: str) -> None:
        self.members.drop(peer, at, why)

    def aligned(self, peer: int) -> bool:
        return self.members.aligned(peer)

    def align(self, peer: int, header: wire.Header, step: int) -> wire.Header:
        return self.members.align(peer, header, step)

    def hold(self, peer: int, header: wire.Header) -> None:
        self.members.hold(peer, header)

    def next_step(self) -> int:
        return self.members.next_step

    def describe(self, peer: int) -> str:
        return self.endpoint.describe(peer)
