"""One formation loop for both AFD roles, and the attention side's group across outages.

``FormationLoop`` (both sides)
    Forms one group after another for one rank. An attempt builds a new connector (``build``) and waits in
    its ``init`` for the peers, at most ``wait_s`` (``connector_extra_config.idle_timeout_s``: a group, the
    first one too, may take as long as a deploy takes). *Any* exception of an attempt — a peer that does
    not show up, a mismatched or foreign peer, the port held by another program, the host name not
    resolving for a moment, the token file unreadable or too open during a rotation, a bug — ends that
    attempt only: it is logged at ERROR the first time its cause (exception type and message) is seen
    and at DEBUG when it repeats, counted (``vllm:afd_group_formation_failures``), and the next attempt
    starts after ``retry_pause``: ``RETRY_S``, doubled per failure in a row, at most ``RETRY_MAX_S`` and at
    most the group's ``timeout_s`` (so a peer that is back waits at most that long for the next attempt).
    Only the stop event ends the loop (``form`` then returns None); ``cancel`` closes the connector whose
    ``init`` is in progress, so a stop takes effect at once. The token file and the host name are read by
    the connector at each attempt (``afd_patches.connectors``), so a rotated token or a moved host is
    picked up by the next attempt, and a transient fault costs one pause, never the loop. With
    ``deadline`` (the attention side's first group, formed inside vLLM's ``load_model``) the loop gives up
    once the next attempt could not start before it, raising ``FormationFailed`` with the last cause.

``AttentionGroup`` (attention side)
    Owns the attention worker's connector: ``start()`` forms the first group (bounded by ``timeout_s``, at least
    ``FIRST_GROUP_MIN_S``; transient faults retried within it), binds it to the model's link and starts the idle
    ticker where the lockstep needs one; ``stop()`` ends everything. Idempotent.

    - ``lost(error)``: a step or an idle step raised ``error`` (a ``ConnectorError``: the FFN closed, broke
      the connection or stayed silent for ``timeout_s``). The first call of an outage unbinds the connector
      from the link (between steps, under its lock), so every later exchange raises ``AfdGroupDown`` at
      once, with a message naming AFD, this rank and the FFN's ``host:port``; it logs one error line, sets
      ``vllm:afd_group_up`` to 0 and starts the re-forming thread (``afd-regroup-<rank>``), which closes the
      lost connector and runs the ``FormationLoop`` at the same address until a group forms (bound to the
      link under its lock, logged, counted as ``vllm:afd_group_reformations``) or ``stop()``. It returns the
      ``AfdGroupDown`` to raise. Later calls during the same outage change nothing.
    - ``hold(error, since)``: the model's forward met ``error`` (the group binds it as ``AfdLink.hold`` when
      ``hold_s`` > 0). It records
      the loss as ``lost`` does, then waits until a group is bound again, at most ``hold_s`` after ``since``
      (when that step was first held): then it returns and the forward runs the step again from its first
      layer (counted as ``vllm:afd_replayed_steps``); else, or on ``stop()``, it raises the step's
      ``AfdGroupDown``. Either way one line names the rank, the FFN's address and how long the step was held
      (``vllm:afd_hold_seconds``).
    - The idle ticker (``afd-idle-<rank>``; only under ``batched`` with several attention ranks per FFN rank,
      and not where vLLM keeps data-parallel ranks in step): after ``IDLE_TICK_S`` without a step it runs a
      zero-token step, so the FFN rank's batch never waits on an idle engine.
    - ``status()``: what ``afd_group_status()`` reports through ``collective_rpc`` (the engine core and the
      API server ask it): a ``GroupStatus``.

Limits: one connector per worker, as in the rest of the attention role. The engine itself decides what
happens to requests (``afd_patches.patches.outage``): the worker only raises and reports. An exception that
is not a connector's, raised by an idle step, stops the ticker (logged): the busy ranks then wait for this
rank's real steps, and its FFN rank drops it after ``timeout_s`` as it drops any stalled rank.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from afd_patches import LOGGER, metrics
from afd_patches.connectors.base import ConnectorError
from afd_patches.models.link import AfdGroupDown, AfdLink

if TYPE_CHECKING:
    from afd_patches.connectors.base import Connector

logger = logging.getLogger(LOGGER)

RETRY_S = 1.0  # pause after a formation attempt that failed, doubled per failure in a row ...
RETRY_MAX_S = 10.0  # ... up to this (a right peer arriving then waits at most this long)
IDLE_TICK_S = 0.02  # an idle attention rank's zero-token step interval (see AttentionGroup)
# the first group's bound is at least this: the attention engines of one group start together and reach their
# first formation at different moments (tens of seconds apart on a loaded host), whatever timeout_s is
FIRST_GROUP_MIN_S = 60.0


def retry_pause(failures: int, cap_s: float = float("inf")) -> float:
    """Seconds to wait before the next formation after ``failures`` (at least 1) failed in a row: ``RETRY_S``
    doubled per failure, at most ``RETRY_MAX_S`` and at most ``cap_s``."""
    return min(RETRY_S * 2 ** min(failures - 1, 32), RETRY_MAX_S, cap_s)


@dataclass(frozen=True)
class GroupStatus:
    """An attention rank's group as ``afd_group_status()`` reports it (``as_json()`` crosses vLLM's RPC). Times
    are ``time.time()``. The group was down at some moment since ``t`` iff it is down now, or an outage began at
    or after ``t``, or a group formed again at or after ``t`` (so it was down before that): how
    ``afd_patches.patches.outage`` judges a failed step or request."""

    up: bool
    error: str | None = None  # the last outage's message (kept after the group re-forms)
    since: float | None = None  # when the last outage began
    reformed_at: float | None = None  # when the group last re-formed after an outage
    outages: int = 0
    reformations: int = 0
    address: str | None = None  # the FFN's host:port
    tp_rank: int | None = None  # an attention TP follower's rank (it has no group of its own)

    def as_json(self) -> dict[str, Any]:
        return {"role": "attention", **asdict(self)}


class MessageTally:
    """Messages sent and received over every group a rank had: the lost groups' connectors' counts (``retire``)
    plus the current one's. Not locked: its owner holds its own lock around both calls."""

    def __init__(self) -> None:
        self.sent = self.received = 0

    def retire(self, conn: Connector | None) -> None:
        """Keep the counts of ``conn``, a connector that is being replaced."""
        if conn is not None:
            self.sent += conn.messages_sent
            self.received += conn.messages_received

    def total(self, current: Connector | None) -> tuple[int, int]:
        """Sent and received over the retired connectors and ``current``."""
        if current is None:
            return self.sent, self.received
        return self.sent + current.messages_sent, self.received + current.messages_received


class FormationFailed(ConnectorError):
    """The first group did not form before its deadline; the message names the last attempt's cause."""


def _close_quietly(conn: Connector) -> None:
    try:
        conn.close()
    except Exception:  # a connector that failed half-way may fail to close too; nothing else holds it
        logger.debug("AFD: closing a connector whose formation failed raised", exc_info=True)


class FormationLoop:
    """Forms groups for one rank, one attempt after another (see the module docstring)."""

    def __init__(self, who: str, address: str, build: Callable[[], Connector], wait_s: float,
                 stop: threading.Event, pause_cap_s: float = float("inf")) -> None:
        self.who = who  # "AFD attention rank 0", for the log
        self.address = address  # "host:port", for the log
        self.build = build  # a new, not yet initialised connector for the same group
        self.wait_s = wait_s
        self.stop = stop
        self.pause_cap_s = pause_cap_s  # the group's timeout_s: a peer back after a fault waits at most this
        self.failures = 0  # attempts that failed in a row (their retries back off)
        self.attempts_failed = 0  # over the loop's life
        self._causes: set[str] = set()  # causes logged at ERROR already
        self._forming: Connector | None = None
        self._lock = threading.Lock()

    def form(self, deadline: float | None = None) -> Connector | None:
        """A connector whose group formed; None once the stop event is set. With ``deadline``
        (``time.monotonic()``) ``FormationFailed`` once the next attempt could not begin before it."""
        conn: Connector | None = None
        while not self.stop.is_set():
            conn = None
            try:
                conn = self.build()
                with self._lock:
                    if self.stop.is_set():
                        break
                    self._forming = conn
                wait_s = self.wait_s if deadline is None else max(0.0, min(self.wait_s, deadline - time.monotonic()))
                conn.init(wait_s)
            except Exception as e:  # one attempt only: see the module docstring
                with self._lock:
                    self._forming = None
                if conn is not None:
                    _close_quietly(conn)
                if self.stop.is_set():
                    return None
                pause = self._failed(e)
                if deadline is not None and time.monotonic() + pause >= deadline:
                    raise FormationFailed(f"{self.who}: no group formed at {self.address}: {e}") from e
                self.stop.wait(pause)
                continue
            with self._lock:
                self._forming = None
                if self.stop.is_set():
                    break
            if self.failures:
                logger.info("%s: a group formed at %s after %d failed attempt(s)", self.who, self.address,
                            self.failures)
            self.failures = 0
            return conn
        if conn is not None:
            _close_quietly(conn)
        return None

    def _failed(self, error: Exception) -> float:
        """Log (once per cause) and count a failed attempt; the pause before the next one."""
        self.failures += 1
        self.attempts_failed += 1
        metrics.METRICS.add("group_formation_failures")
        pause = retry_pause(self.failures, self.pause_cap_s)
        cause = f"{type(error).__name__}: {error}"
        if cause not in self._causes:
            self._causes.add(cause)
            logger.error("%s: a group did not form at %s (%s); trying again in %.0fs, and after every failure "
                         "(this cause is logged once)", self.who, self.address, cause, pause)
        else:
            logger.debug("%s: a group did not form at %s (%s, failure %d in a row); trying again in %.0fs",
                         self.who, self.address, cause, self.failures, pause)
        return pause

    def cancel(self) -> None:
        """Close the connector whose ``init`` is in progress (set the stop event first)."""
        with self._lock:
            forming, self._forming = self._forming, None
        if forming is not None:
            _close_quietly(forming)


class AttentionGroup:
    """The attention worker's group: its formation, loss and replacement, and the idle ticker (see the module
    docstring)."""

    def __init__(self, rank: int, address: str, build: Callable[[], Connector], link: AfdLink, wait_s: float,
                 timeout_s: float, tick: bool, hold_s: float = 0.0) -> None:
        self.rank = rank
        self.address = address
        self.link = link
        self.timeout_s = timeout_s  # bounds the first group (formed inside vLLM's load_model) and retry pauses
        self.hold_s = hold_s  # how long a step that lost its FFN waits for the group (``hold``); 0: not at all
        self._up = threading.Event()  # set while a group is bound
        if hold_s > 0:
            link.hold = self.hold  # the model's forward holds a step that met a connector error
        self.tick = tick
        self.connector: Connector | None = None
        self.earlier = MessageTally()  # the connectors of groups lost so far
        self.error: str | None = None
        self.since: float | None = None
        self.reformed_at: float | None = None
        self.outages = 0
        self.reformations = 0
        self._stop = threading.Event()
        self._loop = FormationLoop(f"AFD attention rank {rank}", address, build, wait_s, self._stop, timeout_s)
        self._lost: Connector | None = None  # closed by the re-forming thread
        self._thread: threading.Thread | None = None
        self._ticker: threading.Thread | None = None
        self._state = threading.Lock()

    def start(self) -> None:
        """Form the first group (within ``timeout_s``, at least ``FIRST_GROUP_MIN_S``; ``FormationFailed`` naming
        the cause otherwise), bind
        it to the link, start the idle ticker if this rank needs one."""
        t0 = time.monotonic()
        conn = self._loop.form(deadline=t0 + max(self.timeout_s, FIRST_GROUP_MIN_S))
        if conn is None:  # stopped while forming
            return
        with self._state:
            self.connector = conn
            self.link.swap(conn)
            self._up.set()
        metrics.set_group_up(True)
        logger.info("AFD attention rank %d connected in %.1fs", self.rank, time.monotonic() - t0)
        if self.tick:
            self._ticker = threading.Thread(target=self._tick, name=f"afd-idle-{self.rank}", daemon=True)
            self._ticker.start()

    def lost(self, error: ConnectorError) -> AfdGroupDown:
        """Record the loss of the group (once per outage); return the error the failed step raises."""
        if isinstance(error, AfdGroupDown):
            return error  # already down before that step began
        with self._state:
            if self.connector is None or self._stop.is_set():
                return AfdGroupDown(self.error or f"AFD attention rank {self.rank}: no group at {self.address}")
            waits = f"wait up to {self.hold_s:g}s, then fail," if self.hold_s > 0 else "fail"
            self.error = (f"AFD: attention rank {self.rank} lost its FFN role at {self.address} ({error}); "
                          f"requests {waits} until an FFN serves {self.address} again and the group re-forms "
                          "(this engine re-forms it by itself)")
            self.since = time.time()
            self.outages += 1
            self._up.clear()
            old = self.link.swap(None, self.error)
            self._lost, self.connector = old, None
            self.earlier.retire(old)
            metrics.set_group_up(False)
            logger.error("AFD attention rank %d: lost the FFN role at %s (%s); requests %s while the group "
                         "re-forms in the background", self.rank, self.address, error, waits)
            self._thread = threading.Thread(target=self._reform, name=f"afd-regroup-{self.rank}", daemon=True)
            self._thread.start()
            return AfdGroupDown(self.error)

    def hold(self, error: ConnectorError, since: float) -> None:
        """Hold the step that met ``error`` until a group is bound again (return: run the step again), at most
        ``hold_s`` after ``since`` (``time.monotonic()`` when that step was first held); ``AfdGroupDown`` past
        it, while stopping, or with ``hold_s`` 0."""
        down = self.lost(error)
        remaining = since + self.hold_s - time.monotonic()
        if self.hold_s <= 0 or self._stop.is_set():
            raise down
        up = self._up.wait(max(0.0, remaining)) and not self._stop.is_set()
        held = time.monotonic() - since
        metrics.METRICS.observe(held, "hold_seconds")
        if not up:
            logger.error("AFD attention rank %d: held a step %.1fs (hold_s %g); no FFN served %s again in that "
                         "time: failing its requests", self.rank, held, self.hold_s, self.address)
            raise down
        metrics.METRICS.add("replayed_steps")
        logger.warning("AFD attention rank %d: held a step %.1fs until an FFN served %s again; running it again "
                       "from its first layer", self.rank, held, self.address)

    def _reform(self) -> None:
        """Close the lost connector, then run the formation loop at the same address until a group forms or
        ``stop()``."""
        with self._state:
            lost, self._lost = self._lost, None
        if lost is not None:
            _close_quietly(lost)
        t0 = time.monotonic()
        logger.info("AFD attention rank %d: waiting for an FFN at %s to re-form the group", self.rank, self.address)
        conn = self._loop.form()
        if conn is None:
            return
        with self._state:
            if self._stop.is_set():
                _close_quietly(conn)
                return
            self.connector = conn
            self.reformations += 1
            self.reformed_at = time.time()
            self.link.swap(conn)
            self._up.set()
        metrics.METRICS.add("group_reformations")
        metrics.set_group_up(True)
        logger.info("AFD attention rank %d: re-formed the group at %s %.1fs after losing it; serving again",
                    self.rank, self.address, time.monotonic() - t0)

    def _tick(self) -> None:
        """Zero-token steps while this engine is idle, so the FFN rank's batch never waits forever."""
        while not self._stop.wait(IDLE_TICK_S):
            try:
                self.link.try_idle_step(IDLE_TICK_S)
            except ConnectorError as e:
                if self._stop.is_set():
                    return
                self.lost(e)  # idle steps resume once the group has re-formed
            except Exception:
                if not self._stop.is_set():
                    logger.exception("AFD attention rank %d: an idle step failed; stopping the idle ticker",
                                     self.rank)
                return

    def status(self) -> GroupStatus:
        """This rank's group now."""
        with self._state:
            return GroupStatus(self.connector is not None, self.error, self.since, self.reformed_at, self.outages,
                               self.reformations, self.address)

    def messages(self) -> tuple[int, int]:
        """Messages sent and received over every group so far."""
        with self._state:
            return self.earlier.total(self.connector)

    def stop(self) -> None:
        """Stop the ticker, cancel a formation in progress and close the current connector (the FFN sees a clean
        close). Idempotent."""
        with self._state:
            self._stop.set()
            self._up.set()  # a held step wakes, sees the stop and fails
            conn, self.connector = self.connector, None
        self._loop.cancel()
        if conn is not None:
            locked = self.link.lock.acquire(timeout=5.0)  # let a step in flight finish (it uses this connector)
            try:
                self.link.connector, self.link.down = None, "AFD: this attention engine is shutting down"
                _close_quietly(conn)
            finally:
                if locked:
                    self.link.lock.release()
        for thread in (self._thread, self._ticker):
            if thread is not None and thread is not threading.current_thread():
                thread.join(5.0)
