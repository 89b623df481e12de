"""Role-splitting machinery shared by every AFD model variant.

``AfdCausalLMMixin`` goes first in the bases of a vLLM ``*ForCausalLM`` class
(``class AFDLlamaForCausalLM(AfdCausalLMMixin, LlamaForCausalLM)``). It reads
the role from ``vllm_config.additional_config["afd"]`` and:

- attention role: builds vLLM's model unchanged (delegating to its
  ``__init__``), then replaces each decoder layer's FFN module (attribute
  ``afd_ffn_attr``, ``mlp`` for Llama/Qwen) by an ``AfdFfnProxy``, which has no
  parameters. Every layer call sends the post-attention-norm hidden states
  through the connector and returns what comes back. ``load_weights`` drops the
  FFN weights before delegating to vLLM.
- FFN role: builds only ``model.layers[i].<afd_ffn_attr>`` (via the subclass's
  ``afd_build_ffn``), so parameter names match the checkpoint, and loads only
  those weights. ``afd_ffn(layer, x)`` runs one layer's FFN; ``forward`` is
  not available.

Limits: no pipeline parallelism (every layer must be local), no torch.compile
or CUDA graphs on the attention side (the exchange is a Python-level call;
use ``enforce_eager=True``), no LoRA on FFN modules. On the attention role the
FFN modules exist briefly while vLLM builds the model and are freed before
weight loading; peak memory during construction is that of the full model.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from afd_patches.config import AfdConfig, from_additional_config

if TYPE_CHECKING:
    from afd_patches.connectors.base import Connector

ATTENTION = "attention"
FFN = "ffn"


class AfdLink:
    """The attention side's end of the exchange: connector plus forward-step counter.

    ``begin_step()`` is called once per model forward; ``exchange()`` once per
    layer per forward, so ``exchanges == layers * steps`` by construction.
    ``lock`` is held for a whole step (real forward or ``idle_step``), so steps
    never interleave on the connector.
    """

    def __init__(self, num_layers: int = 0, hidden_size: int = 0, dtype: torch.dtype = torch.float32) -> None:
        self.connector: Connector | None = None
        self.step = -1
        self.exchanges = 0
        self.idle_steps = 0
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.lock = threading.RLock()
        self.last_active = time.monotonic()

    def begin_step(self) -> int:
        self.step += 1
        return self.step

    def exchange(self, hidden: torch.Tensor, layer: int) -> torch.Tensor:
        """Send ``hidden`` for ``layer`` of the current step; return the FFN output (same shape)."""
        if self.connector is None:
            raise RuntimeError(
                "AFD attention model ran a forward before a connector was bound "
                "(the attention role needs afd_patches' attention worker)"
            )
        self.connector.send_attn_output(hidden.contiguous(), layer, self.step)
        out = self.connector.recv_ffn_output(layer, self.step)
        self.exchanges += 1
        if out.shape != hidden.shape:
            raise RuntimeError(f"AFD layer {layer} step {self.step}: FFN returned {tuple(out.shape)}, "
                               f"expected {tuple(hidden.shape)}")
        return out.to(device=hidden.device, dtype=hidden.dtype)

    def try_idle_step(self, idle_for_s: float) -> bool:
        """A zero-token step (every layer, empty tensors) if no step ran for ``idle_for_s``.

        Keeps an idle attention rank in step with the busy ranks that share its
        FFN rank. Non-blocking: returns False when a real step holds the lock.
        """
        if time.monotonic() - self.last_active < idle_for_s or not self.lock.acquire(blocking=False):
            return False
        try:
            self.begin_step()
            empty = torch.empty((0, self.hidden_size), dtype=self.dtype)
            for layer in range(self.num_layers):
                self.exchange(empty, layer)
            self.idle_steps += 1
            self.last_active = time.monotonic()
            return True
        finally:
            self.lock.release()


class AfdFfnProxy(nn.Module):
    """Stands in for a decoder layer's MLP/MoE on the attention role; holds no parameters."""

    def __init__(self, link: AfdLink, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self._link = link  # a plain object, not a submodule

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._link.exchange(hidden_states, self.layer)

    def extra_repr(self) -> str:
        return f"layer={self.layer}"


def afd_config_of(vllm_config: Any) -> AfdConfig:
    """The AFD config of ``vllm_config``; an AFD architecture without one is an error."""
    cfg = from_additional_config(getattr(vllm_config, "additional_config", None))
    if cfg is None:
        raise ValueError('an AFD<Arch> model needs additional_config["afd"] (role attention or ffn)')
    return cfg


def _forget_registered_layers(vllm_config: Any, removed: nn.Module) -> None:
    """Drop ``removed``'s submodules from vLLM's static forward context (e.g. FusedMoE layers)."""
    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None)
    if not context:
        return
    owned = {id(m) for m in removed.modules()}
    for name in [n for n, m in context.items() if id(m) in owned]:
        del context[name]


class AfdCausalLMMixin(nn.Module):
    """Role split for a vLLM ``*ForCausalLM``; put it before the vLLM class in the bases.

    Subclasses set ``afd_ffn_attr`` and implement ``afd_build_ffn``; they may
    override ``afd_is_ffn_weight`` and ``afd_load_ffn_weights``.
    """

    afd_ffn_attr: ClassVar[str] = "mlp"
    afd_needs_forward_context: ClassVar[bool] = False  # e.g. FusedMoE looks itself up in it
    _FFN_WEIGHT: ClassVar[re.Pattern[str]] = re.compile(r"(^|\.)layers\.\d+\.mlp\.")

    afd_role: str
    _afd_link: AfdLink

    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        cfg = afd_config_of(vllm_config)
        if cfg.role == ATTENTION:
            super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)  # type: ignore[call-arg]
            self.afd_role = ATTENTION
            hf_config = vllm_config.model_config.hf_config
            self._afd_link = AfdLink(hf_config.num_hidden_layers, hf_config.hidden_size,
                                     vllm_config.model_config.dtype)
            self._afd_install_proxies(vllm_config)
        else:
            nn.Module.__init__(self)  # the vLLM model's own __init__ would build attention and KV layers
            self.afd_role = FFN
            self._afd_build_ffn_model(vllm_config, prefix)

    # ---- subclass hooks -------------------------------------------------
    def afd_build_ffn(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        """Build layer ``layer``'s FFN module (FFN role); ``prefix`` is its checkpoint name."""
        raise NotImplementedError

    def afd_is_ffn_weight(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to a decoder layer's FFN."""
        return self._FFN_WEIGHT.search(name) is not None

    def afd_load_ffn_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load FFN weights into the FFN-role model (default: vLLM's AutoWeightsLoader + the arch's mapper)."""
        from vllm.model_executor.models.utils import AutoWeightsLoader

        mapper = getattr(self, "hf_to_vllm_mapper", None)
        return AutoWeightsLoader(self).load_weights(weights, mapper=mapper)

    # ---- construction ---------------------------------------------------
    def _afd_layers(self) -> nn.ModuleList:
        return self.model.layers  # type: ignore[no-any-return, union-attr, attr-defined]

    def _afd_install_proxies(self, vllm_config: Any) -> None:
        from vllm.model_executor.models.utils import PPMissingLayer

        layers = self._afd_layers()
        if any(isinstance(layer, PPMissingLayer) for layer in layers):
            raise ValueError("AFD does not support pipeline parallelism (some decoder layers are not local)")
        for idx, layer in enumerate(layers):
            old = getattr(layer, self.afd_ffn_attr)
            setattr(layer, self.afd_ffn_attr, AfdFfnProxy(self._afd_link, idx))
            _forget_registered_layers(vllm_config, old)

    def _afd_build_ffn_model(self, vllm_config: Any, prefix: str) -> None:
        from vllm.model_executor.models.utils import maybe_prefix

        hf_config = vllm_config.model_config.hf_config
        self.config = hf_config
        self.vllm_config = vllm_config
        self.quant_config = vllm_config.quant_config
        base = maybe_prefix(prefix, "model")
        layers = nn.ModuleList()
        for idx in range(hf_config.num_hidden_layers):
            holder = nn.Module()
            holder.add_module(
                self.afd_ffn_attr,
                self.afd_build_ffn(vllm_config, idx, f"{base}.layers.{idx}.{self.afd_ffn_attr}"),
            )
            layers.append(holder)
        self.model = nn.Module()
        self.model.layers = layers

    # ---- runtime --------------------------------------------------------
    def afd_bind(self, connector: Connector) -> None:
        """Attach the connector the attention role exchanges through (called by the attention worker)."""
        if self.afd_role != ATTENTION:
            raise RuntimeError("afd_bind is for the attention role")
        self._afd_link.connector = connector

    def afd_stats(self) -> dict[str, int]:
        """Forward steps and layer exchanges so far (attention role), and layer count."""
        layers = len(self._afd_layers())
        if self.afd_role != ATTENTION:
            return {"layers": layers}
        link = self._afd_link
        return {"layers": layers, "steps": link.step + 1, "exchanges": link.exchanges, "idle_steps": link.idle_steps}

    def afd_link(self) -> AfdLink:
        """The attention role's link (the attention worker drives idle steps through it)."""
        return self._afd_link

    def afd_ffn(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """FFN role: run layer ``layer``'s FFN on ``hidden`` ([tokens, hidden])."""
        module = getattr(self._afd_layers()[layer], self.afd_ffn_attr)
        if not self.afd_needs_forward_context:
            return module(hidden)  # type: ignore[no-any-return]
        from vllm.forward_context import set_forward_context

        with set_forward_context(None, self.vllm_config, num_tokens=hidden.shape[0]):
            return module(hidden)  # type: ignore[no-any-return]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Attention role: one forward step (exchanges once per layer). FFN role: not available."""
        if self.afd_role != ATTENTION:
            raise RuntimeError("the FFN role of an AFD model has no forward; it serves afd_ffn()")
        link = self._afd_link
        with link.lock:
            link.begin_step()
            try:
                return super().forward(*args, **kwargs)
            finally:
                link.last_active = time.monotonic()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Role-filtered load: the attention role skips FFN weights; the FFN role loads only them."""
        if self.afd_role == ATTENTION:
            return super().load_weights(  # type: ignore[misc, no-any-return]
                (name, w) for name, w in weights if not self.afd_is_ffn_weight(name))
        return self.afd_load_ffn_weights((name, w) for name, w in weights if self.afd_is_ffn_weight(name))
