"""An AFD role run by a tensor-parallel vLLM engine: one AFD rank is one vLLM TP group.

With ``--tensor-parallel-size N`` vLLM starts N worker processes per engine and shards
the model's linear layers across them (column/row parallel, an all-reduce in the TP
group). AFD then keeps one connector per TP group, not per worker:

- TP rank 0 (vLLM's ``get_tp_group().rank_in_group == 0``, the *leader*) builds the
  connector and is the AFD rank the other role sees. TP ranks > 0 (*followers*) build
  none and never talk to the other role.
- FFN role: the leader receives a layer's hidden states as without TP and, right
  before each FFN call, publishes the call (exchange index, the batch exactly as it
  enters ``afd_ffn``) to its followers (``FfnLeader``); every TP rank then runs
  ``model.afd_ffn(layer, x)`` on the same batch, so vLLM's row-parallel layers
  all-reduce inside the group as in a plain TP forward, and only the leader sends the
  result. A group that ended (``end``, with the error that ended it, if any) and a
  serve loop that stopped (``stop``) are published too, so ``afd_wait()`` returns on
  every TP rank together (``follow_ffn``).
- Attention role: every TP rank runs vLLM's forward (attention sharded by vLLM, hidden
  states replicated after its all-reduce). At each ``afd::exchange`` the leader
  exchanges with the FFN role as without TP and publishes the answer; followers take
  it instead of exchanging (``AttentionLeader``/``AttentionFollower``, bound to the
  operator with ``exchange_op.rebind``). A failed exchange is published as an error,
  so followers raise too (``AfdGroupDown`` while the leader's group is down) instead of
  waiting. The leader's idle steps (rA:1F) bypass the operator and involve no follower.

Channel (``TpChannel``): a small header dict through vLLM's shared-memory message queue
of the TP group (``GroupCoordinator.mq_broadcaster``, the leader its writer), then the
tensor, if any, through ``GroupCoordinator.broadcast`` (the TP group's device group:
gloo on CPU, NCCL on CUDA), so a tensor travels bit-exact and never through pickle.
Followers poll the queue with a timeout (``POLL_S``), so an idle FFN follower waits
without warnings and notices its own shutdown.

Threads: on the FFN role the serve loop runs in a background thread of each worker
(the FFN worker never runs ``execute_model``, and vLLM's CPU worker runs no collective
after ``load_model`` when it does not warm up), so that thread is the only user of the
TP group's queue and all-reduce. On the attention role the exchange runs inside vLLM's
forward, where every TP rank reaches the same layers in the same order.

Limits: TP only inside a role (no pipeline parallelism); attention micro-batches
(``micro_batches`` > 1) are refused with attention TP > 1; a follower trusts its
leader's header (same engine, shared memory), checking exchange index and shape.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from afd_patches import LOGGER
from afd_patches.connectors.base import ConnectorError
from afd_patches.models import exchange_op
from afd_patches.models.link import AfdGroupDown

logger = logging.getLogger(LOGGER)

POLL_S = 1.0  # an FFN follower's wait for its leader's next message, between checks of its stop event


class TpChannel:
    """Leader → followers messages inside this worker's vLLM TP group (see the module's "Channel")."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank: int = group.rank_in_group
        self.size: int = group.world_size
        self.queue = group.mq_broadcaster
        if self.queue is None:
            raise RuntimeError(f"AFD: vLLM's TP group (size {self.size}) has no message queue broadcaster")

    @classmethod
    def of_worker(cls) -> TpChannel | None:
        """The channel of this worker's TP group; None when the engine is not tensor parallel."""
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        return cls(group) if group.world_size > 1 else None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def publish(self, header: dict[str, Any], tensor: torch.Tensor | None = None) -> None:
        """Leader: send ``header`` (plain values) and ``tensor`` to every follower, in that order."""
        header = dict(header)
        if tensor is not None:
            header["shape"], header["dtype"] = list(tensor.shape), str(tensor.dtype).removeprefix("torch.")
        self.queue.enqueue(header)
        if tensor is not None and tensor.numel():
            self.group.broadcast(tensor.contiguous(), src=0)

    def take(self, timeout_s: float | None) -> tuple[dict[str, Any], torch.Tensor | None] | None:
        """Follower: the leader's next header and tensor (None if it sent none); None after ``timeout_s``."""
        try:
            header = self.queue.dequeue(timeout=timeout_s)
        except TimeoutError:
            return None
        tensor = None
        if "shape" in header:
            tensor = torch.empty(header["shape"], dtype=getattr(torch, header["dtype"]), device=self.group.device)
            if tensor.numel():
                self.group.broadcast(tensor, src=0)
        return header, tensor


# ---------------------------------------------------------------------------------------------- FFN role
class FfnLeader:
    """What the FFN leader's serve loop calls instead of the model: each ``afd_ffn`` call is published first."""

    def __init__(self, model: Any, channel: TpChannel) -> None:
        self.model = model
        self.channel = channel

    def afd_ffn(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        self.channel.publish({"op": "ffn", "layer": layer}, hidden)
        return self.model.afd_ffn(layer, hidden)  # type: ignore[no-any-return]

    def group_ended(self, error: BaseException | None) -> None:
        """Tell the followers that a group ended (``error``: what ended it, None for a clean close)."""
        self.channel.publish({"op": "end", "error": None if error is None else str(error)})

    def stopped(self, error: BaseException | None) -> None:
        """Tell the followers that the serve loop stopped (``error``: why, None on shutdown)."""
        self.channel.publish({"op": "stop", "error": None if error is None else repr(error)})


def follow_ffn(channel: TpChannel, model: Any, stop: threading.Event,
               on_end: Callable[[str | None], None], on_call: Callable[[], None]) -> str | None:
    """An FFN follower's loop: run every call its leader publishes (``on_call`` after each), report each ended
    group (``on_end`` with the leader's error text, None for a clean close); return when ``stop`` is set (None)
    or the leader stopped (its error text, or None)."""
    while not stop.is_set():
        got = channel.take(POLL_S)
        if got is None:
            continue
        header, tensor = got
        op = header["op"]
        if op == "ffn":
            if tensor is None:
                raise RuntimeError(f"AFD FFN TP rank {channel.rank}: the leader's FFN call carried no tensor")
            with torch.inference_mode():
                model.afd_ffn(header["layer"], tensor)  # its all-reduce pairs with the leader's
            on_call()
        elif op == "end":
            on_end(header.get("error"))
        elif op == "stop":
            return header.get("error")  # type: ignore[no-any-return]
        else:
            raise RuntimeError(f"AFD FFN TP rank {channel.rank}: unknown message {op!r} from the leader")
    return None


# ---------------------------------------------------------------------------------------------- attention role
class AttentionLeader:
    """The attention leader's ``afd::exchange`` target: its link's exchange, whose answer (or failure) it publishes."""

    def __init__(self, link: Any, channel: TpChannel) -> None:
        self.link = link
        self.channel = channel

    def exchange(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        try:
            out: torch.Tensor = self.link.exchange(hidden, layer)
        except BaseException as e:
            self.channel.publish({"op": "error", "layer": layer, "error": str(e),
                                  "down": isinstance(e, AfdGroupDown), "connector": isinstance(e, ConnectorError)})
            raise
        self.channel.publish({"op": "out", "layer": layer}, out)
        return out


class AttentionFollower:
    """An attention follower's ``afd::exchange`` target: the answer its leader published for the same layer."""

    def __init__(self, channel: TpChannel) -> None:
        self.channel = channel
        self.exchanges = 0

    def exchange(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        got = self.channel.take(None)  # the leader answers within its connector's timeout_s, or fails
        assert got is not None
        header, out = got
        if header["op"] == "error":
            text = f"AFD attention TP rank {self.channel.rank}: the TP leader's exchange failed: {header['error']}"
            if header.get("down"):
                raise AfdGroupDown(text)
            raise (ConnectorError if header.get("connector") else RuntimeError)(text)
        if header["op"] != "out" or header["layer"] != layer or out is None or out.shape != hidden.shape:
            raise RuntimeError(f"AFD attention TP rank {self.channel.rank}: expected layer {layer}'s answer of shape "
                               f"{tuple(hidden.shape)}, the leader published {header}")
        self.exchanges += 1
        return out.to(dtype=hidden.dtype)


def bind_attention(link: Any, channel: TpChannel) -> AttentionLeader | AttentionFollower:
    """Make the attention model's ``afd::exchange`` (``link.op_id``) go through the TP group: the leader's
    exchanges are published, a follower's are taken from its leader."""
    target: AttentionLeader | AttentionFollower = (AttentionLeader(link, channel) if channel.leader
                                                   else AttentionFollower(channel))
    exchange_op.rebind(link.op_id, target)
    return target


