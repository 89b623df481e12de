"""Decode throughput of 1A1F AFD vs plain vLLM on the tiny model, side by side in one run.

Each engine runs in its own process (harness/engine.py), FFN first; the
same prompts, greedy, ``ignore_eos``. Decode tokens/s = generated tokens /
generation wall time. The connector's own per-layer exchange latency is
measured by ``benchmarks/connector_latency.py``.

    python -m benchmarks.afd_throughput [--max-tokens 64] [--prompts 4] [--arch llama]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from harness.engine import ARCH, run_engines
from harness.env import free_port
from harness.tiny_model import build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--arch", default="llama", choices=sorted(ARCH))
    args = parser.parse_args()
    prompts = [[(7 * i + j) % 500 + 1 for j in range(8)] for i in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build(work / args.arch, args.arch)
        common = {"model": str(model), "arch": ARCH[args.arch], "prompts": prompts, "max_tokens": args.max_tokens,
                  "logprobs": 0}
        (plain,) = run_engines([{**common, "name": "plain", "mode": "plain"}], work)
        afd = {"connector": "torch_dist", "port": free_port(), "num_attention_ranks": 1, "num_ffn_ranks": 1,
               "timeout_s": 120.0}
        _, attn = run_engines([
            {**common, "name": "ffn", "mode": "ffn", "afd": {**afd, "role": "ffn"}},
            {**common, "name": "attn", "mode": "attention", "afd": {**afd, "role": "attention"}},
        ], work, stagger_s=1.0)
    generated = args.prompts * args.max_tokens
    tps_plain = generated / plain["seconds"]["generate"]
    tps_afd = generated / attn["seconds"]["generate"]
    stats = attn["stats"][0]
    step_ms = attn["seconds"]["generate"] / max(stats["steps"], 1) * 1e3
    print(f"tiny {args.arch}, {args.prompts} prompts x {args.max_tokens} tokens, greedy, float32, CPU")
    print(f"plain vLLM : {tps_plain:8.1f} tok/s  ({plain['seconds']['generate']:.2f} s)")
    print(f"AFD 1A1F   : {tps_afd:8.1f} tok/s  ({attn['seconds']['generate']:.2f} s, "
          f"{stats['steps']} steps x {stats['layers']} layers = {stats['exchanges']} exchanges, {step_ms:.1f} ms/step)")
    print(f"ratio AFD / plain: {tps_afd / tps_plain:.2f}  (goal >= 0.5)")
    print(f"tokens equal: {attn['tokens'] == plain['tokens']}")


if __name__ == "__main__":
    main()
