"""Micro-batch overlap on the attention role: the attention of one micro-batch runs while the FFN computes another.

vLLM's model runner splits a step into micro-batches when it is told to (``should_ubatch``; AFD tells it in
``afd_patches.patches.micro_batches``): ``maybe_create_ubatch_slices`` cuts the step's tokens into
``UBatchSlice`` s (a request may straddle two), ``split_attn_metadata`` builds each slice's attention
metadata, and the forward context then holds one metadata dict and one slot-mapping dict per slice. This
module runs the model once per slice, each in its own thread, the way vLLM's dual-batch overlap does on
CUDA streams, but with one baton instead of streams (a CPU has none): exactly one micro-batch computes at
a time, and it hands the baton to the next at its layer exchange (``hand_over``), right after sending its
hidden states to the FFN role and before waiting for the answer. So with two micro-batches, layer L's
attention of micro-batch 1 runs while the FFN computes layer L of micro-batch 0; the answers come back in
the order they were sent, which is the order the micro-batches wait for them.

Per micro-batch ``k`` the thread sees vLLM's forward context with ``attn_metadata[k]`` and
``slot_mapping[k]`` (and ``is_padding[k]`` where that is a list, as AFD's Model Runner V2 path gives it) and no
``ubatch_slices`` (it is entered when the thread takes the baton and left when
it hands it on, so the one process-wide context is always the running micro-batch's), and the input ids,
positions and embeddings of its token slice. The step's output is the slices' outputs concatenated in
token order, as the unsplit forward returns it.

Exactness: each micro-batch runs the same kernels on fewer rows. Attention reads the KV cache, and a
request split across two slices has its first part's KV written (layer L, micro-batch k) before its second
part reads it (layer L, micro-batch k+1), because the baton visits the micro-batches in order at every
layer. Row-independent kernels (every GEMM vLLM's CPU build runs here) then give the same bits; a kernel
whose result for a row depends on the other rows of its call would not (none was found; see
docs/benchmarks.md "Micro-batches").

Threads: micro-batch 0 runs in the caller's thread; the others in ``MicroBatchRunner`` 's threads, made
once per runner and reused. Each enters ``torch.inference_mode`` (thread-local in torch) and its
micro-batch's forward context. The shape is the one a CUDA path would take with vLLM's streams: the
baton is replaced by stream events, the hand-over point stays the exchange operator.

Limits: inputs must be the ``input_ids``/``positions``/``inputs_embeds`` keywords vLLM's runner passes
(no intermediate tensors: AFD has no pipeline parallelism; other model keywords are refused); an
exception in any micro-batch is re-raised in the caller after every micro-batch has stopped (the others
then fail at their next exchange, since the connector is broken, or finish).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from afd_patches import trace

_CURRENT = threading.local()  # .turn: the (Baton, micro-batch) this thread runs, while it runs one


class Baton:
    """Which micro-batch may compute now: one at a time, handed on in cyclic order among those not done."""

    def __init__(self, contexts: list[Any]) -> None:
        self._cond = threading.Condition()
        self._active = list(range(len(contexts)))
        self._turn = 0
        self._contexts = contexts
        self._entered: dict[int, AbstractContextManager[Any]] = {}
        self.first_taken_at = [0.0] * len(contexts)  # when each micro-batch began computing (``trace.now_us``)

    def take(self, k: int) -> None:
        """Block until it is micro-batch ``k``'s turn, then make its forward context current."""
        with self._cond:
            self._cond.wait_for(lambda: self._turn == k)
        from vllm.forward_context import override_forward_context

        entered = override_forward_context(self._contexts[k])
        entered.__enter__()
        self._entered[k] = entered
        if not self.first_taken_at[k]:
            self.first_taken_at[k] = trace.now_us()

    def _release(self, k: int, done: bool) -> None:
        entered = self._entered.pop(k, None)
        if entered is not None:
            entered.__exit__(None, None, None)
        with self._cond:
            at = self._active.index(k)
            if done:
                self._active.remove(k)
                nxt = self._active[at % len(self._active)] if self._active else -1
            else:
                nxt = self._active[(at + 1) % len(self._active)]
            self._turn = nxt
            self._cond.notify_all()

    def hand_over(self, k: int) -> None:
        """Micro-batch ``k`` has sent its layer: let the next one compute, then wait for ``k``'s turn again."""
        self._release(k, done=False)
        self.take(k)

    def finish(self, k: int) -> None:
        """Micro-batch ``k`` is done (or failed): the rest go on without it."""
        self._release(k, done=True)


def current() -> tuple[Baton, int] | None:
    """The baton and micro-batch index this thread runs now (the exchange hands over through it), else None."""
    return getattr(_CURRENT, "turn", None)


def step_slices() -> list[Any] | None:
    """The ``UBatchSlice`` s of the step being run (vLLM's forward context), or None when it is not split."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    slices = get_forward_context().ubatch_slices
    return list(slices) if slices and len(slices) > 1 else None


def _slice_inputs(kwargs: dict[str, Any], tokens: slice) -> dict[str, Any]:
    out = dict(kwargs)
    for key in ("input_ids", "inputs_embeds"):
        if out.get(key) is not None:
            out[key] = out[key][tokens]
    if out.get("positions") is not None:
        out["positions"] = out["positions"][..., tokens]  # (tokens,) or M-RoPE's (3, tokens)
    return out


class MicroBatchRunner:
    """Runs one forward per micro-batch with the baton (see the module docstring); one per attention model."""

    def __init__(self) -> None:
        self._workers: list[tuple[threading.Thread, queue.SimpleQueue[Callable[[], None] | None]]] = []

    def _worker(self, i: int) -> queue.SimpleQueue[Callable[[], None] | None]:
        while len(self._workers) <= i:
            jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
            thread = threading.Thread(target=self._serve, args=(jobs,), name=f"afd-ubatch-{len(self._workers) + 1}",
                                      daemon=True)
            thread.start()
            self._workers.append((thread, jobs))
        return self._workers[i][1]

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        with torch.inference_mode():
            while (job := jobs.get()) is not None:
                job()

    def run(self, forward: Callable[..., torch.Tensor], slices: list[Any], kwargs: dict[str, Any]) -> torch.Tensor:
        """``forward(**kwargs_k)`` once per slice of ``slices`` (vLLM ``UBatchSlice`` s, ``step_slices()``) under
        the baton; the outputs concatenated."""
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        extra = sorted(k for k, v in kwargs.items()
                       if v is not None and k not in ("input_ids", "positions", "inputs_embeds"))
        if extra:
            raise NotImplementedError(f"AFD micro-batches: model inputs {extra} cannot be split yet")
        slot = context.slot_mapping
        padding = getattr(context, "is_padding", None)  # a list under Model Runner V2 (micro_batches_v2), per slice
        per_slice = {"is_padding": padding} if isinstance(padding, list) else {}
        contexts = [dataclasses.replace(context, attn_metadata=context.attn_metadata[k],
                                        slot_mapping=slot[k] if isinstance(slot, list) else slot,
                                        ubatch_slices=None, **{key: v[k] for key, v in per_slice.items()})
                    for k in range(len(slices))]
        baton = Baton(contexts)
        outputs: list[torch.Tensor | None] = [None] * len(slices)
        errors: list[BaseException] = []
        done = threading.Event()
        remaining = [len(slices)]
        lock = threading.Lock()

        def body(k: int) -> None:
            _CURRENT.turn = (baton, k)
            try:
                baton.take(k)
                outputs[k] = forward(**_slice_inputs(kwargs, slices[k].token_slice))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                errors.append(e)
            finally:
                _CURRENT.turn = None
                baton.finish(k)
                with lock:
                    remaining[0] -= 1
                    if not remaining[0]:
                        done.set()

        for k in range(1, len(slices)):
            self._worker(k - 1).put(lambda k=k: body(k))
        body(0)
        done.wait()
        if errors:
            raise errors[0]
        return torch.cat(outputs)  # type: ignore[arg-type]
