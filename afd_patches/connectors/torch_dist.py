"""``torch_dist``: the AFD connector, composed of its layers.

Layers (each its own module)
    ``session``     the one authenticated protocol of rendezvous and data links (admission, proofs, MAC'd
                    messages); ``rendezvous`` forms the group on top of it (compare, verdict, group id).
    ``transport``   the interface and typed errors; ``tcp`` (sockets, CPU default) and ``torch_group``
                    (gloo, NCCL; store records MAC'd) implement it.
    ``wire``        the header: encoding and the checks made before anything is allocated.
    ``schedule``    how an FFN rank takes its served ranks' messages (``batched``, ``pingpong``).
    ``liveness``    heartbeats for gloo/NCCL (tcp keeps its own alive on the links).

Group
    World size ``A + F`` in FFN-first order (``afd_patches.topology``); FFN rank 0 hosts the rendezvous at
    ``host:port`` (the host resolved once, ``auth.resolve``). On ``tcp`` every link is an authenticated
    session's socket: attention ranks served by FFN rank 0 keep their rendezvous session as their link;
    those served by another FFN rank open a data session at the address that rank advertised inside its
    own session with FFN rank 0 (``options.advertise``, else its bound address and ``data_port``). On gloo
    and NCCL the group is built over FFN rank 0's ``TCPStore`` with every record MAC'd.

Messages
    One header (``wire``) per tensor, carrying layer, step and micro-batch; a zero-row tensor (an idle
    attention rank's step) is a header alone. Every received header passes ``wire.Limits`` (layer within
    the model's exchanges per step, micro-batch, dtype, ``(tokens, hidden_size)``, token and byte bounds) before a byte
    of payload is allocated; a violation raises ``wire.BadMessage`` and breaks this group only.

Failures
    Every wait inside a step is bounded by ``timeout_s`` (an attention rank's wait for its answer under
    batched by ``answer_s``, see "Progress"); the FFN side's wait for the next step of an idle group by
    ``idle_timeout_s``. A peer whose process ended is noticed at once (its connection closes); a
    frozen one within about ``timeout_s`` (keep-alives on tcp, store heartbeats on gloo/NCCL). Transport
    errors are typed (``afd_patches.connectors.transport``) and re-raised with this rank, the peer and what
    was awaited in the message; after any failure the connector is broken: later calls raise
    ``ConnectorError`` and only ``close()`` is useful.

Progress (``schedule: batched``, several attention ranks per FFN rank)
    Liveness is progress, not keep-alives (a rank whose worker hangs still pings from its own thread): the
    first header of any member starts the clock and a member that has not sent its own within ``timeout_s``
    is dropped from the group's steps (``schedule``): logged once, sent a ``KIND_DROP`` header (its next
    call raises ``ConnectorDropped`` naming the step it missed), not waited for again; the others are served
    at once. An attention rank therefore waits up to ``2 * timeout_s`` for its answer (``answer_s``). On tcp
    FFN rank 0 takes its dropped ranks back into the live group (``rendezvous.Rejoins``, checked between
    steps, every ``REJOIN_POLL_S`` while idle): the re-joined rank gets a new link and is merged at a step
    boundary, its steps offset by a constant fixed at its first header (answers carry its own numbering).
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
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from afd_patches import LOGGER, topology
from afd_patches.config import DEFAULT_INLINE_BYTES, HOST_BACKENDS
from afd_patches.connectors import auth, liveness, rendezvous, schedule, wire
from afd_patches.connectors.base import (
    Connector,
    ConnectorClosed,
    ConnectorDropped,
    ConnectorError,
    ConnectorTimeout,
    Meta,
)
from afd_patches.connectors.handshake import Hello
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

logger = logging.getLogger(LOGGER)

_TOKENLESS_WARNED: set[str] = set()  # group addresses this process warned about (once each)
CLOSE_WAIT_S = 2.0  # how long close() waits for each peer to take its CLOSE header


class TorchDistConnector(Connector):
    """One AFD endpoint (attention or FFN rank); see the module docstring."""

    def __init__(self, config: AfdConfig, identity: Mapping[str, Any] | None = None) -> None:
        super().__init__(config, identity)
        a, f = config.num_attention_ranks, config.num_ffn_ranks
        try:
            topology.validate(a, f)
            self.global_rank = topology.global_rank(config.role, config.rank, a, f)
            self.options = config.link
        except ValueError as e:
            raise ConnectorError(f"AFD connector: {e}") from e
        self.world_size, self.role = a + f, config.role
        if self.role == topology.ATTENTION:
            self.peers = [topology.global_rank(topology.FFN, topology.ffn_rank_of(config.rank, a, f), a, f)]
        else:
            self.peers = [topology.global_rank(topology.ATTENTION, i, a, f)
                          for i in topology.attention_ranks_of(config.rank, a, f)]
        opts = self.options
        self.backend = opts.backend or ("nccl" if torch.cuda.is_available() else "tcp")
        if opts.device:
            self.device = torch.device(opts.device)
        else:
            self.device = torch.device("cpu") if self.backend in HOST_BACKENDS else torch.device(
                "cuda", torch.cuda.current_device())
        self.timeout_s, self.idle_timeout_s = float(config.timeout_s), opts.idle_timeout_s
        # an attention rank's wait for its answer: under batched with several ranks per FFN rank the FFN may
        # first wait timeout_s for the others ("Progress")
        self.answer_s = self.timeout_s * (2 if opts.schedule == "batched" and a > f else 1)
        self.inline_bytes = opts.inline_bytes if opts.inline_bytes is not None else (
            DEFAULT_INLINE_BYTES if self.backend == "gloo" else 0)
        self.schedule = opts.schedule
        ident = self.identity
        exchanges = ident.get("exchanges_per_step") or ident.get("num_hidden_layers")  # a header's layer bound
        self.limits = wire.Limits(exchanges, ident.get("hidden_size"), ident.get("dtype"),
                                  ident.get("max_num_batched_tokens"), opts.micro_batches, self.inline_bytes)
        try:
            self.token = auth.load_token(config.token_file)
            self.host = auth.resolve(config.host)
            auth.check_policy(self.host, self.token, config.allow_unauthenticated)
        except (auth.TokenError, OSError) as e:
            raise ConnectorError(f"AFD rendezvous at {config.host}:{config.port}: {e}") from None
        if self.token is None and self.address not in _TOKENLESS_WARNED:
            _TOKENLESS_WARNED.add(self.address)
            logger.warning("AFD group at %s has no token: any local user (or anyone who reaches the port) can join "
                           "it, or take the port while the FFN is down and answer as an FFN; %s; %s", self.address,
                           auth.HOW_TO_SET, auth.HOW_TO_MAKE)
        self.group = ""  # the id of the group formed last (``rendezvous``), for logs and tests
        self._transport: Transport | None = None
        self._heartbeat: liveness.Heartbeat | None = None
        self._pending: list[Any] = []  # send handles not yet known complete
        self._answer: list[int] = []  # the peers whose inputs the last recv_attn_output returned
        self._closed_peers: set[int] = set()
        self._lost: dict[int, str] = {}
        self._broken: str | None = None
        self._cancel = threading.Event()
        self._lock = threading.Lock()  # guards _busy (threads inside a transport call) and the cancel check
        self._busy = 0
        self._sent_at: dict[int, float] = {}  # micro-batch -> when its hidden states were sent
        self._received_at = 0.0
        self._out_device = self.device
        # FFN side, schedule batched (see "Progress"): dropped peers (why), their re-joining, step alignment
        self._dropped: dict[int, str] = {}
        self._rejoins: rendezvous.Rejoins | None = None
        self._offset: dict[int, int | None] = {}  # peer -> its step minus the group's (None: not aligned yet)
        self._held: dict[int, wire.Header] = {}  # re-joined peers' headers waiting for a step boundary
        self._next_step = 0  # the group's step after the last one served

    # ---------------------------------------------------------------- naming
    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.config.port}"

    def describe(self, peer: int) -> str:
        role, rank = topology.role_of_global(peer, self.config.num_attention_ranks, self.config.num_ffn_ranks)
        return f"{role} rank {rank} (global rank {peer} of {self.world_size}, group at {self.address})"

    def me(self) -> str:
        return f"{self.role} rank {self.config.rank} (global rank {self.global_rank})"

    def hello(self, purpose: str = "group", group: str = "", address: str = "") -> Hello:
        from afd_patches.connectors.torch_group import device_identity

        fields: dict[str, Any] = {"num_attention_ranks": self.config.num_attention_ranks,
                                  "num_ffn_ranks": self.config.num_ffn_ranks, "backend": self.backend,
                                  "inline_bytes": self.inline_bytes, "schedule": self.schedule,
                                  "micro_batches": self.options.micro_batches}
        fields.update(rendezvous.model_fields(self.identity))
        return Hello(self.role, self.config.rank, fields, device_identity(self.device), purpose, group, address)

    # ----------------------------------------------------------- lifecycle
    def init(self, wait_s: float | None = None) -> None:
        """Form the group; fail within about ``wait_s`` (default ``timeout_s``) naming host and port.

        ``ConnectorAuthError`` (another token), ``ConnectorMismatch`` (settings differ), ``ConnectorTimeout``
        (a peer did not show up in time), else ``ConnectorError`` (also when ``close()`` cancelled it).
        """
        if self._transport is not None:
            return
        from afd_patches.connectors import formation

        wait_s = self.timeout_s if wait_s is None else wait_s
        transport, store, rejoins = formation.form(self, time.monotonic() + wait_s, wait_s)
        with self._lock:
            if self._cancel.is_set():
                transport.close(clean=False)
                if rejoins is not None:
                    rejoins.close()
                raise ConnectorError(f"AFD connector init of {self.me()} was cancelled by close()")
            self._transport, self._rejoins = transport, rejoins
        if store is not None:
            beat = liveness.Heartbeat(store, self.global_rank, list(self.peers), self.timeout_s, self._on_lost,
                                      f"{self.address} (hosted by ffn rank 0)", store_rank=0)
            beat.start()
            self._heartbeat = beat

    @property
    def cancelled(self) -> Callable[[], bool]:
        return self._cancel.is_set

    def _on_lost(self, peer: int, why: str) -> None:
        """Heartbeat thread: ``peer`` is gone; interrupt a wait on it (unless it was dropped: nothing waits)."""
        if peer in self._dropped:
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
        clean = (self._broken is None or set(self.peers) <= self._closed_peers) and not self._lost
        if clean:
            clean = self._offer_close(transport)
        interrupted = bool(self._busy)  # on NCCL an abandoned receive stays queued: abort, never shut down
        for peer in self.peers:
            transport.interrupt(peer)
        left = time.monotonic() + CLOSE_WAIT_S
        while self._busy and time.monotonic() < left:  # the interrupted call leaves within milliseconds
            time.sleep(0.005)
        if self._heartbeat is not None:
            self._heartbeat.stop(clean=clean)
            self._heartbeat = None
        if self._rejoins is not None:
            self._rejoins.close()
        self._broken = self._broken or "closed"
        transport.close(clean and not interrupted)

    def _offer_close(self, transport: Transport) -> bool:
        try:
            handles = [transport.send(p, wire.words(wire.KIND_CLOSE), None) for p in self.peers
                       if p not in self._closed_peers and p not in self._dropped]
            for handle in [*self._pending, *handles]:
                handle.wait(min(self.timeout_s, CLOSE_WAIT_S))
        except ConnectorError:
            return False  # the peer is gone or not listening; we are leaving anyway
        finally:
            self._pending.clear()
        return True

    # ------------------------------------------------------------ plumbing
    def _check(self, role: str) -> Transport:
        if self.role != role:
            raise ConnectorError(f"{self.me()} cannot call a {role}-side method")
        if self._cancel.is_set():
            raise ConnectorClosed(f"AFD connector of {self.me()} was closed by this side")
        lost = next((p for p in self.peers if p in self._lost), None)
        if lost is not None and self._broken is None:
            self._broken = f"lost {self.describe(lost)}"
            raise PeerSilent(lost, f"AFD {self.me()}: lost {self.describe(lost)}: {self._lost[lost]}")
        if self._broken is not None:
            raise ConnectorError(f"AFD connector of {self.me()} is unusable: {self._broken}")
        if self._transport is None:
            raise ConnectorError(f"AFD connector of {self.me()} is not initialised (call init())")
        return self._transport

    def _io(self, what: str, peer: int, call: Callable[[], Any]) -> Any:
        """Run one transport call, counted as a wait ``close()`` interrupts; errors named and typed."""
        with self._lock:
            if self._cancel.is_set():
                raise ConnectorClosed(f"AFD connector of {self.me()} was closed by this side")
            self._busy += 1
        try:
            return call()
        except (LinkError, wire.BadMessage) as e:
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
        if isinstance(err, LinkClosed) and self.role == topology.ATTENTION:
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
            self._io("a send", self.peers[0], lambda h=handle: h.wait(self.timeout_s))

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

    def _payload(self, transport: Transport, peer: int, header: wire.Header, what: str) -> torch.Tensor:
        try:
            nbytes = self.limits.check(header)
        except wire.BadMessage as e:
            raise self._fail(e, peer, what) from e
        return self._io(what, peer, lambda: transport.payload(peer, header, nbytes, self.timeout_s))

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(self.device).contiguous()

    # ------------------------------------------------------ attention side
    def send_attn_output(self, hidden: torch.Tensor, layer: int, step: int, microbatch: int = 0) -> None:
        """Send this rank's MLP input of ``layer`` at ``step`` (``(0, hidden)`` when idle) to its FFN rank."""
        transport = self._check(topology.ATTENTION)
        self._drain()
        self._sent_at[microbatch], self._out_device = time.perf_counter(), hidden.device
        self._send(transport, self.peers[0], self._wire(hidden), layer, step, microbatch)

    def recv_ffn_output(self, layer: int, step: int, microbatch: int = 0) -> torch.Tensor:
        """The FFN's output for ``layer``/``step``/``microbatch``, on the device the hidden states were sent
        from. Answers come in the order the messages were sent (the FFN serves them in arrival order)."""
        transport = self._check(topology.ATTENTION)
        peer, what = self.peers[0], f"the FFN output of layer {layer} step {step} micro-batch {microbatch}"
        header = self._io(what, peer, lambda: transport.next_header(peer, self.answer_s))
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
            "the other attention ranks (this worker stalled); the others were served on, and a new connector "
            "re-joins the group")

    # ------------------------------------------------------------ FFN side
    def recv_attn_output(self) -> tuple[Meta, list[torch.Tensor]]:
        """One layer's MLP inputs from the served attention ranks, in rank order (``schedule``).

        ``Meta.shape`` is the shape of their concatenation. A rank not part of this batch (closed, or not
        first under ``pingpong``) gets a zero-row slot and is sent nothing. ``ConnectorClosed`` once every
        served rank closed.
        """
        transport = self._check(topology.FFN)
        try:
            got = schedule.SCHEDULES[self.schedule](_Inbox(self, transport))
        except ConnectorClosed:
            self._broken = "all served attention ranks closed"
            raise ConnectorClosed(f"AFD {self.me()}: every served attention rank closed") from None
        except ConnectorError as e:
            if self._broken is None:
                self._broken = str(e)
                raise type(e)(f"AFD {self.me()}: {e}") from e
            raise
        first = got[0][1]
        what = f"the attention output of layer {first.layer} step {first.step}"
        received = {peer: self._payload(transport, peer, header, what) for peer, header in got}
        self._drain()  # after the payloads: an attention rank takes this answer only once its next input went
        self.messages_received += len(received)
        METRICS.add("bytes_received", sum(t.numel() * t.element_size() for t in received.values()))
        self._received_at = time.perf_counter()
        self._answer = list(received)
        self._next_step = max(self._next_step, first.step + 1)
        template = next(iter(received.values()))
        tensors = [received.get(p, template.new_empty((0, *template.shape[1:]))) for p in self.peers]
        rows = sum(t.shape[0] for t in tensors)
        return Meta(first.layer, first.step, (rows, *first.shape[1:]), first.dtype, first.microbatch), tensors

    def send_ffn_output(self, outputs: list[torch.Tensor], meta: Meta) -> None:
        """Send ``outputs[i]`` to the i-th served attention rank, tagged with ``meta``'s layer, step and
        micro-batch (only to the ranks whose inputs the last ``recv_attn_output`` returned)."""
        transport = self._check(topology.FFN)
        if len(outputs) != len(self.peers):
            raise ConnectorError(f"AFD {self.me()}: {len(outputs)} outputs for {len(self.peers)} attention ranks")
        # The FFN's own time stops here: a send that wakes the attention rank can hand it this core.
        elapsed = time.perf_counter() - self._received_at
        self._drain()
        for tensor, peer in zip(outputs, self.peers, strict=True):
            if peer in self._answer:
                step = meta.step + (self._offset.get(peer) or 0)  # in the peer's own numbering
                self._send(transport, peer, self._wire(tensor), meta.layer, step, meta.microbatch)
        METRICS.add("exchanges")
        METRICS.observe(elapsed)


    def _drop(self, peer: int, at: wire.Header, why: str) -> None:
        """Drop ``peer`` from the group's steps (``schedule.batched``); ``at``: the step it missed, in the group's
        numbering once it is aligned. Logged once; the peer is sent ``KIND_DROP`` naming that step in its own."""
        assert self._transport is not None
        back = ("once it re-joins (FFN rank 0 takes it back at a step boundary)" if self._rejoins is not None else
                f"with the next group (a {self.backend} group, or one hosted by another FFN rank, takes no member "
                "back; the next forms once the other ranks closed)")
        logger.warning("AFD %s: dropped %s from the group's steps: %s; the other ranks are served on, it is served "
                       "again %s", self.me(), self.describe(peer), why, back)
        self._dropped[peer] = why
        self._held.pop(peer, None)
        step = at.step + (self._offset.pop(peer, 0) or 0)  # not aligned yet: ``at`` is its own header
        if self._heartbeat is not None:
            self._heartbeat.forget(peer)
        self._transport.drop(peer, wire.words(wire.KIND_DROP, at.layer, step, microbatch=at.microbatch))

    def aligned(self, peer: int) -> bool:
        return peer not in self._offset or self._offset[peer] is not None

    def _readmit(self) -> bool:
        """FFN rank 0 on tcp: answer re-join sessions (``rendezvous.Rejoins``); give each dropped rank that
        re-joined its new link, not aligned yet (``schedule``). True if one came back."""
        if self._rejoins is None:
            return False
        from afd_patches.connectors.tcp import TcpTransport

        a, f = self.config.num_attention_ranks, self.config.num_ffn_ranks
        dropped = {topology.role_of_global(p, a, f): p for p in self._dropped}
        back = self._rejoins.take(set(dropped))
        for key, joined in back.items():
            peer = dropped[key]
            assert isinstance(self._transport, TcpTransport)
            self._transport.add(peer, *joined.session.detach())
            del self._dropped[peer]
            self._offset[peer] = None
            logger.warning("AFD %s: %s re-joined the group; it is served again from its next step boundary",
                           self.me(), self.describe(peer))
        return bool(back)


REJOIN_POLL_S = 0.1  # while a rank is dropped, an idle FFN rank 0 looks for its re-join this often


class _Inbox:
    """The connector as a ``schedule.Inbox``."""

    def __init__(self, conn: TorchDistConnector, transport: Transport) -> None:
        self.conn, self.transport = conn, transport
        self.timeout_s = conn.timeout_s

    def open_peers(self) -> list[int]:
        return [p for p in self.conn.peers if p not in self.conn._closed_peers and p not in self.conn._dropped]

    def header(self, peer: int, idle: bool) -> wire.Header | None:
        conn = self.conn
        held = conn._held.pop(peer, None)
        if held is not None:
            return held  # held before alignment: its step is the rank's own
        bound = conn.idle_timeout_s if idle else conn.timeout_s
        header = conn._io("the next attention output", peer, lambda: self.transport.next_header(peer, bound))
        if header.kind == wire.KIND_CLOSE:
            conn._closed_peers.add(peer)
            if conn._heartbeat is not None:
                conn._heartbeat.forget(peer)
            return None
        offset = conn._offset.get(peer)
        return header._replace(step=header.step - offset) if offset else header  # type: ignore[no-any-return]

    def first(self, peers: list[int], timeout_s: float | None = None, lone: bool = False) -> int | None:
        conn = self.conn
        held = next((p for p in peers if p in conn._held), None)
        if held is not None:
            return held
        if timeout_s is not None:
            return self._first(peers, timeout_s)
        end = time.monotonic() + conn.idle_timeout_s
        while not conn._readmit():
            rejoining = conn._rejoins is not None and bool(conn._dropped)
            if lone and len(peers) == 1 and not rejoining:
                return peers[0]  # header(idle=True) waits for it: one wait instead of two
            left = end - time.monotonic()
            if left <= 0:
                raise ConnectorTimeout(f"no attention rank sent anything within {conn.idle_timeout_s:g}s")
            peer = self._first(peers, min(left, REJOIN_POLL_S) if rejoining else left)
            if peer is not None:
                return peer
        return None

    def _first(self, peers: list[int], timeout_s: float) -> int | None:
        return self.conn._io(  # type: ignore[no-any-return]
            "the next attention output", peers[0], lambda: self.transport.first(peers, timeout_s))

    def drop(self, peer: int, at: wire.Header, why: str) -> None:
        self.conn._drop(peer, at, why)

    def aligned(self, peer: int) -> bool:
        return self.conn.aligned(peer)

    def align(self, peer: int, header: wire.Header, step: int) -> wire.Header:
        self.conn._offset[peer] = header.step - step
        return header._replace(step=step)

    def hold(self, peer: int, header: wire.Header) -> None:
        self.conn._held[peer] = header

    def next_step(self) -> int:
        return self.conn._next_step

    def describe(self, peer: int) -> str:
        return self.conn.describe(peer)
