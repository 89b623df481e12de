"""How an AFD group forms: every rank opens an authenticated session with FFN rank 0, settings are compared,
and FFN rank 0 answers each with one MAC'd verdict that carries everything the rank will act on.

Why
    torch's rendezvous cannot tell a misconfigured peer from a slow one, its store has no authentication,
    and a ``TCPStore`` client that reaches some other program waits forever. So every rank first talks to
    the rank that hosts the group (FFN rank 0) over a plain TCP socket bound to the configured address
    only, where every wait is ours and bounded, through ``afd_patches.connectors.session``.

Rules
    A hello's ``fields`` (counts, backend, schedule, ``model.*`` identity) present on both sides must be
    equal; a difference between authenticated peers fails the group on both sides with
    ``ConnectorMismatch`` naming every differing field and both values. With NCCL two ranks naming the same
    GPU fail the group, saying how to fix it. A second claim of a rank already taken, or a rank outside the
    topology, is refused (that process fails naming the rank); the others' rendezvous goes on.

Verdict
    ``{"verdict": "ok", "group": G, "ffn": "host:port" | ""}``, sent inside the session (MAC'd). ``G`` is a
    fresh random id: it names the group's records in a ``TCPStore`` and keys their MACs (gloo/NCCL), and
    binds the data sessions of FFN ranks other than 0. ``ffn`` is where an attention rank served by such an
    FFN rank opens its data session: the address that FFN rank advertised inside its own authenticated
    hello. ``{"verdict": "fail", "kind", "message"}`` otherwise.

Re-joins (``backend: tcp``, ``schedule: batched``, FFN rank 0 serving several attention ranks)
    FFN rank 0 keeps its port open behind the same ``Gate`` for the group's life (``Rejoins``): an attention
    rank it dropped from a step re-joins the live group through the ordinary rendezvous (the same hello,
    the same ``ok`` verdict with the same group id); every other claim is refused and the group goes on.

Data sessions (``backend: tcp``, FFN ranks other than 0)
    The same session protocol with ``purpose: data`` and the group id: the FFN rank accepts exactly the
    attention ranks it serves, for the group it was told about, then answers each with an ``ok`` verdict.
"""

from __future__ import annotations

import logging
import queue
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from afd_patches import LOGGER
from afd_patches.connectors.admission import POLL_S, Gate, Joined
from afd_patches.connectors.base import ConnectorAuthError, ConnectorError, ConnectorMismatch, ConnectorTimeout
from afd_patches.connectors.handshake import Hello
from afd_patches.connectors.session import Session, SessionError, open_session

logger = logging.getLogger(LOGGER)

_KINDS: dict[str, type[ConnectorError]] = {
    "mismatch": ConnectorMismatch,
    "timeout": ConnectorTimeout,
    "auth": ConnectorAuthError,
    "error": ConnectorError,
}


def model_fields(identity: Mapping[str, Any] | None) -> dict[str, Any]:
    """``{"hidden_size": 64}`` → ``{"model.hidden_size": 64}``, dropping ``None`` values."""
    return {f"model.{k}": v for k, v in (identity or {}).items() if v is not None}


def differences(a: Hello, b: Hello) -> str:
    """``""`` when ``a`` and ``b`` agree, else ``"f (a: x, b: y); …"`` for every field both have."""
    return "; ".join(f"{name} ({a.who}: {a.fields[name]!r}, {b.who}: {b.fields[name]!r})"
                     for name in sorted(set(a.fields) & set(b.fields)) if a.fields[name] != b.fields[name])


def device_clash(a: Hello, b: Hello) -> str:
    """``""`` unless ``a`` and ``b`` would be two ranks of one NCCL group on one GPU; else what to do about it."""
    if not a.device or a.device != b.device or "nccl" not in (a.fields.get("backend"), b.fields.get("backend")):
        return ""
    return (f"{a.who} and {b.who} both use GPU {a.device}, and NCCL cannot put two ranks of one group on one "
            "GPU; give each engine its own GPU (CUDA_VISIBLE_DEVICES per engine, or connector_extra_config "
            "device), or set connector_extra_config backend: gloo on a single-GPU test box")


def collect(listener: socket.socket, own: Hello, expected: set[tuple[str, int]], deadline: float, address: str,
            timeout_s: float, token: bytes | None, cancelled: Callable[[], bool],
            group: str = "") -> dict[tuple[str, int], Joined]:
    """Admit authenticated hellos until every ``(role, rank)`` of ``expected`` said one; their sessions.

    ``group``: accept only ``data`` sessions of that group (an FFN rank other than 0), else only ``group``
    sessions. On a settings mismatch, at ``deadline`` or when ``cancelled()``, every waiting joiner gets a
    failing verdict and ``ConnectorMismatch``/``ConnectorTimeout``/``ConnectorError`` is raised.
    """
    gate = Gate(listener, own, token, address)
    waiting: dict[tuple[str, int], Joined] = {}
    current: Joined | None = None
    try:
        while set(waiting) != expected:
            if cancelled():
                raise ConnectorError(f"AFD rendezvous at {address}: cancelled (engine shutting down)")
            left = deadline - time.monotonic()
            if left <= 0:
                missing = ", ".join(f"{r} rank {i}" for r, i in sorted(expected - set(waiting)))
                raise ConnectorTimeout(f"AFD rendezvous at {address}: {own.who} heard from {len(waiting)} of "
                                       f"{len(expected)} expected rank(s) within {timeout_s:g}s; missing: "
                                       f"{missing}{gate.summary()}")
            try:
                current = gate.joined.get(timeout=min(left, POLL_S))
            except queue.Empty:
                continue
            hello = current.hello
            diff = differences(own, hello)
            if diff:
                raise ConnectorMismatch(f"AFD rendezvous at {address} failed: {own.who} and {hello.who} disagree "
                                        f"on {diff}")
            key = (hello.role, hello.rank)
            why = _claim_problem(own, hello, ("data", group) if group else ("group", ""),
                                 key in waiting or key == (own.role, own.rank), key in expected)
            if why:
                gate.note(current.session.peer, why)
                _refuse([current.session], "mismatch", f"AFD rendezvous at {address} failed: {why}")
                current = None
                continue
            for other in [own, *(j.hello for j in waiting.values())]:
                clash = device_clash(other, hello)
                if clash:
                    raise ConnectorMismatch(f"AFD rendezvous at {address} failed: {clash}")
            waiting[key], current = current, None
    except ConnectorError as e:
        kind = next(name for name, cls in _KINDS.items() if isinstance(e, cls))  # "error" matches last
        _refuse([j.session for j in [*waiting.values(), *([current] if current else [])]], kind, str(e))
        raise
    finally:
        gate.close()
        while True:  # sessions handed over after the last look
            try:
                gate.joined.get_nowait().session.close()
            except queue.Empty:
                break
    return waiting


def _claim_problem(own: Hello, hello: Hello, wanted: tuple[str, str], taken: bool, known: bool) -> str:
    """Why ``own`` refuses ``hello``'s claim (``wanted``: the (purpose, group) it admits), or ``""``."""
    if (hello.purpose, hello.group) != wanted:
        return f"{hello.who} asked for a {hello.purpose} session of another group"
    if taken:
        return f"{hello.who} is already taken"
    if not known:
        return f"{hello.who} is not part of the topology {own.who} hosts"
    return ""


class Rejoins:
    """FFN rank 0 of a live ``tcp`` group under ``batched``: takes back the attention ranks it dropped.

    The rendezvous' listening socket stays open for the group's life behind the same ``Gate`` (admission,
    proofs). ``take(dropped)`` runs on the serving thread between steps and never blocks: every session that
    arrived is answered. A ``group`` hello of a rank in ``dropped`` with the same settings gets this group's
    ``ok`` verdict (its session is its link, as at formation) and is returned; any other is refused as at
    formation (a rank still served is "already taken", a settings difference is named) and the group goes on.
    ``known`` are the topology's ranks other than FFN rank 0. ``close()`` stops admitting and closes the socket.
    """

    def __init__(self, listener: socket.socket, own: Hello, token: bytes | None, address: str, group: str,
                 known: set[tuple[str, int]]) -> None:
        self.own, self.address, self.group, self.known = own, address, group, known
        self._listener = listener
        self._gate = Gate(listener, own, token, address)

    def take(self, dropped: set[tuple[str, int]]) -> dict[tuple[str, int], Joined]:
        back: dict[tuple[str, int], Joined] = {}
        while True:
            try:
                joined = self._gate.joined.get_nowait()
            except queue.Empty:
                break
            hello = joined.hello
            key = (hello.role, hello.rank)
            diff = differences(self.own, hello)
            why = f"{self.own.who} and {hello.who} disagree on {diff}" if diff else _claim_problem(
                self.own, hello, ("group", ""), key not in dropped or key in back, key in self.known)
            if why:
                self._gate.note(joined.session.peer, why)
                _refuse([joined.session], "mismatch", f"AFD rendezvous at {self.address} failed: {why}")
                continue
            back[key] = joined
        accept(back, self.group, lambda hello: "")
        return back

    def close(self) -> None:
        self._gate.close()
        self._listener.close()
        self.take(set())  # sessions that arrived meanwhile are refused


def new_group_id() -> str:
    return secrets.token_hex(16)


def accept(joined: dict[tuple[str, int], Joined], group: str, ffn_address: Callable[[Hello], str]) -> None:
    """Send each joiner its ``ok`` verdict (``ffn_address(hello)``: where its data session goes, or ``""``)."""
    for j in joined.values():
        try:
            j.session.send({"verdict": "ok", "group": group, "ffn": ffn_address(j.hello)})
        except OSError:
            pass  # that peer is gone; the group fails on its side


def refuse(joined: dict[tuple[str, int], Joined], kind: str, message: str) -> None:
    """Send each joiner a failing verdict and close its session."""
    _refuse([j.session for j in joined.values()], kind, message)


def _refuse(sessions: list[Session], kind: str, message: str) -> None:
    for s in sessions:
        try:
            s.send({"verdict": "fail", "kind": kind, "message": message}, timeout_s=1.0)
        except OSError:
            pass
        s.close()


def join(host: str, port: int, own: Hello, deadline: float, timeout_s: float, token: bytes | None,
         cancelled: Callable[[], bool]) -> tuple[Session, Hello, dict[str, Any]]:
    """Open a session with ``host:port``, compare settings, wait for the verdict; (session, host hello, verdict).

    Raises ``ConnectorAuthError`` (another token), ``ConnectorMismatch`` (settings differ, or the host refused
    this rank), ``ConnectorTimeout`` (no verdict by ``deadline``), ``ConnectorError`` otherwise.
    """
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    session, host_hello = open_session(host, port, own, token, deadline, timeout_s, cancelled)
    try:
        diff = differences(own, host_hello)
        problem = f"{own.who} and {host_hello.who} disagree on {diff}" if diff else device_clash(own, host_hello)
        if problem:
            raise ConnectorMismatch(f"AFD rendezvous at {address} failed: {problem}")
        while True:
            if cancelled():
                raise ConnectorError(f"AFD rendezvous for {own.who}: cancelled (engine shutting down)")
            try:
                verdict = session.recv(min(deadline, time.monotonic() + POLL_S))
                break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise ConnectorTimeout(f"AFD rendezvous for {own.who}: {host_hello.who} at {address} did not "
                                           f"complete the group within {timeout_s:g}s (waiting for the other ranks)"
                                           ) from None
            except SessionError as e:
                raise ConnectorError(f"AFD rendezvous for {own.who}: lost {host_hello.who} at {address} ({e})") from e
        if verdict.get("verdict") != "ok":
            cls = _KINDS.get(str(verdict.get("kind")), ConnectorError)
            raise cls(f"{host_hello.who} at {address} refused the group for {own.who}: "
                      f"{verdict.get('message', verdict)}")
        if not isinstance(verdict.get("group"), str) or not isinstance(verdict.get("ffn", ""), str):
            raise ConnectorError(f"AFD rendezvous for {own.who}: {address} sent a malformed verdict")
    except BaseException:
        session.close()
        raise
    return session, host_hello, verdict
