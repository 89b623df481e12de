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
  comes back, through the registered operator ``afd::exchange``
  (``afd_patches.models.exchange_op``), which vLLM's compiler treats as opaque.
  ``load_weights`` drops the FFN weights before delegating to vLLM.
- FFN role: builds only ``model.layers[i].<afd_ffn_attr>`` (via the subclass's
  ``afd_build_ffn``; ``afd_build_ffn_layer`` for a layer with several FFN
  modules), so parameter names match the checkpoint, and loads only those
  weights. ``afd_ffn(layer, x)`` runs one layer's FFN (compiled where vLLM
  would compile the model, see ``afd_patches.models.ffn_compile``); ``forward``
  is not available.
- A decoder layer that builds a second FFN module and adds its output to the
  first's (Step-3's ``share_expert``) names it in ``afd_folded_ffn_attrs``: its
  proxy returns zeros without exchanging, and the FFN role computes the sum.
- A decoder layer that calls several FFN modules with attention in between
  (LongCat-Flash: its MoE and ``mlps[0]`` on one input, then the second attention,
  then ``mlps[1]``) lists their paths in ``afd_exchange_slots``, in call order: each
  is exchanged on its own, module ``k`` of layer ``L`` under exchange index
  ``L * len(afd_exchange_slots) + k`` (the ``layer`` integer of ``afd::exchange``
  and of the wire header, which the connector bounds by
  ``afd_exchanges_per_step()``, part of the roles' identity). A step then makes
  that many round trips per layer; the FFN role holds no state between them.

Limits: no pipeline parallelism (every layer must be local), no LoRA on FFN
modules; on CUDA only piecewise CUDA graphs (``afd_patches.patches.compilation``). The
rebinding lasts for the attention model's ``__init__`` only, under patchkit's process-wide lock: another
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

from afd_patches import trace
from afd_patches.config import AfdConfig, from_additional_config
from afd_patches.connectors.base import ConnectorError
from afd_patches.metrics import METRICS
from afd_patches.models import exchange_op, microbatch
from afd_patches.topology import ATTENTION, FFN

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


class AfdFfnProxy(nn.Module):
    """Stands in for a decoder layer's MLP/MoE on the attention role; holds no parameters.

    Its forward is one ``afd::exchange`` operator call (traced as one opaque node when vLLM compiles).

    ``folded``: it stands for a module whose output the FFN role adds into the exchanged one (a
    shared expert that vLLM's decoder layer sums with the MoE output), so it returns zeros and
    exchanges nothing; the decoder layer's sum then equals the FFN role's exactly (``0 + y == y``).

    ``layer`` is its exchange index: the decoder layer's index, or for a family with
    ``afd_exchange_slots`` the slot's (see the module docstring).
    """

    def __init__(self, link: AfdLink, layer: int, folded: bool = False) -> None:
        nn.Module.__init__(self)  # not super(): in a proxy_type the FFN class follows in the MRO
        self.layer = layer
        self.folded = folded
        self.link_id = link.op_id

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.folded:
            return torch.zeros_like(hidden_states)
        return exchange_op.exchange(hidden_states, self.link_id, self.layer)

    def extra_repr(self) -> str:
        return f"layer={self.layer}" + (", folded" if self.folded else "")


class _NoExperts:
    """MoE bookkeeping a proxy for a MoE block reports to vLLM's model ``__init__``: no local experts."""

    experts = None
    n_logical_experts = n_physical_experts = n_local_physical_experts = 0
    n_routed_experts = n_shared_experts = n_redundant_experts = 0
    is_fused_shared_expert_enabled = False


_BUILDING = threading.local()  # .link: the AfdLink of the attention model this thread is building
_PROXY_TYPES: dict[tuple[type, bool], type] = {}
_LAYER_OF_PREFIX = re.compile(r"(?:^|\.)layers\.(\d+)\.([^.]+(?:\.\d+)?)$")  # layer, path (``mlps.0``)


def _proxy_init(self: AfdFfnProxy, *args: Any, **kwargs: Any) -> None:
    """Construct a proxy from the arguments vLLM's decoder layer passes to the FFN class (only ``prefix`` is read)."""
    link = getattr(_BUILDING, "link", None)
    if link is None:
        raise RuntimeError(f"{type(self).__name__} is built only while an AFD attention-role model is built")
    prefix = kwargs.get("prefix", "")
    match = _LAYER_OF_PREFIX.search(prefix) if isinstance(prefix, str) else None
    if match is None:
        raise RuntimeError(f"AFD: an FFN module was built with prefix {prefix!r}, which names no decoder layer")
    layer, path = int(match.group(1)), match.group(2)
    if not link.slots and "." in path:
        raise RuntimeError(f"AFD: an FFN module was built with prefix {prefix!r}, which names no decoder layer")
    AfdFfnProxy.__init__(self, link, link.exchange_index(layer, path), folded=path in link.folded_attrs)


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


def copy_expert_counts(model: nn.Module, blocks: list[nn.Module], num_shared_experts: int = 0) -> None:
    """Set the expert counts a vLLM ``MixtureOfExperts`` model reads from its first MoE block's ``n_*``
    attributes (every block has the same), as vLLM's Mixtral/Qwen3-MoE/ERNIE-4.5-MoE ``__init__`` do: one
    expert group, ``num_shared_experts`` as given; all counts 0 without ``blocks``."""
    model.num_expert_groups = 1
    model.num_shared_experts = num_shared_experts
    for count in ("logical", "physical", "local_physical", "routed", "redundant"):
        setattr(model, f"num_{count}_experts", getattr(blocks[0], f"n_{count}_experts") if blocks else 0)


def adopt_moe_blocks(model: nn.Module, blocks: list[nn.Module]) -> None:
    """FFN role of a vLLM model whose ``__init__`` keeps its MoE blocks in ``moe_mlp_layers`` and sets
    ``num_expert_groups`` from ``config.n_group`` (DeepSeek-V2/V3, GLM-4-MoE): the same, from ``blocks``;
    the caller then runs vLLM's own ``self.extract_moe_parameters`` (in its own class, so that ``patchkit
    deps`` sees which vLLM method it calls). Fused shared experts (ROCm AITER), which move shared-expert
    weights into the routed experts, are refused."""
    if any(getattr(b, "is_fused_shared_expert_enabled", False) for b in blocks):
        raise NotImplementedError(f"AFD {type(model).__name__} FFN role: fused shared experts are not supported")
    model.moe_mlp_layers = blocks
    model.num_expert_groups = getattr(model.config, "n_group", 1)


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
    # FFN modules vLLM's decoder layer builds besides the exchanged one and adds to its output (Step-3's
    # ``share_expert``): the FFN role computes them with it (``afd_ffn_of``), their proxies return zeros.
    afd_folded_ffn_attrs: ClassVar[tuple[str, ...]] = ()
    # FFN modules (paths under a decoder layer) vLLM's decoder layer calls one after another with attention in
    # between, in call order, each exchanged on its own (LongCat-Flash); empty: one exchange per layer.
    afd_exchange_slots: ClassVar[tuple[str, ...]] = ()
    afd_needs_forward_context: ClassVar[bool] = False  # e.g. FusedMoE looks itself up in it
    _FFN_WEIGHT: ClassVar[re.Pattern[str]] = re.compile(r"(^|\.)layers\.\d+\.mlp\.")  # from afd_ffn_attr

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that names another ``afd_ffn_attr`` gets the matching ``_FFN_WEIGHT`` unless it sets
        its own (a layer with several FFN modules, a pattern with a group)."""
        super().__init_subclass__(**kwargs)
        if "afd_ffn_attr" in vars(cls) and "_FFN_WEIGHT" not in vars(cls):
            cls._FFN_WEIGHT = re.compile(rf"(^|\.)layers\.\d+\.{re.escape(cls.afd_ffn_attr)}\.")

    afd_role: str
    _afd_link: AfdLink
    _afd_ffn_calls: list[Any] | None = None  # FFN role: the compiled per-layer modules (afd_compile_ffn)
    _afd_ffn_compile_s = 0.0
    _afd_micro: microbatch.MicroBatchRunner | None = None  # attention role, made at the first split step

    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        cfg = afd_config_of(vllm_config)
        if cfg.role == ATTENTION:
            hf_config = vllm_config.model_config.hf_text_config
            link = AfdLink(self.afd_num_layers(hf_config), hf_config.hidden_size, vllm_config.model_config.dtype,
                           frozenset(self.afd_folded_ffn_attrs), self.afd_exchange_slots)
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

    def afd_ffn_of(self, layer: nn.Module) -> nn.Module | None:
        """The module that computes (FFN role) or exchanges (attention role) decoder layer ``layer``'s FFN
        (default: its ``afd_ffn_attr``)."""
        return getattr(layer, self.afd_ffn_attr, None)  # type: ignore[no-any-return]

    def afd_build_ffn_layer(self, vllm_config: Any, layer: int, prefix: str) -> nn.Module:
        """FFN role: the stand-in for decoder layer ``layer`` (``prefix``: its checkpoint name), holding its
        FFN modules under their checkpoint names (default: ``afd_build_ffn`` as ``afd_ffn_attr``)."""
        holder = nn.Module()
        holder.add_module(self.afd_ffn_attr,
                          self.afd_build_ffn(vllm_config, layer, f"{prefix}.{self.afd_ffn_attr}"))
        return holder

    def afd_num_layers(self, hf_config: Any) -> int:
        """How many decoder layers vLLM's model builds (default ``num_hidden_layers``)."""
        return int(hf_config.num_hidden_layers)

    def afd_describe_experts(self, blocks: list[nn.Module]) -> None:
        """FFN role: set the architecture's expert counts from its MoE ``blocks`` (in layer order, maybe [])."""

    # ---- construction ---------------------------------------------------
    def _afd_layers(self) -> nn.ModuleList:
        return self.model.layers  # type: ignore[no-any-return, union-attr, attr-defined]

    def _afd_exchanged(self) -> list[nn.Module | None]:
        """The module behind each exchange index, in index order: per decoder layer its ``afd_exchange_slots``
        (``get_submodule``), or ``afd_ffn_of`` when there are none."""
        if not self.afd_exchange_slots:
            return [self.afd_ffn_of(layer) for layer in self._afd_layers()]
        return [layer.get_submodule(path) for layer in self._afd_layers() for path in self.afd_exchange_slots]

    def afd_exchanges_per_step(self) -> int:
        """Exchanges one forward step makes: decoder layers x ``afd_exchange_slots`` (at least one each)."""
        return len(self._afd_layers()) * max(1, len(self.afd_exchange_slots))

    def afd_check_attention_layers(self) -> None:
        """Attention role, after construction: every decoder layer is local and holds a proxy as its FFN."""
        from vllm.model_executor.models.utils import PPMissingLayer

        layers = self._afd_layers()
        if any(isinstance(layer, PPMissingLayer) for layer in layers):
            raise ValueError("AFD does not support pipeline parallelism (some decoder layers are not local)")
        slots = self.afd_exchange_slots or (self.afd_ffn_attr,)
        for idx, ffn in enumerate(self._afd_exchanged()):
            if not isinstance(ffn, AfdFfnProxy) or ffn.layer != idx or ffn.folded:
                raise RuntimeError(f"AFD attention role: decoder layer {idx // len(slots)} built {type(ffn).__name__} "
                                   f"as {slots[idx % len(slots)]!r}, not a proxy; this vLLM builds its FFN modules "
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
                  if isinstance(ffn := self.afd_ffn_of(layer), self.afd_moe_classes)]
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
        for idx in range(self.afd_num_layers(hf_config)):
            layers.append(self.afd_build_ffn_layer(vllm_config, idx, f"{base}.layers.{idx}"))
        self.model = nn.Module()
        self.model.layers = layers

    # ---- runtime --------------------------------------------------------
    def afd_bind(self, connector: Connector) -> None:
        """Attach the connector the attention role exchanges through (called by the attention worker)."""
        if self.afd_role != ATTENTION:
            raise RuntimeError("afd_bind is for the attention role")
        self._afd_link.connector = connector

    def afd_stats(self) -> dict[str, int]:
        """Forward steps, layer exchanges (micro-batch 0's) and micro-batches so far (attention role), layer
        count, and (FFN role) the seconds ``afd_compile_ffn`` spent."""
        layers = len(self._afd_layers())
        if self.afd_role != ATTENTION:
            return {"layers": layers, "ffn_compile_s": self._afd_ffn_compile_s}
        link = self._afd_link
        return {"layers": layers, "steps": link.step + 1, "exchanges": link.exchanges, "idle_steps": link.idle_steps,
                "micro_batches": link.micro_batches}

    def afd_link(self) -> AfdLink:
        """The attention role's link (the attention worker drives idle steps through it)."""
        return self._afd_link

    def afd_compile_ffn(self, device: torch.device, dtype: torch.dtype) -> float:
        """FFN role, once after loading: compile every layer's FFN module where vLLM would compile a model
        (``afd_patches.models.ffn_compile``); ``afd_ffn`` runs the compiled ones from then on. Seconds spent."""
        from afd_patches.models import ffn_compile

        modules = self._afd_exchanged()
        calls, seconds = ffn_compile.compile_ffn_modules(modules, self.vllm_config, self._afd_run_ffn,
                                                         self.vllm_config.model_config.get_hidden_size(), device, dtype)
        self._afd_ffn_calls = calls
        self._afd_ffn_compile_s = seconds
        return seconds

    def afd_ffn(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """FFN role: run exchange index ``layer``'s FFN (the decoder layer's, or one slot's) on ``hidden``
        ([tokens, hidden]), compiled if ``afd_compile_ffn`` ran."""
        calls = self._afd_ffn_calls
        if calls:
            call = calls[layer]
        elif slots := self.afd_exchange_slots:
            call = self._afd_layers()[layer // len(slots)].get_submodule(slots[layer % len(slots)])
        else:
            call = self.afd_ffn_of(self._afd_layers()[layer])
        return self._afd_run_ffn(call, hidden)

    def _afd_run_ffn(self, call: Any, hidden: torch.Tensor) -> torch.Tensor:
        if not self.afd_needs_forward_context:
            return call(hidden)  # type: ignore[no-any-return]
        from vllm.forward_context import set_forward_context

        with set_forward_context(None, self.vllm_config, num_tokens=hidden.shape[0]):
            return call(hidden)  # type: ignore[no-any-return]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Attention role: one forward step (exchanges once per layer and micro-batch; split when vLLM's runner
        split the step, ``afd_patches.models.microbatch``). FFN role: not available."""
        if self.afd_role != ATTENTION:
            raise RuntimeError("the FFN role of an AFD model has no forward; it serves afd_ffn()")
        link = self._afd_link
        with link.lock:
            link.begin_step()
            try:
                slices = microbatch.step_slices()
                link.micro_batches += len(slices) if slices else 1
                METRICS.add("steps")
                METRICS.add("micro_batches", len(slices) if slices else 1)
                if not slices:
                    return super().forward(*args, **kwargs)
                if args:
                    raise TypeError("AFD micro-batches: the model is called with keyword inputs only (as vLLM's "
                                    "runner calls it)")
                if self._afd_micro is None:
                    self._afd_micro = microbatch.MicroBatchRunner()
                return self._afd_micro.run(super().forward, slices, kwargs)
            finally:
                link.last_active = time.monotonic()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Role-filtered load: the attention role skips FFN weights; the FFN role loads only them."""
        if self.afd_role == ATTENTION:
            return super().load_weights(  # type: ignore[misc, no-any-return]
                (name, w) for name, w in weights if not self.afd_is_ffn_weight(name))
        return self.afd_load_ffn_weights((name, w) for name, w in weights if self.afd_is_ffn_weight(name))
