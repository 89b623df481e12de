"""Peer liveness for AFD groups on gloo or NCCL, through MAC'd records in the group's store.

Why
    gloo notices a peer whose process ended (its socket closes), but not one that is frozen; NCCL notices
    neither: a receive posted to a dead peer just never completes. So every rank of such a group also
    beats a record in the group's ``TCPStore``. (``backend: tcp`` needs none of this: its keep-alives
    travel on the links themselves, see ``afd_patches.connectors.tcp``.)

How
    Each rank's ``Heartbeat`` thread writes ``alive/<global rank>`` = its beat count every ``interval_s``
    (``GroupSpec.beat_s``: ``timeout_s / 4``, clamped; ``afd_patches.connectors.spec``) and reads its peers'
    records, all through the group's ``MacStore``: a record written without the group's key does not verify and
    counts as no beat (logged once per peer), so a stranger who writes ``closed`` or a fresh count into the
    store cannot hide a frozen peer; at worst a stranger who overwrites records gets a live peer reported
    lost (the group fails, as a lost peer does). A peer whose record did not change for ``timeout_s`` is
    reported lost (``on_lost(peer, why)``), once. A store that stops answering means its host, FFN rank 0,
    died or froze: that rank is reported lost if watched, and the watch ends. A rank that leaves cleanly
    writes ``closed`` (``stop(clean=True)``); a peer seen with that record is forgotten, not reported.

Limits
    A loss is reported between ``timeout_s - interval_s`` and ``timeout_s + 2 * interval_s`` after the peer's
    last beat. Costs one thread and ``1 + 2 * len(peers)`` small store requests per ``interval_s`` per rank.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from afd_patches import LOGGER
from afd_patches.connectors.store import StoreTampered

logger = logging.getLogger(LOGGER)

CLOSED = b"closed"


def key(rank: int) -> str:
    """The store record holding ``rank``'s heartbeat."""
    return f"alive/{rank}"


class Heartbeat:
    """Beat for ``me`` every ``interval_s`` and watch ``peers`` in ``store`` (a ``MacStore``), each lost after
    ``timeout_s`` without a beat.

    ``on_lost(peer, why)`` runs on the heartbeat thread, at most once per peer; it must not block.
    ``store_name`` names the store in messages, ``store_rank`` is the rank whose process hosts it.
    """

    def __init__(self, store: Any, me: int, peers: list[int], timeout_s: float, interval_s: float,
                 on_lost: Callable[[int, str], None], store_name: str, store_rank: int) -> None:
        self.store, self.me, self.timeout_s, self.interval_s = store, me, timeout_s, interval_s
        self.on_lost, self.store_name, self.store_rank = on_lost, store_name, store_rank
        self._count = 0
        self._watched: dict[int, tuple[bytes, float]] = {peer: (b"", time.monotonic()) for peer in peers}
        self._forged: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"afd-heartbeat-{me}", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def stop(self, clean: bool) -> None:
        """Stop beating; with ``clean`` mark this rank as gone on purpose (peers then forget it)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.interval_s)  # a thread still in a store request ends on its own (daemon)
        if clean:
            try:
                self.store.set(key(self.me), CLOSED)
            except RuntimeError:
                pass  # the store host is gone; nobody is left to tell

    def forget(self, peer: int) -> None:
        """Stop watching ``peer`` (it closed the group cleanly)."""
        self._watched.pop(peer, None)

    def _beat(self) -> None:
        self._count += 1
        self.store.set(key(self.me), str(self._count).encode())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
                self._check()
            except RuntimeError as e:  # store requests fail or time out: its host (FFN rank 0) is gone
                if self._stop.is_set():
                    return
                text = str(e).splitlines()[0] if str(e) else type(e).__name__
                why = f"the group's store at {self.store_name} stopped answering ({text})"
                if self.store_rank in self._watched:
                    self._lose(self.store_rank, why)
                elif self._watched and self.store_rank != self.me:
                    logger.warning("AFD heartbeat of global rank %d: %s; its peers are no longer watched",
                                   self.me, why)
                return

    def _check(self) -> None:
        now = time.monotonic()
        for peer, (last, moved_at) in list(self._watched.items()):
            value = last
            if self.store.check([key(peer)]):
                try:
                    value = self.store.get(key(peer))
                except StoreTampered:
                    if peer not in self._forged:
                        self._forged.add(peer)
                        logger.warning("AFD heartbeat of global rank %d: the record of global rank %d in the "
                                       "group's store was written without the group's key; ignored", self.me, peer)
            if value == CLOSED:
                self.forget(peer)
            elif value != last:
                self._watched[peer] = (value, now)
            elif now - moved_at > self.timeout_s:
                self._lose(peer, f"no heartbeat for {now - moved_at:.1f}s (more than timeout_s={self.timeout_s:g}s):"
                                 " the process is frozen, or gone without its connection closing")

    def _lose(self, peer: int, why: str) -> None:
        if self._watched.pop(peer, None) is None:
            return
        try:
            self.on_lost(peer, why)
        except Exception:  # a failing callback must not end the watch over the other peers
            logger.exception("AFD heartbeat: reporting the loss of global rank %d failed", peer)
