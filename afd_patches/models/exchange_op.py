"""The per-layer AFD exchange as a registered torch operator, ``afd::exchange``.

``torch.ops.afd.exchange(hidden, link, layer) -> Tensor`` sends ``hidden`` (the
post-attention-norm hidden states of decoder layer ``layer``) to the FFN role
through the ``AfdLink`` registered under the integer ``link`` in this process
and returns the FFN's output: a new tensor of the same shape, dtype and device.

Why an operator: vLLM compiles the attention model (dynamo + inductor on CPU,
piecewise CUDA graphs on GPU). Dynamo cannot trace a connector (sockets, locks,
host waits), and a graph break inside vLLM's ``fullgraph`` compile is an error.
An operator with a fake (meta) implementation is opaque to both: dynamo records
one node per layer, inductor compiles everything around it and calls it as an
extern kernel, and vLLM's ``splitting_ops`` can name it (``OP_NAME``) so
piecewise CUDA graphs end before it and start again after it, the way vLLM
treats attention. The fake implementation only allocates the result's shape.

Contract: the op neither mutates nor aliases ``hidden`` (it returns a fresh
tensor; an answer that shares ``hidden``'s storage is copied). ``link`` and
``layer`` are plain integers baked into the compiled graph, so vLLM's
compilation cache can reuse a graph in another process: ``link`` is the index
in this process's registry (``register``), which is 0 for the first attention
model a process builds, as in every process vLLM starts (one model per worker).
The op is a point where the caller hands over (the micro-batch schedule of
issue 27 does its send/wait split inside ``AfdLink``, behind this same op).

Registered once per process at import (``torch.library``, device-generic
``CompositeExplicitAutograd`` kernel). Limits: no autograd (inference only);
the kernel runs the link's Python code, so it cannot be captured inside a CUDA
graph: on CUDA it must be in ``splitting_ops`` (see
``afd_patches.patches.compilation``).
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch


class Exchanger(Protocol):
    """What the op calls (``afd_patches.models.link.AfdLink`` is one): no import of it, so the layers stay
    one-way (``tests/afd/test_layers.py``)."""

    def exchange(self, hidden: torch.Tensor, layer: int) -> torch.Tensor: ...


NAMESPACE = "afd"
OP_NAME = f"{NAMESPACE}::exchange"  # the name vLLM's splitting_ops takes

_LINKS: list[Exchanger] = []
_LINKS_LOCK = threading.Lock()


def register(link: Exchanger) -> int:
    """Make ``link`` reachable from the op; its index (stable for the process's life)."""
    with _LINKS_LOCK:
        _LINKS.append(link)
        return len(_LINKS) - 1


def rebind(index: int, exchanger: Exchanger) -> Exchanger:
    """Make the op's ``link`` integer ``index`` call ``exchanger`` from now on (an attention TP rank's, see
    ``afd_patches.workers.tp_group``); the exchanger it called before. Call it between steps."""
    with _LINKS_LOCK:
        old, _LINKS[index] = _LINKS[index], exchanger
        return old


def _exchange(hidden: torch.Tensor, link: int, layer: int) -> torch.Tensor:
    out = _LINKS[link].exchange(hidden, layer)
    if out.numel() and out.untyped_storage().data_ptr() == hidden.untyped_storage().data_ptr():
        out = out.clone()  # an operator's output must not alias its input
    return out


def _exchange_fake(hidden: torch.Tensor, link: int, layer: int) -> torch.Tensor:
    return torch.empty_like(hidden)


_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # kept alive: the op lives as long as this object
_LIB.define("exchange(Tensor hidden, int link, int layer) -> Tensor")
_LIB.impl("exchange", _exchange, "CompositeExplicitAutograd")
torch.library.register_fake(OP_NAME, _exchange_fake, lib=_LIB)


def exchange(hidden: torch.Tensor, link: int, layer: int) -> torch.Tensor:
    """Call the registered op (what the attention model's proxies run, traced or eager)."""
    return torch.ops.afd.exchange(hidden, link, layer)  # type: ignore[no-any-return]
