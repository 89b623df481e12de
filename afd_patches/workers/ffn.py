"""The FFN role's worker behaviour: ``FfnRoleMixin``, placed before a vLLM worker class.

No KV cache (``get_kv_cache_spec() == {}``, so the engine starts as for an attention-free model and
allocates no cache), prefix caching off, no warm-up forwards, never runs ``execute_model``. After the model
is loaded it starts an ``FfnServer`` (``afd_patches.workers.ffn_server``): a daemon thread that forms one
group after another at the configured ``host:port`` and serves each (receive → FFN → send), so attention
engines can be restarted, or crash, without the FFN engine; ``shutdown()`` stops it.

Through ``collective_rpc`` it exposes ``afd_stats()`` (``afd_patches.workers.role``, over every group
served, plus ``ffn_batches``) and ``afd_wait(timeout_s)``, which blocks until a group ended or the serve
loop stopped, and re-raises its error. It starts the ``vllm:afd_*`` metrics writer; the server keeps the
``vllm:afd_group_up`` gauge (``afd_patches.metrics``).

A serve loop that stops with an error that is not a connector's (a failing FFN computation) stops the
engine, so a broken loop never looks healthy. How is decided once, from vLLM's config (``engine_stopper``):
where this worker runs in a process vLLM started for the engine (a worker of the multiprocessing executor,
or the engine-core process of the uniprocess executor), SIGTERM to this process runs vLLM's own shutdown
path: the executor reports the failure, the engine core stops as dead and the OpenAI API server's watchdog
stops the server (unless ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH`` is set). An engine in the caller's own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` with the uniprocess executor) and any other executor (Ray, external
launchers) get no signal: ``afd_wait()`` reports the error there.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import torch

from afd_patches import LOGGER, metrics, trace
from afd_patches.models.causal_lm import afd_config_of
from afd_patches.workers import tp_group
from afd_patches.workers.connection import build_connector, model_identity
from afd_patches.workers.ffn_server import FfnServer
from afd_patches.workers.role import RoleBase

logger = logging.getLogger(LOGGER)


def engine_stopper(vllm_config: Any) -> Callable[[], None] | None:
    """How this FFN worker stops its engine after its serve loop failed (see the module docstring): SIGTERM to
    this process where vLLM started the process for the engine, else None (``afd_wait()`` reports)."""
    from vllm import envs

    backend = getattr(vllm_config.parallel_config, "distributed_executor_backend", None)
    if backend == "mp" or (backend == "uni" and envs.VLLM_ENABLE_V1_MULTIPROCESSING):
        pid = os.getpid()
        return lambda: os.kill(pid, signal.SIGTERM)
    return None


class FfnRoleMixin(RoleBase):
    """FFN role: no KV cache, no scheduling; a background receive → FFN → send loop."""

    _afd_server: FfnServer | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.vllm_config.cache_config.enable_prefix_caching = False

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
        identity = model_identity(self.vllm_config, model)
        placement = self._afd_placement(model, identity)
        if cfg.compile_ffn:
            model.afd_compile_ffn(*placement)  # where vLLM compiles; a no-op otherwise
        else:
            logger.info("AFD FFN rank %d: FFN modules run eagerly (compile_ffn is off: compiling them did not pay "
                        "in docs/benchmarks.md)", cfg.rank)
        tp = tp_group.TpChannel.of_worker()
        self._afd_server = FfnServer(cfg.rank, f"{cfg.host}:{cfg.port}", lambda: build_connector(cfg, identity),
                                     cfg.link.idle_timeout_s, cfg.timeout_s, model,
                                     placement, tp, engine_stopper(self.vllm_config))
        if not self._afd_server.follower:
            metrics.start_writer("ffn", cfg.rank)
            trace.TRACER.start("ffn", cfg.rank)
        self._afd_server.start()

    def _afd_placement(self, model: Any, identity: dict[str, Any]) -> tuple[torch.device, torch.dtype]:
        """Where the FFN runs: the device of the model's parameters (else the worker's ``device``), and the
        activation dtype vLLM runs the model in (else the parameters' dtype)."""
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device(getattr(self, "device", None) or "cpu")
        dtype = getattr(torch, str(identity.get("dtype") or ""), None)
        if not isinstance(dtype, torch.dtype):
            dtype = param.dtype if param is not None else torch.get_default_dtype()
        return device, dtype

    def afd_wait(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Block until a group ended (the loop then waits for the next group) or the serve loop stopped;
        return stats, re-raise the error that ended the group or the loop (``FfnServer.wait``)."""
        if self._afd_server is not None:
            self._afd_server.wait(timeout_s)
        return self.afd_stats()

    def afd_stats(self) -> dict[str, Any]:
        """Counters over every group served so far."""
        server = self._afd_server
        stats = self._afd_common_stats("ffn", server.messages() if server is not None else (0, 0))
        stats["ffn_batches"] = server.batches if server is not None else 0
        return stats

    def shutdown(self) -> None:
        try:
            if self._afd_server is not None:
                self._afd_server.stop()
        finally:
            super().shutdown()  # type: ignore[misc]
