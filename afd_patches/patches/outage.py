"""An AFD attention engine that outlives its FFN role: wrappers of vLLM's engine core and async front end.

When the attention worker loses its group (``afd_patches.workers.regroup``) it
holds the step up to ``hold_s`` and runs it again once the group re-formed
(``AfdCausalLMMixin.forward``); only past that (or with ``hold_s`` 0, or on a
model that cannot run a step twice) does its step raise. Unwrapped, vLLM's
engine core then dies and the API server exits.
With these wrappers, on an engine whose ``additional_config["afd"]`` has role
``attention`` (read at call time; any other engine runs vLLM's code unchanged,
apart from one attribute read per step):

``step_outliving_ffn`` (wraps ``EngineCore.step``)
    When vLLM's step raises, it asks the workers (``collective_rpc``,
    ``afd_group_status``) whether their AFD group is down. If not (or the
    question itself fails: the executor is gone), the exception goes on as
    before (a group down at any moment since the step began, already re-formed
    or not, counts as down). If so, every request of the scheduler is finished with
    ``FINISHED_ERROR`` (vLLM's ``finish_requests``, which frees their KV
    blocks), the prefix cache is reset (the failed step wrote part of its KV
    cache, and vLLM caches blocks when it schedules them), and the step
    returns their error outputs; the engine core stays up. While the group is
    down, a step with unfinished requests asks again before running vLLM's
    step: still down, they are failed the same way without reaching the model
    (no traceback per request); up, the step runs as usual. A step with only
    finished requests left runs vLLM's step, which schedules nothing and tells
    the worker to drop them (no exchange); without it vLLM would step forever. Nothing is classified
    by message: the worker turns ``ConnectorError`` (a type) into its status.

``generate_naming_afd`` (wraps ``AsyncLLM.generate``)
    A request that ends with finish reason ``error`` when this rank's group was
    down at some moment since the request arrived (``GroupStatus``), raises
    ``AfdFfnUnavailable`` with the worker's message (it names AFD, the rank and
    the FFN's ``host:port``) in place of vLLM's bare "Internal server error";
    the OpenAI server returns it as an HTTP 500 whose message is that text (in
    a stream: as the error event). Other engines get vLLM's generator itself.

``check_health_with_afd_group`` (wraps ``AsyncLLM.check_health``)
    After vLLM's own check, an attention engine reads its workers' group
    state from their metrics snapshots (``vllm:afd_group_up``, the value
    ``/metrics`` shows, written as soon as a worker's group goes down or up,
    before its failed step's requests end; no RPC, so it answers at once
    while a step is running or held); where no current
    snapshot says (none written yet, or stale), it asks the workers. While the
    group is down, ``/health`` answers 500 with a message naming AFD, the
    ranks and the FFN's ``host:port``, so a load balancer routes away, and
    200 again once the group has re-formed.

Limits: only ``EngineCore.step`` is wrapped. An engine core that steps with a
batch queue (``step_with_batch_queue``: asynchronous scheduling or pipeline
parallelism, both off on the CPU platform; AFD has no pipeline parallelism)
still ends on an FFN loss, as before. A health check that has to ask the
workers waits for the engine core to be between steps (``STATUS_RPC_S`` at
most, then it fails, which also reads as unhealthy).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable
from functools import cache
from typing import Any

from afd_patches import CONFIG_KEY, LOGGER, metrics

logger = logging.getLogger(LOGGER)

STATUS_RPC_S = 30.0  # bound on one afd_group_status question (it waits for the engine core to be between steps)
_DOWN = "_afd_group_down"  # attribute of an EngineCore: the status of the group while it is down, else absent


def _is_attention(vllm_config: Any) -> bool:
    """Whether this engine runs the AFD attention role (``additional_config["afd"]`` as the front end stored
    it, normalized, by ``validate_afd_config``)."""
    afd = (getattr(vllm_config, "additional_config", None) or {}).get(CONFIG_KEY)
    return isinstance(afd, dict) and afd.get("role") == "attention"


def _statuses(answer: Any) -> list[dict[str, Any]]:
    """The workers' ``afd_group_status()`` answers (``GroupStatus.as_json()``), one per worker."""
    return [s for s in (answer if isinstance(answer, list) else [answer]) if isinstance(s, dict)]


def _first_down(statuses: Any, since: float | None = None) -> dict[str, Any] | None:
    """The first worker status whose group is down now, or (with ``since``, a ``time.time()``) was down at some
    moment since then: an outage began, or the group re-formed, at or after it (``GroupStatus``); else None."""
    def was_down(s: dict[str, Any]) -> bool:
        return not s.get("up", True) or (since is not None and max(s.get("since") or 0, s.get("reformed_at") or 0)
                                         >= since)
    return next((s for s in _statuses(statuses) if was_down(s)), None)


# ------------------------------------------------------------------ engine core
def _group_down(core: Any, lost_since: float | None = None) -> dict[str, Any] | None:
    """The workers' report of a down AFD group (or, with ``lost_since``, of a group down at some moment since that
    ``time.time()``, even if already re-formed), else None (group up, not an AFD attention engine, no answer)."""
    if not _is_attention(core.vllm_config):
        return None
    try:
        statuses = core.model_executor.collective_rpc("afd_group_status", timeout=STATUS_RPC_S)
    except Exception:
        logger.debug("AFD: afd_group_status failed", exc_info=True)
        return None
    return _first_down(statuses, lost_since)


def _fail_all(core: Any, status: dict[str, Any], stepped: bool) -> dict[int, Any]:
    """Finish every request of ``core``'s scheduler with an error; their outputs by client index.

    ``stepped``: a step of vLLM's ran and failed, so the prefix cache is reset (vLLM caches blocks when it
    schedules them, and that step never finished writing their KV); requests failed before any step (the group
    was already down) hold no such blocks.
    """
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.request import RequestStatus

    failed = core.scheduler.finish_requests(None, RequestStatus.FINISHED_ERROR)
    if stepped:
        core.scheduler.reset_prefix_cache()
        logger.error("AFD: failed %d request(s) in flight: %s", len(failed), status.get("error"))
    elif failed:
        logger.warning("AFD: failed %d new request(s): the attention engine has no FFN group yet", len(failed))
    by_client: dict[int, list[str]] = defaultdict(list)
    for request in failed:
        by_client[request.client_index].append(request.request_id)
    return {client: EngineCoreOutputs(outputs=[EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR)
                                               for rid in ids], finished_requests=set(ids))
            for client, ids in by_client.items()}


def step_outliving_ffn(original: Callable[..., Any], core: Any, *args: Any, **kwargs: Any) -> Any:
    """Wrapper of ``EngineCore.step``: an AFD group loss fails the requests, not the engine (module docstring)."""
    if getattr(core, _DOWN, None) is not None and core.scheduler.get_num_unfinished_requests():
        status = _group_down(core)
        if status is not None:
            return _fail_all(core, status, stepped=False), False
        setattr(core, _DOWN, None)
        logger.info("AFD: the attention engine's group is up again; serving requests")
    began = time.time()
    try:
        return original(core, *args, **kwargs)
    except Exception:
        status = _group_down(core, lost_since=began)
        if status is None:
            raise
        setattr(core, _DOWN, status if not status.get("up", False) else None)
        return _fail_all(core, status, stepped=True), False


# ------------------------------------------------------------------ front end
@cache
def _error_type() -> type[Exception]:
    from vllm.exceptions import VLLMServerError

    class AfdFfnUnavailable(VLLMServerError):
        """A request failed, or the engine is unhealthy, because the AFD attention engine has no FFN group."""

    return AfdFfnUnavailable


async def _down_since(client: Any, since: float) -> dict[str, Any] | None:
    """A worker status whose group was down at some moment since ``since``; None if none was (or no answer)."""
    try:
        statuses = await client.collective_rpc("afd_group_status", timeout=STATUS_RPC_S)
    except Exception:
        logger.debug("AFD: afd_group_status failed", exc_info=True)
        return None
    return _first_down(statuses, since)


async def _afd_errors_named(client: Any, outputs: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    arrived = time.time()
    async with contextlib.aclosing(outputs):
        async for out in outputs:
            if any(getattr(c, "finish_reason", None) == "error" for c in getattr(out, "outputs", ())):
                status = await _down_since(client, arrived)
                if status is not None:
                    raise _error_type()(status.get("error") or "AFD: the attention engine has no FFN group")
            yield out


def generate_naming_afd(original: Callable[..., Any], client: Any, *args: Any, **kwargs: Any) -> Any:
    """Wrapper of ``AsyncLLM.generate``: an AFD attention engine's request that failed because its FFN group is
    down raises an error naming AFD and the FFN's address; other engines get vLLM's generator unchanged."""
    outputs = original(client, *args, **kwargs)
    if not _is_attention(client.vllm_config):
        return outputs
    return _afd_errors_named(client, outputs)


async def check_health_with_afd_group(original: Callable[..., Any], client: Any, *args: Any, **kwargs: Any) -> None:
    """Wrapper of ``AsyncLLM.check_health``: an AFD attention engine without a group is unhealthy."""
    await original(client, *args, **kwargs)
    if not _is_attention(client.vllm_config):
        return
    ranks = metrics.attention_groups_down()
    if ranks:
        afd = client.vllm_config.additional_config[CONFIG_KEY]
        raise _error_type()(f"AFD: attention rank(s) {', '.join(map(str, sorted(ranks)))} have no FFN group at "
                            f"{afd.get('host')}:{afd.get('port')} (re-forming by itself)")
    if ranks is None:  # no current snapshot says: ask the workers (waits for the engine to be between steps)
        down = _first_down(await client.collective_rpc("afd_group_status", timeout=STATUS_RPC_S))
        if down is not None:
            raise _error_type()(down.get("error") or "AFD: the attention engine has no FFN group")
