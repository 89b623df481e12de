"""The ``afd::exchange`` operator: opaque to torch.compile, one connector round trip per call, in order.

A recording connector stands in for the FFN role (it answers ``2 * x + layer``); the model is a
small stack of layers whose MLP is an ``AfdFfnProxy``, compiled with ``fullgraph=True`` as vLLM
compiles (a graph break would fail the test).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from afd_patches.models import exchange_op
from afd_patches.models.ffn_proxy import AfdFfnProxy
from afd_patches.models.link import AfdLink


class Recorder:
    """Connector stand-in: the attention side's two calls; the FFN answer is ``2 * x + layer``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self._pending: dict[int, torch.Tensor] = {}

    def send_attn_output(self, hidden: torch.Tensor, layer: int, step: int, microbatch: int = 0) -> None:
        self.calls.append(("send", layer, step))
        self._pending[layer] = 2 * hidden + layer

    def recv_ffn_output(self, layer: int, step: int, microbatch: int = 0) -> torch.Tensor:
        self.calls.append(("recv", layer, step))
        return self._pending.pop(layer)


class Block(nn.Module):
    def __init__(self, link: AfdLink, layer: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = AfdFfnProxy(link, layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(torch.relu(self.norm(x)))


class Stack(nn.Module):
    def __init__(self, link: AfdLink, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(link, i) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _link(layers: int) -> tuple[AfdLink, Recorder]:
    link = AfdLink(layers, 8)
    rec = Recorder()
    link.connector = rec  # type: ignore[assignment]
    link.begin_step()
    return link, rec


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_stack_calls_the_link_once_per_layer_in_order(backend: str) -> None:
    link, rec = _link(3)
    model = Stack(link, 3).eval()
    x = torch.randn(5, 8)
    with torch.inference_mode():
        expected = model(x)
        assert [c[:2] for c in rec.calls] == [("send", 0), ("recv", 0), ("send", 1), ("recv", 1),
                                              ("send", 2), ("recv", 2)]
        rec.calls.clear()
        compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
        got = compiled(x)
        rec.calls.clear()
        link.begin_step()
        got = compiled(x)
    assert [c for c in rec.calls] == [("send", 0, 1), ("recv", 0, 1), ("send", 1, 1), ("recv", 1, 1),
                                      ("send", 2, 1), ("recv", 2, 1)]
    torch.testing.assert_close(got, expected)  # inductor's LayerNorm may differ in the last bits from eager's
    assert link.exchanges == 3 * 3  # eager, compile-time first call, and the counted call


def test_the_op_is_one_opaque_node_per_layer_where_vllm_splits() -> None:
    """Dynamo records one node per layer (link id and layer baked in), and vLLM's piecewise splitter
    (``should_split``, what ``splitting_ops`` feeds) splits at exactly those nodes."""
    from vllm.compilation.partition_rules import should_split

    link, _ = _link(2)
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    with torch.inference_mode():
        torch.compile(Stack(link, 2), fullgraph=True, backend=capture)(torch.randn(3, 8))
    (graph,) = graphs
    calls = [n for n in graph.graph.nodes if n.op == "call_function" and "afd" in str(n.target)]
    assert [n.args[1:] for n in calls] == [(link.op_id, 0), (link.op_id, 1)]
    assert [n for n in graph.graph.nodes if should_split(n, [exchange_op.OP_NAME])] == calls


def test_fake_implementation_gives_shape_dtype_device_without_calling_the_link() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    link, rec = _link(1)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.empty(7, 8, dtype=torch.float64))
        out = exchange_op.exchange(x, link.op_id, 0)
    assert out.shape == (7, 8) and out.dtype == torch.float64 and rec.calls == []


def test_an_answer_sharing_the_input_storage_is_copied() -> None:
    link, _ = _link(1)

    class Echo(Recorder):
        def recv_ffn_output(self, layer: int, step: int, microbatch: int = 0) -> torch.Tensor:
            return self.sent

        def send_attn_output(self, hidden: torch.Tensor, layer: int, step: int, microbatch: int = 0) -> None:
            self.sent = hidden

    link.connector = Echo()  # type: ignore[assignment]
    x = torch.randn(2, 8)
    out = exchange_op.exchange(x, link.op_id, 0)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
