"""Roles on their own cores, before and after, in one run: AFD 1A1F behind vLLM's OpenAI server with
vLLM's default OpenMP binding against afd's placement.

Two AFD 1A1F deployments of the same checkpoint are up side by side on 127.0.0.1, both with
``VLLM_CPU_OMP_THREADS_BIND=auto`` (vLLM's default):

- ``vllm-auto``: the ``afd.cpu-binding`` entry disabled (``PATCHKIT_DISABLE``), so vLLM's ``auto``
  binds each engine's worker as if it were alone on the host (on x86: the first core of the first
  NUMA node, for both roles);
- ``afd-placed``: the entry on, so each role's worker gets its own share of the allowed CPUs
  (``afd_patches.cores.derive``; on two cores: FFN core 0, attention core 1).

Each worker's affinity is read from ``/proc/<pid>/status`` and printed. Then ``--rounds`` rounds of
``--requests`` concurrent greedy completions of ``--tokens`` tokens (``ignore_eos``), the order of the two
sides rotating every round, each side's batch ``SETTLE_S`` after the other's; decode tok/s = completion
tokens / wall time of the batch; every round checks that both sides' completions are equal. Front ends
and engine cores are not pinned (vLLM does not pin them either).

``--model``: ``heavy`` (default: hidden 1024, intermediate 4096, 4 layers; FFN time comparable to
attention time) or ``tiny`` (the tests' Llama, hidden 64, 2 layers: per-op overhead dominates).
Engines run eagerly unless ``--compiled``. ``--micro-batches N`` (N > 1) runs both sides with
``micro_batches: N`` and ``micro_batch_min_tokens: 2``, where the two roles can compute at once; at N = 1
they take turns whatever the placement. Prints one table; nothing is written.

    python -m benchmarks.afd_cores [--model heavy] [--rounds 3] [--requests 16] [--tokens 64] [--compiled]
                                   [--micro-batches 1]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from statistics import median

from benchmarks.afd_compile import MODELS
from benchmarks.afd_server_load import HOST, SETTLE_S, Server, load
from harness.env import REPO, free_port, vllm_env
from harness.tiny_model import build
from harness.tiny_tokenizer import build_tokenizer

ARCH = ["--hf-overrides", json.dumps({"architectures": ["AFDLlamaForCausalLM"]})]
SIDES = {"vllm-auto": {"PATCHKIT_DISABLE": "afd.cpu-binding"}, "afd-placed": {}}


def worker_cpus(server: Server) -> str:
    """``Cpus_allowed_list`` of the server's ``VLLM::Worker`` process(es), ``|``-separated."""
    import psutil

    found = []
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if p.cmdline()[:1] and p.cmdline()[0].startswith("VLLM::Worker"):
                status = Path(f"/proc/{p.pid}/status").read_text()
                found.append(next(line.split(":", 1)[1].strip() for line in status.splitlines()
                                  if line.startswith("Cpus_allowed_list:")))
        except (psutil.Error, OSError):
            continue
    return "|".join(found) or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="heavy")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--compiled", action="store_true", help="vLLM's default compilation (else eager)")
    parser.add_argument("--micro-batches", type=int, default=1, choices=range(1, 5))
    args = parser.parse_args()
    env = vllm_env(PYTHONUNBUFFERED="1", VLLM_CPU_OMP_THREADS_BIND="auto")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)  # this checkout
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tokenizer(build(work / "model", "llama", overrides=MODELS[args.model]), vocab_size=512)
        sides: dict[str, tuple[Server, Server]] = {}
        ffns: dict[str, tuple[dict[str, object], Server]] = {}
        try:
            for label, extra in SIDES.items():
                afd: dict[str, object] = {"port": free_port(), "host": HOST, "timeout_s": 300}
                if args.micro_batches > 1:
                    afd["connector_extra_config"] = {"micro_batches": args.micro_batches, "micro_batch_min_tokens": 2}
                ffns[label] = (afd, Server(f"{label}-ffn", model, work, [*ARCH, "--additional-config", json.dumps(
                    {"afd": {**afd, "role": "ffn"}})], {**env, **extra}, None, eager=not args.compiled))
            for label, (afd, ffn) in ffns.items():
                ffn.wait_healthy()
                attn = Server(f"{label}-attention", model, work, [*ARCH, "--additional-config", json.dumps(
                    {"afd": {**afd, "role": "attention"}})], {**env, **SIDES[label]}, None, eager=not args.compiled)
                sides[label] = (ffn, attn)
            for _, attn in sides.values():
                attn.wait_healthy()
            for label, (ffn, attn) in sides.items():
                print(f"{label}: FFN worker on CPU(s) {worker_cpus(ffn)}, attention worker on CPU(s) "
                      f"{worker_cpus(attn)}", flush=True)
            load([sides["afd-placed"][1].port], model, 2, 4)  # warm both front ends once
            load([sides["vllm-auto"][1].port], model, 2, 4)
            rates: dict[str, list[float]] = {label: [] for label in sides}
            order = list(sides)
            for r in range(args.rounds):
                texts = {}
                for label in order[r % 2:] + order[:r % 2]:
                    time.sleep(SETTLE_S)
                    rate, texts[label] = load([sides[label][1].port], model, args.requests, args.tokens)
                    rates[label].append(rate)
                    print(f"round {r + 1} {label}: {rate:.1f} tok/s", flush=True)
                if texts["vllm-auto"] != texts["afd-placed"]:
                    raise SystemExit(f"round {r + 1}: the two sides' completions differ")
            print(f"\n{args.model} model, AFD 1A1F, micro_batches {args.micro_batches}, "
                  f"{args.requests} x {args.tokens} tokens, "
                  f"{'compiled' if args.compiled else 'eager'}, {len(os.sched_getaffinity(0))} allowed CPU(s):")
            print(f"{'side':<12} {'median tok/s':>13}  rounds")
            for label, values in rates.items():
                print(f"{label:<12} {median(values):>13.1f}  {', '.join(f'{v:.1f}' for v in values)}")
            print(f"afd-placed / vllm-auto: {median(rates['afd-placed']) / median(rates['vllm-auto']):.2f}x")
        finally:
            for _, attn in sides.values():
                attn.stop()
            for _, ffn in ffns.values():
                ffn.stop()


if __name__ == "__main__":
    main()
