"""Greedy generation on a real vLLM engine; prints one JSON line with tokens and logprobs.

    python scripts/generate.py MODEL [--additional-config JSON] [--hf-overrides JSON]
                                     [--max-tokens 8] [--prompts "1 2 3;4 5 6"]

Used by the tests, the demo and the benchmarks, so they all drive vLLM the same
way: ``LLM(..., enforce_eager=True, max_model_len=256, skip_tokenizer_init=True)``
with token-id prompts, temperature 0, top-5 logprobs.
"""

from __future__ import annotations

import argparse
import json
import time

DEFAULT_PROMPTS = "1 2 3 4 5;17 99 4;250 251 252 253 254 255 256 7"


def generate(model: str, additional_config: dict | None = None, hf_overrides: dict | None = None,
             max_tokens: int = 8, prompts: str = DEFAULT_PROMPTS) -> dict:
    from vllm import LLM, SamplingParams

    kwargs = {}
    if additional_config is not None:
        kwargs["additional_config"] = additional_config
    if hf_overrides is not None:
        kwargs["hf_overrides"] = hf_overrides
    started = time.perf_counter()
    llm = LLM(model=model, enforce_eager=True, max_model_len=256, skip_tokenizer_init=True,
              dtype="float32", seed=0, gpu_memory_utilization=0.2, kv_cache_memory_bytes=64 << 20, **kwargs)
    ready = time.perf_counter()
    token_prompts = [{"prompt_token_ids": [int(t) for t in p.split()]} for p in prompts.split(";")]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5, ignore_eos=True, detokenize=False)
    outputs = llm.generate(token_prompts, params, use_tqdm=False)
    done = time.perf_counter()
    result = {"tokens": [], "logprobs": [], "startup_s": round(ready - started, 2),
              "generate_s": round(done - ready, 3),
              "worker_cls": str(llm.llm_engine.vllm_config.parallel_config.worker_cls)}
    for out in outputs:
        completion = out.outputs[0]
        result["tokens"].append(list(completion.token_ids))
        result["logprobs"].append([
            {str(tok): round(lp.logprob, 5) for tok, lp in sorted(step.items())} for step in completion.logprobs
        ])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--additional-config", type=json.loads)
    parser.add_argument("--hf-overrides", type=json.loads)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS)
    args = parser.parse_args()
    result = generate(args.model, args.additional_config, args.hf_overrides, args.max_tokens, args.prompts)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
