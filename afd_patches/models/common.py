"""Role-splitting machinery shared by every AFD model variant.

``AfdCausalLMMixin`` goes first in the bases of a vLLM ``*ForCausalLM`` class
(``class AFDLlamaForCausalLM(AfdCausalLMMixin, LlamaForCausalLM)``). It reads
the role from ``vllm_config.additional_config["afd"]`` and:

- attention role: delegates to vLLM's ``__init__`` with this thread marked as
  building an attention-role model (``building_attention_model``). The family's
  ``op: scoped-rebind`` manifest entry (one per family, e.g. ``afd.llama.ffn-proxies``)
  binds, for that one call, the names under which the decoder layer's module refers
  to its FFN classes to parameter-free proxy classes (``proxy_type``, one module-level
  ``<Class>Proxy`` per FFN class in the family's module); patchkit applies, reports,
  reverts and locks that rebinding like every other change to vLLM, and this module
  never writes into a vLLM module. vLLM's decoder layers therefore build an
  ``AfdFfnProxy`` in place of each MLP/MoE block: no FFN parameter, buffer or
  forward-context entry is ever created on this role, on any device. A proxy
  is also an instance of the FFN class it stands in for, so vLLM's own type
  checks (MoE bookkeeping, DeepSeek's float16 rescaling of dense MLP outputs)
  behave as without AFD; MoE proxies report no experts. Every layer call sends
  the post-attention-norm hidden states through the connector and returns what
  comes back. ``load_weights`` drops the FFN weights before delegating to vLLM.
- FFN role: builds only ``model.layers[i].<afd_ffn_attr>`` (via the subclass's
  ``afd_build_ffn``), so parameter names match the checkpoint, and loads only
  those weights. ``afd_ffn(layer, x)`` runs one layer's FFN; ``forward`` is
  not available.

Limits: no pipeline parallelism (every layer must be local), no torch.compile
or CUDA graphs on the attention side (the exchange is a Python-level call;
use ``enforce_eager=True``), no LoRA on FFN modules. The rebinding lasts for
the attention model's ``__init__`` only, under patchkit's process-wide lock: another
thread that builds a plain model of the same vLLM module at that moment would
get proxies too (vLLM builds one model per worker process). A vLLM whose
decoder-layer module stops naming an FFN class is refused by patchkit with an error
naming the module and the class; one that builds an FFN module some other way, or a
process where the scoped-rebind entry is not applied, is refused after construction
(a layer without a proxy).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
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
        nn.Module.__init__(self)  # not super(): in a proxy_type the FFN class follows in the MRO
        self.layer = layer
        self._link = link  # a plain object, not a submodule

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._link.exchange(hidden_states, self.layer)

    def extra_repr(self) -> str:
        return f"layer={self.layer}"


class _NoExperts:
    """MoE bookkeeping a proxy for a MoE block reports to vLLM's model ``__init__``: no local experts."""

    experts = None
    n_logical_experts = n_physical_experts = n_local_physical_experts = 0
    n_routed_experts = n_shared_experts = n_redundant_experts = 0
    is_fused_shared_expert_enabled = False


_BUILDING = threading.local()  # .link: the AfdLink of the attention model this thread is building
_PROXY_TYPES: dict[tuple[type, bool], type] = {}
_LAYER_OF_PREFIX = re.compile(r"(?:^|\.)layers\.(\d+)\.[^.]+$")


def _proxy_init(self: AfdFfnProxy, *args: Any, **kwargs: Any) -> None:
    """Construct a proxy from the arguments vLLM's decoder layer passes to the FFN class (only ``prefix`` is read)."""
    link = getattr(_BUILDING, "link", None)
    if link is None:
        raise RuntimeError(f"{type(self).__name__} is built only while an AFD attention-role model is built")
    prefix = kwargs.get("prefix", "")
    match = _LAYER_OF_PREFIX.search(prefix) if isinstance(prefix, str) else None
    if match is None:
        raise RuntimeError(f"AFD: an FFN module was built with prefix {prefix!r}, which names no decoder layer")
    AfdFfnProxy.__init__(self, link, int(match.group(1)))


def proxy_type(ffn_cls: type[nn.Module], moe: bool = False) -> type[AfdFfnProxy]:
    """The parameter-free proxy class standing in for ``ffn_cls`` (one per class, cached).

    It subclasses ``AfdFfnProxy`` (whose ``forward`` wins) and ``ffn_cls`` (for
    ``isinstance``), and its constructor accepts ``ffn_cls``'s arguments without
    running ``ffn_cls.__init__``. ``moe``: also report no experts (``_NoExperts``).
    """
    key = (ffn_cls, moe)
    if key not in _PROXY_TYPES:
        bases = (AfdFfnProxy, _NoExperts, ffn_cls) if moe else (AfdFfnProxy, ffn_cls)
        _PROXY_TYPES[key] = type(f"Afd{ffn_cls.__name__}Proxy", bases, {
            "__init__": _proxy_init, "__module__": __name__,
            "__doc__": f"Attention-role proxy for vLLM's ``{ffn_cls.__name__}`` (see ``proxy_type``)."})
    return _PROXY_TYPES[key]


def building_attention_model(*_args: Any, **_kwargs: Any) -> bool:
    """``active_if`` of every family's scoped-rebind entry: whether this thread is inside an AFD
    attention-role model's ``__init__`` (so a plain vLLM model built meanwhile is left alone)."""
    return getattr(_BUILDING, "link", None) is not None


@contextmanager
def _building(link: AfdLink) -> Iterator[None]:
    """Mark this thread as building ``link``'s attention-role model for the block."""
    _BUILDING.link = link
    try:
        yield
    finally:
        _BUILDING.link = None


def afd_config_of(vllm_config: Any) -> AfdConfig:
    """The AFD config of ``vllm_config``; an AFD architecture without one is an error."""
    cfg = from_additional_config(getattr(vllm_config, "additional_config", None))
    if cfg is None:
        raise ValueError('an AFD<Arch> model needs additional_config["afd"] (role attention or ffn)')
    return cfg


def build_dense_mlp(mlp_cls: type[nn.Module], vllm_config: Any, prefix: str, **extra: Any) -> nn.Module:
    """``mlp_cls`` built with the keyword arguments vLLM's decoder layers give a dense MLP (plus ``extra``)."""
    config = vllm_config.model_config.hf_text_config
    return mlp_cls(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                   hidden_act=config.hidden_act, quant_config=vllm_config.quant_config, prefix=prefix, **extra)


class AfdCausalLMMixin(nn.Module):
    """Role split for a vLLM ``*ForCausalLM``; put it before the vLLM class in the bases.

    Subclasses set ``afd_moe_classes`` (the FFN classes that hold experts, if any) and
    ``afd_ffn_attr``, define a ``<Class>Proxy = proxy_type(<Class>)`` per FFN class that the
    family's scoped-rebind manifest entry binds, and implement ``afd_build_ffn``; they may
    override ``afd_is_ffn_weight``, ``afd_load_ffn_weights``, ``afd_check_attention_layers``
    and ``afd_describe_experts``.

    MoE bookkeeping (the attributes vLLM reads for expert load balancing and
    metrics): on the FFN role ``moe_layers`` lists each MoE block's ``experts``
    and ``num_moe_layers`` counts them, and ``afd_describe_experts`` sets the
    architecture's expert counts from the same blocks; on the attention role
    both lists are empty and ``num_moe_layers`` is 0 (the experts live on the
    FFN role). Architectures without ``afd_moe_classes`` get none of these.
    """

    afd_moe_classes: ClassVar[tuple[type[nn.Module], ...]] = ()  # the FFN classes that hold experts
    afd_ffn_attr: ClassVar[str] = "mlp"
    afd_needs_forward_context: ClassVar[bool] = False  # e.g. FusedMoE looks itself up in it
    _FFN_WEIGHT: ClassVar[re.Pattern[str]] = re.compile(r"(^|\.)layers\.\d+\.mlp\.")

    afd_role: str
    _afd_link: AfdLink

    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        cfg = afd_config_of(vllm_config)
        if cfg.role == ATTENTION:
            hf_config = vllm_config.model_config.hf_text_config
            link = AfdLink(hf_config.num_hidden_layers, hf_config.hidden_size, vllm_config.model_config.dtype)
            with _building(link):  # the family's scoped-rebind entry binds the FFN classes to proxies now
                super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)  # type: ignore[call-arg]
            self.afd_role = ATTENTION
            self._afd_link = link
            self.afd_check_attention_layers()
            self._afd_forget_experts()
        else:
            nn.Module.__init__(self)  # the vLLM model's own __init__ would build attention and KV layers
            self.afd_role = FFN
            self._afd_build_ffn_model(vllm_config, prefix)
            if self.afd_moe_classes:
                self._afd_count_experts()

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

    def afd_describe_experts(self, blocks: list[nn.Module]) -> None:
        """FFN role: set the architecture's expert counts from its MoE ``blocks`` (in layer order, maybe [])."""

    # ---- construction ---------------------------------------------------
    def _afd_layers(self) -> nn.ModuleList:
        return self.model.layers  # type: ignore[no-any-return, union-attr, attr-defined]

    def afd_check_attention_layers(self) -> None:
        """Attention role, after construction: every decoder layer is local and holds a proxy as its FFN."""
        from vllm.model_executor.models.utils import PPMissingLayer

        layers = self._afd_layers()
        if any(isinstance(layer, PPMissingLayer) for layer in layers):
            raise ValueError("AFD does not support pipeline parallelism (some decoder layers are not local)")
        for idx, layer in enumerate(layers):
            ffn = getattr(layer, self.afd_ffn_attr, None)
            if not isinstance(ffn, AfdFfnProxy) or ffn.layer != idx:
                raise RuntimeError(f"AFD attention role: decoder layer {idx} built {type(ffn).__name__} as "
                                   f"{self.afd_ffn_attr!r}, not a proxy; this vLLM builds its FFN modules "
                                   "in a way AFD does not support, or the family's scoped-rebind manifest entry "
                                   "is not applied in this process (see patchkit.applied())")

    def _afd_forget_experts(self) -> None:
        """Attention role: vLLM's MoE bookkeeping lists no experts (they live on the FFN role)."""
        if hasattr(self, "moe_layers"):
            self.moe_layers = []
            self.num_moe_layers = 0
        if hasattr(self, "moe_mlp_layers"):
            self.moe_mlp_layers = []

    def _afd_count_experts(self) -> None:
        """FFN role, after construction: vLLM's MoE bookkeeping describes the experts built here."""
        blocks = [ffn for layer in self._afd_layers()
                  if isinstance(ffn := getattr(layer, self.afd_ffn_attr), self.afd_moe_classes)]
        self.moe_layers = [b.experts for b in blocks]
        self.num_moe_layers = len(blocks)
        self.afd_describe_experts(blocks)

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
