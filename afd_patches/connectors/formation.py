"""Forming one AFD group for a rank: the token and the host read, the rendezvous, the transport its backend needs.

``form(spec, hello, cancelled, deadline, wait_s)`` forms the group of ``spec``'s rank (``hello(purpose, group,
address)`` makes its hellos; ``cancelled()`` ends the wait) and returns a ``Formed``: the connected ``Transport``,
on gloo/NCCL the ``MacStore`` the heartbeats use (``None`` on tcp), on FFN rank 0 of a tcp group serving several
attention ranks the ``rendezvous.Rejoins`` that takes back the ranks it drops (else ``None``), and the group id.

Each attempt reads the token (``auth.load_token``; its strength estimate is skipped while the token's source
is unchanged, ``_token``) and resolves the host name (``auth.resolve``) itself, on purpose: a token rotated or
a name moved between two groups is seen by the next. The address resolved is what
the policy judges (``auth.check_policy``) and what this attempt binds and connects to. Per rank:

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

import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from afd_patches import LOGGER, topology
from afd_patches.connectors import auth, rendezvous
from afd_patches.connectors.admission import listen
from afd_patches.connectors.base import ConnectorError, ConnectorTimeout
from afd_patches.connectors.handshake import Hello
from afd_patches.connectors.session import Session
from afd_patches.connectors.spec import GroupSpec
from afd_patches.connectors.transport import Transport
from afd_patches.metrics import METRICS

logger = logging.getLogger(LOGGER)

WILDCARDS = ("0.0.0.0", "::")
_TOKENLESS_WARNED: set[str] = set()  # group addresses this process warned about (once each)
_TOKENS: dict[tuple[Any, ...], bytes] = {}  # the last token judged strong, by its source's state (``_token``)


class Formed(NamedTuple):
    transport: Transport
    store: Any  # gloo/NCCL: the group's ``MacStore``; tcp: None
    rejoins: rendezvous.Rejoins | None
    group: str


class _Attempt(NamedTuple):
    """One formation attempt's inputs: the spec, what was read for it, how to say hello, when to give up."""

    spec: GroupSpec
    host: str  # the address the host name resolved to, for this attempt
    token: bytes | None
    hello: Callable[..., Hello]
    cancelled: Callable[[], bool]
    deadline: float
    wait_s: float


def form(spec: GroupSpec, hello: Callable[..., Hello], cancelled: Callable[[], bool], deadline: float,
         wait_s: float) -> Formed:
    """The formed group (see the module). ``ConnectorError`` when the token or the host cannot be used."""
    try:
        token = _token(spec.token_file)
        host = _address(spec.host)
        auth.check_policy(host, token, spec.allow_unauthenticated)
    except (auth.TokenError, OSError, UnicodeError) as e:
        raise ConnectorError(f"AFD rendezvous at {spec.address}: {e}") from None
    if token is None and spec.address not in _TOKENLESS_WARNED:
        _TOKENLESS_WARNED.add(spec.address)
        logger.warning("AFD group at %s has no token: any local user (or anyone who reaches the port) can join it, "
                       "or take the port while the FFN is down and answer as an FFN; %s; %s", spec.address,
                       auth.HOW_TO_SET, auth.HOW_TO_MAKE)
    return _form(_Attempt(spec, host, token, hello, cancelled, deadline, wait_s))


def _token(token_file: str | None) -> bytes | None:
    """The token as ``auth.load_token`` reads it now. Its strength estimate (about 0.4 ms) is not repeated while the
    source is what it was: the same ``AFD_TOKEN`` value, or a token file whose ``lstat`` (inode, mode, owner, size,
    modification time) did not change; anything else (a rotation, a ``chmod``, a link put in its place, the file
    gone) is read and judged again."""
    env = os.environ.get(auth.TOKEN_ENV)
    source: tuple[Any, ...] = (None, env)
    if token_file:
        try:
            st = os.lstat(token_file)
        except OSError:
            return auth.load_token(token_file)  # it names what is wrong with the file
        source = (token_file, env, st.st_ino, st.st_dev, st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns)
    known = _TOKENS.get(source)
    if known is not None:
        return known
    token = auth.load_token(token_file)
    _TOKENS.clear()  # one source at a time
    if token is not None:
        _TOKENS[source] = token
    return token


def _address(host: str) -> str:
    """``host`` resolved now (``auth.resolve``); an IP address without a scope is its own answer."""
    if "%" not in host:
        try:
            return str(ipaddress.ip_address(host))
        except ValueError:
            pass
    return auth.resolve(host)


def _form(at: _Attempt) -> Formed:
    spec = at.spec
    a, f = spec.num_attention_ranks, spec.num_ffn_ranks
    if spec.global_rank == 0:
        listener = listen(at.host, spec.port, "the group")
        try:
            expected = {topology.role_of_global(g, a, f) for g in range(1, spec.world_size)}
            joined = rendezvous.collect(listener, at.hello(), expected, at.deadline, spec.address, at.wait_s,
                                        at.token, at.cancelled)
        except BaseException:
            listener.close()
            raise
        group = rendezvous.new_group_id()
        addresses = {rank: j.hello.address for (role, rank), j in joined.items() if role == topology.FFN}

        def ffn_of(hello: Any) -> str:
            j = topology.ffn_rank_of(hello.rank, a, f) if hello.role == topology.ATTENTION else 0
            return addresses.get(j, "") if j else ""

        METRICS.add("handshakes_accepted", len(joined))
        if spec.backend == "tcp":
            rejoins = None
            if spec.takes_back:
                rejoins = rendezvous.Rejoins(listener, at.hello(), at.token, spec.address, group, expected)
            else:
                listener.close()
            rendezvous.accept(joined, group, ffn_of)
            served = {topology.global_rank(role, rank, a, f): j.session for (role, rank), j in joined.items()
                      if role == topology.ATTENTION and topology.global_rank(role, rank, a, f) in spec.peers}
            for (role, rank), j in joined.items():
                if topology.global_rank(role, rank, a, f) not in served:
                    j.session.close()
            return Formed(_tcp(spec, served), None, rejoins, group)
        return Formed(*_torch_group(at, group, listener, joined, ffn_of), None, group)
    if spec.backend == "tcp" and spec.role == topology.FFN:
        return _tcp_ffn(at)
    session, _, verdict = rendezvous.join(at.host, spec.port, at.hello(), at.deadline, at.wait_s, at.token,
                                          at.cancelled)
    METRICS.add("handshakes_accepted")
    group = verdict["group"]
    if spec.backend != "tcp":
        session.close()
        return Formed(*_torch_group(at, group, None, {}, None), None, group)
    if not verdict["ffn"]:
        return Formed(_tcp(spec, {spec.peers[0]: session}), None, None, group)
    session.close()
    host, _, port = verdict["ffn"].rpartition(":")
    data, _, _ = rendezvous.join(host.strip("[]"), int(port), at.hello("data", group), at.deadline, at.wait_s,
                                 at.token, at.cancelled)
    return Formed(_tcp(spec, {spec.peers[0]: data}), None, None, group)


def _tcp(spec: GroupSpec, sessions: dict[int, Session]) -> Transport:
    from afd_patches.connectors.tcp import TcpTransport

    return TcpTransport({peer: s.detach() for peer, s in sessions.items()}, spec.alive_s, spec.beat_s)


def _tcp_ffn(at: _Attempt) -> Formed:
    """An FFN rank other than 0 on tcp: listen for data sessions, join FFN rank 0, admit the served ranks."""
    from afd_patches.connectors.addresses import local_address

    spec = at.spec
    bind = at.host if at.host in WILDCARDS else local_address(at.host)
    listener = listen(bind, spec.data_port, "data sessions")
    try:
        host, port = spec.advertise or (
            socket.gethostbyname(socket.gethostname()) if bind in WILDCARDS else bind, listener.getsockname()[1])
        advertised = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        session, _, verdict = rendezvous.join(at.host, spec.port, at.hello(address=advertised), at.deadline,
                                              at.wait_s, at.token, at.cancelled)
        session.close()
        group = verdict["group"]
        a, f = spec.num_attention_ranks, spec.num_ffn_ranks
        expected = {(topology.ATTENTION, i) for i in topology.attention_ranks_of(spec.rank, a, f)}
        joined = rendezvous.collect(listener, at.hello("data", group), expected, at.deadline, advertised,
                                    at.wait_s, at.token, at.cancelled, group=group)
    finally:
        listener.close()
    rendezvous.accept(joined, group, lambda hello: "")
    METRICS.add("handshakes_accepted", len(joined))
    sessions = {topology.global_rank(role, rank, a, f): j.session for (role, rank), j in joined.items()}
    return Formed(_tcp(spec, sessions), None, None, group)


def _torch_group(at: _Attempt, group: str, listener: socket.socket | None, joined: dict[Any, Any],
                 ffn_of: Any) -> tuple[Transport, Any]:
    """gloo/NCCL: the group's store (FFN rank 0 serves it on ``listener``), the MAC'd group over it, warm-up."""
    from afd_patches.connectors.sealing import seal_store
    from afd_patches.connectors.store import group_store
    from afd_patches.connectors.torch_group import TorchGroupTransport, build_group

    spec, me = at.spec, at.spec.me()
    remaining = max(at.deadline - time.monotonic(), 1.0)
    key = auth.group_key(at.token, group)
    try:
        raw, store = group_store(at.host, spec.port, spec.global_rank, group, key, remaining,
                                 listener.detach() if listener is not None else None)
    except (RuntimeError, ValueError) as e:
        message = f"AFD {me}: could not open the group's store at {spec.address}: {e}"
        rendezvous.refuse(joined, "error", message)
        raise ConnectorError(message) from e
    rendezvous.accept(joined, group, ffn_of)
    try:
        pg = build_group(store, spec.backend, spec.global_rank, spec.world_size, spec.group_timeout_s(remaining))
    except Exception as e:  # torch raises several unrelated types here
        why = (f"the record {store.tampered!r} in the group's store failed authentication (written by someone "
               "without the group's token)") if store.tampered else f"{type(e).__name__}: {e}"
        late = store.tampered is None and time.monotonic() >= at.deadline
        raise (ConnectorTimeout if late else ConnectorError)(
            f"AFD connector init failed for {me}: could not form the {spec.backend} group of "
            f"{spec.world_size} ranks at {spec.address}: {why}") from e
    transport = TorchGroupTransport(pg, spec.backend, spec.device, spec.timeout_s, spec.inline_bytes, raw)
    try:
        if listener is not None:  # FFN rank 0: the store takes nothing more from strangers
            seal_store(store, spec.port, spec.world_size, max(at.deadline - time.monotonic(), 1.0), spec.address)
        transport.warm_up(list(spec.peers), spec.role == topology.FFN, max(at.deadline - time.monotonic(), 1.0))
    except BaseException:
        transport.close(clean=False)
        raise
    return transport, store
