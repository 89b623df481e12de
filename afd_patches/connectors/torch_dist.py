"""``torch_dist``: the AFD connector on torch.distributed point-to-point messages.

Group
    One standalone process group per deployment, built with vLLM's
    ``stateless_init_torch_distributed_process_group`` (its own TCP store at the
    configured ``host:port``; no global torch.distributed state, no
    ``new_group``). World size ``A + F`` in FFN-first order (see
    ``afd_patches.topology``): global rank 0 is FFN rank 0 and hosts the store.
    Only the group's own ``send``/``recv`` are used.

Handshake
    Before the group forms, every rank says hello to FFN rank 0 on a plain
    socket at ``host:port`` (``afd_patches.connectors.handshake``) and both
    compare ``num_attention_ranks``, ``num_ffn_ranks``, ``backend``,
    ``inline_bytes`` and the creator's model identity (``model.*``). A
    difference raises ``ConnectorMismatch`` on both sides, naming the field and
    both values, so ranks that disagree on the world size never reach torch's
    rendezvous. Each hello also says where the rank's tensors live (host and
    GPU UUID, see ``device_identity``): with NCCL, two ranks on one GPU are
    refused here with a message saying what to do, instead of NCCL's
    "Duplicate GPU detected" at the first exchange. FFN rank 0 then hands its
    listening socket to the group's
    ``TCPStore`` (``multi_tenant``, so vLLM's helper reuses that server). A
    port already taken by another program fails FFN rank 0 at once
    (``ConnectorError`` naming ``host:port``, "in use"); a joining rank that
    reaches another program fails within ``timeout_s`` naming ``host:port``
    instead of waiting in a ``TCPStore`` client, which would never return.
    Once the group formed, every FFN rank sends each attention rank it serves
    one small warm-up message (tag ``TAG_WARMUP``), so NCCL builds its
    point-to-point communicators inside ``init()`` (bounded by ``timeout_s``)
    rather than lazily in the first forward.

Backend
    ``connector_extra_config["backend"]`` if given, else ``"nccl"`` when CUDA
    is available and ``"tcp"`` otherwise. ``tcp`` forms no torch group: after
    the handshake each FFN/attention pair opens one plain socket
    (``afd_patches.connectors.sockets``, found through the group's store) and
    the thread that waits reads it itself, so a message costs one thread
    wake-up instead of gloo's two or more, and an idle group wakes nothing (a
    gloo group's loop thread wakes 100 times a second). On that socket a
    message is the header followed by its payload (no inline form, no tags);
    everything else below holds for it as for gloo, except where it says.
    Messages travel on the backend's device (``cpu`` for gloo and tcp, the
    current CUDA device for NCCL; ``connector_extra_config["device"]``
    overrides it, not on tcp); the attention side gets its results back on the
    device its hidden states came from.

Wire format
    Every message starts with an ``int64`` header of ``HEADER_LEN`` words
    (magic, kind, layer, step, dtype code, ndim, inline flag, shape…), sent as
    bytes with tag ``TAG_HEADER``. On gloo a payload of up to ``inline_bytes``
    (``connector_extra_config``, default ``DEFAULT_INLINE_BYTES``) travels in
    the same message right after the header: the receiver posts a buffer of
    ``HEADER_BYTES + inline_bytes`` and gloo accepts a shorter message. This
    halves the messages of a decode step, and every gloo message costs thread
    wake-ups on both sides (figures: docs/benchmarks.md). Larger payloads, and all
    payloads on NCCL (which needs exact sizes), follow as a second message with
    tag ``TAG_PAYLOAD``. A zero-element tensor (an idle attention rank's
    ``(0, hidden)`` step) is the header alone. ``kind`` is ``DATA`` or
    ``CLOSE``; a ``CLOSE`` header is what ``close()`` sends, and the receiving
    side raises ``ConnectorClosed``. Tensors have at most ``MAX_NDIM``
    dimensions and a dtype from ``DTYPE_CODES``.

Schedules
    ``connector_extra_config["schedule"]`` (``afd_patches.config.SCHEDULES``,
    compared in the handshake). ``batched``: ``recv_attn_output`` returns one
    layer from every open served rank (they must agree on layer and step).
    ``pingpong`` with several served ranks: it keeps one header receive posted
    per open rank and returns whichever completes first
    (``afd_patches.connectors.arrivals``; on tcp one ``select`` over the
    ranks' sockets, ``SocketArrivals``), the other slots zero-row; gloo or tcp.
    Either way ``send_ffn_output`` answers exactly the ranks whose inputs the
    last ``recv_attn_output`` returned.

Counting
    ``messages_sent`` / ``messages_received`` count tensor messages (one per
    layer, step, direction and peer); ``CLOSE`` headers are not counted.

Timeouts and failures
    Every wait inside a step is bounded by ``timeout_s``. The FFN side's wait for
    the first header of the *next* step uses ``connector_extra_config
    ["idle_timeout_s"]``, by default a week: an idle engine (a server between
    requests) does not step at all, and on gloo a timed-out wait cannot be
    resumed, so a short bound there would break an idle server. A wait that
    runs out raises ``ConnectorTimeout`` naming the peer, the group's
    ``host:port`` and the layer/step.

    Dead peers are noticed within about ``timeout_s``, idle or not, on every
    backend, through a heartbeat in the group's store
    (``afd_patches.connectors.liveness``): a peer that is silent for
    ``timeout_s`` is lost (``ConnectorTimeout``), and so is every peer when the
    store host (FFN rank 0) stops answering. A lost peer interrupts a wait in
    progress (on gloo by closing the connection to that peer; NCCL waits poll).
    On gloo a peer process that dies is also noticed at once, because its socket
    closes (``ConnectorError``); NCCL gives no such signal, so there the
    heartbeat is the only one. Any failure marks the connector broken: later
    calls raise ``ConnectorError`` and only ``close()`` is useful. ``init()``
    fails within about ``timeout_s`` (naming host and port) when the group
    cannot be formed. Errors that NCCL raises are reported as NCCL errors (with
    NCCL's text), not as a lost peer.

NCCL
    The group's timeout (``ProcessGroupNCCL.Options._timeout``, after which
    torch's watchdog aborts the process when an operation is still queued) is
    ``max(idle_timeout_s, timeout_s)`` (``group_timeout``): the FFN's posted
    receive for the next step is such an operation for as long as the engine is
    idle. Waits on NCCL do not block in torch: they poll ``is_completed()`` with
    a short backoff (``POLL_MIN_S`` … ``POLL_MAX_S``, ``POLL_IDLE_S`` after a
    second) and check the deadline, ``close()`` and the heartbeat between polls,
    so a header is read only once it arrived. The NCCL paths are written
    against torch's and NCCL's documented behaviour and exercised by
    ``scripts/gpu_check``; the CPU test suite runs them only with stand-ins.

Threads
    One thread drives the exchange (the methods are not thread-safe among
    themselves). ``close()`` may come from any thread, also while that thread
    waits: it cancels the wait (gloo: the connection to each peer is closed
    after ``CLOSE`` was offered; NCCL: the polling wait sees the cancel and
    returns, and only then ``close()`` uses the communicator), waits at most
    ``CLOSE_WAIT_S`` for it to leave, and then aborts the group when anything
    failed or, on NCCL, a wait was interrupted (its receive stays queued, and
    shutting down would wait for it; ``abort()`` where torch has it), else
    shuts it down.
    The interrupted call raises ``ConnectorClosed``.

Limits
    Sends are asynchronous: a tensor handed to ``send_attn_output`` must not be
    modified before the matching ``recv_ffn_output`` returns, and one handed to
    ``send_ffn_output`` not before the next ``recv_attn_output`` (or
    ``close()``) returns. One exchange is in flight per connector: the
    attention side alternates send/recv, the FFN side recv/send. Every header
    costs a host synchronisation (it is read with ``tolist()``), once per layer
    and direction.
"""

from __future__ import annotations

import inspect
import logging
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from afd_patches import topology
from afd_patches.config import SCHEDULES
from afd_patches.connectors import auth, handshake, liveness
from afd_patches.connectors.arrivals import Arrivals
from afd_patches.connectors.base import Connector, ConnectorClosed, ConnectorError, ConnectorTimeout, Meta
from afd_patches.connectors.metrics import METRICS
from afd_patches.connectors.sockets import SocketArrivals, SocketLinks

if TYPE_CHECKING:
    from collections.abc import Mapping

    from afd_patches.config import AfdConfig

logger = logging.getLogger("afd")

MAGIC = 0xAFD0_0001
MAX_NDIM = 8
HEADER_LEN = 7 + MAX_NDIM  # magic, kind, layer, step, dtype code, ndim, inline flag, shape[MAX_NDIM]
HEADER_BYTES = HEADER_LEN * 8
HEADER_STRUCT = struct.Struct(f"={HEADER_LEN}q")  # the same bytes as the int64 tensor form, without torch (tcp)
DEFAULT_INLINE_BYTES = 64 * 1024
KIND_DATA = 1
KIND_CLOSE = 2
TAG_HEADER = 1
TAG_PAYLOAD = 2
TAG_WARMUP = 3  # init(): one message per FFN/attention pair, so NCCL forms its communicators there
TAG_BREAK = 4  # never sent: a 1 ms receive on it closes a gloo connection (how a blocked wait is interrupted)
POLL_MIN_S, POLL_MAX_S, POLL_IDLE_S = 2e-5, 1e-3, 1e-2  # NCCL polling backoff (POLL_IDLE_S after 1 s)
CLOSE_WAIT_S = 2.0  # how long close() waits for each peer to take its CLOSE header
IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # see "Timeouts and failures": idle is not a failure
MAX_MESSAGE_BYTES = 1 << 30  # bound on one received tensor when the model's identity gives no tighter one
HOST_BACKENDS = ("gloo", "tcp")  # backends whose messages live in host memory (and that can serve pingpong)
EXTRA_KEYS = ("backend", "device", "idle_timeout_s", "inline_bytes", "schedule")

# Stable wire codes; a dtype missing from this torch build is simply not offered.
DTYPE_CODES: dict[str, int] = {
    "float32": 1,
    "float16": 2,
    "bfloat16": 3,
    "float64": 4,
    "int8": 5,
    "uint8": 6,
    "int16": 7,
    "int32": 8,
    "int64": 9,
    "bool": 10,
    "float8_e4m3fn": 11,
    "float8_e5m2": 12,
    "float8_e4m3fnuz": 13,
    "float8_e5m2fnuz": 14,
}
_CODE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
_ITEMSIZE = {name: getattr(torch, name).itemsize for name in DTYPE_CODES if hasattr(torch, name)}


def device_identity(device: torch.device) -> str:
    """Where tensors on ``device`` live, as two ranks of a group must tell apart: ``"host/GPU-<uuid>"`` for a
    CUDA device (the UUID does not depend on ``CUDA_VISIBLE_DEVICES``), ``""`` for host memory."""
    if device.type != "cuda":
        return ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    where = f"GPU-{uuid}" if uuid else f"PCI {props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}"
    return f"{socket.gethostname()}/{where}"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"`` (the form used in ``Meta.dtype``)."""
    return str(dtype).removeprefix("torch.")


class Header(NamedTuple):
    kind: int
    layer: int
    step: int
    shape: tuple[int, ...]
    dtype: str
    inline: bool


def header_words(kind: int, layer: int, step: int, tensor: torch.Tensor | None, inline: bool = False) -> list[int]:
    """The ``HEADER_LEN`` words of the header describing ``tensor`` (or a bare header for ``CLOSE``)."""
    words = [MAGIC, kind, layer, step, 0, 0, int(inline)] + [0] * MAX_NDIM
    if tensor is not None:
        name = dtype_name(tensor.dtype)
        if name not in DTYPE_CODES:
            raise ConnectorError(f"dtype {name} cannot be sent (supported: {', '.join(DTYPE_CODES)})")
        if tensor.dim() > MAX_NDIM:
            raise ConnectorError(f"tensor has {tensor.dim()} dimensions; at most {MAX_NDIM} can be sent")
        words[4] = DTYPE_CODES[name]
        words[5] = tensor.dim()
        words[7 : 7 + tensor.dim()] = list(tensor.shape)
    return words


def encode_header(
    kind: int,
    layer: int,
    step: int,
    tensor: torch.Tensor | None,
    device: torch.device,
    inline: bool = False,
) -> torch.Tensor:
    """The ``int64`` header describing ``tensor`` (or a bare header for ``CLOSE``), on ``device``."""
    return torch.tensor(header_words(kind, layer, step, tensor, inline), dtype=torch.int64, device=device)


def decode_header(message: torch.Tensor | bytearray) -> Header:
    """Parse an ``int64`` header, or the header at the start of a ``uint8`` message or a ``bytearray`` (tcp,
    native byte order like the tensor form); ``ConnectorError`` on garbage."""
    if isinstance(message, bytearray):
        words = list(HEADER_STRUCT.unpack_from(message))
    else:
        if message.dtype == torch.uint8:
            message = message[:HEADER_BYTES].view(torch.int64)
        words = message.tolist()
    if len(words) != HEADER_LEN or words[0] != MAGIC or words[1] not in (KIND_DATA, KIND_CLOSE):
        raise ConnectorError(f"malformed AFD header {words[:7]}… (peer speaks another protocol or version?)")
    kind, layer, step, code, ndim, inline = words[1:7]
    if kind == KIND_CLOSE:
        return Header(kind, layer, step, (), "", False)
    if code not in _CODE_NAMES or not 0 <= ndim <= MAX_NDIM:
        raise ConnectorError(f"malformed AFD header: dtype code {code}, ndim {ndim}")
    return Header(kind, layer, step, tuple(words[7 : 7 + ndim]), _CODE_NAMES[code], bool(inline))


class TorchDistConnector(Connector):
    """One AFD endpoint (attention or FFN rank) on a standalone torch.distributed group."""

    def __init__(self, config: AfdConfig, identity: Mapping[str, Any] | None = None) -> None:
        super().__init__(config, identity)
        a, f = config.num_attention_ranks, config.num_ffn_ranks
        try:
            topology.validate(a, f)
            self.global_rank = topology.global_rank(config.role, config.rank, a, f)
        except ValueError as e:
            raise ConnectorError(f"AFD topology: {e}") from e
        self.world_size = a + f
        self.role = config.role
        if self.role == topology.ATTENTION:
            self.peers = [topology.global_rank(topology.FFN, topology.ffn_rank_of(config.rank, a, f), a, f)]
        else:
            served = topology.attention_ranks_of(config.rank, a, f)
            self.peers = [topology.global_rank(topology.ATTENTION, i, a, f) for i in served]
        extra = dict(config.connector_extra_config or {})
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ConnectorError(
                f"connector_extra_config: unknown key(s) {unknown} for torch_dist (known: {list(EXTRA_KEYS)})"
            )
        self.backend: str = extra.get("backend") or ("nccl" if torch.cuda.is_available() else "tcp")
        if "device" in extra:
            self.device = torch.device(extra["device"])
        elif self.backend in HOST_BACKENDS:
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = float(config.timeout_s)
        self.idle_timeout_s = float(extra.get("idle_timeout_s", IDLE_TIMEOUT_S))
        if self.timeout_s <= 0 or self.idle_timeout_s <= 0:
            raise ConnectorError("timeout_s and idle_timeout_s must be > 0")
        default_inline = DEFAULT_INLINE_BYTES if self.backend == "gloo" else 0
        self.inline_bytes = int(extra.get("inline_bytes", default_inline))
        if self.inline_bytes < 0 or (self.inline_bytes and self.backend != "gloo"):
            raise ConnectorError(
                f"connector_extra_config.inline_bytes={self.inline_bytes}: must be >= 0, and 0 unless backend is gloo"
            )
        if self.backend == "tcp" and self.device.type != "cpu":
            raise ConnectorError(f"connector_extra_config.device={self.device}: backend tcp carries host memory "
                                 "only (leave device unset)")
        self.schedule = config.schedule
        if self.schedule not in SCHEDULES or (self.schedule == "pingpong" and self.backend not in HOST_BACKENDS):
            raise ConnectorError(f"connector_extra_config.schedule={self.schedule!r}: must be one of "
                                 f"{list(SCHEDULES)}, and 'pingpong' needs backend gloo or tcp")
        self._pg: Any = None
        self._answer: list[int] = []  # the peers whose inputs the last recv_attn_output returned
        self._arrivals: Arrivals | SocketArrivals = Arrivals(f"afd-arrivals-{config.rank}")  # pingpong
        self._posted: dict[int, torch.Tensor | bytearray] = {}  # pingpong: peer -> buffer of its posted header receive
        self._store: Any = None  # FFN rank 0: the TCPStore that took over the handshake's listening socket
        self._pending: list[tuple[Any, torch.Tensor, int, str]] = []  # (work, tensor kept alive, peer, what)
        self._closed_peers: set[int] = set()
        self._broken: str | None = None
        self._out_device: torch.device = self.device
        self._cancel = threading.Event()
        self._cond = threading.Condition()  # guards _busy: threads inside a group operation or wait
        self._busy = 0
        self._lost: dict[int, tuple[type[ConnectorError], str]] = {}  # peer → (error class, why), from the heartbeat
        self._heartbeat: liveness.Heartbeat | None = None
        self._sent_at = self._received_at = 0.0  # exchange latency: attention send, FFN inputs complete
        self._want_dtype = self.identity.get("dtype")
        try:
            self._token = auth.load_token(config.token_file)
            auth.check_policy(config.host, self._token, config.allow_unauthenticated)
        except auth.TokenError as e:
            raise ConnectorError(f"AFD rendezvous at {self.address}: {e}") from None

    # ---------------------------------------------------------------- naming
    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.config.port}"

    def _describe(self, peer: int | None) -> str:
        if peer is None:
            return f"any served attention rank (group at {self.address})"
        role, rank = topology.role_of_global(peer, self.config.num_attention_ranks, self.config.num_ffn_ranks)
        return f"{role} rank {rank} (global rank {peer} of {self.world_size}, group at {self.address})"

    def _me(self) -> str:
        return f"{self.role} rank {self.config.rank} (global rank {self.global_rank})"

    # ----------------------------------------------------------- lifecycle
    def init(self, wait_s: float | None = None) -> None:
        """Handshake, then form the group; fail within about ``wait_s`` (default ``timeout_s``) naming host and port.

        ``ConnectorAuthError`` when the other side holds another token,
        ``ConnectorMismatch`` when the peers' settings differ (see "Handshake"),
        ``ConnectorTimeout`` when a peer did not show up in time, else
        ``ConnectorError`` (also when ``close()`` cancelled the wait).
        """
        if self._pg is not None:
            return
        wait_s = self.timeout_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        if self.global_rank == 0:
            self._host_handshake(deadline, wait_s)
        else:
            handshake.join(self.config.host, self.config.port, self._hello(), deadline, wait_s, self._token,
                           self._cancel.is_set)
            METRICS.add("handshakes_accepted")
        if self.backend == "tcp":
            self._form_links(deadline, wait_s)
            return
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        remaining = max(deadline - time.monotonic(), 1.0)
        kwargs: dict[str, Any] = {}
        # vLLM 0.30's helper takes no timeout (0.32's does); there the group forms under torch's default.
        if "timeout" in inspect.signature(stateless_init_torch_distributed_process_group).parameters:
            kwargs["timeout"] = self.group_timeout(remaining)
        try:
            self._pg = stateless_init_torch_distributed_process_group(
                host=self.config.host,
                port=self.config.port,
                rank=self.global_rank,
                world_size=self.world_size,
                backend=self.backend,
                **kwargs,
            )
        except Exception as e:  # torch raises several unrelated types here
            self._store = None
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            cls = ConnectorTimeout if "time" in text.lower() else ConnectorError
            raise cls(
                f"AFD connector init failed for {self._me()}: could not form the {self.backend} group of "
                f"{self.world_size} ranks at {self.address} within {self.timeout_s:g}s ({type(e).__name__}: {text})"
            ) from e
        try:
            self._warm_up(deadline)
            self._start_heartbeat()
        except BaseException:
            self.close()
            raise

    def _form_links(self, deadline: float, wait_s: float) -> None:
        """``backend: tcp``: one socket per peer (``afd_patches.connectors.sockets``), then the heartbeat."""
        try:
            store = self._group_store()
            links = SocketLinks.form_group(self.role == topology.FFN, self.global_rank, list(self.peers), store,
                                           self.config.host, self._token, deadline, self._cancel.is_set,
                                           self.timeout_s, self.world_size)
        except (ConnectorError, RuntimeError, OSError) as e:
            self._store = None
            if isinstance(e, ConnectorError) and self._cancel.is_set():
                raise ConnectorError(f"AFD connector init of {self._me()} was cancelled by close()") from e
            cls = ConnectorTimeout if isinstance(e, ConnectorTimeout) else ConnectorError
            raise cls(f"AFD connector init failed for {self._me()}: could not form the tcp group of "
                      f"{self.world_size} ranks at {self.address} within {wait_s:g}s ({e})") from e
        with self._cond:
            if self._cancel.is_set():
                links.shutdown()
                raise ConnectorError(f"AFD connector init of {self._me()} was cancelled by close()")
            self._pg = links
        self._arrivals = SocketArrivals(links)
        try:
            self._start_heartbeat()
        except BaseException:
            self.close()
            raise

    def _group_store(self) -> Any:
        """The group's ``TCPStore``: the one this rank hosts (FFN rank 0), else a client of it (cached)."""
        if self._store is None:
            from torch.distributed import TCPStore

            try:
                self._store = TCPStore(self.config.host, self.config.port, None, False,
                                       timedelta(seconds=self.timeout_s), wait_for_workers=False)
            except RuntimeError as e:
                raise ConnectorError(f"AFD {self._me()}: cannot reach the group's store at {self.address} "
                                     f"({e})") from e
        return self._store

    def group_timeout(self, remaining_s: float) -> timedelta:
        """The timeout the group is created with: what is left of the handshake budget on gloo (every wait
        passes its own bound); on NCCL, where torch's watchdog aborts the process once any queued operation
        exceeds it, at least ``max(idle_timeout_s, timeout_s)``, so an idle FFN engine is not killed."""
        if self.backend == "gloo":
            return timedelta(seconds=remaining_s)
        return timedelta(seconds=max(self.idle_timeout_s, self.timeout_s, remaining_s))

    def _warm_up(self, deadline: float) -> None:
        """One small message per FFN/attention pair inside ``init()`` (NCCL forms its communicators here)."""
        left = max(deadline - time.monotonic(), 1.0)
        if self.role == topology.FFN:
            for peer in self.peers:
                self._post_send(torch.zeros(1, dtype=torch.int64, device=self.device), peer, TAG_WARMUP, "warm-up")
            self._pending, pending = [], self._pending
            for work, _tensor, peer, what in pending:
                self._wait(work, peer, what, left)
        else:
            flag = torch.empty(1, dtype=torch.int64, device=self.device)
            work = self._post_recv(flag, self.peers[0], TAG_WARMUP, "warm-up")
            self._wait(work, self.peers[0], "warm-up", left)

    def _start_heartbeat(self) -> None:
        """Beat in the group's store and watch this rank's peers (see ``afd_patches.connectors.liveness``)."""
        beat = liveness.Heartbeat(self._group_store(), self.global_rank, list(self.peers), self.timeout_s,
                                  self._on_lost, f"{self.address} (hosted by ffn rank 0)", store_rank=0)
        beat.start()
        self._heartbeat = beat

    def _on_lost(self, peer: int, why: str) -> None:
        """Heartbeat thread: ``peer`` is gone. Record it and interrupt a wait in progress."""
        low = why.lower()
        cls = ConnectorTimeout if ("no heartbeat" in low or "time" in low) else ConnectorError
        self._lost[peer] = (cls, why)
        logger.warning("AFD %s: lost %s: %s", self._me(), self._describe(peer), why)
        pg = self._pg
        if pg is not None and self.backend == "tcp":
            pg.interrupt(peer)
        elif pg is not None and self.backend == "gloo":
            _break_gloo_pair(pg, peer)

    def _hello(self) -> handshake.Hello:
        """What this rank tells its peers before the group forms (the fields both sides compare)."""
        fields: dict[str, Any] = {
            "num_attention_ranks": self.config.num_attention_ranks,
            "num_ffn_ranks": self.config.num_ffn_ranks,
            "backend": self.backend,
            "inline_bytes": self.inline_bytes,
            "schedule": self.schedule,
        }
        fields.update(handshake.model_fields(self.identity))
        return handshake.Hello(self.role, self.config.rank, fields, device_identity(self.device))

    def _host_handshake(self, deadline: float, wait_s: float) -> None:
        """FFN rank 0: collect every rank's hello, start the group's store on the same socket, say ok."""
        a, f = self.config.num_attention_ranks, self.config.num_ffn_ranks
        expected = {topology.role_of_global(g, a, f) for g in range(1, self.world_size)}
        listener = handshake.listen(self.config.host, self.config.port)
        try:
            joiners = handshake.collect(listener, self._hello(), expected, deadline, self.address, wait_s,
                                        self._token, self._cancel.is_set)
        except BaseException:
            listener.close()
            raise
        from torch.distributed import TCPStore

        fd = listener.detach()  # the store owns the listening socket from here on
        try:
            # multi_tenant: the rendezvous inside vLLM's helper finds this server by its port and reuses it.
            self._store = TCPStore(
                self.config.host, self.config.port, None, True,
                timedelta(seconds=max(deadline - time.monotonic(), 1.0)),
                wait_for_workers=False, multi_tenant=True, master_listen_fd=fd,
            )
        except Exception as e:
            socket.close(fd)
            message = f"AFD {self._me()}: could not start the group's store at {self.address}: {e}"
            handshake.refuse(joiners, "error", message)
            raise ConnectorError(message) from e
        handshake.accept_all(joiners)
        METRICS.add("handshakes_accepted", len(joiners))

    def close(self) -> None:
        """Cancel a handshake or a wait in progress (from any thread), offer every still-open peer ``CLOSE``
        (bounded), then shut the group down, or abort it when anything failed. Idempotent; never hangs
        (see "Threads")."""
        with self._cond:
            self._cancel.set()
            pg, self._pg = self._pg, None
        if pg is None:
            return
        ended_cleanly = self._broken is None or set(self.peers) <= self._closed_peers  # no error, or CLOSE
        clean = ended_cleanly and not self._lost
        interrupted = bool(self._busy)  # on NCCL an abandoned receive stays queued: abort, never shut down
        offered = False
        if clean and self.backend == "tcp" and self._heartbeat is not None:
            # tcp delivers CLOSE at once, and a peer that hosts the store may end it right away: say "gone on
            # purpose" in the store first, so this rank's last store request does not hit a closed store
            self._heartbeat.stop(clean=True)
            self._heartbeat = None
        if clean and (self.backend in HOST_BACKENDS or not self._busy):
            clean = offered = self._offer_close(pg)  # gloo/tcp take this next to a blocked wait; NCCL only alone
        if self._busy and self.backend == "tcp":
            for peer in self.peers:
                pg.interrupt(peer)
        elif self._busy and self.backend == "gloo":
            for peer in self.peers:
                _break_gloo_pair(pg, peer)
        with self._cond:
            left = self._cond.wait_for(lambda: not self._busy, CLOSE_WAIT_S + POLL_IDLE_S)
        if clean and not offered:
            clean = left and self._offer_close(pg)
        self._pending.clear()
        self._arrivals.stop()
        self._broken = self._broken or "closed"
        if self._heartbeat is not None:
            self._heartbeat.stop(clean=clean)
            self._heartbeat = None
        self._store = None
        _end_group(pg, abort=self.backend != "gloo" and (interrupted or not clean))

    def _offer_close(self, pg: Any) -> bool:
        """Send ``CLOSE`` to every open peer and wait up to ``CLOSE_WAIT_S``; True when every send completed."""
        wait_s = min(self.timeout_s, CLOSE_WAIT_S)
        try:
            works = []
            for peer in self.peers:
                if peer in self._closed_peers:
                    continue
                header = encode_header(KIND_CLOSE, -1, -1, None, self.device).view(torch.uint8)
                if self.backend == "tcp":  # written before send() returns, bounded by wait_s
                    pg.send([header], peer, TAG_HEADER, timeout_s=wait_s)
                    continue
                works.append((pg.send([header], peer, TAG_HEADER), header))
            for work, _ in [*((w, t) for w, t, _, _ in self._pending), *works]:
                if self.backend in HOST_BACKENDS:
                    work.wait(timeout=timedelta(seconds=wait_s))
                elif not _poll(work, time.monotonic() + wait_s, lambda: False):
                    return False
        except RuntimeError:
            return False  # the peer is gone or not listening; we are leaving anyway
        return True

    # ------------------------------------------------------------ plumbing
    def _check(self, role: str) -> None:
        if self.role != role:
            raise ConnectorError(f"{self._me()} cannot call a {role}-side method")
        if self._cancel.is_set():
            raise ConnectorClosed(f"AFD connector of {self._me()} was closed by this side")
        lost = next((p for p in self.peers if p in self._lost), None)
        if lost is not None and self._broken is None:
            raise self._fail(RuntimeError("lost"), lost, "the next exchange", self.timeout_s)
        if self._broken is not None:
            raise ConnectorError(f"AFD connector of {self._me()} is unusable: {self._broken}")
        if self._pg is None:
            raise ConnectorError(f"AFD connector of {self._me()} is not initialised (call init())")

    def _fail(self, err: Exception, peer: int | None, what: str, timeout_s: float) -> ConnectorError:
        """Mark broken and translate a backend error into a connector error."""
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        low = str(err).lower()
        if self._cancel.is_set():
            self._broken = self._broken or "closed"
            return ConnectorClosed(f"AFD {self._me()}: closed by this side while waiting for {what} from/to "
                                   f"{self._describe(peer)}")
        if peer in self._lost:
            cls, why = self._lost[peer]
            self._broken = f"lost {self._describe(peer)}"
            return cls(f"AFD {self._me()}: lost {self._describe(peer)} during {what}: {why}")
        if "nccl" in low:
            self._broken = f"NCCL error with {self._describe(peer)}"
            hint = ""
            if "duplicate gpu" in low:
                hint = ("; two ranks of the group share one GPU: give each engine its own GPU "
                        "(CUDA_VISIBLE_DEVICES per engine), or use backend: gloo on a single-GPU test box")
            return ConnectorError(f"AFD {self._me()}: NCCL reported an error during {what} with "
                                  f"{self._describe(peer)} (an NCCL failure, not a lost connection){hint} "
                                  f"({type(err).__name__}: {text})")
        if "timed out" in low or ("timeout" in low and "pair closure" not in low):
            self._broken = f"timed out waiting for {what} from/to {self._describe(peer)}"
            return ConnectorTimeout(
                f"AFD {self._me()}: no {what} from/to {self._describe(peer)} within {timeout_s:g}s ({text})"
            )
        if any(word in low for word in ("closed", "reset by peer", "broken pipe")):
            self._broken = f"lost {self._describe(peer)}"
            return ConnectorError(
                f"AFD {self._me()}: lost {self._describe(peer)} during {what}: its connection closed, so the peer "
                f"crashed or exited ({type(err).__name__}: {text})"
            )
        self._broken = f"connection to {self._describe(peer)} failed"
        return ConnectorError(
            f"AFD {self._me()}: {what} from/to {self._describe(peer)} failed; the peer probably crashed or "
            f"exited ({type(err).__name__}: {text})"
        )

    def _enter(self) -> Any:
        """Count this thread as inside the group (``close()`` waits for it); the group, or ``ConnectorClosed``."""
        with self._cond:
            if self._cancel.is_set() or self._pg is None:
                raise ConnectorClosed(f"AFD connector of {self._me()} was closed by this side")
            self._busy += 1
            return self._pg

    def _leave(self) -> None:
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()

    def _post_send(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> None:
        pg = self._enter()
        try:
            work = pg.send([tensor], peer, tag)
        except RuntimeError as e:
            raise self._fail(e, peer, what, self.timeout_s) from e
        finally:
            self._leave()
        if self.backend != "tcp":  # a tcp send completed inside pg.send
            self._pending.append((work, tensor, peer, what))

    def _post_send_all(self, tensors: list[torch.Tensor | bytes], peer: int, what: str) -> None:
        """``backend: tcp``: write ``tensors`` back to back to ``peer`` (complete on return)."""
        pg = self._enter()
        try:
            pg.send(tensors, peer, TAG_HEADER)
        except RuntimeError as e:
            raise self._fail(e, peer, what, self.timeout_s) from e
        finally:
            self._leave()

    def _post_recv(self, tensor: torch.Tensor | bytearray, peer: int, tag: int, what: str) -> Any:
        pg = self._enter()
        try:
            return pg.recv([tensor], peer, tag)
        except RuntimeError as e:
            raise self._fail(e, peer, what, self.timeout_s) from e
        finally:
            self._leave()

    def _wait(self, work: Any, peer: int, what: str, timeout_s: float) -> None:
        """Wait for ``work`` at most ``timeout_s``: blocking on gloo, polling elsewhere (see "NCCL")."""
        self._enter()
        try:
            if self.backend in HOST_BACKENDS:
                work.wait(timeout=timedelta(seconds=timeout_s))
            elif not _poll(work, time.monotonic() + timeout_s,
                           lambda: self._cancel.is_set() or peer in self._lost):
                if self._cancel.is_set() or peer in self._lost:
                    raise RuntimeError("wait interrupted")
                raise RuntimeError(f"timed out after {timeout_s:g}s")
        except RuntimeError as e:
            raise self._fail(e, peer, what, timeout_s) from e
        finally:
            self._leave()

    def _peer_closed(self, peer: int) -> None:
        self._closed_peers.add(peer)
        if self._heartbeat is not None:
            self._heartbeat.forget(peer)

    def _drain_sends(self) -> None:
        pending, self._pending = self._pending, []
        for work, _tensor, peer, what in pending:
            self._wait(work, peer, what, self.timeout_s)

    def _send_tensor(self, tensor: torch.Tensor, peer: int, layer: int, step: int) -> None:
        what = f"layer {layer} step {step}"
        nbytes = tensor.numel() * tensor.element_size()
        inline = 0 < nbytes <= self.inline_bytes
        if self.backend == "tcp":  # header and payload in one write on the pair's stream
            self._post_send_all([HEADER_STRUCT.pack(*header_words(KIND_DATA, layer, step, tensor)), tensor], peer,
                                what)
            self._count_sent(layer, nbytes)
            return
        header = encode_header(KIND_DATA, layer, step, tensor, self.device, inline).view(torch.uint8)
        if inline:
            message = torch.empty(HEADER_BYTES + nbytes, dtype=torch.uint8, device=self.device)
            message[:HEADER_BYTES] = header
            message[HEADER_BYTES:] = tensor.reshape(-1).view(torch.uint8)
            self._post_send(message, peer, TAG_HEADER, what)
        else:
            self._post_send(header, peer, TAG_HEADER, f"header of {what}")
            if nbytes:
                self._post_send(tensor, peer, TAG_PAYLOAD, f"payload of {what}")
        self._count_sent(layer, nbytes)

    def _count_sent(self, layer: int, nbytes: int) -> None:
        self.messages_sent += 1
        METRICS.add("bytes_sent", nbytes)
        if layer == 0 and nbytes == 0:
            METRICS.add("idle_steps")

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(self.device).contiguous()

    def _post_header_recv(self, peer: int, what: str) -> tuple[torch.Tensor | bytearray, Any]:
        if self.backend == "tcp":  # no torch op per header on tcp: a bytearray and struct
            message: torch.Tensor | bytearray = bytearray(HEADER_BYTES)
            return message, self._post_recv(message, peer, TAG_HEADER, what)
        message = torch.empty(HEADER_BYTES + self.inline_bytes, dtype=torch.uint8, device=self.device)
        return message, self._post_recv(message, peer, TAG_HEADER, what)

    def _check_header(self, header: Header, peer: int, what: str) -> int:
        """Bytes of the payload ``header`` announces, after checking it against what this side expects.

        The model's identity (when the creator gave one) fixes the dtype, a 2-D
        ``(tokens, hidden_size)`` shape and at most ``max_num_batched_tokens``
        rows; every payload is at most ``MAX_MESSAGE_BYTES`` and an inline one
        fits in the received message. ``ConnectorError`` (connector broken)
        otherwise, before anything is allocated.
        """
        ident = self.identity
        shape = header.shape
        nbytes = _ITEMSIZE.get(header.dtype, 0)
        if not nbytes:
            self._broken = f"bad header from {self._describe(peer)}"
            raise ConnectorError(f"AFD {self._me()}: {self._describe(peer)} announced dtype {header.dtype}, "
                                 "which this torch build lacks")
        for dim in shape:
            nbytes *= max(dim, 0)
        if shape == self._usual_shape(shape) and header.dtype == self._want_dtype and (
                not header.inline or nbytes <= self.inline_bytes):
            return nbytes  # the common case, checked in a few comparisons
        problems = []
        if any(dim < 0 for dim in shape):
            problems.append("a negative dimension")
        if ident.get("dtype") and header.dtype != ident["dtype"]:
            problems.append(f"dtype {header.dtype}, expected {ident['dtype']}")
        if ident.get("hidden_size") and (len(shape) != 2 or shape[1] != ident["hidden_size"]):
            problems.append(f"not (tokens, {ident['hidden_size']})")
        limit = ident.get("max_num_batched_tokens")
        if limit and shape and shape[0] > limit:
            problems.append(f"{shape[0]} tokens, more than max_num_batched_tokens={limit}")
        if nbytes > MAX_MESSAGE_BYTES:
            problems.append(f"{nbytes} bytes, more than {MAX_MESSAGE_BYTES}")
        if header.inline and nbytes > self.inline_bytes:
            problems.append(f"{nbytes} inline bytes, more than inline_bytes={self.inline_bytes}")
        if problems:
            self._broken = f"bad header from {self._describe(peer)}"
            raise ConnectorError(f"AFD {self._me()}: {self._describe(peer)} announced {header.dtype}{list(shape)} "
                                 f"for {what}: {'; '.join(problems)}; nothing was allocated")
        return nbytes

    def _usual_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """``shape`` itself when it is ``(rows, hidden_size)`` with ``0 <= rows <= max_num_batched_tokens``
        and the identity gives both, else ``None`` (then ``_check_header`` looks closer)."""
        hidden, limit = self.identity.get("hidden_size"), self.identity.get("max_num_batched_tokens")
        if hidden and limit and len(shape) == 2 and shape[1] == hidden and 0 <= shape[0] <= limit:
            return shape
        return None

    def _recv_payload(self, message: torch.Tensor | bytearray, header: Header, peer: int,
                      what: str) -> tuple[torch.Tensor, Any]:
        """The payload described by ``header``: a view into ``message`` when inline, else a posted receive."""
        nbytes = self._check_header(header, peer, what)
        dtype = getattr(torch, header.dtype)
        if header.inline and isinstance(message, torch.Tensor):  # (tcp has no inline form)
            return message[HEADER_BYTES : HEADER_BYTES + nbytes].view(dtype).view(header.shape), None
        out = torch.empty(header.shape, dtype=dtype, device=self.device)
        work = self._post_recv(out, peer, TAG_PAYLOAD, f"payload of {what}") if out.numel() else None
        return out, work

    # ------------------------------------------------------ attention side
    def send_attn_output(self, hidden: torch.Tensor, layer: int, step: int) -> None:
        """Send this rank's MLP input of ``layer`` at ``step`` (``(0, hidden)`` when idle) to its FFN rank."""
        self._check(topology.ATTENTION)
        self._drain_sends()
        self._sent_at = time.perf_counter()
        self._out_device = hidden.device
        self._send_tensor(self._wire(hidden), self.peers[0], layer, step)

    def recv_ffn_output(self, layer: int, step: int) -> torch.Tensor:
        """The FFN's output for ``layer``/``step``, on the device the hidden states were sent from."""
        self._check(topology.ATTENTION)
        peer = self.peers[0]
        what = f"FFN output of layer {layer} step {step}"
        message, work = self._post_header_recv(peer, what)
        self._wait(work, peer, what, self.timeout_s)
        header = decode_header(message)
        if header.kind == KIND_CLOSE:
            self._peer_closed(peer)
            self._broken = f"{self._describe(peer)} closed"
            raise ConnectorClosed(f"AFD {self._me()}: {self._describe(peer)} closed while {what} was awaited")
        self._drain_sends()  # the FFN answered, so our sends were taken; this returns at once
        if (header.layer, header.step) != (layer, step):
            self._broken = "layer/step mismatch"
            raise ConnectorError(
                f"AFD {self._me()}: expected FFN output of layer {layer} step {step}, got layer {header.layer} "
                f"step {header.step} from {self._describe(peer)}"
            )
        out, work = self._recv_payload(message, header, peer, what)
        if work is not None:
            self._wait(work, peer, f"payload of {what}", self.timeout_s)
        self.messages_received += 1
        METRICS.add("exchanges")
        METRICS.add("bytes_received", out.numel() * out.element_size())
        METRICS.observe(time.perf_counter() - self._sent_at)
        return out.to(self._out_device)

    # ------------------------------------------------------------ FFN side
    def recv_attn_output(self) -> tuple[Meta, list[torch.Tensor]]:
        """One step's MLP inputs from every served attention rank, in rank order.

        ``Meta.shape`` is the shape of their concatenation along dim 0. All ranks
        must agree on layer, step, dtype and trailing dimensions, else
        ``ConnectorError``. A rank that sent ``CLOSE`` is idle from then on: its
        slot holds a zero-row tensor and it is sent nothing. ``ConnectorClosed``
        is raised once every served rank has closed.

        With ``schedule: pingpong`` it returns the next layer of whichever rank
        sent first instead; the other slots hold zero-row tensors, and
        ``send_ffn_output`` answers only that rank.
        """
        self._check(topology.FFN)
        if self.schedule == "pingpong" and len(self.peers) > 1:
            return self._recv_first()
        while True:
            open_peers = [p for p in self.peers if p not in self._closed_peers]
            if not open_peers:
                self._broken = "all served attention ranks closed"
                raise ConnectorClosed(f"AFD {self._me()}: every served attention rank closed")
            posted = [(peer, self._post_header_recv(peer, "next attention output")) for peer in open_peers]
            decoded: list[tuple[int, torch.Tensor, Header]] = []
            for i, (peer, (message, work)) in enumerate(posted):
                self._wait(work, peer, "next attention output (header)", self.idle_timeout_s if i == 0 else
                           self.timeout_s)
                header = decode_header(message)
                if header.kind == KIND_CLOSE:
                    self._peer_closed(peer)
                else:
                    decoded.append((peer, message, header))
            if decoded:
                break
        self._drain_sends()
        first = decoded[0][2]
        layer, step, shape0, dtype0 = first.layer, first.step, first.shape, first.dtype
        for peer, _, other in decoded[1:]:
            if (other.layer, other.step) != (layer, step):
                self._broken = "layer/step mismatch between attention ranks"
                raise ConnectorError(
                    f"AFD {self._me()}: attention ranks out of step: {self._describe(decoded[0][0])} sent layer "
                    f"{layer} step {step}, {self._describe(peer)} sent layer {other.layer} step {other.step}"
                )
            shape, dtype = other.shape, other.dtype
            if dtype != dtype0 or len(shape) != len(shape0) or shape[1:] != shape0[1:] or not shape:
                self._broken = "shape/dtype mismatch between attention ranks"
                raise ConnectorError(
                    f"AFD {self._me()}: layer {layer} step {step}: {self._describe(peer)} sent {dtype}{list(shape)}, "
                    f"{self._describe(decoded[0][0])} sent {dtype0}{list(shape0)}; they cannot be batched"
                )
        what = f"attention output of layer {layer} step {step}"
        received = {peer: self._recv_payload(message, header, peer, what) for peer, message, header in decoded}
        for peer, (_, work) in received.items():
            if work is not None:
                self._wait(work, peer, f"payload of {what}", self.timeout_s)
        self.messages_received += len(received)
        METRICS.add("bytes_received", sum(t.numel() * t.element_size() for t, _ in received.values()))
        self._received_at = time.perf_counter()
        self._answer = [peer for peer, _, _ in decoded]
        template = received[decoded[0][0]][0]
        tensors = [received[p][0] if p in received else template.new_empty((0, *template.shape[1:]))
                   for p in self.peers]
        rows = sum(t.shape[0] for t in tensors) if shape0 else 0
        return Meta(layer, step, (rows, *shape0[1:]) if shape0 else (), dtype0), tensors

    def _recv_first(self) -> tuple[Meta, list[torch.Tensor]]:
        """Pingpong: one layer's input from whichever served rank's header arrives first.

        Every open rank has one header receive posted; ``Arrivals`` reports them in
        completion order, so a rank that died is noticed while others are silent.
        """
        while True:
            open_peers = [p for p in self.peers if p not in self._closed_peers]
            if not open_peers:
                self._broken = "all served attention ranks closed"
                raise ConnectorClosed(f"AFD {self._me()}: every served attention rank closed")
            for peer in open_peers:
                if peer not in self._posted:
                    message, work = self._post_header_recv(peer, "next attention output")
                    self._posted[peer] = message
                    self._arrivals.watch(peer, work, self.idle_timeout_s)
            self._enter()  # close() from another thread sees this wait and breaks it
            try:
                got = self._arrivals.next(self.idle_timeout_s + CLOSE_WAIT_S)
            finally:
                self._leave()
            if got is None:
                raise self._fail(RuntimeError("timed out"), None, "next attention output", self.idle_timeout_s)
            peer, err = got
            message = self._posted.pop(peer)
            if err is not None:
                raise self._fail(err, peer, "next attention output (header)", self.idle_timeout_s)
            header = decode_header(message)
            if header.kind != KIND_CLOSE:
                break
            self._closed_peers.add(peer)
        self._drain_sends()
        what = f"attention output of layer {header.layer} step {header.step}"
        tensor, work = self._recv_payload(message, header, peer, what)
        if work is not None:
            self._wait(work, peer, f"payload of {what}", self.timeout_s)
        self.messages_received += 1
        METRICS.add("bytes_received", tensor.numel() * tensor.element_size())
        self._received_at = time.perf_counter()
        self._answer = [peer]
        tensors = [tensor if p == peer else tensor.new_empty((0, *tensor.shape[1:])) for p in self.peers]
        return Meta(header.layer, header.step, tuple(tensor.shape), header.dtype), tensors

    def send_ffn_output(self, outputs: list[torch.Tensor], meta: Meta) -> None:
        """Send ``outputs[i]`` to the i-th served attention rank, tagged with ``meta``'s layer and step
        (only to the ranks whose inputs the last ``recv_attn_output`` returned)."""
        self._check(topology.FFN)
        if len(outputs) != len(self.peers):
            raise ConnectorError(f"AFD {self._me()}: {len(outputs)} outputs for {len(self.peers)} attention ranks")
        # The FFN's own time stops here: a send that wakes the attention rank can hand it this core, and the
        # time until this thread runs again says nothing about the FFN.
        elapsed = time.perf_counter() - self._received_at
        self._drain_sends()
        for tensor, peer in zip(outputs, self.peers, strict=True):
            if peer in self._answer:
                self._send_tensor(self._wire(tensor), peer, meta.layer, meta.step)
        METRICS.add("exchanges")
        METRICS.observe(elapsed)


def _poll(work: Any, deadline: float, stop: Any) -> bool:
    """Wait for ``work`` by polling ``is_completed()`` with a backoff; False at ``deadline`` or when ``stop()``.

    On NCCL ``is_completed()`` queries the operation's CUDA event and never blocks; ``work.wait()`` then
    only orders the current stream after it (or raises NCCL's error)."""
    start = time.monotonic()
    delay = 0.0
    while not work.is_completed():
        now = time.monotonic()
        if now >= deadline or stop():
            return False
        time.sleep(delay)
        delay = min(delay * 2 or POLL_MIN_S, POLL_MAX_S if now - start < 1.0 else POLL_IDLE_S)
    work.wait()
    return True


def _break_gloo_pair(pg: Any, peer: int) -> None:
    """Close the gloo connection to ``peer`` for good, so a wait blocked on it raises at once.

    gloo has no way to cancel a posted receive, but a receive that times out closes its connection
    ("pair"), and every other operation on that pair then fails: so post one on ``TAG_BREAK`` (never
    sent) and let it time out after 1 ms."""
    try:
        pg.recv([torch.empty(1, dtype=torch.uint8)], peer, TAG_BREAK).wait(timeout=timedelta(milliseconds=1))
    except RuntimeError:
        pass  # the expected timeout, or the pair was already closed


def _end_group(pg: Any, abort: bool) -> None:
    """``abort()`` a group whose communicator may be broken (where torch has it), else ``shutdown()``."""
    try:
        if abort and hasattr(pg, "abort"):
            pg.abort()
        else:
            pg.shutdown()
    except RuntimeError:
        pass
