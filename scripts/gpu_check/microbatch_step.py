"""The attention side of check.py's ``microbatch`` call: AFD's micro-batch schedule as Model Runner V2 drives it.

What Model Runner V2 (MRV2) does with a split step, per ``afd_patches/patches/micro_batches_v2.py``: its
``AfdUBatchRunner.run`` calls the model once inside a forward context whose ``attn_metadata``, ``slot_mapping``
and ``is_padding`` are lists (one entry per micro-batch) and whose ``ubatch_slices`` are the step's token
slices; the AFD model's ``forward`` (``AfdCausalLMMixin.forward``) takes ``link.lock``, begins a link step, asks
``microbatch.step_slices()`` and hands the step to ``microbatch.MicroBatchRunner.run``. This module does the same
with the real ``afd_patches.models.microbatch`` and the real ``AfdLink`` / ``afd::exchange`` operator, on a toy
model of ``LAYERS`` layers, each: [matmul + RMS norm -> write the KV cache at the context's ``slot_mapping`` ->
causal attention over the request's KV (a masked max over the cache rows the context's metadata names) ->
residual] -> RMS norm -> ``afd::exchange`` (through the real connector to the FFN process's serve loop) ->
residual. The attention reads KV rows that earlier tokens of the same request wrote in the same layer, so a
request cut by a micro-batch boundary reads, in its second part, what its first part (an earlier micro-batch)
wrote: the order the schedule guarantees (see microbatch.py, "Exactness").

vLLM is not installed on the device machine: ``install_forward_context_standin`` puts a STAND-IN for
``vllm.forward_context`` into ``sys.modules`` (with a bare ``vllm`` package above it). It provides only the names
microbatch.py uses (``get_forward_context``, ``override_forward_context``, ``is_forward_context_available``) plus
a ``ForwardContext`` dataclass with the fields microbatch.py reads or replaces, with vLLM's contract: one
process-wide current context (not per thread), ``override_forward_context`` a context manager that makes its
argument current and restores the previous one on exit, ``get_forward_context`` an error when none is set. It is
this script's own code, not vLLM's; whether vLLM's real module behaves so is for a vLLM run.

Optional on CUDA (``cuda_streams``): each micro-batch issues its compute on its own ``torch.cuda.Stream`` and, as
vLLM's ``UBatchRunner`` does with its streams, records an event when it hands the baton over (before its
exchange, and when it finishes); the micro-batch that takes the baton next makes its stream wait for that event
before computing. Without the events the KV a straddling request's second part reads could be read before its
first part's stream wrote it. The streams and events are this check's, at the forward and the exchange hook; the
baton, threads and contexts stay microbatch.py's.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

LAYERS = 2


# ------------------------------------------------------------------ stand-in for vllm.forward_context
@dataclasses.dataclass
class ForwardContext:
    """Stand-in for vLLM's ``ForwardContext``: only the fields AFD's micro-batch code reads or replaces."""

    attn_metadata: Any = None
    slot_mapping: Any = None
    ubatch_slices: list[Any] | None = None
    is_padding: Any = None


@dataclasses.dataclass(frozen=True)
class UBatchSlice:
    """Stand-in for vLLM's ``UBatchSlice``: which requests and which tokens one micro-batch covers."""

    request_slice: slice
    token_slice: slice


_CURRENT: list[ForwardContext | None] = [None]  # process-wide, as vLLM's module-level current context


def get_forward_context() -> ForwardContext:
    context = _CURRENT[0]
    if context is None:
        raise RuntimeError("stand-in vllm.forward_context: no forward context is set")
    return context


def is_forward_context_available() -> bool:
    return _CURRENT[0] is not None


@contextmanager
def override_forward_context(context: ForwardContext | None) -> Iterator[None]:
    previous = _CURRENT[0]
    _CURRENT[0] = context
    try:
        yield
    finally:
        _CURRENT[0] = previous


def install_forward_context_standin() -> types.ModuleType:
    """Register the stand-in as ``vllm.forward_context`` (module docstring); refuses next to a real vLLM."""
    existing = sys.modules.get("vllm")
    if existing is not None and not getattr(existing, "AFD_GPU_CHECK_STANDIN", False):
        raise RuntimeError("vLLM is imported in this process: the forward-context stand-in would mix with it")
    package = existing or types.ModuleType("vllm", "stand-in package of scripts/gpu_check (vLLM is not installed)")
    package.__path__ = []  # a package: submodules are looked up in sys.modules only
    package.AFD_GPU_CHECK_STANDIN = True  # type: ignore[attr-defined]
    module = types.ModuleType("vllm.forward_context", "stand-in of scripts/gpu_check/microbatch_step.py")
    for name in ("ForwardContext", "get_forward_context", "is_forward_context_available",
                 "override_forward_context"):
        setattr(module, name, globals()[name])
    package.forward_context = module  # type: ignore[attr-defined]
    sys.modules["vllm"], sys.modules["vllm.forward_context"] = package, module
    return module


# ------------------------------------------------------------------ one step's batch and its contexts
@dataclasses.dataclass(frozen=True)
class AttnMetadata:
    """Toy attention metadata of the whole step (``ubatch`` -1) or one micro-batch: its tokens and, per token,
    the KV-cache rows it attends over (``ctx_slots``, valid where ``ctx_mask``)."""

    ubatch: int
    tokens: tuple[int, int]
    ctx_slots: torch.Tensor
    ctx_mask: torch.Tensor
    positions: torch.Tensor


class Batch:
    """Requests of ``requests[i]`` new tokens each (prefills from position 0), their hidden states, and the
    KV-cache slot of every token (a seeded permutation, so the cache is not in token order)."""

    def __init__(self, requests: list[int], hidden: int, device: torch.device, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(5)
        self.requests, self.total = requests, sum(requests)
        self.starts = [sum(requests[:i]) for i in range(len(requests))]
        self.x = torch.randn(self.total, hidden, generator=gen).to(device, dtype)
        self.positions = torch.cat([torch.arange(n) for n in requests]).to(device)
        slots = torch.randperm(self.total, generator=gen)
        longest = max(requests)
        ctx = torch.zeros(self.total, longest, dtype=torch.long)
        mask = torch.zeros(self.total, longest, dtype=torch.bool)
        for start, n in zip(self.starts, requests, strict=True):
            ctx[start:start + n, :n] = slots[start:start + n].expand(n, n)  # column j: token j's slot
            mask[start:start + n, :n] = torch.ones(n, n, dtype=torch.bool).tril()  # causal
        self.slots, self.ctx, self.mask = slots.to(device), ctx.to(device), mask.to(device)

    def metadata(self, k: int, a: int, b: int) -> AttnMetadata:
        return AttnMetadata(k, (a, b), self.ctx[a:b], self.mask[a:b], self.positions[a:b])

    def slices(self, n: int) -> list[UBatchSlice]:
        """``n`` token slices of near-equal size (a request may straddle two, as in vLLM's slicing)."""
        cuts = [i * self.total // n for i in range(n + 1)]
        out = []
        for a, b in itertools.pairwise(cuts):
            first = max(i for i, s in enumerate(self.starts) if s <= a)
            last = max(i for i, s in enumerate(self.starts) if s < b)
            out.append(UBatchSlice(slice(first, last + 1), slice(a, b)))
        return out

    def step_context(self, n: int) -> tuple[ForwardContext, list[tuple[AttnMetadata, Any, Any]]]:
        """The forward context MRV2 gives the model for ``n`` micro-batches (``AfdUBatchRunner.run``: lists, one
        entry per micro-batch, and the slices; for 1 the unsplit step's own), and what micro-batch ``k`` must see."""
        if n == 1:
            whole = (self.metadata(-1, 0, self.total), self.slots, torch.zeros(self.total, dtype=torch.bool))
            return ForwardContext(whole[0], whole[1], None, whole[2]), [whole]
        slices = self.slices(n)
        per = [(self.metadata(k, s.token_slice.start, s.token_slice.stop), self.slots[s.token_slice],
                torch.zeros(s.token_slice.stop - s.token_slice.start, dtype=torch.bool))
               for k, s in enumerate(slices)]
        return ForwardContext([p[0] for p in per], [p[1] for p in per], slices, [p[2] for p in per]), per


# ------------------------------------------------------------------ what the layers saw
class Seen:
    """Per layer call (while ``enabled``): which micro-batch (``microbatch.current()``), which context, which
    thread; whether two micro-batches ever computed at once (``overlaps``)."""

    def __init__(self, expected: list[tuple[AttnMetadata, Any, Any]]) -> None:
        self.expected = expected
        self.enabled = True
        self.order: list[tuple[int, int]] = []
        self.problems: list[str] = []
        self.threads: dict[int, set[str]] = {}
        self.cuda_devices: dict[int, set[int]] = {}
        self.computing: set[int] = set()
        self.overlaps = 0
        self._lock = threading.Lock()

    def check(self, layer: int, k: int, context: ForwardContext, h: torch.Tensor, positions: torch.Tensor,
              where: str) -> None:
        if not self.enabled:
            return
        md, slot, padding = self.expected[k]
        rows = md.tokens[1] - md.tokens[0]
        wrong = [name for name, ok in (
            ("attn_metadata", context.attn_metadata is md), ("slot_mapping", context.slot_mapping is slot),
            ("is_padding", context.is_padding is padding), ("ubatch_slices", context.ubatch_slices is None),
            ("rows", h.shape[0] == rows), ("positions", torch.equal(positions, md.positions))) if not ok]
        with self._lock:
            if wrong:
                self.problems.append(f"layer {layer} micro-batch {k} {where}: {', '.join(wrong)}")
            if where == "start":
                self.order.append((layer, k))
                self.threads.setdefault(k, set()).add(threading.current_thread().name)
                if h.is_cuda:
                    self.cuda_devices.setdefault(k, set()).add(torch.cuda.current_device())

    def enter(self, k: int) -> None:
        with self._lock:
            self.overlaps += bool(self.computing - {k})
            self.computing.add(k)

    def leave(self, k: int) -> None:
        with self._lock:
            self.computing.discard(k)


class HandOver:
    """The CUDA-stream variant's events: the last one recorded at a hand-over, waited for by the next taker."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.last: torch.cuda.Event | None = None

    def record(self) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.last = event

    def wait(self) -> None:
        if self.last is not None:
            torch.cuda.current_stream(self.device).wait_event(self.last)


# ------------------------------------------------------------------ the toy model
Ffn = Callable[[torch.Tensor, int], torch.Tensor]


class Stack:
    """``LAYERS`` layers (module docstring) and their KV cache."""

    def __init__(self, hidden: int, total: int, device: torch.device, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(21)
        self.hidden = hidden
        self.weights = [(torch.randn(hidden, hidden, generator=gen) * hidden ** -0.5).to(device, dtype)
                        for _ in range(LAYERS)]
        self.cache = torch.zeros(LAYERS, total, hidden, device=device, dtype=dtype)

    def layers(self, h: torch.Tensor, positions: torch.Tensor, k: int, ffn: Ffn, seen: Seen | None,
               hand: HandOver | None) -> torch.Tensor:
        norm = (self.hidden,)
        for layer in range(LAYERS):
            context = get_forward_context()
            if seen is not None:
                seen.check(layer, k, context, h, positions, "start")
                seen.enter(k)
            md = context.attn_metadata
            kv = torch.nn.functional.rms_norm(h @ self.weights[layer].t(), norm)
            self.cache[layer].index_copy_(0, context.slot_mapping, kv)
            seen_kv = self.cache[layer][md.ctx_slots].masked_fill(~md.ctx_mask.unsqueeze(-1), float("-inf"))
            h = h + seen_kv.amax(dim=1)  # order-free reduction: the same bits for any row count
            if seen is not None:
                seen.leave(k)
            if hand is not None:
                hand.record()  # this micro-batch's compute so far, for whoever takes the baton next
            y = ffn(torch.nn.functional.rms_norm(h, norm), layer)
            if hand is not None:
                hand.wait()  # the compute of whoever handed the baton back comes first
            if seen is not None:
                seen.enter(k)
                seen.check(layer, k, get_forward_context(), h, positions, "after exchange")
            h = h + y
            if seen is not None:
                seen.leave(k)
        return h


def afd_forward(stack: Stack, ffn: Ffn, seen: Seen | None, streams: list[torch.cuda.Stream] | None,
                hand: HandOver | None, device: torch.device) -> Callable[..., torch.Tensor]:
    """The model's forward as vLLM's runner calls it (keywords), on micro-batch ``k``'s stream when ``streams``."""
    from afd_patches.models import microbatch

    def forward(*, input_ids: torch.Tensor | None = None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor) -> torch.Tensor:
        turn = microbatch.current()
        k = 0 if turn is None else turn[1]
        if streams is None:
            return stack.layers(inputs_embeds, positions, k, ffn, seen, None)
        stream, step_stream = streams[k], torch.cuda.current_stream(device)
        stream.wait_stream(step_stream)  # the step's inputs and its cleared cache
        with torch.cuda.stream(stream):
            assert hand is not None
            hand.wait()
            out = stack.layers(inputs_embeds, positions, k, ffn, seen, hand)
            hand.record()  # finished: the next taker's compute comes after this one's
        step_stream.wait_stream(stream)
        out.record_stream(step_stream)
        return out

    return forward


def run_step(link: Any, runner: Any, context: ForwardContext, forward: Callable[..., torch.Tensor],
             batch: Batch) -> torch.Tensor:
    """One step as the AFD model's ``forward`` runs it (``AfdCausalLMMixin.forward``) inside the context
    ``AfdUBatchRunner.run`` makes current."""
    from afd_patches.models import microbatch

    kwargs = {"input_ids": None, "positions": batch.positions, "inputs_embeds": batch.x}
    with override_forward_context(context), link.lock:
        link.begin_step()
        slices = microbatch.step_slices()
        if not slices:
            return forward(**kwargs)
        return runner.run(forward, slices, kwargs)  # type: ignore[no-any-return]


def local_step(stack: Stack, ref: Ffn, context: ForwardContext, batch: Batch, n: int) -> torch.Tensor:
    """The same slicing without AFD: each micro-batch in turn, in the context microbatch.py would give it, with
    the FFN computed here (``ref``). Earlier slices run every layer first, which keeps the KV order."""
    if n == 1:
        with override_forward_context(context):
            return stack.layers(batch.x, batch.positions, 0, ref, None, None)
    outs = []
    for k, s in enumerate(context.ubatch_slices or []):
        part = dataclasses.replace(context, attn_metadata=context.attn_metadata[k],
                                   slot_mapping=context.slot_mapping[k], is_padding=context.is_padding[k],
                                   ubatch_slices=None)
        with override_forward_context(part):
            outs.append(stack.layers(batch.x[s.token_slice], batch.positions[s.token_slice], k, ref, None, None))
    return torch.cat(outs)


def kernels_row_independent(stack: Stack, ref: Ffn, batch: Batch, slices: list[UBatchSlice]) -> bool:
    """Whether the model's row-wise kernels (each layer's matmul + RMS norm, the FFN's MLP) give every row the same
    bits on a micro-batch's rows as on the whole batch's: where not (a GPU library choosing another kernel for
    fewer rows), a split step cannot be bitwise equal to the unsplit one, with or without AFD."""
    if len(slices) < 2:
        return True
    x, norm = batch.x, (stack.hidden,)
    calls: list[Callable[[torch.Tensor], torch.Tensor]] = [
        *(lambda h, w=w: torch.nn.functional.rms_norm(h @ w.t(), norm) for w in stack.weights),
        lambda h: ref(h, 0)]
    return all(torch.equal(full[s.token_slice], call(x[s.token_slice]))
               for call in calls for full in [call(x)] for s in slices)


def _timed(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.Tensor, float]:
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, (time.perf_counter() - t0) * 1e6


def variants(conn: Any, ref: Ffn, opts: dict[str, Any], device: torch.device,
             dtype: torch.dtype) -> Iterator[dict[str, Any]]:
    """One result per ``opts["variants"]`` entry ``(micro_batches, cuda_streams)``; the first must be ``(1, False)``
    (the unsplit reference). Each runs ``1 + opts["reps"]`` AFD steps (the first checked, the rest timed)."""
    install_forward_context_standin()
    from afd_patches.models import exchange_op, microbatch
    from afd_patches.models.link import AfdLink

    hidden, reps = opts["hidden"], opts["reps"]
    batch = Batch(opts["requests"], hidden, device, dtype)
    stack, local = Stack(hidden, batch.total, device, dtype), Stack(hidden, batch.total, device, dtype)
    link = AfdLink(LAYERS, hidden, dtype)
    link.connector = conn
    runner = microbatch.MicroBatchRunner()  # one per model, its threads reused across steps

    def exchange(x: torch.Tensor, layer: int) -> torch.Tensor:
        return exchange_op.exchange(x, link.op_id, layer)

    streams = ([torch.cuda.Stream(device) for _ in range(max(n for n, _ in opts["variants"]))]
               if device.type == "cuda" else [])
    reference: tuple[torch.Tensor, torch.Tensor] | None = None
    for n, on_streams in opts["variants"]:
        if reference is None and (n, on_streams) != (1, False):
            raise ValueError(f"microbatch: the first variant must be the unsplit step, not {(n, on_streams)}")
        context, expected = batch.step_context(n)
        seen = Seen(expected)
        hand = HandOver(device) if on_streams else None
        forward = afd_forward(stack, exchange, seen, streams if on_streams else None, hand, device)

        def step(forward: Callable[..., torch.Tensor] = forward, context: ForwardContext = context,
                 hand: HandOver | None = hand) -> torch.Tensor:
            stack.cache.zero_()
            if hand is not None:
                hand.last = None
            return run_step(link, runner, context, forward, batch)

        def local_run(context: ForwardContext = context, n: int = n) -> torch.Tensor:
            local.cache.zero_()
            return local_step(local, ref, context, batch, n)

        with torch.inference_mode():
            out, _ = _timed(step, device)
            seen.enabled = False
            cache = stack.cache.clone()
            local_out, _ = _timed(local_run, device)
            local_cache = local.cache.clone()
            if reference is None:
                reference = (out, cache)
            step_us, local_us, reps_equal = [], [], True
            for _ in range(reps):
                again, us = _timed(step, device)
                step_us.append(us)
                reps_equal = reps_equal and bool(torch.equal(again, out) and torch.equal(stack.cache, cache))
                local_us.append(_timed(local_run, device)[1])
        equal_unsplit = bool(torch.equal(out, reference[0]) and torch.equal(cache, reference[1]))
        equal_local = bool(torch.equal(out, local_out) and torch.equal(cache, local_cache))
        with torch.inference_mode():
            row_independent = kernels_row_independent(local, ref, batch, context.ubatch_slices or [])
        expected_order = [(layer, k) for layer in range(LAYERS) for k in range(n)]
        per_step = n * LAYERS
        yield {
            "micro_batches": n, "cuda_streams": on_streams, "layers": LAYERS, "requests": opts["requests"],
            "tokens": batch.total, "hidden": hidden, "dtype": opts["dtype"],
            "slices": [[s.token_slice.start, s.token_slice.stop] for s in (context.ubatch_slices or [])],
            "bitwise_equal_unsplit": equal_unsplit, "bitwise_equal_local_same_split": equal_local,
            "kernels_row_independent": row_independent,
            "max_abs_diff_unsplit": float((out.float() - reference[0].float()).abs().max()),
            "timed_steps_equal": reps_equal, "steps": 1 + reps, "exchanges_per_step": per_step,
            "contexts_ok": not seen.problems, "context_problems": seen.problems[:8],
            "schedule_ok": seen.order == expected_order, "schedule": [f"{layer}.{k}" for layer, k in seen.order],
            "overlaps": seen.overlaps,
            "threads": {k: sorted(v) for k, v in seen.threads.items()},
            "threads_distinct": len({t for v in seen.threads.values() for t in v}) == n,
            **({"thread_cuda_device": {k: sorted(v) for k, v in seen.cuda_devices.items()}}
               if device.type == "cuda" else {}),
            "step_us_p50": statistics.median(step_us) if step_us else None,
            "us_per_exchange_p50": statistics.median(step_us) / per_step if step_us else None,
            "local_step_us_p50": statistics.median(local_us) if local_us else None,
        }
