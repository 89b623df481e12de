"""Build tiny random-weight float32 checkpoints for real-vLLM tests (nothing is downloaded).

Weights are drawn with a large std (0.2) so greedy tokens are decisive: vLLM's
'dummy' weights give near-uniform logits, which makes token comparisons fragile.

    python -m harness.tiny_model OUT_DIR [--arch llama|qwen3|qwen3_moe|deepseek_v2] [--seed 0]

``deepseek_v2``: layer 0 dense MLP, layer 1 MoE (4 routed experts, top-2, one
shared expert), MLA attention with ``kv_lora_rank`` 512 and ``qk_rope_head_dim``
64 -- the only latent size vLLM's CPU MLA decode kernel supports (576) -- and
small per-head dims (nope 32, v 32, 2 heads); ``q_lora_rank`` None.

``--wide``: the FFN-heavy variant of ``arch`` (``WIDE``: a wide dense MLP, many
experts), whose MLP/expert parameters are over 90 % of the model's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ARCHES = ("llama", "qwen3", "qwen3_moe", "deepseek_v2")
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
}


def build(out: Path, arch: str = "llama", seed: int = 0, wide: bool = False,
          overrides: dict[str, int] | None = None) -> Path:
    """Write config.json + model.safetensors for ``arch`` (``WIDE[arch]`` if ``wide``, then ``overrides``,
    e.g. a compute-heavy ``hidden_size``) into ``out``.

    Idempotent (an existing ``out/config.json`` is kept); returns ``out``.
    """
    import torch
    import transformers

    if (out / "config.json").exists():
        return out
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r} (known: {', '.join(ARCHES)})")
    torch.manual_seed(seed)
    common = {**COMMON, **(WIDE[arch] if wide else {}), **(overrides or {})}
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
    else:
        config = transformers.DeepseekV2Config(**{
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "moe_intermediate_size": 32, "topk_method": "greedy", "n_group": 1,
            "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0, "q_lora_rank": None,
            "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
            **{k: v for k, v in common.items() if k != "head_dim"}, "num_key_value_heads": 2})
        model = transformers.DeepseekV2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
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
