"""AFD micro-batches (``connector_extra_config.micro_batches``) against plain vLLM, behind the OpenAI server, at
equal cores, in one run with the sides rotated.

For each model in ``--models`` (``tiny``: the tests' float32 Llama, hidden 64, 2 layers; ``heavy``: a
compute-heavy Llama, hidden 1024, intermediate 4096, 4 layers, 16 heads of 64; ``heavy-moe``: a Qwen3-MoE of
the same attention with 8 experts of intermediate 1024, top-2; ``balanced``: the heavy Llama with intermediate
1024, whose MLP has about as many weights as its attention; ``llama-h<H>-i<I>-l<L>``: a Llama of hidden H,
intermediate I and L layers, heads of 64, four query heads per KV head) it starts:

- ``plain``: plain vLLM, its worker on cores ``0-1`` (two OpenMP threads);
- ``afd-n1``, ``afd-n2``, ``afd-n3``: AFD 1A1F with 1, 2, 3 micro-batches (``micro_batch_min_tokens``
  ``--min-tokens``, 8), the attention worker on core ``0``, the FFN worker on core ``1``;
- ``afd-2a-n2`` (with ``--two-attention``): AFD 2A1F, two micro-batches, ``batched``, both attention
  workers on core ``0``, the FFN worker on core ``1``, requests alternating between the two servers;
- ``afd-n2-min2`` (with ``--sweep``): two micro-batches split from 2 tokens on; after the rounds, batches of
  each ``--sweep`` concurrency run on it and on ``afd-n1`` (where does a split start to pay?).

Every server runs at vLLM's default compilation (``--eager``: ``--enforce-eager`` everywhere); front ends and
engine cores are not pinned. Then ``--rounds`` rounds of ``--requests`` concurrent greedy completions of
``--tokens`` tokens each (``ignore_eos``), the order of the setups rotating every round, each
``SETTLE_S`` after the previous; every round checks that each AFD setup's completions equal plain's.

Reported per setup: tok/s per round and the median, the ratio to ``plain`` and to ``afd-n1``, TPOT as
``--requests`` / median tok/s (the requests of a batch decode side by side for its whole length), CPU seconds
per generated token over the setup's own rounds (all of its processes), and for AFD the mean micro-batches
per step and the FFN time hidden behind attention (``vllm:afd_micro_batches`` / ``vllm:afd_steps`` and
``vllm:afd_ffn_hidden_fraction`` from the attention server's ``/metrics``, over the whole run).

``--trace DIR`` additionally runs ``afd-n1`` and ``afd-n2`` once more on the first model with
``AFD_TRACE_DIR`` set and draws one step of each with ``scripts/render_trace.py`` into ``DIR/step-n1.png``
and ``DIR/step-n2.png`` (the trace files are copied next to them).

    python -m benchmarks.afd_microbatch [--models tiny,heavy,heavy-moe] [--rounds 3] [--two-attention]
        [--eager] [--trace DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from statistics import median

from benchmarks import record
from benchmarks.afd_server_load import HOST, SETTLE_S, Server, load, rotated_rounds
from harness.env import REPO, free_port, vllm_env
from harness.tiny_model import build
from harness.tiny_tokenizer import build_tokenizer

HEAVY = {"hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
         "head_dim": 64}
MODELS = {  # name -> (family, config overrides)
    "tiny": ("llama", {}),
    "heavy": ("llama", {**HEAVY, "intermediate_size": 4096}),
    "balanced": ("llama", {**HEAVY, "intermediate_size": 1024}),
    "heavy-moe": ("qwen3_moe", {**HEAVY, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 1024}),
}
ARCH = {"llama": "AFDLlamaForCausalLM", "qwen3_moe": "AFDQwen3MoeForCausalLM"}
SHAPED = re.compile(r"^llama-h(\d+)-i(\d+)-l(\d+)$")  # e.g. llama-h512-i1024-l16: heads of 64, 4 per KV head


def model_spec(name: str) -> tuple[str, dict[str, int]]:
    """(family, config overrides) of a named model of ``MODELS`` or a shaped Llama ``llama-h<H>-i<I>-l<L>``."""
    if name in MODELS:
        return MODELS[name]
    match = SHAPED.match(name)
    if not match:
        raise SystemExit(f"unknown model {name!r}: one of {sorted(MODELS)} or llama-h<H>-i<I>-l<L>")
    hidden, intermediate, layers = (int(g) for g in match.groups())
    heads = max(1, hidden // 64)
    return "llama", {"hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
                     "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4), "head_dim": 64}
PLAIN_CORES, ATTENTION_CORE, FFN_CORE = "0-1", "0", "1"


class Setup:
    """A plain server, or an AFD deployment (FFN server, then ``ranks`` attention servers)."""

    def __init__(self, label: str, family: str, model: Path, work: Path, env: dict[str, str],
                 args: argparse.Namespace, micro_batches: int = 0, ranks: int = 1,
                 min_tokens: int | None = None, via: Callable[[int], int] | None = None) -> None:
        """``via``: maps the FFN's port to the port the attention servers are given (a relay in front of the FFN,
        ``benchmarks.afd_link_delay``); none: the FFN's own."""
        self.label, self.family, self.model, self.work, self.env, self.args = label, family, model, work, env, args
        self.micro_batches, self.ranks, self.min_tokens, self.via = micro_batches, ranks, min_tokens, via
        self.servers: list[Server] = []
        self.cpu = 0.0  # CPU seconds over this setup's own rounds

    @property
    def afd(self) -> bool:
        return self.micro_batches > 0

    def _server(self, name: str, cores: str, extra: list[str]) -> Server:
        extra = [*extra, "--max-num-seqs", str(self.args.max_num_seqs)]  # the last of a repeated flag counts
        server = Server(f"{self.label}-{name}", self.model, self.work, extra,
                        {**self.env, "VLLM_CPU_OMP_THREADS_BIND": cores}, None, eager=self.args.eager)
        self.servers.append(server)
        return server

    def start(self) -> None:
        """Start the servers, all at once (their start-ups overlap; an attention server's connector retries until the
        FFN server listens), then wait until each answers /health."""
        if not self.afd:
            self._server("plain", PLAIN_CORES, []).wait_healthy()
            return
        extra = {"micro_batches": self.micro_batches}
        if self.min_tokens is not None:
            extra["micro_batch_min_tokens"] = self.min_tokens
        afd = {"host": HOST, "port": free_port(), "num_attention_ranks": self.ranks, "timeout_s": 600,
               "connector_extra_config": extra}
        arch = ["--hf-overrides", json.dumps({"architectures": [ARCH[self.family]]})]
        ffn = self._server("ffn", FFN_CORE, [*arch, "--afd-role", "ffn", "--additional-config",
                                              json.dumps({"afd": afd})])
        if self.via is not None:
            afd["port"] = self.via(afd["port"])
        config = ["--additional-config", json.dumps({"afd": afd})]
        attns = [self._server(f"attn{rank}", ATTENTION_CORE,
                              [*arch, "--afd-role", "attention", "--afd-rank", str(rank), *config])
                 for rank in range(self.ranks)]
        for server in [ffn, *attns]:
            server.wait_healthy()

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers if not s.name.endswith("-ffn")]

    def cpu_seconds(self) -> float:
        return sum(s.cpu_seconds() for s in self.servers)

    def overlap(self) -> tuple[float, float]:
        """(mean micro-batches per step, FFN fraction hidden) of the first attention server, over the run."""
        with urllib.request.urlopen(f"http://{HOST}:{self.ports[0]}/metrics", timeout=10) as r:
            text = r.read().decode()

        def value(name: str) -> float:
            m = re.search(rf'^vllm:afd_{name}\{{[^}}]*role="attention"[^}}]*\}} (\S+)', text, re.M)
            return float(m.group(1)) if m else float("nan")

        return value("micro_batches_total") / value("steps_total"), value("ffn_hidden_fraction")

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()
        self.servers = []


def run_model(name: str, args: argparse.Namespace, trace: Path | None) -> None:
    family, overrides = model_spec(name)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = vllm_env(PYTHONUNBUFFERED="1", VLLM_CACHE_ROOT=str(work / "vllm-cache"))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        model = build_tokenizer(build(work / name, family, overrides=overrides), vocab_size=512)
        setups = [Setup("plain", family, model, work, env, args)]
        setups += [Setup(f"afd-n{n}", family, model, work, env, args, micro_batches=n, min_tokens=args.min_tokens)
                   for n in args.micro_batches]
        if args.two_attention:
            setups.append(Setup("afd-2a-n2", family, model, work, env, args, micro_batches=2, ranks=2,
                                min_tokens=args.min_tokens))
        if args.sweep:
            setups.append(Setup("afd-n2-min2", family, model, work, env, args, micro_batches=2, min_tokens=2))
        overlap: dict[str, tuple[float, float]] = {}
        sweep: dict[int, dict[str, list[float]]] = {}
        try:
            for s in setups:
                s.start()
                load(s.ports, model, 4, 8)  # warm-up (and compile, where vLLM compiles at the first shapes)

            def measure(s: Setup) -> tuple[float, list[str]]:
                before = s.cpu_seconds()
                result = load(s.ports, model, args.requests, args.tokens)
                s.cpu += s.cpu_seconds() - before
                return result

            tps, loadavg = rotated_rounds(setups, args.rounds, measure, lambda s: s.label, lambda _: "plain",
                                          f"{name} ")
            overlap = {s.label: s.overlap() for s in setups if s.afd}
            for requests in args.sweep:
                for r in range(args.rounds):
                    for s in setups if r % 2 else reversed(setups):
                        if s.label in ("afd-n1", "afd-n2-min2"):
                            time.sleep(SETTLE_S)
                            rate, _ = load(s.ports, model, requests, args.tokens)
                            sweep.setdefault(requests, {}).setdefault(s.label, []).append(rate)
        finally:
            for s in setups:
                s.stop()
        report(name, args, setups, tps, loadavg, overlap)
        for requests, rates in sweep.items():
            n1, n2 = median(rates["afd-n1"]), median(rates["afd-n2-min2"])
            print(f"sweep {requests:3d} concurrent (decode steps of {requests} tokens): afd-n1 {n1:6.0f} tok/s, "
                  f"afd-n2 (min 2 tokens) {n2:6.0f} tok/s, x {n2 / n1:.2f}")
        if trace is not None:
            traces(name, family, model, work, env, args, trace)


def traces(name: str, family: str, model: Path, work: Path, env: dict[str, str], args: argparse.Namespace,
           out: Path) -> None:
    """One short run each of afd-n1 and afd-n2 with AFD_TRACE_DIR set; one step of each drawn as a PNG."""
    out.mkdir(parents=True, exist_ok=True)
    for n in (1, 2):
        folder = work / f"trace-n{n}"
        folder.mkdir(mode=0o700)
        s = Setup(f"trace-n{n}", family, model, work, {**env, "AFD_TRACE_DIR": str(folder)}, args, micro_batches=n,
                  min_tokens=args.min_tokens)
        try:
            s.start()
            load(s.ports, model, args.requests, 16)
        finally:
            s.stop()
        png = out / f"step-n{n}.png"
        subprocess.run([sys.executable, str(REPO / "scripts" / "render_trace.py"), str(folder), "--out", str(png),
                        "--title", f"{name} Llama, AFD 1A1F, micro_batches={n}, {args.requests} requests"],
                       check=True)
        for f in folder.glob("afd-trace-*.json"):
            (out / f"n{n}-{f.name}").write_bytes(f.read_bytes())


def report(name: str, args: argparse.Namespace, setups: list[Setup], tps: dict[str, list[float]],
           loadavg: list[float], overlap: dict[str, tuple[float, float]]) -> None:
    family, overrides = model_spec(name)
    print(f"\n== {name}: {family} {overrides or '(hidden 64, 2 layers)'}; OpenAI server, {args.requests} concurrent "
          f"x {args.tokens} tokens, greedy, float32, {'eager' if args.eager else 'default compilation'}; plain on "
          f"cores {PLAIN_CORES}, AFD attention core {ATTENTION_CORE}, FFN core {FFN_CORE}")
    print(f"load average (1 min) after each round: {', '.join(f'{x:.1f}' for x in loadavg)}")
    plain, n1 = median(tps["plain"]), median(tps["afd-n1"])
    for s in setups:
        rates = tps[s.label]
        tokens = args.requests * args.tokens * len(rates)
        line = (f"{s.label:10s} tok/s {', '.join(f'{x:6.0f}' for x in rates)}  median {median(rates):6.0f}  "
                f"x plain {median(rates) / plain:.2f}  x n1 {median(rates) / n1:.2f}  "
                f"TPOT {1000 * args.requests / median(rates):6.2f} ms  CPU/token {1000 * s.cpu / tokens:.2f} ms")
        if s.label in overlap:
            per_step, hidden = overlap[s.label]
            line += f"  micro-batches/step {per_step:.2f}  FFN hidden {hidden:.2f}"
        print(line)
    print("completions equal plain's in every round")


def main() -> None:
    parser = record.parser(__doc__, rounds=3, requests=16, tokens=64)
    parser.add_argument("--models", default="tiny,heavy,heavy-moe")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="vLLM's, on every server")
    parser.add_argument("--min-tokens", type=int, default=8,
                        help="micro_batch_min_tokens of the AFD setups (the default, 32, would leave a 16-request "
                             "decode step unsplit)")
    parser.add_argument("--micro-batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 3],
                        help="the AFD 1A1F setups' micro_batches (1 must be among them)")
    parser.add_argument("--two-attention", action="store_true", help="also AFD 2A1F with two micro-batches")
    parser.add_argument("--eager", action="store_true", help="--enforce-eager on every server")
    parser.add_argument("--trace", type=Path, help="also draw one step at N=1 and N=2 of the first model here")
    parser.add_argument("--sweep", type=lambda v: [int(x) for x in v.split(",")], default=[],
                        help="concurrency levels at which afd-n1 and afd-n2 with micro_batch_min_tokens=2 are "
                             "compared (where a split starts to pay), e.g. 2,4,8,16")
    args = parser.parse_args()
    if 1 not in args.micro_batches:
        parser.error("--micro-batches must include 1 (every ratio is reported against afd-n1)")
    for i, name in enumerate(args.models.split(",")):
        run_model(name, args, args.trace if i == 0 else None)


if __name__ == "__main__":
    main()
