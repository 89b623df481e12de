"""The attention role's end of the exchange: ``AfdLink``, one per attention-role model.

Contract: ``AfdLink`` holds the connector the attention worker binds (``swap``) and numbers the model's
forward steps (``begin_step``); every FFN proxy's ``afd::exchange`` call (``afd_patches.models.exchange_op``)
lands in ``AfdLink.exchange``, which sends one layer's hidden states and returns the FFN role's answer
(``send`` then ``PendingExchange.wait``; inside a micro-batch, ``afd_patches.models.microbatch``, it hands
the turn to the next micro-batch in between). While the worker has no group (its FFN role was lost, see
``afd_patches.workers.regroup``) every exchange raises ``AfdGroupDown``. ``try_idle_step`` runs the
zero-token steps that keep an idle attention rank in step with the busy ranks of its FFN rank.

The link knows nothing of vLLM's model classes: the model builds it (``afd_patches.models.causal_lm``) and
the proxies reach it through the operator's integer ``link`` (``AfdLink.op_id``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from afd_patches import trace
from afd_patches.connectors.base import ConnectorError
from afd_patches.metrics import METRICS
from afd_patches.models import exchange_op, microbatch

if TYPE_CHECKING:
    from afd_patches.connectors.base import Connector


class AfdGroupDown(ConnectorError):
    """The attention rank has no AFD group now (its FFN role was lost; the worker is re-forming the group)."""


class PendingExchange:
    """A sent layer whose FFN output has not been received yet (``AfdLink.send``'s handle)."""

    __slots__ = ("device", "dtype", "layer", "link", "microbatch", "sent_at", "shape", "step")

    def __init__(self, link: AfdLink, layer: int, step: int, hidden: torch.Tensor, microbatch: int) -> None:
        self.link, self.layer, self.step, self.microbatch = link, layer, step, microbatch
        self.shape, self.device, self.dtype = hidden.shape, hidden.device, hidden.dtype
        self.sent_at = time.perf_counter()

    def wait(self) -> torch.Tensor:
        """The FFN output for the sent hidden states (same shape, device and dtype)."""
        return self.link.wait(self)


class AfdLink:
    """The attention side's end of the exchange: connector plus forward-step counter.

    ``begin_step()`` is called once per model forward; ``exchange()`` once per
    layer per forward and micro-batch, so ``exchanges == layers * steps`` without
    micro-batches. ``exchange`` is ``send`` then ``wait`` on the handle it returns;
    inside a micro-batch (``afd_patches.models.microbatch``) it hands the baton to
    the next micro-batch in between, so that one's attention overlaps this one's
    FFN. ``pad_micro_batches`` (set by the attention worker): an unsplit step or an
    idle step also sends empty micro-batches up to that count, so that every rank
    an FFN rank batches sends the same messages per layer. ``lock`` is held for a whole
    step (real forward or ``idle_step``), so steps never interleave on the
    connector, and ``swap()`` (the worker replacing a lost group's connector)
    never happens inside a step. ``op_id`` is this link's index for the
    ``afd::exchange`` operator.

    While the group is down (``down`` names why; ``connector`` is None) every
    exchange raises ``AfdGroupDown`` with that reason, and idle steps are skipped.
    ``hold`` (None, or the worker's ``AttentionGroup.hold``): what the model's
    forward calls, outside ``lock``, when a step met a connector error, before
    running the step again.
    """

    def __init__(self, num_layers: int = 0, hidden_size: int = 0, dtype: torch.dtype = torch.float32,
                 folded_attrs: frozenset[str] = frozenset(), slots: tuple[str, ...] = ()) -> None:
        self.connector: Connector | None = None
        self.folded_attrs = folded_attrs  # FFN modules whose proxies add nothing (``afd_folded_ffn_attrs``)
        self.slots = slots  # FFN modules exchanged one by one per layer (``afd_exchange_slots``)
        self.step = -1
        self.exchanges = 0
        self.idle_steps = 0
        self.num_layers = num_layers
        self.num_exchanges = num_layers * max(1, len(slots))  # per step
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.lock = threading.RLock()
        self.last_active = time.monotonic()
        self.op_id = exchange_op.register(self)
        self.down: str | None = None
        self.pad_micro_batches = 1
        self._since: dict[int, float] = {}
        self.micro_batches = 0  # over every step: the micro-batches they ran in (1 for a step not split)
        # set by the attention worker where a step may be held and run again (``AttentionGroup.hold``): called
        # with the connector error a forward met and when that step was first held; returns once a group is
        # bound again, raises the step's error otherwise
        self.hold: Callable[[ConnectorError, float], None] | None = None

    def swap(self, connector: Connector | None, down: str | None = None) -> Connector | None:
        """Between steps, bind ``connector`` (None: the group is down because of ``down``); return the old one."""
        with self.lock:
            old, self.connector, self.down = self.connector, connector, (None if connector else down)
        return old

    def exchange_index(self, layer: int, path: str) -> int:
        """The exchange index of the FFN module at ``path`` under decoder layer ``layer`` (``layer`` itself
        unless the family has ``slots``); ``ValueError`` for a module that is not exchanged."""
        if not self.slots:
            return layer
        if path not in self.slots:
            raise ValueError(f"AFD: an FFN module was built at layers.{layer}.{path}, not one of {self.slots}")
        return layer * len(self.slots) + self.slots.index(path)

    def begin_step(self) -> int:
        self.step += 1
        self._since = {0: trace.now_us()}  # micro-batch -> when it last started computing (trace)
        return self.step

    def exchange(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        """Send ``hidden`` for ``layer`` of the current step (and micro-batch); return the FFN output (same
        shape)."""
        turn = microbatch.current()
        if turn is None:
            sent_at = trace.now_us()
            pending = self.send(hidden, layer)
            pads = [self.send(hidden[:0], layer, k) for k in range(1, self.pad_micro_batches)]
            waited_at = trace.now_us()
            out = pending.wait()
            for pad in pads:
                pad.wait()
            self._trace(layer, 0, self._since.get(0, sent_at), sent_at, waited_at, waited_at)
            return out
        baton, k = turn
        sent_at = trace.now_us()
        pending = self.send(hidden, layer, k)
        handed_at = trace.now_us()
        baton.hand_over(k)
        waited_at = trace.now_us()
        out = pending.wait()
        self._trace(layer, k, self._since.get(k, baton.first_taken_at[k]), sent_at, handed_at, waited_at)
        return out

    def _trace(self, layer: int, k: int, since: float, sent_at: float, handed_at: float, waited_at: float) -> None:
        """Trace one exchange of micro-batch ``k`` (``afd_patches.trace``): its attention from ``since``, the
        send, the wait; the micro-batch computes again from now."""
        now = trace.now_us()
        if trace.TRACER.enabled:
            thread, tags = f"micro-batch {k}", {"layer": layer, "microbatch": k, "step": self.step}
            trace.TRACER.event("attention", thread, since, sent_at, **tags)
            trace.TRACER.event("send", thread, sent_at, handed_at, **tags)
            trace.TRACER.event("wait", thread, waited_at, now, **tags)
        self._since[k] = now

    def send(self, hidden: torch.Tensor, layer: int, microbatch: int = 0) -> PendingExchange:
        """Send ``hidden`` for ``layer`` of the current step; the handle whose ``wait()`` returns the answer."""
        if self.connector is None:
            if self.down is not None:
                raise AfdGroupDown(self.down)
            raise RuntimeError(
                "AFD attention model ran a forward before a connector was bound "
                "(the attention role needs afd_patches' attention worker)"
            )
        self.connector.send_attn_output(hidden.contiguous(), layer, self.step, microbatch)
        return PendingExchange(self, layer, self.step, hidden, microbatch)

    def wait(self, pending: PendingExchange) -> torch.Tensor:
        """Receive the FFN output for ``pending`` (see ``send``); checked against the sent shape."""
        if self.connector is None:
            raise RuntimeError("AFD: the connector was closed while an exchange was pending")
        waited_at = time.perf_counter()
        out = self.connector.recv_ffn_output(pending.layer, pending.step, pending.microbatch)
        METRICS.exchanged(pending.sent_at, waited_at, time.perf_counter())
        if pending.microbatch == 0:
            self.exchanges += 1
        if out.shape != pending.shape:
            raise RuntimeError(f"AFD layer {pending.layer} step {pending.step}: FFN returned {tuple(out.shape)}, "
                               f"expected {tuple(pending.shape)}")
        return out.to(device=pending.device, dtype=pending.dtype)

    def try_idle_step(self, idle_for_s: float) -> bool:
        """A zero-token step (every layer, empty tensors) if no step ran for ``idle_for_s``.

        Keeps an idle attention rank in step with the busy ranks that share its
        FFN rank. Non-blocking: returns False when a real step holds the lock,
        and while the group is down.
        """
        if time.monotonic() - self.last_active < idle_for_s or not self.lock.acquire(blocking=False):
            return False
        try:
            if self.connector is None:
                return False
            self.begin_step()
            empty = torch.empty((0, self.hidden_size), dtype=self.dtype)
            for index in range(self.num_exchanges):
                self.exchange(empty, index)
            self.idle_steps += 1
            self.last_active = time.monotonic()
            return True
        finally:
            self.lock.release()
