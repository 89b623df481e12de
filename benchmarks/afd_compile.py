"""AFD compiled vs eager against plain vLLM compiled vs eager, behind the OpenAI server, at equal cores.

For each model in ``--models`` (``tiny``: the tiny float32 Llama of the tests, hidden 64, 2
layers; ``heavy``: a compute-heavy Llama, hidden 1024, intermediate 4096, 4 layers, 16 heads of
64) it starts, one after another (so each start is timed alone), with a fresh
``VLLM_CACHE_ROOT`` per model (cold compile caches):

- ``plain-default``: plain vLLM at its default compilation (on CPU: dynamo + inductor);
- ``plain-eager``: plain vLLM with ``--enforce-eager``;
- ``afd-compiled``: AFD 1A1F, both roles at vLLM's default compilation (the attention model
  compiled around ``afd::exchange``, the FFN role's per-layer modules compiled);
- ``afd-ffn-eager``: the same attention engine, with an FFN engine run with ``--enforce-eager``
  (does compiling the FFN role pay?);
- ``afd-eager``: both roles with ``--enforce-eager``.

Equal cores: vLLM's CPU worker binds its OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``); plain
servers get cores ``0-1`` (two threads), AFD attention servers core ``0`` and FFN servers core
``1``. Front ends and engine cores are not pinned.

Then ``--rounds`` rounds of ``--requests`` concurrent greedy completions of ``--tokens`` tokens
(``ignore_eos``), the order of the setups rotating every round, each ``SETTLE_S`` after the
previous one; every round checks that each setup's completions equal ``plain-default``'s and
``plain-eager``'s alike with each other where they share a compilation setting (AFD compiled vs
plain default, AFD eager vs plain eager). Start-up: seconds from launch to ``/health`` per
server (the compile cost of a role is its compiled start minus its eager start), then with
``--restart`` the compiled servers are stopped and started again on the same configuration:
the second start reuses the compile caches (vLLM's AOT artifacts for the attention model and
plain vLLM, ``afd_ffn/`` for the FFN role). Prints one table per model; nothing is written.

    python -m benchmarks.afd_compile [--models tiny,heavy] [--rounds 3] [--no-restart]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from statistics import median

from benchmarks import record
from benchmarks.afd_server_load import HOST, Server, load, rotated_rounds
from harness.env import REPO, free_port, vllm_env
from harness.tiny_model import build
from harness.tiny_tokenizer import build_tokenizer

MODELS = {"tiny": {}, "heavy": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 4,
                                "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64}}
ARCH = ["--hf-overrides", json.dumps({"architectures": ["AFDLlamaForCausalLM"]})]
PLAIN_CORES, ATTENTION_CORE, FFN_CORE = "0-1", "0", "1"
SAME_AS = {"plain-eager": "plain-eager", "afd-eager": "plain-eager"}  # others: plain-default


class Setup:
    """One setup: a plain server, or an AFD pair (FFN server, then its attention server)."""

    def __init__(self, label: str, model: Path, work: Path, env: dict[str, str], afd: bool, eager: bool,
                 ffn_eager: bool | None = None) -> None:
        self.label, self.model, self.work, self.env = label, model, work, env
        self.afd, self.eager = afd, eager
        self.ffn_eager = eager if ffn_eager is None else ffn_eager
        self.afd_config = {"port": free_port(), "host": HOST, "num_attention_ranks": 1, "timeout_s": 600}
        self.servers: list[Server] = []
        self.starts: dict[str, list[float]] = {}

    def _start(self, role: str, eager: bool, cores: str, extra: list[str]) -> None:
        env = {**self.env, "VLLM_CPU_OMP_THREADS_BIND": cores}
        t0 = time.monotonic()
        server = Server(f"{self.label}-{role}", self.model, self.work, extra, env, None, eager=eager)
        self.servers.append(server)
        server.wait_healthy()
        self.starts.setdefault(role, []).append(time.monotonic() - t0)

    def start(self) -> None:
        """Start (or restart) every server of the setup, one after another, timing each."""
        if not self.afd:
            self._start("plain", self.eager, PLAIN_CORES, [])
            return
        afd = ["--additional-config"]
        self._start("ffn", self.ffn_eager, FFN_CORE,
                    [*ARCH, "--afd-role", "ffn", *afd, json.dumps({"afd": self.afd_config})])
        self._start("attention", self.eager, ATTENTION_CORE,
                    [*ARCH, "--afd-role", "attention", *afd, json.dumps({"afd": self.afd_config})])

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()
        self.servers = []

    @property
    def port(self) -> int:
        return self.servers[-1].port


def run_model(name: str, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = vllm_env(PYTHONUNBUFFERED="1", VLLM_CACHE_ROOT=str(work / "vllm-cache"))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        model = build_tokenizer(build(work / name, "llama", overrides=MODELS[name]), vocab_size=512)
        setups = [Setup("plain-default", model, work, env, afd=False, eager=False),
                  Setup("plain-eager", model, work, env, afd=False, eager=True),
                  Setup("afd-compiled", model, work, env, afd=True, eager=False),
                  Setup("afd-ffn-eager", model, work, env, afd=True, eager=False, ffn_eager=True),
                  Setup("afd-eager", model, work, env, afd=True, eager=True)]
        try:
            for s in setups:
                s.start()
            for s in setups:
                load([s.port], model, 4, 8)  # warm-up
            tps, loadavg = rotated_rounds(setups, args.rounds,
                                          lambda s: load([s.port], model, args.requests, args.tokens),
                                          lambda s: s.label, lambda label: SAME_AS.get(label, "plain-default"),
                                          f"{name} ")
            if args.restart:
                for s in setups:
                    if not s.eager:
                        s.stop()
                        s.start()
        finally:
            for s in setups:
                s.stop()
    report(name, args, setups, tps, loadavg)


def report(name: str, args: argparse.Namespace, setups: list[Setup], tps: dict[str, list[float]],
           loadavg: list[float]) -> None:
    print(f"\n== {name} Llama {MODELS[name] or '(hidden 64, 2 layers)'}; OpenAI server, {args.requests} concurrent "
          f"x {args.tokens} tokens, greedy, float32; plain on cores {PLAIN_CORES}, AFD attention core "
          f"{ATTENTION_CORE}, FFN core {FFN_CORE}")
    print(f"load average (1 min) after each round: {', '.join(f'{x:.1f}' for x in loadavg)}")
    base = tps["plain-default"]
    for label, rates in tps.items():
        ratios = [a / p for a, p in zip(rates, base, strict=True)]
        print(f"{label:14s} tok/s per round: {', '.join(f'{x:7.0f}' for x in rates)}  median {median(rates):7.0f}"
              f"; / plain-default: {', '.join(f'{x:.2f}' for x in ratios)}, median {median(ratios):.2f}")
    print("completions equal plain's at the same compilation setting in every round")
    print("start-up, seconds to /health (first start: cold compile caches; second: the same configuration again):")
    for s in setups:
        print(f"  {s.label:14s} " + "; ".join(f"{role} {', '.join(f'{x:.1f}' for x in times)}"
                                             for role, times in s.starts.items()))


def main() -> None:
    parser = record.parser(__doc__, rounds=3, requests=16, tokens=64)
    parser.add_argument("--models", default="tiny,heavy")
    parser.add_argument("--no-restart", dest="restart", action="store_false",
                        help="skip the second start of the compiled servers")
    args = parser.parse_args()
    for name in args.models.split(","):
        run_model(name, args)


if __name__ == "__main__":
    main()
