"""What splitting a step into two micro-batches can gain on one core per role, from the GEMMs alone.

For the compute-heavy checkpoints of ``benchmarks/afd_microbatch.py`` (``heavy``: hidden 1024, intermediate
4096; ``balanced``: intermediate 1024; 16 heads of 64, 4 KV heads), this times one layer's projections per
AFD role through vLLM's own CPU GEMM dispatch (``dispatch_cpu_unquantized_gemm``: the kernel a vLLM CPU
worker runs for these float32 weights), on one thread, at ``M`` tokens and at ``M/2``, passing through
``--layers`` layers' distinct weights in turn as a step does (4 layers: more than this machine's 32 MiB L3 holds,
so the weights come from memory, not cache); times are per layer:

- attention role: ``qkv_proj`` (1024 → 1536) and ``o_proj`` (1024 → 1024);
- FFN role: ``gate_up_proj`` (1024 → 2·intermediate) and ``down_proj`` (intermediate → 1024).

Printed per model and ``M``: each role's time at ``M`` and ``M/2``, the split cost ``2·T(M/2) / T(M)`` (1.0
when half the tokens take half the time; 2.0 when the GEMM is bound by reading its weights, which each
micro-batch reads again), the weight bandwidth each role reaches at ``M``, and the bound on N = 2 against
N = 1 that these GEMMs allow with perfect overlap: N = 1 runs ``T_A(M) + T_F(M)`` per layer, N = 2 at best
``2·max(T_A(M/2), T_F(M/2))`` (each role's core does both halves). The bound is optimistic: it leaves out
attention over the KV cache, norms, the exchange and every per-op overhead, all of which a split adds to.

Plain vLLM on the same two cores runs both roles' GEMMs of a layer with two threads (``--plain-cores``); the
bound on the best AFD against plain is ``T_plain(M) / min(N = 1, N = 2 at best)``.

Run it on a quiet machine:

    python -m benchmarks.split_gemm_bound [--tokens 8,16,32,64] [--core 1] [--plain-cores 0,1] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import time
from statistics import median

import torch

SHAPES = {  # model -> role -> [(in, out), ...]; float32
    "heavy": {"attention": [(1024, 1536), (1024, 1024)], "ffn": [(1024, 8192), (4096, 1024)]},
    "balanced": {"attention": [(1024, 1536), (1024, 1024)], "ffn": [(1024, 2048), (1024, 1024)]},
}


def layers(shapes: list[tuple[int, int]]) -> list[torch.nn.Linear]:
    """Linear layers with vLLM's CPU GEMM dispatch attached (``layer.cpu_linear``)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    out = []
    for k, n in shapes:
        layer = torch.nn.Linear(k, n, bias=False, dtype=torch.float32).requires_grad_(False)
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        out.append(layer)
    return out


def role_time(stack: list[list[torch.nn.Linear]], tokens: int, repeat: int) -> float:
    """Median seconds per layer for one pass of ``tokens`` rows through every layer of ``stack`` (a list of
    layers, each a list of GEMMs; inputs sized per GEMM)."""
    xs = [torch.randn(tokens, gemm.in_features) for gemm in stack[0]]
    samples = []
    for i in range(repeat + 3):
        start = time.perf_counter()
        for gemms in stack:
            for gemm, x in zip(gemms, xs, strict=True):
                gemm.cpu_linear(x, gemm.weight, None)
        if i >= 3:  # the first passes pay the kernel's one-time setup
            samples.append((time.perf_counter() - start) / len(stack))
    return median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=lambda v: [int(x) for x in v.split(",")], default=[8, 16, 32, 64])
    parser.add_argument("--core", type=int, default=1, help="the one core a role runs on")
    parser.add_argument("--plain-cores", default="0,1", help="plain's cores, one thread each")
    parser.add_argument("--layers", type=int, default=4, help="distinct layers per role (the checkpoints' 4)")
    parser.add_argument("--repeat", type=int, default=100)
    args = parser.parse_args()
    plain_cores = {int(c) for c in args.plain_cores.split(",")}
    stacks = {model: {role: [layers(shapes) for _ in range(args.layers)] for role, shapes in roles.items()}
              for model, roles in SHAPES.items()}
    # plain first: OpenMP starts its threads at the first parallel region, with the affinity of that moment
    os.sched_setaffinity(0, plain_cores)
    torch.set_num_threads(len(plain_cores))
    plain = {(model, m): role_time([a + f for a, f in zip(roles["attention"], roles["ffn"], strict=True)], m,
                                   args.repeat)
             for model, roles in stacks.items() for m in args.tokens}
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    per_role = {(model, role, m): role_time(stack, m, args.repeat)
                for model, roles in stacks.items() for role, stack in roles.items()
                for m in {t for x in args.tokens for t in (x, x // 2)}}
    print(f"torch {torch.__version__}; a role: one thread on core {args.core}; plain: {len(plain_cores)} threads on "
          f"cores {args.plain_cores}; median of {args.repeat} passes over {args.layers} layers; ms per layer")
    print("model     M | attn T(M) T(M/2) split | ffn T(M) T(M/2) split | GB/s attn ffn | plain T(M) | "
          "bound: N2/N1  AFD/plain")
    for model, roles in SHAPES.items():
        weight_bytes = {r: sum(k * n * 4 for k, n in shapes) for r, shapes in roles.items()}
        for m in args.tokens:
            a, f = per_role[model, "attention", m], per_role[model, "ffn", m]
            ah, fh = per_role[model, "attention", m // 2], per_role[model, "ffn", m // 2]
            n1, n2 = a + f, 2 * max(ah, fh)
            print(f"{model:8s} {m:3d} | {1e3 * a:6.3f} {1e3 * ah:6.3f} {2 * ah / a:5.2f} | {1e3 * f:6.3f} "
                  f"{1e3 * fh:6.3f} {2 * fh / f:5.2f} | {weight_bytes['attention'] / a / 1e9:5.1f} "
                  f"{weight_bytes['ffn'] / f / 1e9:5.1f} | {1e3 * plain[model, m]:6.3f} | "
                  f"{n1 / n2:5.2f}  {plain[model, m] / min(n1, n2):5.2f}")


if __name__ == "__main__":
    main()
