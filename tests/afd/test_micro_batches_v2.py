"""AFD's Model Runner V2 micro-batch decisions (``afd_patches.patches.micro_batches_v2``) on vLLM's real batch
descriptor, with stand-in originals; the runner itself runs in tests/integration/test_afd_mrv2.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

from afd_patches.patches import micro_batches
from afd_patches.patches.micro_batches_v2 import build_ubatch_runner, reads_blocks_written_in_step, split_afd_steps_v2


def _dispatch(tokens: int, mode: CUDAGraphMode = CUDAGraphMode.NONE, ubatches: int = 1) -> Any:
    """A stand-in with the parameters of vLLM's ``dispatch_cg_and_sync_dp`` that it needs here."""
    desc = BatchExecutionDescriptor(cg_mode=mode, num_tokens=tokens, num_reqs=4, num_ubatches=ubatches)

    def dispatch(num_tokens: int, allow_ubatching: bool = False, uniform_decode: bool = False) -> Any:
        return desc, "sync"

    return dispatch


@pytest.mark.parametrize("tokens,allow,expected", [(16, True, 3), (8, True, 3), (7, True, 1), (16, False, 1)])
def test_an_afd_step_asks_for_its_micro_batches(tokens: int, allow: bool, expected: int) -> None:
    """At least micro_batch_min_tokens (8) tokens and a runner that can split: num_ubatches = micro_batches."""
    with micro_batches.in_step(3, 8):
        desc, sync = split_afd_steps_v2(_dispatch(tokens), tokens, allow)  # by position, as patchkit passes it
    assert (desc.num_ubatches, desc.num_tokens, sync) == (expected, tokens, "sync")


def test_outside_an_afd_step_and_with_one_micro_batch_vllm_decides() -> None:
    desc, _ = split_afd_steps_v2(_dispatch(64), 64, allow_ubatching=True)
    assert desc.num_ubatches == 1
    with micro_batches.in_step(1, 1):
        assert split_afd_steps_v2(_dispatch(64), 64, allow_ubatching=True)[0].num_ubatches == 1


def test_a_split_step_runs_no_full_cuda_graph_and_vllms_own_split_is_kept() -> None:
    with micro_batches.in_step(2, 1):
        desc, _ = split_afd_steps_v2(_dispatch(64, CUDAGraphMode.FULL), 64, True)
        assert (desc.num_ubatches, desc.cg_mode) == (2, CUDAGraphMode.NONE)
        desc, _ = split_afd_steps_v2(_dispatch(64, CUDAGraphMode.PIECEWISE), 64, True)
        assert desc.cg_mode == CUDAGraphMode.PIECEWISE
        desc, _ = split_afd_steps_v2(_dispatch(64, CUDAGraphMode.FULL, ubatches=4), 64, True)
        assert (desc.num_ubatches, desc.cg_mode) == (4, CUDAGraphMode.FULL)


def test_the_runner_builder_adds_afds_runner_only_where_asked_and_vllm_built_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    built = object()
    assert build_ubatch_runner(lambda *a, **k: built, "config") is built
    monkeypatch.setattr(micro_batches, "_ASKED", None)
    assert build_ubatch_runner(lambda *a, **k: None, "config") is None


BLOCK = 4


@pytest.mark.parametrize("table,computed,lens,expected", [
    # two fresh prompts, and decodes: nobody reads a block of this step
    ([[1, 2], [3, 4]], [0, 0], [8, 8], False),
    ([[1, 2], [3, 4]], [5, 6], [1, 1], False),
    # request 1 was admitted on a prefix hit on block 1, which request 0 writes in this step
    ([[1, 2], [1, 5]], [0, 4], [8, 3], True),
    # a chunked prompt reads its own blocks of earlier steps; the other request writes other blocks
    ([[1, 2, 6], [3, 4, 7]], [8, 0], [3, 8], False),
    # the reader's partly filled block is its own, not read from the cache
    ([[1, 2], [1, 5]], [0, 3], [3, 4], False),
])
def test_a_prefix_read_of_a_block_written_in_the_same_step_is_found(table: list[list[int]], computed: list[int],
                                                                     lens: list[int], expected: bool) -> None:
    assert reads_blocks_written_in_step(np.array(table), np.array(computed), np.array(lens), BLOCK) is expected
