"""The micro-batch schedule (``afd_patches.models.microbatch``) on a connector stand-in: the order of sends and
receives, the forward context each micro-batch sees, outputs in token order, and a failing micro-batch."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
import torch
from vllm.forward_context import get_forward_context, override_forward_context
from vllm.v1.worker.ubatch_utils import UBatchSlice

from afd_patches.models.link import AfdLink
from afd_patches.models.microbatch import MicroBatchRunner


@dataclasses.dataclass
class Context:  # the fields of vLLM's ForwardContext the schedule reads and replaces
    attn_metadata: Any
    slot_mapping: Any
    ubatch_slices: Any


class Recorder:
    """Answers ``hidden + 1``; records ("send"/"recv", layer, micro-batch) in call order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.pending: dict[tuple[int, int], torch.Tensor] = {}

    def send_attn_output(self, hidden: torch.Tensor, layer: int, step: int, microbatch: int = 0) -> None:
        self.calls.append(("send", layer, microbatch))
        self.pending[layer, microbatch] = hidden + 1

    def recv_ffn_output(self, layer: int, step: int, microbatch: int = 0) -> torch.Tensor:
        self.calls.append(("recv", layer, microbatch))
        return self.pending.pop((layer, microbatch))


def _slices(*bounds: int) -> list[UBatchSlice]:
    return [UBatchSlice(slice(i, i + 1), slice(a, b)) for i, (a, b) in enumerate(itertools.pairwise(bounds))]


def _run(n_layers: int, bounds: tuple[int, ...], fail_in: int | None = None) -> tuple[torch.Tensor, Recorder, list]:
    link = AfdLink(n_layers, 4)
    rec = Recorder()
    link.connector = rec  # type: ignore[assignment]
    seen: list[tuple[int, Any]] = []
    n = len(bounds) - 1

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = input_ids.float().unsqueeze(1).repeat(1, 4)
        for layer in range(n_layers):
            seen.append((layer, get_forward_context().attn_metadata))
            if fail_in is not None and get_forward_context().attn_metadata == f"meta{fail_in}" and layer == 1:
                raise RuntimeError("boom")
            h = link.exchange(h, layer)
        return h

    ctx = Context([f"meta{k}" for k in range(n)], [f"slots{k}" for k in range(n)], _slices(*bounds))
    ids = torch.arange(bounds[-1])
    with override_forward_context(ctx):  # type: ignore[arg-type]
        out = MicroBatchRunner().run(forward, list(ctx.ubatch_slices), {"input_ids": ids, "positions": ids})
        assert get_forward_context() is ctx  # the step's context is current again afterwards
    return out, rec, seen


def test_two_micro_batches_alternate_at_every_exchange() -> None:
    out, rec, seen = _run(3, (0, 2, 5))
    assert torch.equal(out, torch.arange(5).float().unsqueeze(1).repeat(1, 4) + 3)
    assert rec.calls == [("send", 0, 0), ("send", 0, 1), ("recv", 0, 0), ("send", 1, 0), ("recv", 0, 1),
                         ("send", 1, 1), ("recv", 1, 0), ("send", 2, 0), ("recv", 1, 1), ("send", 2, 1),
                         ("recv", 2, 0), ("recv", 2, 1)]
    assert seen == [(0, "meta0"), (0, "meta1"), (1, "meta0"), (1, "meta1"), (2, "meta0"), (2, "meta1")]


def test_three_micro_batches_answers_come_in_send_order() -> None:
    out, rec, _ = _run(2, (0, 1, 2, 4))
    assert torch.equal(out[:, 0], torch.arange(4).float() + 2)
    sends = [c[1:] for c in rec.calls if c[0] == "send"]
    recvs = [c[1:] for c in rec.calls if c[0] == "recv"]
    assert sends == recvs == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_a_failing_micro_batch_fails_the_step_after_the_others_stopped() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        _run(3, (0, 2, 4), fail_in=1)
