"""``torch_dist``: the AFD connector, composed of its layers.

Layers (each its own module)
    ``spec``        ``GroupSpec``: the rank's place, backend and every bound, fixed once from the config and its
                    typed link settings (``cfg.link``); no I/O. The token and the host name are read by formation
                    at each attempt.
    ``endpoints``   the attention and FFN halves of the exchange and their shared plumbing (typed errors).
    ``membership``  the FFN side's members: closed, dropped, held, aligned, taken back.
    ``formation``   the rendezvous, then the transport the backend needs.
    ``handshake``, ``session``, ``admission``: the one authenticated protocol of rendezvous and data links (its
                    lines and proofs, MAC'd messages, the host's admission); ``rendezvous`` forms the group on
                    top of it (compare, verdict, group id).
    ``transport``   the interface and typed errors; ``tcp`` (sockets, CPU default) and ``torch_group``
                    (gloo, NCCL over ``store``: records MAC'd, ``sealing``, ``addresses``) implement it.
    ``wire``        the header: encoding and the checks made before anything is allocated.
    ``schedule``    how an FFN rank takes its served ranks' messages (``batched``, ``pingpong``).
    ``liveness``    heartbeats for gloo/NCCL (tcp keeps its own alive on the links).

Group
    World size ``A + F`` in FFN-first order (``afd_patches.topology``); FFN rank 0 hosts the rendezvous at
    ``host:port`` (the host resolved once per formation attempt, ``auth.resolve``). On ``tcp`` every link is an
    authenticated session's socket: attention ranks served by FFN rank 0 keep their rendezvous session as their link;
    those served by another FFN rank open a data session at the address that rank advertised inside its
    own session with FFN rank 0 (``connector_extra_config.advertise``, else its bound address and
    ``data_port``). On gloo and NCCL the group is built over FFN rank 0's ``TCPStore`` with every record MAC'd.

Messages
    One header (``wire``) per tensor, carrying layer, step and micro-batch; a zero-row tensor (an idle
    attention rank's step) is a header alone. Every received header passes ``wire.Limits`` (layer within
    the model's exchanges per step, micro-batch, dtype, ``(tokens, hidden_size)``, token and byte bounds) before a byte
    of payload is allocated; a violation raises ``wire.BadMessage`` and breaks this group only.

Failures
    Every wait inside a step is bounded by ``timeout_s`` (an attention rank's wait for its answer under
    batched by ``answer_s``, see "Progress"); the FFN side's wait for the next step of an idle group by
    ``idle_timeout_s``. A peer whose process ended is noticed at once (its connection closes); a
    frozen one within about ``timeout_s`` (keep-alives on tcp, store heartbeats on gloo/NCCL); on tcp an FFN rank
    drops a frozen member, or one whose header is not complete ``timeout_s`` after its first byte, like a stalled
    one while others remain (``endpoints``), and fails only when it was the last. Transport
    errors are typed (``afd_patches.connectors.transport``) and re-raised with this rank, the peer and what
    was awaited in the message; after any failure the connector is broken: later calls raise
    ``ConnectorError`` and only ``close()`` is useful.

Progress (``schedule: batched``, several attention ranks per FFN rank)
    Liveness is progress, not keep-alives (a rank whose worker hangs still pings from its own thread): the
    first header of any member starts the clock and a member that has not sent its own within ``timeout_s``
    is dropped from the group's steps (``schedule``, ``membership``): logged once, sent a ``KIND_DROP`` header
    (its next call raises ``ConnectorDropped`` naming the step it missed), not waited for again; the others are
    served at once. An attention rank therefore waits up to ``2 * timeout_s`` for its answer (``answer_s``). On
    tcp FFN rank 0 takes its dropped ranks back into the live group (``rendezvous.Rejoins``, checked between
    steps, every ``endpoints.REJOIN_POLL_S`` while idle; under ``pingpong`` too, for the frozen ranks it drops):
    the re-joined rank gets a new link and is merged at a step boundary, its steps offset by a constant fixed at
    its first header (answers carry its own numbering).
    Limits: gloo and NCCL groups, and tcp ranks served by another FFN rank, take no member back: the dropped
    rank's re-formation succeeds with the next group, once the group's other ranks closed.

Threads
    One thread drives the exchange. ``close()`` may come from any thread, also during a wait: it offers
    ``CLOSE`` to every open peer (bounded by ``CLOSE_WAIT_S``), interrupts the wait, waits for it to leave
    and ends the transport. The interrupted call raises ``ConnectorClosed``.

Limits
    Sends may be asynchronous (gloo, NCCL): a tensor handed to ``send_attn_output`` must not change before
    the matching ``recv_ffn_output`` returns, one handed to ``send_ffn_output`` not before the next
    ``recv_attn_output``. Up to ``micro_batches`` exchanges are in flight per attention connector, answered
    in the order they were sent; its calls may come from several threads, one at a time (the micro-batch
    schedule hands over between them, ``afd_patches.models.microbatch``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from afd_patches import LOGGER, topology
from afd_patches.connectors import liveness, rendezvous, wire
from afd_patches.connectors.base import ConnectorError
from afd_patches.connectors.endpoints import AttentionEndpoint, FfnEndpoint
from afd_patches.connectors.handshake import Hello
from afd_patches.connectors.membership import Membership
from afd_patches.connectors.spec import CLOSE_WAIT_S, GroupSpec, SpecError
from afd_patches.connectors.transport import Transport

if TYPE_CHECKING:
    from afd_patches.config import AfdConfig

logger = logging.getLogger(LOGGER)


class TorchDistConnector(AttentionEndpoint, FfnEndpoint):
    """One AFD endpoint (attention or FFN rank); see the module docstring. The constructor does no I/O: it builds
    the rank's ``GroupSpec`` (``ConnectorError`` naming a value that cannot work); ``init()`` forms the group."""

    def __init__(self, config: AfdConfig, identity: Mapping[str, Any] | None = None) -> None:
        try:
            spec = GroupSpec.of(config, identity)
        except SpecError as e:
            raise ConnectorError(f"AFD connector: {e}") from e
        super().__init__(config, identity, spec)
        self.group = ""  # the id of the group formed last (``rendezvous``), for logs and tests
        self._heartbeat: liveness.Heartbeat | None = None

    @property
    def schedule(self) -> str:
        return self.spec.schedule

    def hello(self, purpose: str = "group", group: str = "", address: str = "") -> Hello:
        from afd_patches.connectors.torch_group import device_identity

        spec = self.spec
        fields: dict[str, Any] = {"num_attention_ranks": spec.num_attention_ranks,
                                  "num_ffn_ranks": spec.num_ffn_ranks, "backend": spec.backend,
                                  "inline_bytes": spec.inline_bytes, "schedule": spec.schedule,
                                  "micro_batches": spec.micro_batches}
        fields.update(rendezvous.model_fields(self.identity))
        return Hello(spec.role, spec.rank, fields, device_identity(spec.device), purpose, group, address)

    # ----------------------------------------------------------- lifecycle
    def init(self, wait_s: float | None = None) -> None:
        """Form the group; fail within about ``wait_s`` (default ``timeout_s``) naming host and port.

        Reads the token and resolves the host (each call: a rotated token or a changed name is seen).
        ``ConnectorAuthError`` (another token), ``ConnectorMismatch`` (settings differ), ``ConnectorTimeout``
        (a peer did not show up in time), else ``ConnectorError`` (also when ``close()`` cancelled it, or the
        token or the host cannot be used).
        """
        if self._transport is not None:
            return
        from afd_patches.connectors import formation

        spec = self.spec
        wait_s = spec.timeout_s if wait_s is None else wait_s
        formed = formation.form(spec, self.hello, self.cancelled, time.monotonic() + wait_s, wait_s)
        with self._lock:
            if self._cancel.is_set():
                formed.transport.close(clean=False)
                if formed.rejoins is not None:
                    formed.rejoins.close()
                raise ConnectorError(f"AFD connector init of {self.me()} was cancelled by close()")
            self._transport, self.group = formed.transport, formed.group
        if formed.store is not None:
            beat = liveness.Heartbeat(formed.store, spec.global_rank, list(spec.peers), spec.timeout_s, spec.beat_s,
                                      self._on_lost, f"{spec.address} (hosted by ffn rank 0)", store_rank=0)
            beat.start()
            self._heartbeat = beat
        if spec.role == topology.FFN:
            self._membership = Membership(spec, formed.transport, formed.rejoins, self._forget)

    @property
    def cancelled(self) -> Callable[[], bool]:
        return self._cancel.is_set

    def _forget(self, peer: int) -> None:
        if self._heartbeat is not None:
            self._heartbeat.forget(peer)

    def _on_lost(self, peer: int, why: str) -> None:
        """Heartbeat thread: ``peer`` is gone; interrupt a wait on it (unless it was dropped: nothing waits)."""
        if self._membership is not None and self._membership.is_dropped(peer):
            return
        self._lost[peer] = why
        logger.warning("AFD %s: lost %s: %s", self.me(), self.describe(peer), why)
        if self._transport is not None:
            self._transport.interrupt(peer)

    def close(self) -> None:
        """Offer ``CLOSE`` to every open peer (bounded), interrupt a wait in progress (from any thread), end
        the transport. Idempotent; never hangs."""
        with self._lock:
            self._cancel.set()
            transport, self._transport = self._transport, None
        if transport is None:
            return
        clean = (self._broken is None or self._all_closed()) and not self._lost
        if clean:
            clean = self._offer_close(transport)
        interrupted = bool(self._busy)  # on NCCL an abandoned receive stays queued: abort, never shut down
        for peer in self.spec.peers:
            transport.interrupt(peer)
        left = time.monotonic() + CLOSE_WAIT_S
        while self._busy and time.monotonic() < left:  # the interrupted call leaves within milliseconds
            time.sleep(0.005)
        if self._heartbeat is not None:
            self._heartbeat.stop(clean=clean)
            self._heartbeat = None
        if self._membership is not None:
            self._membership.close()
        self._broken = self._broken or "closed"
        transport.close(clean and not interrupted)

    def _open_peers(self) -> list[int]:
        """The peers still listening: the FFN side's members, or the attention side's FFN rank unless it closed."""
        if self._membership is not None:
            return self._membership.members()
        return [p for p in self.spec.peers if p not in self._closed_peers]

    def _all_closed(self) -> bool:
        if self._membership is not None:
            return self._membership.all_closed()
        return set(self.spec.peers) <= self._closed_peers

    def _offer_close(self, transport: Transport) -> bool:
        try:
            handles = [transport.send(p, wire.words(wire.KIND_CLOSE), None) for p in self._open_peers()]
            for handle in [*self._pending, *handles]:
                handle.wait(self.spec.close_wait_s)
        except ConnectorError:
            return False  # the peer is gone or not listening; we are leaving anyway
        finally:
            self._pending.clear()
        return True
