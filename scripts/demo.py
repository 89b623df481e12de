"""The main job: a tiny random-weight model on real vLLM, plain and as a 1A1F AFD pair.

Builds the checkpoint, runs plain vLLM, then the FFN engine and the attention
engine (each with vLLM's own multiprocessing: front end, engine core, worker),
prints the greedy tokens side by side, and the per-process patch reports with
the check that every process applied the same plan.

    python -m scripts.demo      (from the repository root; scripts/demo.sh installs first)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from harness.engine import ARCH, PROMPTS, EngineFailed, run_engines
from harness.env import free_port
from harness.tiny_model import build


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build(work / "tiny-llama", "llama")
        print(f"tiny Llama checkpoint (random float32, 2 layers, hidden 64): {model}", flush=True)
        reports = work / "reports"
        common = {"model": str(model), "arch": ARCH["llama"], "prompts": PROMPTS, "max_tokens": 8, "logprobs": 1,
                  "multiprocessing": True}
        afd = {"connector": "torch_dist", "port": free_port(), "num_attention_ranks": 1, "num_ffn_ranks": 1}
        try:
            print("plain vLLM ...", flush=True)
            (plain,) = run_engines([{**common, "name": "plain", "mode": "plain"}], work)
            print("AFD 1A1F: FFN engine, then attention engine ...", flush=True)
            env = {"PATCHKIT_REPORT_DIR": str(reports)}
            ffn, attn = run_engines([
                {**common, "name": "ffn", "mode": "ffn", "afd": {**afd, "role": "ffn"}, "env": env},
                {**common, "name": "attn", "mode": "attention", "afd": {**afd, "role": "attention"}, "env": env},
            ], work, stagger_s=1.0)
        except EngineFailed as exc:
            print(exc)
            return 1
        print(f"\n{'prompt':>6}  {'plain vLLM':42}  {'AFD 1A1F (attention + FFN)':42}  same")
        for i, (a, b) in enumerate(zip(plain["tokens"], attn["tokens"], strict=True)):
            print(f"{i:>6}  {a!s:42}  {b!s:42}  {'yes' if a == b else 'NO'}")
        s = attn["stats"][0]
        print(f"\nattention: {s['steps']} forward steps x {s['layers']} layers = {s['exchanges']} exchanges; "
              f"MLP parameters held: {len(s['mlp_param_names'])}; "
              f"FFN engine KV cache bytes: {ffn['stats'][0]['kv_cache_bytes']}")
        print("\nper-process patch reports (both engines):", flush=True)
        check = subprocess.run([sys.executable, "-m", "patchkit.cli", "report", str(reports)])
        return 0 if plain["tokens"] == attn["tokens"] and check.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
