"""AFD micro-batches on vLLM's Model Runner V2 (``vllm/v1/worker/gpu/``): vLLM's slicing, AFD's schedule.

MRV2 decides how many micro-batches a step runs as in ``dp_utils.dispatch_cg_and_sync_dp`` (the
``num_ubatches`` of the ``BatchExecutionDescriptor`` it returns; on one engine, DP 1, it returns before
deciding) and runs them with the object ``ubatch_utils.maybe_build_ubatch_runner`` builds (None at DP 1;
vLLM's ``UBatchRunner`` needs CUDA streams). For an AFD attention worker that asked for ``micro_batches`` > 1
(``micro_batches.asked``), two wrappers, both of the names as ``model_runner`` bound them at import:

- ``split_afd_steps_v2`` (``dispatch_cg_and_sync_dp``): inside an AFD attention step (``micro_batches.in_step``)
  of at least ``micro_batch_min_tokens`` tokens, where the runner has a micro-batch runner and vLLM said one
  micro-batch, the descriptor asks for ``micro_batches`` (and no full CUDA graph). Dummy runs, warm-up and every
  other engine get vLLM's answer unchanged.
- ``build_ubatch_runner`` (``maybe_build_ubatch_runner``): where vLLM built none and this process asked for AFD
  micro-batches, an ``AfdUBatchRunner`` (``runner_class``): vLLM's own ``UBatchRunner.prepare`` (its token
  slices, one attention metadata per micro-batch from that micro-batch's builder, the per-micro-batch slot
  mappings), then ``run`` hands the step to the AFD model in the shape V1's runner gives it: a forward context
  whose ``attn_metadata``, ``slot_mapping`` and ``is_padding`` are lists, one per micro-batch, with the step's
  ``ubatch_slices``. ``afd_patches.models.microbatch`` then runs the micro-batches of both runners alike, with the
  baton instead of streams.

Vetoes, where V1 runs a step unsplit (V1's are vLLM's ``_allow_microbatching`` plus AFD's own; MRV2 has
no ``_allow_microbatching``): models with MLA attention (as on V1), models with recurrent state (MRV2's hybrid
model state accepts only micro-batch 0; V1 splits them at request boundaries), and a step in which a
request reads from the prefix cache a KV block that another request of the same step writes
(``reads_blocks_written_in_step``, V1's rule on MRV2's batch). A vetoed step is prepared and run as one
micro-batch covering the whole batch: the metadata and the forward of the unsplit step.

Limits: eager steps only on CPU (no CUDA graphs there); the ``UBatchRunner`` fields ``prepare`` reads are set
in ``AfdUBatchRunner.__init__`` (its CUDA streams and barrier are left out), so the manifest pins
``UBatchRunner.__init__`` and ``prepare`` (``requires``): a vLLM that changes either is flagged by
``patchkit retarget`` / ``check``. Under vLLM data parallelism vLLM's own runner is kept (AFD refuses
micro-batches with DP in the front end anyway).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from afd_patches.patches import micro_batches


def split_afd_steps_v2(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Wrapper of MRV2's ``dispatch_cg_and_sync_dp`` (module docstring)."""
    batch_desc, sync = original(*args, **kwargs)
    plan = micro_batches.step_plan()
    if plan is None or batch_desc.num_ubatches > 1:
        return batch_desc, sync
    if not _signature(original).bind(*args, **kwargs).arguments.get("allow_ubatching"):  # by position (patchkit)
        return batch_desc, sync
    n, min_tokens = plan
    if batch_desc.num_tokens < max(min_tokens, n):
        return batch_desc, sync
    from vllm.config.compilation import CUDAGraphMode

    mode = CUDAGraphMode.NONE if batch_desc.cg_mode == CUDAGraphMode.FULL else batch_desc.cg_mode
    return dataclasses.replace(batch_desc, num_ubatches=n, cg_mode=mode), sync


@functools.cache
def _signature(function: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(function)


def build_ubatch_runner(original: Callable[..., Any], vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
    """Wrapper of MRV2's ``maybe_build_ubatch_runner`` (module docstring)."""
    runner = original(vllm_config, *args, **kwargs)
    if runner is not None or micro_batches.asked() is None:
        return runner
    return runner_class()(vllm_config, *args, **kwargs)


def reads_blocks_written_in_step(block_table: np.ndarray, computed: np.ndarray, query_lens: np.ndarray,
                                 block_size: int) -> bool:
    """Whether a request that continues past its computed tokens with more than one new token reads a whole
    KV block (below ``computed // block_size``) that a request of the same step writes (one of the blocks
    covering its ``[computed, computed + query_len)``). Rows of ``block_table`` are the step's requests in
    batch order. Split, such a reader in an earlier micro-batch would attend over a block the writer in a
    later one has not filled yet; run whole, every KV write comes before any read."""
    computed = np.asarray(computed, dtype=np.int64)
    query_lens = np.asarray(query_lens, dtype=np.int64)
    readers = np.flatnonzero((query_lens > 1) & (computed > 0))
    if readers.size == 0 or len(computed) < 2:
        return False
    written: set[int] = set()
    for row, (start, length) in enumerate(zip(computed, query_lens, strict=True)):
        first, stop = start // block_size, (start + length + block_size - 1) // block_size
        written.update(int(b) for b in block_table[row, first:stop])
    return any(written.intersection(int(b) for b in block_table[r, : computed[r] // block_size]) for r in readers)


@functools.cache
def runner_class() -> type:
    """``AfdUBatchRunner``, a subclass of the running vLLM's ``UBatchRunner`` (made on first use: importing
    vLLM's MRV2 modules is left to processes that run it)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import create_forward_context, get_forward_context, override_forward_context
    from vllm.v1.worker.gpu.attn_utils import build_slot_mappings_by_layer
    from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner, UBatchState
    from vllm.v1.worker.ubatch_utils import UBatchSlice

    class AfdUBatchRunner(UBatchRunner):  # type: ignore[misc, valid-type]
        """vLLM's micro-batch preparation without CUDA streams; AFD's run (module docstring)."""

        def __init__(self, vllm_config: Any, device: Any, model_state: Any, attn_groups: Any,
                     kv_cache_config: Any, max_num_reqs: int) -> None:
            import torch

            self.vllm_config = vllm_config
            self.parallel_config = vllm_config.parallel_config
            self.num_ubatches = self.parallel_config.num_ubatches
            self.dcp_size, self.dcp_rank = 1, 0  # AFD runs no decode context parallelism
            self.cp_interleave = self.parallel_config.cp_kv_cache_interleave_size
            self.device = device
            self.model_state = model_state
            self.attn_groups = attn_groups
            self.kv_cache_config = kv_cache_config
            self.ubatch_query_start_loc = [torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)
                                           for _ in range(self.num_ubatches)]
            self.ubatch_seq_lens = [torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
                                    for _ in range(self.num_ubatches)]
            self.ubatch_dcp_local_seq_lens = [None] * self.num_ubatches
            self._pending_finish = None
            self.unsplit_model = any(micro_batches.cache_kinds(kv_cache_config))  # MLA or recurrent state

        def _vetoed(self, input_batch: Any, block_tables: tuple[Any, ...]) -> bool:
            if self.unsplit_model:
                return True
            n = input_batch.num_reqs
            computed = input_batch.num_computed_tokens_np[:n]
            lens = np.asarray(input_batch.num_scheduled_tokens[:n])
            groups = self.kv_cache_config.kv_cache_groups
            return any(reads_blocks_written_in_step(table[:n].cpu().numpy(), computed, lens,
                                                    group.kv_cache_spec.block_size)
                       for table, group in zip(block_tables, groups, strict=False))

        def prepare(self, input_batch: Any, block_tables: Any, slot_mappings: Any, *args: Any, **kwargs: Any) -> Any:
            """vLLM's ``prepare`` (its arguments passed on as given); a vetoed step as one micro-batch over the
            whole batch."""
            if not self._vetoed(input_batch, block_tables):
                return super().prepare(input_batch, block_tables, slot_mappings, *args, **kwargs)
            mode = kwargs.get("cg_mode", kwargs.get("batch_desc", args[0] if args else None))
            mode = getattr(mode, "cg_mode", mode) or CUDAGraphMode.NONE  # 0.34 passes the descriptor, 0.32 the mode
            metadata = self.model_state.prepare_attn(input_batch, mode, block_tables, slot_mappings, self.attn_groups,
                                                     self.kv_cache_config,
                                                     for_capture=kwargs.get("for_capture", False))
            whole = UBatchSlice(slice(0, input_batch.num_reqs_after_padding),
                                slice(0, input_batch.num_tokens_after_padding))
            context = create_forward_context(
                metadata, self.vllm_config,
                slot_mapping=build_slot_mappings_by_layer(slot_mappings, self.kv_cache_config),
                is_padding=input_batch.is_padding)
            return UBatchState(slices=[whole], forward_contexts=[context])

        def _make_forward_contexts(self, ubatch_slices: Any, attn_metadata: list[Any],
                                   slot_mappings_by_layer: list[Any], is_padding: list[Any]) -> list[Any]:
            """One context per micro-batch without DP metadata (vLLM's asks for DP > 1; AFD runs at DP 1)."""
            return [create_forward_context(attn_metadata[i], self.vllm_config, slot_mapping=slot_mappings_by_layer[i],
                                           is_padding=is_padding[i])
                    for i in range(len(ubatch_slices))]

        def run(self, model: Any, model_inputs: dict[str, Any], ubatch_state: Any) -> Any:
            """The model once, in the forward context V1's runner gives a split step (module docstring); a
            one-slice state (vetoed) as the unsplit step."""
            outer = get_forward_context()
            parts = ubatch_state.forward_contexts
            if len(parts) == 1:
                step = dataclasses.replace(outer, attn_metadata=parts[0].attn_metadata,
                                           slot_mapping=parts[0].slot_mapping, ubatch_slices=None,
                                           is_padding=parts[0].is_padding)
            else:
                step = dataclasses.replace(outer, attn_metadata=[p.attn_metadata for p in parts],
                                           slot_mapping=[p.slot_mapping for p in parts],
                                           is_padding=[p.is_padding for p in parts],
                                           ubatch_slices=list(ubatch_state.slices))
            with override_forward_context(step):
                return model(**model_inputs)

    return AfdUBatchRunner
