"""The settings of an offline engine for a run spec (``harness.engine``'s spec dicts): what ``LLM(...)`` is given.

Its own module so that ``harness.plain_cache`` keys a plain run by these settings without importing the engine
driver (which uses the cache).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def checkpoint_dtype(model_dir: str | Path) -> str:
    """The dtype a checkpoint's ``config.json`` names (``dtype`` or ``torch_dtype``); float32 when it names none.

    The tiny checkpoints are float32 except the Gated-DeltaNet hybrids (bfloat16: vLLM's CPU GDN kernels
    refuse float32), and every run compares plain and AFD at the checkpoint's own dtype."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def _uses_mla(model_dir: str | Path) -> bool:
    """Whether the checkpoint's attention is multi-head latent attention (DeepSeek-V2/V3: ``kv_lora_rank``)."""
    return bool(json.loads((Path(model_dir) / "config.json").read_text()).get("kv_lora_rank"))


def engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``LLM(...)`` keyword arguments for ``spec`` (the same settings for every mode)."""
    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        enforce_eager=not spec.get("compiled", False),
        max_model_len=256,
        skip_tokenizer_init=True,
        dtype=spec.get("dtype") or checkpoint_dtype(spec["model"]),
        seed=0,
        kv_cache_memory_bytes=64 << 20,
        max_num_seqs=8,
    )
    if spec.get("max_num_batched_tokens"):  # small: long prompts are prefilled in chunks beside decodes
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    if spec.get("tensor_parallel_size", 1) > 1:  # vLLM starts one worker process per TP rank
        kwargs["tensor_parallel_size"] = spec["tensor_parallel_size"]
    if spec.get("enable_expert_parallel"):
        kwargs["enable_expert_parallel"] = True
    if kwargs["dtype"] == "float32" and _uses_mla(spec["model"]):
        # On a host with AMX vLLM picks its AMX MLA backend, which takes bf16/fp16 weights only
        # ("expect weight to be bfloat16, ..."); its reference CPU MLA backend runs float32 anywhere.
        kwargs["attention_config"] = {"backend": "CPU_MLA"}
    if spec["mode"] != "plain":
        kwargs["hf_overrides"] = {"architectures": [spec["arch"]]}
        kwargs["additional_config"] = {"afd": spec["afd"]}
    else:
        for key in ("additional_config", "hf_overrides"):
            if key in spec:
                kwargs[key] = spec[key]
    return kwargs
