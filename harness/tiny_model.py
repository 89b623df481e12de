"""Build tiny random-weight checkpoints for real-vLLM tests (nothing is downloaded).

float32, except the families in ``DTYPE`` (bfloat16: vLLM's CPU Gated-DeltaNet kernels refuse float32).

Weights are drawn with a large std (0.2) so greedy tokens are decisive: vLLM's
'dummy' weights give near-uniform logits, which makes token comparisons fragile.

    python -m harness.tiny_model OUT_DIR [--arch ARCH (one of ARCHES)] [--seed 0]

``deepseek_v2``: layer 0 dense MLP, layer 1 MoE (4 routed experts, top-2, one
shared expert), MLA attention with ``kv_lora_rank`` 512 and ``qk_rope_head_dim``
64 -- the only latent size vLLM's CPU MLA decode kernel supports (576) -- and
small per-head dims (nope 32, v 32, 2 heads); ``q_lora_rank`` None.

``llama4``, ``gpt_oss``, ``qwen3_next``, ``qwen3_5``, ``bailing_moe``, ``longcat_flash``: see each
builder's docstring (``_llama4`` ...); Bailing is written without transformers (``_bailing_moe``).

``--wide``: the FFN-heavy variant of ``arch`` (``WIDE``: a wide dense MLP, many
experts), whose MLP/expert parameters are over 90 % of the model's.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

ARCHES = ("llama", "qwen3", "qwen3_moe", "deepseek_v2",
          "llama4", "gpt_oss", "qwen3_next", "qwen3_5", "bailing_moe", "longcat_flash")
# Families whose checkpoints (and runs) are bfloat16: vLLM's CPU Gated-DeltaNet refuses float32.
DTYPE = {"qwen3_next": "bfloat16", "qwen3_5": "bfloat16"}
COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, vocab_size=512, max_position_embeddings=256,
    initializer_range=0.2, tie_word_embeddings=False, torch_dtype="float32",
)
WIDE: dict[str, dict[str, int]] = {  # vocab 2048 and 64 positions: the rotary cache stays under 2 % of the rest
    "llama": {"vocab_size": 2048, "max_position_embeddings": 64, "intermediate_size": 8192},
    "qwen3": {"vocab_size": 2048, "max_position_embeddings": 64, "intermediate_size": 8192},
    "qwen3_moe": {"vocab_size": 2048, "max_position_embeddings": 64, "num_experts": 128,
                  "moe_intermediate_size": 96},
    "deepseek_v2": {"vocab_size": 2048, "max_position_embeddings": 64, "intermediate_size": 16384,
                    "n_routed_experts": 128, "moe_intermediate_size": 128},
    "llama4": {"vocab_size": 2048, "max_position_embeddings": 64, "intermediate_size_mlp": 8192,
               "num_local_experts": 64, "intermediate_size": 128},
    "gpt_oss": {"vocab_size": 2048, "max_position_embeddings": 64, "num_local_experts": 64},
    "qwen3_next": {"vocab_size": 2048, "max_position_embeddings": 64, "num_experts": 128,
                   "moe_intermediate_size": 96, "intermediate_size": 8192},
    "qwen3_5": {"vocab_size": 2048, "max_position_embeddings": 64, "num_experts": 128, "moe_intermediate_size": 96},
    "bailing_moe": {"vocab_size": 2048, "max_position_embeddings": 64, "num_experts": 128,
                    "moe_intermediate_size": 96, "intermediate_size": 8192},
    "longcat_flash": {"vocab_size": 2048, "max_position_embeddings": 64, "n_routed_experts": 128,
                      "expert_ffn_hidden_size": 128, "ffn_hidden_size": 4096},
}


def build(out: Path, arch: str = "llama", seed: int = 0, wide: bool = False) -> Path:
    """Write config.json + model.safetensors for ``arch`` (``WIDE[arch]`` if ``wide``) into ``out``.

    Idempotent (an existing ``out/config.json`` is kept); returns ``out``.
    """
    import torch
    import transformers

    if (out / "config.json").exists():
        return out
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r} (known: {', '.join(ARCHES)})")
    torch.manual_seed(seed)
    common = {**COMMON, **(WIDE[arch] if wide else {}), "torch_dtype": DTYPE.get(arch, "float32")}
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common)
        model = transformers.Qwen3ForCausalLM(config)
    elif arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**{
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1,
            "norm_topk_prob": True, **common})
        model = transformers.Qwen3MoeForCausalLM(config)
    elif arch == "deepseek_v2":
        config = transformers.DeepseekV2Config(**{
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "moe_intermediate_size": 32, "topk_method": "greedy", "n_group": 1,
            "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0, "q_lora_rank": None,
            "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
            **{k: v for k, v in common.items() if k != "head_dim"}, "num_key_value_heads": 2})
        model = transformers.DeepseekV2ForCausalLM(config)
    elif arch == "bailing_moe":
        return _bailing_moe(out, common)
    else:
        model = _EXTRA[arch](transformers, common)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.to(getattr(torch, DTYPE.get(arch, "float32"))).save_pretrained(out, safe_serialization=True)
    if getattr(model.config, "zero_expert_num", 0):
        _drop_zero_experts(out / "model.safetensors", model.config.n_routed_experts)
    return out


_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def _drop_zero_experts(path: Path, routed: int) -> None:
    """Rewrite ``path`` without expert tensors of index >= ``routed``: transformers' LongCat-Flash saves gate/up
    tensors for its zero-computation experts, which the released checkpoints (and vLLM's loader) do not have."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    save_file({k: v for k, v in tensors.items()
               if not (m := _EXPERT_INDEX.search(k)) or int(m.group(1)) < routed}, str(path), metadata={"format": "pt"})


def _text(common: dict, drop: tuple[str, ...] = ()) -> dict:
    """``common`` without the keys a family's config does not take (``drop``)."""
    return {k: v for k, v in common.items() if k not in drop}


def _llama4(transformers: Any, common: dict) -> Any:
    """Llama-4 text decoder: layer 0 dense (``intermediate_size_mlp``), layer 1 MoE (4 experts, top-1, one shared
    expert of ``intermediate_size``); layer 0 uses RoPE with QK norm, layer 1 is a NoPE layer; no chunked attention."""
    config = transformers.Llama4TextConfig(**{
        "intermediate_size": 64, "intermediate_size_mlp": 128, "num_local_experts": 4, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2, "no_rope_layers": [1, 0], "attention_chunk_size": None,
        "use_qk_norm": True, **_text(common, ("intermediate_size",)),
        **({"intermediate_size": common["intermediate_size"]} if "intermediate_size_mlp" in common else {})})
    return transformers.Llama4ForCausalLM(config)


def _gpt_oss(transformers: Any, common: dict) -> Any:
    """gpt-oss: every layer MoE (4 experts with biases, top-2), unquantized; layer 0 sliding-window attention
    with sinks, layer 1 full attention with sinks. YaRN over ``max_position_embeddings`` positions (factor 2):
    the released factor 32 over 4096 positions makes vLLM's rotary cache 131072 positions long."""
    positions = common["max_position_embeddings"]
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 2.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": positions // 2, "truncate": False}
    config = transformers.GptOssConfig(**{
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128, "rope_parameters": rope,
        "layer_types": ["sliding_attention", "full_attention"], **_text(common)})
    return transformers.GptOssForCausalLM(config)


def _qwen3_next(transformers: Any, common: dict) -> Any:
    """Qwen3-Next (bfloat16): layer 0 Gated-DeltaNet linear attention with a dense MLP, layer 1 gated full
    attention with a sparse MoE block (4 experts, top-2, one shared expert)."""
    config = transformers.Qwen3NextConfig(**{
        "layer_types": ["linear_attention", "full_attention"], "mlp_only_layers": [0], "decoder_sparse_step": 1,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "norm_topk_prob": True, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 2,
        "linear_num_value_heads": 2, **_text(common)})
    return transformers.Qwen3NextForCausalLM(config)


def _qwen3_5(transformers: Any, common: dict) -> Any:
    """Qwen3.5-MoE text decoder (bfloat16): layer 0 Gated-DeltaNet, layer 1 full attention; both layers hold a
    sparse MoE block (4 experts, top-2, one shared expert), as every Qwen3.5-MoE layer does."""
    config = transformers.Qwen3_5MoeTextConfig(**{
        "layer_types": ["linear_attention", "full_attention"], "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 2,
        "linear_num_value_heads": 2, **_text(common, ("intermediate_size",))})
    return transformers.Qwen3_5MoeForCausalLM(config)


def _longcat_flash(transformers: Any, common: dict) -> Any:
    """LongCat-Flash: one layer holds two MLA attentions, two dense MLPs and a MoE of 4 experts plus 2
    zero-computation experts (top-2); MLA sizes as for deepseek_v2 (vLLM's CPU MLA kernel), with a query LoRA
    rank of 64 (the config requires one)."""
    config = transformers.LongcatFlashConfig(**{
        "num_layers": common["num_hidden_layers"], "ffn_hidden_size": 128, "expert_ffn_hidden_size": 32,
        "n_routed_experts": 4, "zero_expert_num": 2, "zero_expert_type": "identity", "moe_topk": 2,
        "routed_scaling_factor": 1.0, "q_lora_rank": 64, "mla_scale_q_lora": True, "mla_scale_kv_lora": True,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
        **_text(common, ("num_hidden_layers", "intermediate_size", "head_dim")), "num_key_value_heads": 2})
    return transformers.LongcatFlashForCausalLM(config)


_EXTRA = {"llama4": _llama4, "gpt_oss": _gpt_oss, "qwen3_next": _qwen3_next, "qwen3_5": _qwen3_5,
          "longcat_flash": _longcat_flash}


def _bailing_moe(out: Path, common: dict) -> Path:
    """Bailing-MoE (Ling), written without transformers (it has no Bailing class): layer 0 dense MLP, layer 1
    MoE (4 experts, top-2, one shared expert); tensors named as vLLM's ``BailingMoeForCausalLM`` loads them.

    ``model_type`` is ``bailing_moe`` as in the released checkpoints, whose config class ships with the checkpoint
    (remote code); transformers has none, so the drivers that read it call ``register_configs`` first.
    """
    import torch
    from safetensors.torch import save_file

    h, inter, vocab = common["hidden_size"], common["intermediate_size"], common["vocab_size"]
    heads, kv, hd = common["num_attention_heads"], common["num_key_value_heads"], common["head_dim"]
    experts, moe_inter = common.get("num_experts", 4), common.get("moe_intermediate_size", 32)
    config = {
        "architectures": ["BailingMoeForCausalLM"], "model_type": "bailing_moe", "torch_dtype": "float32",
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "vocab_size": vocab,
        "max_position_embeddings": common["max_position_embeddings"], "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "use_bias": False, "use_qkv_bias": False, "use_qk_norm": False,
        "norm_head": False, "embedding_dropout": 0.0, "tie_word_embeddings": False,
        "first_k_dense_replace": 1, "num_experts": experts, "num_experts_per_tok": 2,
        "moe_intermediate_size": moe_inter, "num_shared_experts": 1, "norm_topk_prob": True,
    }
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * common["initializer_range"]

    def mlp(prefix: str, size: int) -> dict[str, torch.Tensor]:
        return {f"{prefix}.gate_proj.weight": rand(size, h), f"{prefix}.up_proj.weight": rand(size, h),
                f"{prefix}.down_proj.weight": rand(h, size)}

    tensors = {"model.word_embeddings.weight": rand(vocab, h), "model.norm.weight": torch.ones(h),
               "lm_head.weight": rand(vocab, h)}
    for i in range(2):
        p = f"model.layers.{i}"
        tensors |= {f"{p}.input_layernorm.weight": torch.ones(h), f"{p}.post_attention_layernorm.weight": torch.ones(h),
                    f"{p}.attention.query_key_value.weight": rand((heads + 2 * kv) * hd, h),
                    f"{p}.attention.dense.weight": rand(h, heads * hd)}
        if i < config["first_k_dense_replace"]:
            tensors |= mlp(f"{p}.mlp", inter)
        else:
            tensors[f"{p}.mlp.gate.weight"] = rand(experts, h)
            tensors |= mlp(f"{p}.mlp.shared_experts", moe_inter)
            for e in range(experts):
                tensors |= mlp(f"{p}.mlp.experts.{e}", moe_inter)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


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
