"""How AFD engines are compiled: vLLM's own compilation settings, with the exchange as a split point.

Called from ``afd_patches.patches.engine_config.validate_afd_config`` (the front end's
``EngineArgs.create_engine_config``), only for engines that ask for AFD:

- ``before_config(engine_args, role, cuda)`` runs before vLLM builds its config. CUDA graphs
  that hold a whole step (``cudagraph_mode`` FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE) would
  capture the per-layer exchange, whose kernel runs the connector's host code and waits on
  the FFN role; that has not been verified on a GPU, so an explicit request for one on the
  attention role is refused with ``AfdCompilationError``. When the attention role on CUDA
  leaves ``cudagraph_mode`` unset (vLLM would pick FULL_AND_PIECEWISE), it is set to PIECEWISE.
- ``after_config(vllm_config, role)`` runs on the built config. A full-graph mode vLLM chose
  itself there (vLLM 0.31 does for sequence parallelism) is refused the same way. Under vLLM's piecewise
  compilation (``CompilationMode.VLLM_COMPILE``, CUDA's default) it adds ``afd::exchange``
  to ``compilation_config.splitting_ops`` next to vLLM's attention ops, so the graph is
  split at every exchange and CUDA graphs capture the pieces between exchanges. Under the
  other compiling modes (CPU's default ``DYNAMO_TRACE_ONCE`` with inductor) the op needs no
  splitting: inductor calls it as an extern kernel between the code it generates.

Nothing else changes: ``--enforce-eager`` still runs both roles eagerly, and a user's
``compilation_config`` is taken as given. Limits: the FFN role compiles its per-layer
modules itself (``afd_patches.models.ffn_compile``), under CPU's modes only; no CUDA graphs
on the FFN role.
"""

from __future__ import annotations

import logging
from typing import Any

from afd_patches import LOGGER, AfdConfigError
from afd_patches.models.exchange_op import OP_NAME

logger = logging.getLogger(LOGGER)


class AfdCompilationError(AfdConfigError):
    """A compilation setting AFD cannot honour; the message names the setting and what to use."""


def _refuse_full_graphs(mode: Any, why: str = "") -> None:
    if mode is not None and mode.has_full_cudagraphs():
        raise AfdCompilationError(
            f"compilation_config.cudagraph_mode={mode.name}{why}: full CUDA graphs would capture the per-layer "
            f"AFD exchange ({OP_NAME}, which runs the connector's host code and waits on the FFN role); "
            "not verified on a GPU yet, so AFD refuses it. Use PIECEWISE (AFD's default on CUDA: graphs "
            "between exchanges), NONE, or --enforce-eager.")


def before_config(engine_args: Any, role: str, cuda: bool) -> None:
    """Refuse full CUDA graphs on the attention role; default it to piecewise graphs on CUDA (see module)."""
    if role != "attention" or getattr(engine_args, "enforce_eager", False):
        return
    from vllm.config import CUDAGraphMode

    compilation = engine_args.compilation_config
    mode = compilation.cudagraph_mode
    _refuse_full_graphs(mode)
    if mode is None and cuda:
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
        logger.info("AFD: cudagraph_mode=PIECEWISE on the attention role (CUDA graphs between exchanges)")


def after_config(vllm_config: Any, role: str) -> None:
    """Under vLLM's piecewise compilation, split the attention model's graph at every exchange; refuse full
    CUDA graphs that vLLM itself chose while building the config (e.g. for sequence parallelism)."""
    from vllm.config import CompilationMode

    compilation = vllm_config.compilation_config
    if role != "attention":
        return
    _refuse_full_graphs(compilation.cudagraph_mode, " (set by vLLM while building the config)")
    if compilation.mode != CompilationMode.VLLM_COMPILE:
        return
    ops = compilation.splitting_ops
    if ops is not None and OP_NAME not in ops:
        ops.append(OP_NAME)
