"""An AFD group's lifecycle on each side, with one retry policy and one idle wait for both.

Both sides form every group the same way: one formation (the connector's ``init``) waits for the peers for as
long as ``idle_wait_s`` (``connector_extra_config.idle_timeout_s``, default ``afd_patches.config.IDLE_TIMEOUT_S``,
a week: a group, the first one too, may take as long as a deploy takes); one that fails (a mismatched or
foreign peer, the wait running out, the port held by another program) is logged and tried again after
``retry_pause``: ``RETRY_S``, doubled per failure in a row, at most ``RETRY_MAX_S``.

FFN side: ``GroupFormer`` forms each group the FFN worker serves (``FfnRoleMixin._afd_serve``,
``afd_patches.workers.ffn``), the first exactly as any later one: ``form(conn)`` logs that it waits, keeps
``vllm:afd_group_up`` at 0 meanwhile, and returns True once the group formed (counted, and from the second
group on counted as ``vllm:afd_group_reformations``), or False after a failed formation and its pause. Only
the worker's stop event ends the waiting.

Attention side: ``GroupKeeper`` owns the attention worker's connector once the first group has
formed (``AttentionRoleMixin.load_model``):

- ``lost(error)``: a step or an idle step raised ``error`` (a ``ConnectorError``:
  the FFN closed, broke the connection or stayed silent for ``timeout_s``).
  The first call of an outage unbinds the connector from the model's link
  (between steps, under its lock), so every later exchange raises
  ``AfdGroupDown`` at once, with a message naming AFD, this rank and the FFN's
  ``host:port``; it logs one error line, sets ``vllm:afd_group_up`` to 0 and
  starts the re-forming thread. It returns the ``AfdGroupDown`` to raise.
  Later calls during the same outage change nothing.
- The re-forming thread (``afd-regroup-<rank>``) closes the lost connector,
  then builds a new one (``build_connector``) and waits in ``init`` for as long
  as ``idle_wait_s`` for an FFN at the same ``host:port``; a handshake that
  fails (a mismatched or foreign peer) is logged and tried again after
  ``retry_pause``. Once one forms it is bound to the
  link (under its lock), logged, and counted (``vllm:afd_group_reformations``).
- ``status()``: what ``afd_group_status()`` reports through ``collective_rpc``
  (the engine core and the API server ask it): ``up``, ``error`` (the message
  of the last outage, kept after it ended), ``since`` (``time.time()`` when the
  last outage began), ``outages``, ``reformations``, ``address``.
- ``stop()``: cancels a re-formation in progress (closing a connector cancels
  its ``init``) and closes the current connector. Idempotent.

Limits: one connector per worker, as in the rest of the attention role. The
engine itself decides what happens to requests (``afd_patches.patches.outage``):
the worker only raises and reports.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from afd_patches import LOGGER, metrics
from afd_patches.connectors.base import ConnectorError
from afd_patches.models.link import AfdGroupDown, AfdLink

if TYPE_CHECKING:
    from afd_patches.config import AfdConfig
    from afd_patches.connectors.base import Connector

logger = logging.getLogger(LOGGER)

RETRY_S = 1.0  # pause after a formation that failed, doubled per failure in a row ...
RETRY_MAX_S = 10.0  # ... up to this (a right peer arriving then waits at most this long)


def retry_pause(failures: int) -> float:
    """Seconds to wait before the next formation after ``failures`` (at least 1) failed in a row."""
    return min(RETRY_S * 2 ** (failures - 1), RETRY_MAX_S)


def idle_wait_s(cfg: AfdConfig) -> float:
    """How long one formation waits for its peers: ``connector_extra_config.idle_timeout_s``."""
    return cfg.link.idle_timeout_s


class GroupFormer:
    """The FFN worker's formations, one group after another (see the module docstring)."""

    def __init__(self, cfg: AfdConfig, stop: threading.Event) -> None:
        self.cfg = cfg
        self.stop = stop  # the worker's: set by shutdown()
        self.groups = 0  # groups formed so far
        self.failures = 0  # formations that failed in a row (their retries back off)

    def form(self, conn: Connector) -> bool:
        """Wait in ``conn.init`` for a group; True once formed, False after a failed formation and its pause.
        A ``ConnectorError`` once the stop event is set propagates."""
        cfg = self.cfg
        logger.info("AFD FFN rank %d: waiting for %s group at %s:%s", cfg.rank, "a new" if self.groups else
                    "its first", cfg.host, cfg.port)
        metrics.set_group_up(False)
        try:
            conn.init(idle_wait_s(cfg))
        except ConnectorError as e:
            if self.stop.is_set():
                raise
            self.failures += 1
            pause = retry_pause(self.failures)
            logger.error("AFD FFN rank %d: a group did not form (%s); waiting for one again in %.0fs", cfg.rank, e,
                         pause)
            self.stop.wait(pause)  # a port held by another program fails at once: do not spin
            return False
        self.failures = 0
        if self.groups:
            metrics.METRICS.add("group_reformations")
        self.groups += 1
        metrics.set_group_up(True)
        logger.info("AFD FFN rank %d: a group formed at %s:%s", cfg.rank, cfg.host, cfg.port)
        return True


class GroupKeeper:
    """The attention worker's connector, its loss and its replacement (see the module docstring)."""

    def __init__(self, cfg: AfdConfig, build: Callable[[], Connector], link: AfdLink, connector: Connector,
                 reform_wait_s: float) -> None:
        self.cfg = cfg
        self.build = build  # a new, not yet initialised connector for the same group
        self.link = link
        self.address = f"{cfg.host}:{cfg.port}"
        self.reform_wait_s = reform_wait_s
        self.connector: Connector | None = connector
        self.earlier = [0, 0]  # messages sent/received by the connectors of groups lost so far
        self.error: str | None = None
        self.since: float | None = None
        self.outages = 0
        self.reformations = 0
        self._lost: Connector | None = None  # closed by the re-forming thread
        self._forming: Connector | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._state = threading.Lock()
        link.swap(connector)
        metrics.set_group_up(True)

    def lost(self, error: ConnectorError) -> AfdGroupDown:
        """Record the loss of the group (once per outage); return the error the failed step raises."""
        if isinstance(error, AfdGroupDown):
            return error  # already down before that step began
        with self._state:
            if self.connector is None or self._stop.is_set():
                return AfdGroupDown(self.error or f"AFD attention rank {self.cfg.rank}: no group at {self.address}")
            self.error = (f"AFD: attention rank {self.cfg.rank} lost its FFN role at {self.address} ({error}); "
                          f"requests fail until an FFN serves {self.address} again and the group re-forms "
                          "(this engine re-forms it by itself)")
            self.since = time.time()
            self.outages += 1
            old = self.link.swap(None, self.error)
            self._lost, self.connector = old, None
            if old is not None:
                self.earlier[0] += old.messages_sent
                self.earlier[1] += old.messages_received
            metrics.set_group_up(False)
            logger.error("AFD attention rank %d: lost the FFN role at %s (%s); failing requests and re-forming "
                         "the group in the background", self.cfg.rank, self.address, error)
            self._thread = threading.Thread(target=self._reform, name=f"afd-regroup-{self.cfg.rank}", daemon=True)
            self._thread.start()
            return AfdGroupDown(self.error)

    def _reform(self) -> None:
        """Close the lost connector, then form a new group at the same address until one forms or ``stop()``."""
        with self._state:
            lost, self._lost = self._lost, None
        if lost is not None:
            lost.close()
        t0 = time.monotonic()
        logger.info("AFD attention rank %d: waiting for an FFN at %s to re-form the group", self.cfg.rank,
                    self.address)
        failures = 0
        while not self._stop.is_set():
            conn = self.build()
            with self._state:
                if self._stop.is_set():
                    conn.close()
                    return
                self._forming = conn
            try:
                conn.init(self.reform_wait_s)
            except ConnectorError as e:
                conn.close()
                if self._stop.is_set():
                    return
                failures += 1
                pause = retry_pause(failures)
                logger.error("AFD attention rank %d: the group at %s did not re-form (%s); trying again in %.0fs",
                             self.cfg.rank, self.address, e, pause)
                self._stop.wait(pause)
                continue
            finally:
                with self._state:
                    self._forming = None
            with self._state:
                if self._stop.is_set():
                    conn.close()
                    return
                self.connector = conn
                self.reformations += 1
                self.link.swap(conn)
            metrics.METRICS.add("group_reformations")
            metrics.set_group_up(True)
            logger.info("AFD attention rank %d: re-formed the group at %s %.1fs after losing it; serving again",
                        self.cfg.rank, self.address, time.monotonic() - t0)
            return

    def status(self) -> dict[str, Any]:
        """This rank's group as ``afd_group_status()`` reports it (JSON values)."""
        with self._state:
            return {"role": "attention", "up": self.connector is not None, "error": self.error,
                    "since": self.since, "outages": self.outages, "reformations": self.reformations,
                    "address": self.address}

    def messages(self) -> tuple[int, int]:
        """Messages sent and received over every group so far."""
        with self._state:
            conn = self.connector
            sent, received = self.earlier
        return sent + (conn.messages_sent if conn else 0), received + (conn.messages_received if conn else 0)

    def stop(self) -> None:
        """Cancel a re-formation in progress and close the current connector (the FFN sees a clean close)."""
        with self._state:
            self._stop.set()
            forming, self._forming = self._forming, None
            conn, self.connector = self.connector, None
        if forming is not None:
            forming.close()
        if conn is not None:
            locked = self.link.lock.acquire(timeout=5.0)  # let a step in flight finish (it uses this connector)
            try:
                self.link.connector, self.link.down = None, "AFD: this attention engine is shutting down"
                conn.close()
            finally:
                if locked:
                    self.link.lock.release()
        if self._thread is not None:
            self._thread.join(5.0)
