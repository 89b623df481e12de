"""The role split of every AFD model variant: ``AfdCausalLMMixin`` and the helpers family modules share.

``AfdCausalLMMixin`` goes first in the bases of a vLLM ``*ForCausalLM`` class
(``class AFDLlamaForCausalLM(AfdCausalLMMixin, LlamaForCausalLM)``). It reads
the role from ``vllm_config.additional_config["afd"]`` (``afd_config_of``) and:

- attention role: makes the model's ``AfdLink`` (``afd_patches.models.link``) and delegates to vLLM's
  ``__init__`` inside ``ffn_proxy.building(link)``, so vLLM's decoder layers build a parameter-free
  ``AfdFfnProxy`` in place of each MLP/MoE block (``afd_patches.models.ffn_proxy`` tells how); no FFN
  parameter, buffer or forward-context entry is ever created on this role. Every layer call sends the
  post-attention-norm hidden states through the connector and returns what comes back, through the
  registered operator ``afd::exchange`` (``afd_patches.models.exchange_op``), which vLLM's compiler treats
  as opaque. ``load_weights`` drops the FFN weights before delegating to vLLM.
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

The helpers (``build_dense_mlp``, ``copy_expert_counts``, ``adopt_moe_blocks``) build an FFN role's modules
and MoE bookkeeping the way vLLM's own ``__init__`` would.

Limits: no pipeline parallelism (every layer must be local), no LoRA on FFN
modules; on CUDA only piecewise CUDA graphs (``afd_patches.patches.compilation``).
A vLLM whose decoder-layer module stops naming an FFN class is refused by patchkit
with an error naming the module and the class; one that builds an FFN module some
other way, or a process where the family's scoped-rebind entry is not applied, is
refused after construction (a layer without a proxy, ``afd_check_attention_layers``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from afd_patches.config import AfdConfig, from_additional_config
from afd_patches.connectors.base import ConnectorError
from afd_patches.metrics import METRICS
from afd_patches.models import microbatch
from afd_patches.models.ffn_proxy import AfdFfnProxy, building
from afd_patches.models.link import AfdLink
from afd_patches.topology import ATTENTION, FFN


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
            with building(link):  # the family's scoped-rebind entry binds the FFN classes to proxies now
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
        split the step, ``afd_patches.models.microbatch``). FFN role: not available.

        A step whose exchange fails (``ConnectorError``: the FFN closed, reset or went silent) is held where
        the worker allows it (``AfdLink.hold``): the link's lock is released, the worker waits for the group to
        re-form, and the step runs again from its first layer with the same inputs. The FFN role keeps no state
        of a request, and the attention layers write the same KV cache slots with the same values again, so
        the step's result is the one it would have had (a model with state that a step updates in place, such
        as a recurrent layer's, is never held: ``AttentionRoleMixin``)."""
        if self.afd_role != ATTENTION:
            raise RuntimeError("the FFN role of an AFD model has no forward; it serves afd_ffn()")
        link = self._afd_link
        held_since: float | None = None
        while True:
            with link.lock:
                try:
                    return self._afd_step(link, args, kwargs)
                except ConnectorError as e:
                    if link.hold is None:
                        raise
                    error = e
            held_since = held_since if held_since is not None else time.monotonic()
            link.hold(error, held_since)  # raises when the group did not re-form in time

    def _afd_step(self, link: AfdLink, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One run of the step (``link.lock`` held)."""
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
