"""Forming one AFD group for a connector: the rendezvous, then the transport its backend needs.

``form(conn, deadline, wait_s)`` returns ``(transport, store, rejoins)``: the connected ``Transport``, on
gloo/NCCL the ``MacStore`` the heartbeats use (``None`` on tcp), and on FFN rank 0 of a tcp group under
``batched`` that serves several attention ranks the ``rendezvous.Rejoins`` that takes back the ranks it drops
(else ``None``). Per rank:

- FFN rank 0: admits every other rank's session at the configured address (``rendezvous.collect``),
  draws the group id and answers each with its verdict. On tcp it keeps the sessions of the attention
  ranks it serves as their links (and its listening socket for re-joins, see above); on gloo/NCCL its
  listening socket becomes the group's ``TCPStore``.
- another FFN rank (tcp): listens for data sessions first (``data_port``), joins FFN rank 0 advertising
  that address, then admits exactly its served attention ranks for that group id.
- an attention rank: joins FFN rank 0; on tcp keeps that session as its link, or opens a data session
  at the FFN address its verdict names.

Every failure closes what was opened and raises a ``ConnectorError`` subclass naming this rank, the
address and the cause.
"""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any, Protocol

from afd_patches import topology
from afd_patches.connectors import auth, liveness, rendezvous
from afd_patches.connectors.admission import listen
from afd_patches.connectors.base import ConnectorError, ConnectorTimeout
from afd_patches.connectors.session import Session
from afd_patches.connectors.transport import Transport
from afd_patches.metrics import METRICS

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from afd_patches.config import AfdConfig, LinkConfig
    from afd_patches.connectors.handshake import Hello


class Member(Protocol):
    """What formation reads of the rank it forms a group for (the connector is one)."""

    config: AfdConfig
    options: LinkConfig
    role: str
    global_rank: int
    world_size: int
    peers: list[int]
    backend: str
    schedule: str
    device: torch.device
    host: str
    timeout_s: float
    idle_timeout_s: float
    inline_bytes: int
    group: str
    token: bytes | None

    @property
    def address(self) -> str: ...

    @property
    def cancelled(self) -> Callable[[], bool]: ...

    def hello(self, purpose: str = "group", group: str = "", address: str = "") -> Hello: ...

    def me(self) -> str: ...


WILDCARDS = ("0.0.0.0", "::")


def form(conn: Member, deadline: float, wait_s: float) -> tuple[Transport, Any, rendezvous.Rejoins | None]:
    """The connected transport, on gloo/NCCL the ``MacStore`` for the heartbeats, the re-join gate (see the
    module)."""
    cfg = conn.config
    a, f = cfg.num_attention_ranks, cfg.num_ffn_ranks
    if conn.global_rank == 0:
        listener = listen(conn.host, cfg.port, "the group")
        try:
            expected = {topology.role_of_global(g, a, f) for g in range(1, conn.world_size)}
            joined = rendezvous.collect(listener, conn.hello(), expected, deadline, conn.address, wait_s,
                                        conn.token, conn.cancelled)
        except BaseException:
            listener.close()
            raise
        group = conn.group = rendezvous.new_group_id()
        addresses = {rank: j.hello.address for (role, rank), j in joined.items() if role == topology.FFN}

        def ffn_of(hello: Any) -> str:
            j = topology.ffn_rank_of(hello.rank, a, f) if hello.role == topology.ATTENTION else 0
            return addresses.get(j, "") if j else ""

        METRICS.add("handshakes_accepted", len(joined))
        if conn.backend == "tcp":
            rejoins = None
            if conn.schedule == "batched" and len(conn.peers) > 1:
                rejoins = rendezvous.Rejoins(listener, conn.hello(), conn.token, conn.address, group, expected)
            else:
                listener.close()
            rendezvous.accept(joined, group, ffn_of)
            served = {topology.global_rank(role, rank, a, f): j.session for (role, rank), j in joined.items()
                      if role == topology.ATTENTION and topology.global_rank(role, rank, a, f) in conn.peers}
            for (role, rank), j in joined.items():
                if topology.global_rank(role, rank, a, f) not in served:
                    j.session.close()
            return _tcp(conn, served), None, rejoins
        return (*_torch_group(conn, group, deadline, listener, joined, ffn_of), None)
    if conn.backend == "tcp" and conn.role == topology.FFN:
        return _tcp_ffn(conn, deadline, wait_s), None, None
    session, _, verdict = rendezvous.join(conn.host, cfg.port, conn.hello(), deadline, wait_s, conn.token,
                                          conn.cancelled)
    METRICS.add("handshakes_accepted")
    conn.group = verdict["group"]
    if conn.backend != "tcp":
        session.close()
        return (*_torch_group(conn, verdict["group"], deadline, None, {}, None), None)
    if not verdict["ffn"]:
        return _tcp(conn, {conn.peers[0]: session}), None, None
    session.close()
    host, _, port = verdict["ffn"].rpartition(":")
    data, _, _ = rendezvous.join(host.strip("[]"), int(port), conn.hello("data", verdict["group"]), deadline,
                                  wait_s, conn.token, conn.cancelled)
    return _tcp(conn, {conn.peers[0]: data}), None, None


def _tcp(conn: Member, sessions: dict[int, Session]) -> Transport:
    from afd_patches.connectors.tcp import TcpTransport

    return TcpTransport({peer: s.detach() for peer, s in sessions.items()}, conn.timeout_s,
                        liveness.interval_for(conn.timeout_s))


def _tcp_ffn(conn: Member, deadline: float, wait_s: float) -> Transport:
    """An FFN rank other than 0 on tcp: listen for data sessions, join FFN rank 0, admit the served ranks."""
    from afd_patches.connectors.addresses import local_address

    cfg, opts = conn.config, conn.options
    bind = conn.host if conn.host in WILDCARDS else local_address(conn.host)
    listener = listen(bind, opts.data_port, "data sessions")
    try:
        host, port = opts.advertise or (
            socket.gethostbyname(socket.gethostname()) if bind in WILDCARDS else bind, listener.getsockname()[1])
        advertised = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        session, _, verdict = rendezvous.join(conn.host, cfg.port, conn.hello(address=advertised), deadline, wait_s,
                                              conn.token, conn.cancelled)
        session.close()
        group = conn.group = verdict["group"]
        a, f = cfg.num_attention_ranks, cfg.num_ffn_ranks
        expected = {(topology.ATTENTION, i) for i in topology.attention_ranks_of(cfg.rank, a, f)}
        joined = rendezvous.collect(listener, conn.hello("data", group), expected, deadline, advertised, wait_s,
                                    conn.token, conn.cancelled, group=group)
    finally:
        listener.close()
    rendezvous.accept(joined, group, lambda hello: "")
    METRICS.add("handshakes_accepted", len(joined))
    return _tcp(conn, {topology.global_rank(role, rank, a, f): j.session for (role, rank), j in joined.items()})


def _torch_group(conn: Member, group: str, deadline: float, listener: socket.socket | None,
                 joined: dict[Any, Any], ffn_of: Any) -> tuple[Transport, Any]:
    """gloo/NCCL: the group's store (FFN rank 0 serves it on ``listener``), the MAC'd group over it, warm-up."""
    from afd_patches.connectors.sealing import seal_store
    from afd_patches.connectors.store import group_store
    from afd_patches.connectors.torch_group import TorchGroupTransport, build_group

    cfg = conn.config
    remaining = max(deadline - time.monotonic(), 1.0)
    key = auth.group_key(conn.token, group)
    try:
        raw, store = group_store(conn.host, cfg.port, conn.global_rank, group, key, remaining,
                                 listener.detach() if listener is not None else None)
    except (RuntimeError, ValueError) as e:
        message = f"AFD {conn.me()}: could not open the group's store at {conn.address}: {e}"
        rendezvous.refuse(joined, "error", message)
        raise ConnectorError(message) from e
    rendezvous.accept(joined, group, ffn_of)
    group_timeout = remaining if conn.backend == "gloo" else max(conn.idle_timeout_s, conn.timeout_s, remaining)
    try:
        pg = build_group(store, conn.backend, conn.global_rank, conn.world_size, group_timeout)
    except Exception as e:  # torch raises several unrelated types here
        why = (f"the record {store.tampered!r} in the group's store failed authentication (written by someone "
               "without the group's token)") if store.tampered else f"{type(e).__name__}: {e}"
        late = store.tampered is None and time.monotonic() >= deadline
        raise (ConnectorTimeout if late else ConnectorError)(
            f"AFD connector init failed for {conn.me()}: could not form the {conn.backend} group of "
            f"{conn.world_size} ranks at {conn.address}: {why}") from e
    transport = TorchGroupTransport(pg, conn.backend, conn.device, conn.timeout_s, conn.inline_bytes, raw)
    try:
        if listener is not None:  # FFN rank 0: the store takes nothing more from strangers
            seal_store(store, cfg.port, conn.world_size, max(deadline - time.monotonic(), 1.0), conn.address)
        transport.warm_up(conn.peers, conn.role == topology.FFN, max(deadline - time.monotonic(), 1.0))
    except BaseException:
        transport.close(clean=False)
        raise
    return transport, store
