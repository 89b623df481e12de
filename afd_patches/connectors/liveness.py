"""Peer liveness for the AFD group, independent of the tensor backend.

Why
    gloo notices a peer whose process ended (its socket closes), but not one
    that is frozen; NCCL notices neither: a receive posted to a dead peer just
    never completes, and torch's watchdog only acts after the group's timeout,
    which on NCCL must cover a whole idle period (see ``torch_dist``). So every
    rank of a group also beats a counter in the group's own ``TCPStore``.

How
    Each rank's ``Heartbeat`` thread adds 1 to ``afd/alive/<global rank>``
    every ``interval_s`` (``timeout_s / 4``, between ``MIN_INTERVAL_S`` and
    ``MAX_INTERVAL_S``) and reads its peers' counters. A peer whose counter did
    not move for ``timeout_s`` is reported lost (``on_lost(peer, why)``), once.
    A store that stops answering (every store operation is bounded by
    ``timeout_s``) means its host, FFN rank 0, died or froze: that rank is
    reported lost if it is watched, and the watch ends (other peers can no
    longer be watched; they are not reported, since they may well be alive).
    A rank that leaves cleanly adds ``CLOSED`` to its counter (``stop(clean=True)``);
    a peer seen past that mark is forgotten, not reported.

Limits
    A peer counts as silent from when this rank last saw its counter move, so a
    loss is reported between ``timeout_s - interval_s`` and ``timeout_s + 2 *
    interval_s`` after the peer's last beat (a process that still runs but
    whose Python threads are starved that long counts as lost). The store is unauthenticated,
    like the rest of torch's rendezvous: a party that can reach it can fake
    beats. Costs one thread and ``1 + len(peers)`` small store requests per
    ``interval_s`` per rank.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("afd")

MIN_INTERVAL_S = 0.05
MAX_INTERVAL_S = 1.0
CLOSED = 1 << 48  # added to a counter by a rank that leaves cleanly


def key(rank: int) -> str:
    """The store key holding ``rank``'s heartbeat counter."""
    return f"afd/alive/{rank}"


def interval_for(timeout_s: float) -> float:
    """Seconds between beats for a group whose peers count as lost after ``timeout_s`` of silence."""
    return min(max(timeout_s / 4, MIN_INTERVAL_S), MAX_INTERVAL_S)


class Heartbeat:
    """Beat for ``me`` and watch ``peers`` in ``store`` (any object with torch's ``Store.add``).

    ``on_lost(peer, why)`` runs on the heartbeat thread, at most once per peer;
    it must not block. ``store_name`` names the store in messages, ``store_rank``
    is the rank whose process hosts it.
    """

    def __init__(self, store: Any, me: int, peers: list[int], timeout_s: float,
                 on_lost: Callable[[int, str], None], store_name: str, store_rank: int) -> None:
        self.store = store
        self.me = me
        self.timeout_s = timeout_s
        self.interval_s = interval_for(timeout_s)
        self.on_lost = on_lost
        self.store_name = store_name
        self.store_rank = store_rank
        self._watched = {peer: (-1, time.monotonic()) for peer in peers}  # peer → (last count, when it moved)
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
                self.store.add(key(self.me), CLOSED)
            except RuntimeError:
                pass  # the store host is gone; nobody is left to tell

    def forget(self, peer: int) -> None:
        """Stop watching ``peer`` (it closed the group cleanly)."""
        self._watched.pop(peer, None)

    def _beat(self) -> None:
        self.store.add(key(self.me), 1)

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
            count = self.store.add(key(peer), 0)
            if count >= CLOSED:
                self.forget(peer)
            elif count != last:
                self._watched[peer] = (count, now)
            elif now - moved_at > self.timeout_s:
                self._lose(peer, f"no heartbeat for {now - moved_at:.1f}s (more than timeout_s="
                                 f"{self.timeout_s:g}s): the process is frozen, or gone without its "
                                 f"connection closing")

    def _lose(self, peer: int, why: str) -> None:
        if self._watched.pop(peer, None) is None:
            return
        try:
            self.on_lost(peer, why)
        except Exception:  # a failing callback must not end the watch over the other peers
            logger.exception("AFD heartbeat: reporting the loss of global rank %d failed", peer)
