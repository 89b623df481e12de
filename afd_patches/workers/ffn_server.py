"""The FFN role's server: ``FfnServer``, one per FFN worker, with ``start()``/``stop()``; and ``run_ffn``.

``start()`` starts one daemon thread. Under FFN TP only TP rank 0 serves; the others run the calls it
publishes (``afd_patches.workers.tp_group``), which is all their thread does.

Serving (``afd-ffn-<rank>``): the ``FormationLoop`` (``afd_patches.workers.regroup``) forms a group at the
configured ``host:port`` — the first exactly as any later one, waiting as long as ``idle_timeout_s`` per
attempt and trying again after any failed attempt, so an FFN engine never stops itself for a group that did
not form (no attention rank yet, a misconfigured one, strangers at the port, a token file being rotated).
Then it serves the group: receive one layer's hidden states from every attention rank it serves, run that
layer's FFN once on all of them (``run_ffn``), send each rank its slice; messages are served in the order
they arrive, each answered with its layer, step and micro-batch. The group ends when every attention rank it
serves closed cleanly (``ConnectorClosed``), or on any other connector error within the group (a lost or
silent attention rank, a message refused by its header checks): that one is logged as one ``AFD FFN rank N:
the group ended: …`` line naming the peer and the cause and kept for ``wait()``; ``vllm:afd_group_up`` is 0
until the next group forms. The loop stops on ``stop()`` (which cancels a formation in progress) and on an
error that is not the connector's (a failing FFN computation): that one is logged as ``AFD FFN serve loop
stopped: …`` and, unless a ``wait()`` caller will report it, handed to ``on_fatal`` — the worker's way to
stop its engine, decided once by the worker from vLLM's config (``afd_patches.workers.ffn``) — so a broken
loop never looks healthy.

Devices: the serve thread first makes the model's device current there (``torch.cuda.set_device``; the
worker thread's choice does not carry over to a new thread), and moves every received batch to the FFN
model's device and activation dtype before the MLP runs.

Limits: one FFN call at a time (pingpong overlaps one rank's attention with another's FFN, not two FFN
calls); a group's membership is fixed, so with several attention ranks per FFN rank a new group forms only
after all of them have shut down or were dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from afd_patches import LOGGER, metrics, trace
from afd_patches.connectors.base import Connector, ConnectorClosed, ConnectorError, ConnectorTimeout
from afd_patches.workers import tp_group
from afd_patches.workers.regroup import FormationLoop, MessageTally

logger = logging.getLogger(LOGGER)


def run_ffn(model: Any, layer: int, inputs: list[torch.Tensor], device: torch.device,
            dtype: torch.dtype) -> list[torch.Tensor]:
    """Layer ``layer``'s FFN over the rows of every input, one call, on the model's ``device`` in its
    ``dtype``; outputs in the same order and shapes.

    Zero-row inputs (idle ranks, and the ranks a pingpong receive did not come
    from) are answered with themselves; with one non-empty input already on
    ``device`` in ``dtype`` nothing is copied.
    """
    busy = [i for i, t in enumerate(inputs) if t.shape[0]]
    if not busy:
        return inputs
    with torch.inference_mode():
        if len(busy) == 1:
            out = [model.afd_ffn(layer, inputs[busy[0]].to(device=device, dtype=dtype))]
        else:
            batch = torch.cat([inputs[i] for i in busy]).to(device=device, dtype=dtype)
            out = list(torch.split(model.afd_ffn(layer, batch), [inputs[i].shape[0] for i in busy]))
    outputs = list(inputs)
    for i, o in zip(busy, out, strict=True):
        outputs[i] = o
    return outputs


class FfnServer:
    """One FFN worker's serve (or TP-follow) thread and what it reports (see the module docstring)."""

    def __init__(self, rank: int, address: str, build: Callable[[], Connector], wait_s: float, timeout_s: float,
                 model: Any, placement: tuple[torch.device, torch.dtype], tp: tp_group.TpChannel | None,
                 on_fatal: Callable[[], None] | None) -> None:
        self.rank = rank
        self.address = address
        self.model = model  # anything with the AFD model's ``afd_ffn``
        self.placement = placement
        self.tp = tp
        self.on_fatal = on_fatal  # None: the engine runs in the caller's process; wait() reports instead
        self.error: BaseException | None = None  # what stopped the loop
        self.group_error: ConnectorError | None = None  # what ended the last group, when not a clean close
        self.batches = 0
        self.group_ended = threading.Event()
        self._stop = threading.Event()
        self._loop = FormationLoop(f"AFD FFN rank {rank}", address, build, wait_s, self._stop, timeout_s)
        self._lock = threading.Lock()
        self._waiters = 0  # wait() calls blocked on the loop; they report its error
        self._connector: Connector | None = None
        self._earlier = MessageTally()  # the connectors of earlier groups
        self._thread: threading.Thread | None = None
        self._groups = 0

    @property
    def follower(self) -> bool:
        """A TP rank other than 0: it runs its TP leader's calls and serves no group."""
        return self.tp is not None and not self.tp.leader

    @property
    def alive(self) -> bool:
        """Whether the serve (or follow) thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the serve thread (the TP-follow thread on a TP rank other than 0)."""
        target, name = (self._follow, f"afd-ffn-{self.rank}-tp{self.tp.rank}") if self.follower and self.tp else (
            self._serve, f"afd-ffn-{self.rank}")
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ serving
    def _serve(self) -> None:
        """Serve one group after another until ``stop()`` or an error that is not a connector's."""
        leader = tp_group.FfnLeader(self.model, self.tp) if self.tp is not None else None
        try:
            if self.placement[0].type == "cuda":
                torch.cuda.set_device(self.placement[0])  # per thread: the worker's choice is not inherited
            while not self._stop.is_set():
                logger.info("AFD FFN rank %d: waiting for %s group at %s", self.rank,
                            "a new" if self._groups else "its first", self.address)
                metrics.set_group_up(False)
                conn = self._loop.form()
                if conn is None:
                    break
                self._adopt(conn)
                self._formed()
                try:
                    self.group_error = None
                    self._serve_group(conn, leader or self.model)
                    logger.info("AFD FFN rank %d: every attention rank closed", self.rank)
                except ConnectorError as e:  # this group only: a lost peer, a refused message; serve the next
                    if self._stop.is_set():
                        break
                    self.group_error = e
                    logger.error("AFD FFN rank %d: the group ended: %s", self.rank, e)
                finally:
                    conn.close()
                    metrics.set_group_up(False)
                if leader is not None:
                    leader.group_ended(self.group_error)
                self.group_ended.set()
        except BaseException as e:  # surfaced by wait()
            logger.exception("AFD FFN serve loop stopped")
            self.error = e
        finally:
            if leader is not None and self.error is not None and not self._stop.is_set():
                self._tell_followers(leader)  # on stop() each TP rank stops by itself
            self.group_ended.set()
            self._fatal()

    def _formed(self) -> None:
        if self._groups:
            metrics.METRICS.add("group_reformations")
        self._groups += 1
        metrics.set_group_up(True)
        logger.info("AFD FFN rank %d: a group formed at %s", self.rank, self.address)

    def _adopt(self, new: Connector) -> None:
        """Make ``new`` the current connector; the old one's message counts stay in ``stats()``."""
        with self._lock:
            old, self._connector = self._connector, new
            self._earlier.retire(old)

    def _serve_group(self, conn: Connector, model: Any) -> None:
        """Receive → FFN → send until every served attention rank closed cleanly (return) or an error.
        ``model``: anything with the AFD model's ``afd_ffn`` (under TP the ``tp_group.FfnLeader``)."""
        device, dtype = self.placement
        while not self._stop.is_set():
            try:
                meta, inputs = conn.recv_attn_output()
            except ConnectorClosed:
                return
            except ConnectorTimeout:
                if self._stop.is_set():
                    return
                raise
            began = trace.now_us()
            outputs = run_ffn(model, meta.layer, inputs, device, dtype)
            computed = trace.now_us()
            conn.send_ffn_output(outputs, meta)
            self.batches += 1
            if trace.TRACER.enabled:
                tags = {"layer": meta.layer, "microbatch": meta.microbatch, "step": meta.step, "tokens": meta.shape[0]}
                trace.TRACER.event("ffn", "ffn", began, computed, **tags)
                trace.TRACER.event("send", "ffn", computed, trace.now_us(), **tags)

    def _tell_followers(self, leader: tp_group.FfnLeader) -> None:
        """TP leader whose serve loop ended with an error: its followers stop too, with that error (best effort)."""
        try:
            leader.stopped(self.error)
        except Exception:
            logger.warning("AFD FFN rank %d: could not tell its TP followers that it stopped", self.rank,
                           exc_info=True)

    def _follow(self) -> None:
        """TP rank > 0: run the FFN calls its TP leader publishes until ``stop()`` or the leader stops
        (``afd_patches.workers.tp_group.follow_ffn``); a group the leader saw end ends here too, with its error."""
        assert self.tp is not None

        def ended(error: str | None) -> None:
            self.group_error = None if error is None else ConnectorError(f"(reported by TP rank 0) {error}")
            self.group_ended.set()

        def called() -> None:
            self.batches += 1

        try:
            if self.placement[0].type == "cuda":
                torch.cuda.set_device(self.placement[0])
            error = tp_group.follow_ffn(self.tp, self.model, self._stop, ended, called)
            if error is not None:
                self.error = RuntimeError(f"AFD FFN: the TP leader's serve loop stopped: {error}")
        except BaseException as e:  # surfaced by wait(); on shutdown vLLM may close the TP group first
            if not self._stop.is_set():
                logger.exception("AFD FFN TP rank %d: following its leader failed", self.tp.rank)
                self.error = e
        finally:
            self.group_ended.set()
            self._fatal()

    def _fatal(self) -> None:
        """After the loop ended with an error, hand it to ``on_fatal`` unless ``stop()`` was asked for or a
        ``wait()`` caller will report it."""
        with self._lock:
            if self.error is None or self._stop.is_set() or self._waiters or self.on_fatal is None:
                return
        logger.error("AFD FFN rank %d: stopping this engine: its serve loop ended with an error", self.rank)
        self.on_fatal()

    # ------------------------------------------------------------------ what the worker asks
    def wait(self, timeout_s: float | None = None) -> None:
        """Block until a group ended (the loop then waits for the next group) or the loop stopped; re-raise the
        error that ended the group or the loop."""
        if self._thread is not None:
            with self._lock:
                self._waiters += 1
            try:
                ended = self.group_ended.wait(timeout_s)
            finally:
                with self._lock:
                    self._waiters -= 1
            if not ended:
                raise TimeoutError(f"AFD FFN group still being served after {timeout_s}s")
        if self.error is not None:
            raise RuntimeError(f"AFD FFN serve loop failed: {self.error!r}") from self.error
        if self.group_error is not None:
            raise RuntimeError(f"AFD FFN group ended: {self.group_error!r}") from self.group_error

    def messages(self) -> tuple[int, int]:
        """Messages sent and received over every group so far."""
        with self._lock:
            return self._earlier.total(self._connector)

    def stop(self) -> None:
        """End the loop: cancel a formation in progress, close the current connector, join the thread (5 s at
        most). Idempotent."""
        self._stop.set()
        self._loop.cancel()
        with self._lock:
            conn = self._connector
        if conn is not None:
            conn.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
