"""Waiting for the first of several posted receives, for backends whose work objects have no wait-any.

gloo's point-to-point work has neither futures nor a wait on several works, and
its receive-from-any-source is not failed when one peer's connection closes (a
dead peer would then go unnoticed). So ``Arrivals`` gives each peer a daemon
thread that blocks in ``work.wait()`` on that peer's posted receive (the wait
releases the GIL) and reports the completion, or the error, on one queue the
caller reads in completion order.

Contract: at most one receive per peer is handed over at a time (``watch``);
``next`` returns ``(peer, None)`` for a completed receive, ``(peer, error)`` for a
failed one, ``None`` after ``timeout_s`` without either. ``stop`` ends the
threads once their current wait returns (the caller makes it return, e.g. by
shutting the group down). Costs one thread hand-off per message.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any


class Arrivals:
    """Completion order of posted receives, one waiter thread per peer."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._done: queue.SimpleQueue[tuple[int, RuntimeError | None]] = queue.SimpleQueue()
        self._inboxes: dict[int, queue.SimpleQueue[tuple[Any, float] | None]] = {}

    def watch(self, peer: int, work: Any, timeout_s: float) -> None:
        """Wait (in ``peer``'s thread, up to ``timeout_s``) for ``work``, a receive posted from ``peer``."""
        box = self._inboxes.get(peer)
        if box is None:
            box = self._inboxes[peer] = queue.SimpleQueue()
            threading.Thread(target=self._run, args=(peer, box), name=f"{self._name}-{peer}", daemon=True).start()
        box.put((work, timeout_s))

    def next(self, timeout_s: float) -> tuple[int, RuntimeError | None] | None:
        """The next finished receive as ``(peer, error or None)``; ``None`` if none finished in ``timeout_s``."""
        try:
            return self._done.get(timeout=min(timeout_s, threading.TIMEOUT_MAX))
        except queue.Empty:
            return None

    def stop(self) -> None:
        """Let every waiter thread exit after its current wait."""
        for box in self._inboxes.values():
            box.put(None)

    def _run(self, peer: int, box: queue.SimpleQueue[tuple[Any, float] | None]) -> None:
        while (item := box.get()) is not None:
            work, timeout_s = item
            try:
                work.wait(timeout=timedelta(seconds=timeout_s))
            except RuntimeError as e:
                self._done.put((peer, e))
            else:
                self._done.put((peer, None))
