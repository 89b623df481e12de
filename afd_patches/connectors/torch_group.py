"""``backend: gloo`` and ``backend: nccl``: the AFD traffic as torch.distributed point-to-point messages.

Group
    One standalone process group per AFD group, built here from torch's own classes (no global
    torch.distributed state, no ``new_group``): the gloo/NCCL backend (``build_group``) is built over the
    group's MAC'd store (``afd_patches.connectors.store``), gloo's pairs listening where
    ``afd_patches.connectors.addresses`` says; FFN rank 0 then seals the store
    (``afd_patches.connectors.sealing``). World size ``A + F`` in FFN-first order (``afd_patches.topology``).

Messages
    A message is an ``int64`` header (``wire``) with tag ``TAG_HEADER``; on gloo a payload of up to
    ``inline_bytes`` travels inside the same message (the receiver posts ``HEADER_BYTES + inline_bytes``;
    gloo accepts a shorter message), larger ones and every NCCL payload follow with tag ``TAG_PAYLOAD``.

Waits
    gloo waits block with a timeout; a wait can be interrupted only by closing the connection to that
    peer (``_break_pair``: a 1 ms receive on ``TAG_BREAK``, which is never sent, times out and closes the
    pair). NCCL waits poll ``is_completed()`` with a backoff and check the deadline and interrupts between
    polls. A failed gloo wait that came before its bound, without an interrupt, is ``LinkClosed``; one at
    its bound is ``LinkTimeout``; on NCCL an exception of the operation is ``BackendError``. ``first`` (the
    first of several peers' headers, for both schedules) hands each posted receive to an ``Arrivals`` thread
    on gloo and polls them all on NCCL.

Drops
    A rank dropped from a batched step (``drop``) is posted a ``KIND_DROP`` header and ignored from then on;
    its pair stays, since a torch process group takes no new member: the rank re-joins with the next group.

Limits
    The tensor traffic itself is not authenticated or encrypted (gloo and NCCL have no such option); NCCL's
    group timeout is at least ``idle_timeout_s`` (torch's watchdog would abort an idle FFN otherwise). The
    NCCL paths are exercised by ``scripts/gpu_check`` on a GPU; the CPU suite runs them with stand-ins.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from afd_patches.connectors import wire
from afd_patches.connectors.arrivals import Arrivals
from afd_patches.connectors.store import MacStore
from afd_patches.connectors.transport import (
    BackendError,
    Handle,
    LinkClosed,
    LinkError,
    LinkInterrupted,
    LinkTimeout,
    Transport,
)

TAG_HEADER, TAG_PAYLOAD, TAG_WARMUP, TAG_BREAK = 1, 2, 3, 4
POLL_MIN_S, POLL_MAX_S, POLL_IDLE_S = 2e-5, 1e-3, 1e-2  # NCCL polling backoff (POLL_IDLE_S after 1 s)


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


def build_group(store: MacStore, backend: str, rank: int, world_size: int, timeout_s: float) -> Any:
    """The gloo or NCCL backend object for this rank, over ``store``; gloo's pairs listen on
    ``store.pair_address`` (``GLOO_SOCKET_IFNAME`` applies only where that is ``None``)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        if store.pair_address is None:
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        gloo = dist.ProcessGroupGloo._Options()
        gloo._timeout = timeout
        gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=store.pair_address)]
        return dist.ProcessGroupGloo(store, rank, world_size, gloo)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


class _Sends(Handle):
    """The works of one message, and the tensors they read (kept alive until done)."""

    def __init__(self, transport: TorchGroupTransport, peer: int, works: list[Any], keep: list[torch.Tensor]) -> None:
        self.transport, self.peer, self.works, self.keep = transport, peer, works, keep

    def wait(self, timeout_s: float | None = None) -> None:
        bound = self.transport.timeout_s if timeout_s is None else timeout_s
        for work in self.works:
            self.transport.wait(work, self.peer, bound)
        self.works, self.keep = [], []


class TorchGroupTransport(Transport):
    """A gloo or NCCL group as a ``Transport`` (see the module docstring)."""

    def __init__(self, pg: Any, backend: str, device: torch.device, timeout_s: float, inline_bytes: int,
                 store: Any = None) -> None:
        self.pg, self.backend, self.device = pg, backend, device
        self.store = store  # the raw TCPStore: kept alive with the group (FFN rank 0's process serves it)
        self.device_type = device.type
        self.timeout_s, self.inline_bytes = timeout_s, inline_bytes
        self._posted: dict[int, tuple[torch.Tensor, Any]] = {}  # peer -> its posted header receive
        self._arrived: set[int] = set()  # peers whose posted header receive completed in first()
        self._message: dict[int, torch.Tensor] = {}  # peer -> the last header message (inline payload)
        self._interrupted: set[int] = set()
        self._dropped: set[int] = set()  # peers dropped from the group's steps (``drop``)
        self._farewells: list[Handle] = []  # their DROP headers' sends, kept alive until the group ends
        self._stop = threading.Event()
        self._arrivals = Arrivals("afd-arrivals")

    # ------------------------------------------------------------------ sending
    def send(self, peer: int, words: list[int], tensor: torch.Tensor | None) -> Handle:
        nbytes = tensor.numel() * tensor.element_size() if tensor is not None else 0
        inline = 0 < nbytes <= self.inline_bytes
        header = wire.encode([*words[:7], int(inline), *words[8:]], self.device).view(torch.uint8)
        if inline:
            assert tensor is not None
            message = torch.empty(wire.HEADER_BYTES + nbytes, dtype=torch.uint8, device=self.device)
            message[: wire.HEADER_BYTES] = header
            message[wire.HEADER_BYTES :] = tensor.reshape(-1).view(torch.uint8)
            return _Sends(self, peer, [self._post(self.pg.send, message, peer, TAG_HEADER)], [message])
        works, keep = [self._post(self.pg.send, header, peer, TAG_HEADER)], [header]
        if nbytes:
            assert tensor is not None
            works.append(self._post(self.pg.send, tensor, peer, TAG_PAYLOAD))
            keep.append(tensor)
        return _Sends(self, peer, works, keep)

    def warm_up(self, peers: list[int], is_sender: bool, timeout_s: float) -> None:
        """One small message per FFN/attention pair, so NCCL builds its communicators here, bounded."""
        flag = torch.zeros(1, dtype=torch.int64, device=self.device)
        for peer in peers:
            self.wait(self._post(self.pg.send if is_sender else self.pg.recv, flag, peer, TAG_WARMUP), peer,
                      timeout_s)

    def _post(self, op: Any, tensor: torch.Tensor, peer: int, tag: int) -> Any:
        """``op([tensor], peer, tag)``, the group's send or receive (every post of this transport goes through here);
        gloo raises at once when it already knows the pair closed, which becomes the typed ``LinkClosed``
        (``_error``) as in ``wait``."""
        try:
            return op([tensor], peer, tag)
        except RuntimeError as e:
            raise self._error(e, peer, 0.0, 0.0) from e

    # ---------------------------------------------------------------- receiving
    def _post_header(self, peer: int) -> tuple[torch.Tensor, Any]:
        if peer not in self._posted:
            buf = torch.empty(wire.HEADER_BYTES + self.inline_bytes, dtype=torch.uint8, device=self.device)
            self._posted[peer] = (buf, self._post(self.pg.recv, buf, peer, TAG_HEADER))
        return self._posted[peer]

    def next_header(self, peer: int, timeout_s: float) -> wire.Header:
        buf, work = self._post_header(peer)
        if peer in self._arrived:
            self._arrived.discard(peer)
        else:
            self.wait(work, peer, timeout_s)
        del self._posted[peer]
        self._message[peer] = buf
        return wire.decode(buf)

    def payload(self, peer: int, header: wire.Header, nbytes: int, timeout_s: float) -> torch.Tensor:
        dtype = getattr(torch, header.dtype)
        if header.inline:
            message = self._message.pop(peer)
            return message[wire.HEADER_BYTES : wire.HEADER_BYTES + nbytes].view(dtype).view(header.shape)
        out = torch.empty(header.shape, dtype=dtype, device=self.device)
        if nbytes:
            self.wait(self._post(self.pg.recv, out, peer, TAG_PAYLOAD), peer, timeout_s)
        return out

    def first(self, peers: list[int], timeout_s: float) -> int | None:
        """gloo: one waiter thread per peer reports completions in order (``Arrivals``); a dropped peer's
        completion is ignored. NCCL: the posted receives are polled (``poll`` over ``_AnyOf``)."""
        for peer in peers:
            if peer in self._arrived:
                return peer
        if self.backend == "nccl":
            return self._first_polled(peers, timeout_s)
        for peer in peers:
            if peer not in self._posted:
                _, work = self._post_header(peer)
                self._arrivals.watch(peer, work, timeout_s)
        deadline = time.monotonic() + timeout_s
        while (got := self._arrivals.next(max(deadline - time.monotonic(), 0.0))) is not None:
            peer, err = got
            if peer in self._dropped:
                continue  # a rank dropped from the group woke up: nothing of it is taken any more
            if err is not None:
                self._posted.pop(peer, None)
                raise self._error(err, peer, 0.0, timeout_s)
            self._arrived.add(peer)
            return peer
        return None

    def _first_polled(self, peers: list[int], timeout_s: float) -> int | None:
        start = time.monotonic()
        any_of = _AnyOf({peer: self._post_header(peer)[1] for peer in peers})
        stopped = lambda: self._stop.is_set() or any(p in self._interrupted for p in peers)  # noqa: E731
        try:
            if not poll(any_of, start + timeout_s, stopped):
                if stopped():
                    peer = next((p for p in peers if p in self._interrupted), peers[0])
                    raise LinkInterrupted(peer, f"the wait on global rank {peer} was interrupted by this side")
                return None
        except RuntimeError as e:
            peer = any_of.done if any_of.done is not None else peers[0]
            raise self._error(e, peer, time.monotonic() - start, timeout_s) from e
        assert any_of.done is not None
        self._arrived.add(any_of.done)
        return any_of.done

    def wait(self, work: Any, peer: int, timeout_s: float) -> None:
        """Wait for ``work`` at most ``timeout_s``: blocking on gloo, polling on NCCL (see "Waits")."""
        start = time.monotonic()
        try:
            if self.backend == "gloo":
                work.wait(timeout=timedelta(seconds=timeout_s))
                return
            if not poll(work, start + timeout_s, lambda: self._stop.is_set() or peer in self._interrupted):
                if self._stop.is_set() or peer in self._interrupted:
                    raise LinkInterrupted(peer, f"the wait on global rank {peer} was interrupted by this side")
                raise LinkTimeout(peer, f"nothing from global rank {peer} within {timeout_s:g}s")
        except RuntimeError as e:
            raise self._error(e, peer, time.monotonic() - start, timeout_s) from e

    def _error(self, err: BaseException, peer: int, elapsed: float, bound: float) -> Exception:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        if self._stop.is_set() or peer in self._interrupted:
            return LinkInterrupted(peer, f"the link to global rank {peer} was interrupted by this side")
        if self.backend == "nccl":
            return BackendError(peer, f"NCCL reported an error with global rank {peer} ({type(err).__name__}: "
                                      f"{text})")
        if bound and elapsed >= bound * 0.95:
            return LinkTimeout(peer, f"nothing from global rank {peer} within {bound:g}s ({text})")
        return LinkClosed(peer, f"the connection to global rank {peer} closed ({type(err).__name__}: {text})")

    # ------------------------------------------------------------------ ending
    def interrupt(self, peer: int) -> None:
        self._interrupted.add(peer)
        if self.backend == "gloo":
            _break_pair(self.pg, peer)

    def drop(self, peer: int, words: list[int]) -> None:
        """Post the ``KIND_DROP`` header ``words`` to ``peer`` (never waited for: the rank takes it when it wakes)
        and ignore its arrivals from now on. The pair stays: a torch group takes no new member, so the rank
        re-joins with the next group (see ``afd_patches.connectors.torch_dist``)."""
        self._dropped.add(peer)
        self._arrived.discard(peer)
        try:
            self._farewells.append(self.send(peer, words, None))
        except LinkError:
            pass  # its pair is gone: it finds that instead

    def close(self, clean: bool) -> None:
        self._stop.set()
        self._arrivals.stop()
        if self.backend == "gloo":
            for peer in list(self._posted):
                _break_pair(self.pg, peer)
        try:
            if not clean and self.backend != "gloo" and hasattr(self.pg, "abort"):
                self.pg.abort()
            else:
                self.pg.shutdown()
        except RuntimeError:
            pass


class _AnyOf:
    """Several NCCL works as one for ``poll``: completed once any is (``done``: its peer, the first in order)."""

    def __init__(self, works: dict[int, Any]) -> None:
        self.works = works
        self.done: int | None = None

    def is_completed(self) -> bool:
        self.done = next((peer for peer, work in self.works.items() if work.is_completed()), None)
        return self.done is not None

    def wait(self) -> None:
        assert self.done is not None
        self.works[self.done].wait()


def poll(work: Any, deadline: float, stop: Any) -> bool:
    """Wait for ``work`` by polling ``is_completed()`` with a backoff; False at ``deadline`` or when ``stop()``.

    On NCCL ``is_completed()`` queries the operation's CUDA event and never blocks; ``work.wait()`` then only
    orders the current stream after it (or raises NCCL's error)."""
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


def _break_pair(pg: Any, peer: int) -> None:
    """Close the gloo connection to ``peer`` for good, so a wait blocked on it raises at once."""
    try:
        pg.recv([torch.empty(1, dtype=torch.uint8)], peer, TAG_BREAK).wait(timeout=timedelta(milliseconds=1))
    except RuntimeError:
        pass  # the expected timeout, or the pair was already closed
