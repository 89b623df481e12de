"""How the attention role gets its FFN proxies: the whole story, in the order it happens.

The attention role runs vLLM's own model ``__init__`` (attention, KV cache, norms, embedding and LM head are
vLLM's), yet must hold no FFN parameter, buffer or forward-context entry, on any device. vLLM's decoder
layers build their FFN modules by the names their module imports (``LlamaDecoderLayer`` calls ``LlamaMLP(...,
prefix="model.layers.3.mlp")`` as the global ``LlamaMLP`` of ``vllm.model_executor.models.llama``). AFD swaps
those names, for that one ``__init__`` call, for proxy classes built here. Five parts, in four places:

1. **The proxy classes** (this module). Each family module (``afd_patches/models/<family>.py``) defines, at
   module level, ``<Class>Proxy = proxy_type(<Class>)`` for each FFN class its decoder layer builds
   (``moe=True`` for one that holds experts). ``proxy_type`` makes, once per class, a subclass of
   ``AfdFfnProxy`` (whose ``forward`` wins), of ``_NoExperts`` for MoE blocks (vLLM's MoE bookkeeping then
   counts no experts), and of the FFN class itself, so vLLM's own ``isinstance`` checks (MoE bookkeeping,
   DeepSeek's float16 rescaling of dense MLP outputs) behave as without AFD. Its constructor
   (``_proxy_init``) accepts whatever the decoder layer passes and never runs the FFN class's ``__init__``.
   gpt-oss builds its blocks through class attributes instead of module names, so its module binds
   ``GptOssModel`` to a subclass whose blocks' ``mlp_cls`` is the proxy (``afd_patches.models.gpt_oss``).
2. **The manifest entries** (``manifests/afd/base.yaml``, one ``afd.<family>.ffn-proxies`` entry per family,
   ``op: scoped-rebind``). Each targets the vLLM ``*ForCausalLM.__init__`` the AFD class delegates to,
   names the decoder layer's module (``module:``), maps each FFN class name there to its proxy
   (``bind:``), and gates the rebinding on ``active_if: afd_patches.models.ffn_proxy:building_attention_model``.
   The manifest's ``requires`` entries pin (``pin: full``) the vLLM code this relies on, mostly each
   decoder layer's ``__init__``: it must build its FFN modules under those names, with a layer-indexed
   ``prefix``.
3. **patchkit's scoped rebinding** (``patchkit/runtime/scoped.py``). patchkit wraps the target like any
   other entry (applied, reported, reverted and locked with the rest of the plan; this module never writes
   into a vLLM module). On each call it asks ``active_if``; when true it takes patchkit's process-wide
   re-entrant lock, binds every ``bind:`` name in the module's namespace to its proxy (imported on the
   first such call), runs vLLM's ``__init__`` and restores the previous values in a ``finally``. A module
   that no longer names one of the classes is refused with an error naming the module, the name and the
   entry, before anything is bound.
4. **The thread-local** (``_BUILDING``, this module). ``AfdCausalLMMixin.__init__``
   (``afd_patches.models.causal_lm``) wraps its ``super().__init__`` on the attention role in
   ``building(link)``, which sets ``_BUILDING.link`` to the model's ``AfdLink`` for the block;
   ``building_attention_model`` (the entries' ``active_if``) is true exactly then, so a plain vLLM model
   that this thread builds is left alone, and the FFN role (which never runs vLLM's ``__init__``) and a
   process without AFD never see a proxy.
5. **The regex over vLLM's ``prefix=``** (``_LAYER_OF_PREFIX``, this module). A proxy reads only the
   ``prefix`` keyword vLLM's decoder layer passes: ``layers.<L>.<path>`` at its end gives the decoder
   layer ``L`` and the module's path under it (``mlp``, ``share_expert``, ``mlps.0``). The link maps them
   to the proxy's exchange index (``AfdLink.exchange_index``: ``L``, or for a family with
   ``afd_exchange_slots`` ``L * len(slots) + slot``), and a path listed in the family's
   ``afd_folded_ffn_attrs`` makes a folded proxy (returns zeros, exchanges nothing: the FFN role adds that
   module's output into the exchanged one). A prefix that names no decoder layer, or a dotted path in a
   family without slots, is an error.

At run time a proxy's ``forward`` is one ``afd::exchange`` operator call (``afd_patches.models.exchange_op``,
opaque to vLLM's compiler), which calls ``AfdLink.exchange`` (``afd_patches.models.link``). After
construction ``AfdCausalLMMixin.afd_check_attention_layers`` refuses a model in which some exchanged module
is not a proxy at its index (a vLLM that builds an FFN module some other way, or a process where the
family's scoped-rebind entry is not applied).

Limits: the rebinding writes the decoder layer module's shared namespace for the length of the attention
model's ``__init__``: another thread that builds a plain model of the same vLLM module at that moment gets
proxies too (and fails, not being inside ``building``); vLLM builds one model per worker process.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from afd_patches.models import exchange_op

if TYPE_CHECKING:
    from afd_patches.models.link import AfdLink


class AfdFfnProxy(nn.Module):
    """Stands in for a decoder layer's MLP/MoE on the attention role; holds no parameters.

    Its forward is one ``afd::exchange`` operator call (traced as one opaque node when vLLM compiles).

    ``folded``: it stands for a module whose output the FFN role adds into the exchanged one (a
    shared expert that vLLM's decoder layer sums with the MoE output), so it returns zeros and
    exchanges nothing; the decoder layer's sum then equals the FFN role's exactly (``0 + y == y``).

    ``layer`` is its exchange index: the decoder layer's index, or for a family with
    ``afd_exchange_slots`` the slot's (see ``afd_patches.models.causal_lm``).
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
def building(link: AfdLink) -> Iterator[None]:
    """Mark this thread as building ``link``'s attention-role model for the block."""
    _BUILDING.link = link
    try:
        yield
    finally:
        _BUILDING.link = None
