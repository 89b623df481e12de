"""The attention role's worker behaviour: ``AttentionRoleMixin``, placed before a vLLM worker class.

A normal vLLM worker with a KV cache. Asked for ``micro_batches`` > 1 it fails at start when the manifest
entries that split steps on the model runner it built are not applied (``micro_batches.refuse_unless_split``).
After the model is loaded it hands the group to an ``AttentionGroup`` (``afd_patches.workers.regroup``), which
forms the first group (at most ``timeout_s``: the warm-up/profile forwards that follow already exchange with
the FFN role) and binds it to the model's link. It outlives its FFN role: a step that fails with a
``ConnectorError`` (the FFN died, restarted or went silent) raises ``AfdGroupDown`` naming AFD and the FFN's
``host:port``, and the ``AttentionGroup`` re-forms the group in the background at the same address, through
any transient fault; ``afd_group_status()`` reports it to the engine core and the API server, which fail the
requests and report unhealthy meanwhile (``afd_patches.patches.outage``). Through ``collective_rpc`` it
exposes ``afd_stats()`` (``afd_patches.workers.role``, plus ``group``, its ``afd_group_status()``) and
``afd_group_status()``; it starts the ``vllm:afd_*`` metrics writer, and the ``AttentionGroup`` keeps the
``vllm:afd_group_up`` gauge (``afd_patches.metrics``).

Lockstep (rA:1F, ``schedule: batched``): an idle vLLM engine does not step, yet the FFN rank waits for every
attention rank it serves before its one batched call. So when an FFN rank serves more than one attention
rank, the ``AttentionGroup`` runs an idle ticker (not with ``schedule: pingpong``, where the FFN rank serves
each rank's layer as it arrives, nor in a vLLM data-parallel engine that vLLM steps with its peers by dummy
batches, ``afd_patches.patches.data_parallel``): after ``regroup.IDLE_TICK_S`` without a step it runs a
zero-token step (every layer, empty tensors) through the connector. Busy ranks then wait at most about
``IDLE_TICK_S`` per step for idle ones; a rank that stalls (no step within ``timeout_s`` of the others) is
dropped by the FFN rank and re-joins through its ``AttentionGroup`` (``afd_patches.connectors.schedule``).
Idle ranks' step ids differ from busy ranks'; the FFN side must pair messages by arrival and layer, not by step.

Under attention TP only TP rank 0 exchanges; the others take its answers (``afd_patches.workers.tp_group``).
Limits: idle ticks cost empty exchanges at about 1/IDLE_TICK_S per second while every rank is idle. An
attention rank that shuts down counts as idle from then on.
"""

from __future__ import annotations

import logging
from typing import Any

from afd_patches import LOGGER, metrics, trace
from afd_patches.config import AfdConfig
from afd_patches.connectors.base import ConnectorError
from afd_patches.models.causal_lm import afd_config_of
from afd_patches.patches import data_parallel, micro_batches
from afd_patches.workers import tp_group
from afd_patches.workers.connection import build_connector, model_identity
from afd_patches.workers.regroup import AttentionGroup, GroupStatus
from afd_patches.workers.role import RoleBase

logger = logging.getLogger(LOGGER)


def hold_seconds(vllm_config: Any, cfg: AfdConfig, model: Any) -> float:
    """How long this attention worker holds a step whose FFN was lost (``hold_s``; 0: not at all), decided once
    at start. 0 for a model with state that a step updates in place (vLLM's ``has_inner_state``: recurrent or
    hybrid layers, whose second run would apply the update twice). Under vLLM's multiprocess executor, which
    gives up on a worker's step after ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, at most that less 2 x
    ``timeout_s`` (the loss is noticed up to ``timeout_s`` late, and the step runs again)."""
    from vllm import envs
    from vllm.model_executor.models.interfaces import has_inner_state

    hold_s = cfg.hold_seconds
    if hold_s > 0 and has_inner_state(model):
        logger.info("AFD attention rank %d: %s keeps state across steps; a step whose FFN is lost fails at once "
                    "(hold_s does not apply)", cfg.rank, type(model).__name__)
        return 0.0
    if getattr(vllm_config.parallel_config, "distributed_executor_backend", None) == "mp":
        cap = max(0.0, envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS - 2 * cfg.timeout_s)
        if hold_s > cap:
            logger.warning("AFD attention rank %d: hold_s %g is more than vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS "
                           "(%d) allows with timeout_s %g; holding a step at most %gs", cfg.rank, hold_s,
                           envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, cfg.timeout_s, cap)
            return cap
    return hold_s


class AttentionRoleMixin(RoleBase):
    """Attention role: connect after loading the model and bind the connector to it; outlive the FFN role."""

    _afd_group: AttentionGroup | None = None
    _afd_micro = (1, 1)  # micro_batches, micro_batch_min_tokens (connector_extra_config)
    _afd_tp_target: tp_group.AttentionLeader | tp_group.AttentionFollower | None = None  # under attention TP

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        cfg = data_parallel.attention_config(self.vllm_config, afd_config_of(self.vllm_config))
        opts = cfg.link
        self._afd_micro = (opts.micro_batches, opts.micro_batch_min_tokens)
        tp = tp_group.TpChannel.of_worker()
        if tp is not None and opts.micro_batches > 1:
            raise ValueError(f"AFD micro-batches (micro_batches={opts.micro_batches}) are not supported with "
                             f"tensor parallelism on the attention role (--tensor-parallel-size {tp.size})")
        self._afd_note_runner("attention")
        import patchkit

        status = patchkit.status("afd")
        entries = status.run.manifest.entries if status is not None and status.run is not None else ()
        # before connecting: fail at start
        micro_batches.refuse_unless_split(self.model_runner, opts.micro_batches, patchkit.applied("afd"), entries,
                                          status.refusal if status is not None else lambda _feature: None)
        if opts.micro_batches > 1:  # before the KV cache: vLLM makes one metadata builder per micro-batch
            self.vllm_config.parallel_config.ubatch_size = opts.micro_batches
            micro_batches.ask(opts.micro_batches, opts.micro_batch_min_tokens)
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        model = self._afd_model()
        if not hasattr(model, "afd_link"):
            raise RuntimeError(
                f"AFD attention role needs an AFD<Arch> model, got {type(model).__name__}; "
                "select it with hf_overrides={'architectures': ['AFD<Arch>']}")
        if tp is not None:  # one AFD rank per TP group: its TP rank 0 exchanges, the others take its answers
            self._afd_tp_target = tp_group.bind_attention(model.afd_link(), tp)
            if not tp.leader:
                logger.info("AFD attention rank %d, TP rank %d: follows its TP rank 0", cfg.rank, tp.rank)
                return
        identity = model_identity(self.vllm_config, model)
        metrics.start_writer("attention", cfg.rank)
        trace.TRACER.start("attention", cfg.rank)
        link = model.afd_link()
        if cfg.num_attention_ranks > cfg.num_ffn_ranks and opts.schedule == "batched":
            link.pad_micro_batches = opts.micro_batches  # its FFN rank batches ranks by micro-batch
        tick = (cfg.num_attention_ranks > cfg.num_ffn_ranks and opts.schedule == "batched"
                and not data_parallel.vllm_keeps_lockstep(self.vllm_config))
        # under attention TP the leader's followers wait on its answers with their own deadline: no hold there
        hold_s = hold_seconds(self.vllm_config, cfg, model) if tp is None else 0.0
        self._afd_group = AttentionGroup(cfg.rank, f"{cfg.host}:{cfg.port}", lambda: build_connector(cfg, identity),
                                         link, opts.idle_timeout_s, cfg.timeout_s, tick, hold_s)
        self._afd_group.start()  # the warm-up/profile forwards that follow already exchange with the FFN role
        if opts.micro_batches > 1:
            logger.info("AFD attention rank %d: steps of at least %d tokens run as %d micro-batches", cfg.rank,
                        opts.micro_batch_min_tokens, opts.micro_batches)

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's step; a connector error (the FFN role lost) becomes ``AfdGroupDown`` naming the FFN's address,
        and the group is re-formed in the background (``afd_patches.workers.regroup``)."""
        try:
            with micro_batches.in_step(*self._afd_micro):
                return super().execute_model(*args, **kwargs)  # type: ignore[misc]
        except ConnectorError as e:
            if self._afd_group is None:
                raise
            raise self._afd_group.lost(e) from e

    def afd_group_status(self) -> dict[str, Any]:
        """Whether this rank has a group now, and the last outage (see ``AttentionGroup.status``)."""
        if isinstance(self._afd_tp_target, tp_group.AttentionFollower):  # its leader reports the group
            return GroupStatus(True, tp_rank=self._afd_tp_target.channel.rank).as_json()
        if self._afd_group is None:
            return GroupStatus(False, "AFD: the attention worker has no group yet").as_json()
        return self._afd_group.status().as_json()

    def afd_stats(self) -> dict[str, Any]:
        """Stats between steps (waits up to 5 s for a step in flight, so counts are consistent)."""
        lock = self._afd_model().afd_link().lock
        locked = lock.acquire(timeout=5.0)
        try:
            group = self._afd_group
            stats = self._afd_common_stats("attention", group.messages() if group is not None else (0, 0))
            if group is not None:
                stats["group"] = group.status().as_json()
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
        if self._afd_group is not None:
            self._afd_group.stop()

    def shutdown(self) -> None:
        try:
            self.afd_close()
        finally:
            super().shutdown()  # type: ignore[misc]
