"""AFD behind vLLM's OpenAI server under load, against a plain server, interleaved in one run.

Starts a plain API server and one AFD deployment per schedule in ``--schedules``
(one FFN server, then ``--attention-ranks`` attention servers; ``--baseline DIR``
adds one more running the afd-plugin checkout in DIR, e.g. main's) on a tiny
float32 Llama with a tiny tokenizer, all on 127.0.0.1. Then:

1. Idle CPU: every server sits idle for ``--idle-s`` seconds; the CPU time of
   each server's processes (front end, engine core, worker) over that window,
   as a percentage of one core.
2. Load, ``--rounds`` times, the order of the sides rotating every round:
   ``--requests`` concurrent greedy completions of ``--tokens`` tokens each
   (``ignore_eos``), sent with the ``openai`` client (round-robin over the
   attention servers), each side's batch ``SETTLE_S`` after the previous one
   ended; decode tok/s = completion tokens / wall time of the batch.
   Every round checks AFD's completions equal plain's.
3. Where an AFD exchange's time goes: the roles' ``vllm:afd_exchange_latency_seconds``
   from ``/metrics`` (attention side: send to answer; FFN side: inputs complete to
   outputs ready to send), as means over the load rounds; with ``--timings`` also the
   per-call means of the benchmark-only counters in ``timing_hook/``. And each
   side's CPU time per generated token during its own rounds, per server and
   process (front end, engine core, worker).

``--bind`` sets ``VLLM_CPU_OMP_THREADS_BIND`` for every server (vLLM's default,
``auto``, when not given), ``--ffn-bind`` for the FFN server alone; ``--pin`` runs the plain server and the attention
servers on core 0 and the FFN server on core 1 (taskset), else nothing is pinned.
``--plain-best MASK`` (default ``nobind``) adds a second plain server with that binding, plain tuned on the
same cores; AFD is compared with both. Prints one table; with ``--record`` (``benchmarks.record``) also writes
AFD's ratio to the faster plain server, the lower of the two.

    python -m benchmarks.afd_server_load [--attention-ranks 1] [--schedules batched,pingpong] [--rounds 3]
        [--timings] [--baseline DIR] [--bind MASK] [--ffn-bind MASK] [--pin] [--plain-best MASK] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import median
from typing import Any, TypeVar

from benchmarks import record
from harness.env import REPO, free_port, vllm_env
from harness.tiny_model import build
from harness.tiny_tokenizer import build_tokenizer

Side = TypeVar("Side")

HOST = "127.0.0.1"
START_TIMEOUT_S = 400.0
# vLLM's workers keep busy-polling their input queue for 1 s after the last step (``SpinCondition`` in
# vllm/distributed/device_communicators/shm_broadcast.py); each side waits this long before its batch so that
# it does not share the cores with the previous side's spin.
SETTLE_S = 1.5
SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


class Server:
    """One API server in its own session (so its engine core and worker are found and stopped with it);
    ``eager`` passes ``--enforce-eager`` (else vLLM's default compilation)."""

    def __init__(self, name: str, model: Path, log_dir: Path, extra: list[str], env: dict[str, str],
                 cpus: str | None, eager: bool = True) -> None:
        self.name, self.port = name, free_port()
        args = [*SERVER, "--model", str(model), "--host", HOST, "--port", str(self.port),
                *(["--enforce-eager"] if eager else []), "--max-model-len", "256", "--dtype", "float32", "--seed",
                "0", "--max-num-seqs", "16", "--max-num-batched-tokens", "256", "--kv-cache-memory-bytes",
                str(64 << 20), *extra]
        if cpus:
            args = ["taskset", "-c", cpus, *args]
        self.log = log_dir / f"{name}.log"
        with self.log.open("wb") as fh:
            # cwd outside any checkout: ``python -m`` puts the cwd first on sys.path, ahead of PYTHONPATH, so a
            # cwd of REPO made a --baseline server import this checkout's afd_patches instead of the baseline's
            self.proc = subprocess.Popen(args, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=log_dir,
                                         start_new_session=True)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy in {START_TIMEOUT_S}s:\n{self.log.read_text()[-3000:]}")

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server and every process below it, so far."""
        import psutil

        total = 0.0
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass
        return total

    def cpu_by_process(self) -> dict[str, float]:
        """CPU seconds so far per process kind: ``front`` (the API server), ``EngineCore``, ``Worker``."""
        import psutil

        out: dict[str, float] = {}
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                name = p.name()
                kind = "front" if p.pid == root.pid else next(
                    (k for k in ("EngineCor", "Worker") if k in name), "other")
                t = p.cpu_times()
                out[kind] = out.get(kind, 0.0) + t.user + t.system
        except psutil.Error:
            pass
        return out

    def latency(self) -> tuple[float, float]:
        """(sum of seconds, count) of this server's AFD exchange-latency histogram."""
        with urllib.request.urlopen(f"http://{HOST}:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        total = re.search(r'^vllm:afd_exchange_latency_seconds_sum\{[^}]*\} (\S+)', text, re.M)
        count = re.search(r'^vllm:afd_exchange_latency_seconds_count\{[^}]*\} (\S+)', text, re.M)
        return (float(total.group(1)), float(count.group(1))) if total and count else (0.0, 0.0)

    def stop(self) -> None:
        """SIGTERM the server's session, SIGKILL what is left of it after 30 s; also when the server itself
        already died (killed, say), which leaves its engine processes behind in the session."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self.proc.poll()
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


async def _load(ports: list[int], model: Path, requests: int, tokens: int) -> tuple[float, list[str]]:
    """``requests`` concurrent completions over ``ports``; (completion tokens per second, texts)."""
    from openai import AsyncOpenAI

    clients = [AsyncOpenAI(base_url=f"http://{HOST}:{p}/v1", api_key="none", timeout=600) for p in ports]

    async def one(i: int) -> tuple[int, str]:
        prompt = [(7 * i + j) % 500 + 1 for j in range(8)]
        r = await clients[i % len(clients)].completions.create(
            model=str(model), prompt=prompt, max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True})
        return r.usage.completion_tokens, r.choices[0].text

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(i) for i in range(requests)))
    wall = time.perf_counter() - t0
    for c in clients:
        await c.close()
    return sum(n for n, _ in done) / wall, [text for _, text in done]


def load(ports: list[int], model: Path, requests: int, tokens: int) -> tuple[float, list[str]]:
    return asyncio.run(_load(ports, model, requests, tokens))


def rotated_rounds(sides: Sequence[Side], rounds: int, measure: Callable[[Side], tuple[float, list[str]]],
                   label: Callable[[Side], str], reference: Callable[[str], str],
                   what: str = "") -> tuple[dict[str, list[float]], list[float]]:
    """Measure every side once per round, ``rounds`` times, the order rotated by one side each round and each
    measurement ``SETTLE_S`` after the previous (vLLM workers busy-poll for about a second after their last
    step). ``measure(side)`` returns (tok/s, completions) and does any accounting of its own; after each round
    every side's completions must equal those of ``reference(its label)``, else ``SystemExit`` naming the
    round (prefixed by ``what``). Returns tok/s per label in round order and the 1-minute load average after
    each round."""
    tps: dict[str, list[float]] = {label(s): [] for s in sides}
    loadavg: list[float] = []
    for r in range(rounds):
        texts = {}
        for side in [*sides[r % len(sides):], *sides[:r % len(sides)]]:
            time.sleep(SETTLE_S)
            rate, texts[label(side)] = measure(side)
            tps[label(side)].append(rate)
        loadavg.append(os.getloadavg()[0])
        for name, text in texts.items():
            if text != texts[reference(name)]:
                raise SystemExit(f"{what}round {r}: {name}'s completions differ from {reference(name)}'s")
    return tps, loadavg


def idle_cpu(servers: list[Server], seconds: float) -> list[float]:
    """Percent of one core each server used over ``seconds`` of idleness."""
    before = [s.cpu_seconds() for s in servers]
    time.sleep(seconds)
    return [100 * (s.cpu_seconds() - b) / seconds for s, b in zip(servers, before, strict=True)]


def read_timings(folder: Path) -> dict[str, list[float]]:
    """Sum over processes of the timing hook's counters (name -> [calls, seconds]); {} without ``--timings``."""
    totals: dict[str, list[float]] = {}
    for path in folder.glob("*.json") if folder.is_dir() else []:
        for name, (calls, seconds) in json.loads(path.read_text()).items():
            slot = totals.setdefault(name, [0, 0.0])
            slot[0] += calls
            slot[1] += seconds
    return totals


class Deployment:
    """One AFD deployment: an FFN server, then its attention servers (started by ``start_attention``)."""

    def __init__(self, label: str, schedule: str, ranks: int, model: Path, work: Path, env: dict[str, str],
                 args: argparse.Namespace) -> None:
        self.label, self.model, self.work, self.env, self.args = label, model, work, env, args
        self.afd = {"port": free_port(), "host": HOST, "num_attention_ranks": ranks, "timeout_s": 300,
                    "connector_extra_config": {"schedule": schedule}}
        ffn_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": args.ffn_bind} if args.ffn_bind else env
        self.ffn = Server(f"{label}-ffn", model, work, [*ARCH, "--afd-role", "ffn", "--additional-config",
                                                        json.dumps({"afd": self.afd})],
                          ffn_env, "1" if args.pin else None)
        self.attns: list[Server] = []

    def start_attention(self) -> None:
        for r in range(self.afd["num_attention_ranks"]):
            cfg = {"afd": {**self.afd, "rank": r}}
            self.attns.append(Server(f"{self.label}-attention{r}", self.model, self.work,
                                     [*ARCH, "--afd-role", "attention", "--additional-config", json.dumps(cfg)],
                                     self.env, "0" if self.args.pin else None))

    @property
    def servers(self) -> list[Server]:
        return [self.ffn, *self.attns]


ARCH = ["--hf-overrides", json.dumps({"architectures": ["AFDLlamaForCausalLM"]})]


def bring_up(servers: list[Server], deployments: list[Deployment]) -> None:
    """Wait for every started server (plain and FFN), then start each deployment's attention servers
    (added to ``servers``) and wait for them."""
    for s in list(servers):
        s.wait_healthy()
    for dep in deployments:
        dep.start_attention()
        servers += dep.attns
    for dep in deployments:
        for a in dep.attns:
            a.wait_healthy()


def main() -> None:
    parser = record.parser(__doc__, recorded=True, rounds=3, requests=16, tokens=64,
                           baseline="another afd-plugin checkout: one more deployment (first schedule) runs it")
    parser.add_argument("--attention-ranks", type=int, default=1)
    parser.add_argument("--schedules", default="batched", help="comma-separated: one deployment each")
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument("--bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND for every server")
    parser.add_argument("--ffn-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND for the FFN servers only")
    parser.add_argument("--pin", action="store_true", help="plain+attention on core 0, FFN on core 1")
    parser.add_argument("--timings", action="store_true", help="per-call timing counters (timing_hook/)")
    parser.add_argument("--plain-best", default="nobind",
                        help="VLLM_CPU_OMP_THREADS_BIND of a second plain server (plain tuned on the same cores); "
                             "'' for none")
    args = parser.parse_args()
    env = vllm_env(PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)  # this checkout
    if args.bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.bind
    schedules = args.schedules.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        hook = [str(Path(__file__).resolve().parent / "timing_hook")] if args.timings else []
        model = build_tokenizer(build(work / "tiny-llama", "llama"), vocab_size=512)
        servers: list[Server] = []
        deployments: list[Deployment] = []
        try:
            plain = Server("plain", model, work, [], env, "0" if args.pin else None)
            servers.append(plain)
            plains = [plain]
            if args.plain_best:
                best_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": args.plain_best}
                plains.append(Server("plain-best", model, work, [], best_env, "0" if args.pin else None))
                servers.append(plains[-1])
            variants: list[tuple[str, Path | None]] = [(s, None) for s in schedules]
            if args.baseline:
                variants.append((schedules[0], Path(args.baseline).resolve()))
            for schedule, tree in variants:
                label = f"{'base-' if tree else ''}{schedule}"
                timings = work / f"timings-{label}"
                extra: dict[str, str] = {}
                if args.timings:
                    timings.mkdir()
                    extra["AFD_TIMINGS_DIR"] = str(timings)
                path = [*hook, *([str(tree)] if tree else []), env.get("PYTHONPATH", "")]
                dep = Deployment(label, schedule, args.attention_ranks, model, work,
                                 {**env, **extra, "PYTHONPATH": os.pathsep.join(p for p in path if p)}, args)
                deployments.append(dep)
                servers.append(dep.ffn)
            bring_up(servers, deployments)
            targets = {p.name: [p.port] for p in plains}
            targets.update({d.label: [a.port for a in d.attns] for d in deployments})
            for ports in targets.values():
                load(ports, model, 4, 8)  # warm-up
            time.sleep(3.0)
            idle = idle_cpu(servers, args.idle_s)
            before = {d.label: (read_timings(work / f"timings-{d.label}"), d.attns[0].latency(), d.ffn.latency())
                      for d in deployments}
            groups = {**{p.name: [p] for p in plains}, **{d.label: d.servers for d in deployments}}
            cpu: dict[str, float] = {}

            def measure(label: str) -> tuple[float, list[str]]:
                cpu0 = [s.cpu_by_process() for s in groups[label]]
                result = load(targets[label], model, args.requests, args.tokens)
                for s, c0 in zip(groups[label], cpu0, strict=True):
                    for kind, c in s.cpu_by_process().items():
                        key = f"{label} {s.name.removeprefix(label + '-')} {kind}"
                        cpu[key] = cpu.get(key, 0.0) + c - c0.get(kind, 0.0)
                return result

            tps, loadavg = rotated_rounds(list(targets), args.rounds, measure, str, lambda _: "plain")
            time.sleep(2.5)  # metric snapshots are written every 0.5 s, timing counters every 2 s
            after = {d.label: (read_timings(work / f"timings-{d.label}"), d.attns[0].latency(), d.ffn.latency())
                     for d in deployments}
        finally:
            for s in reversed(servers):
                s.stop()
    report(args, tps, loadavg, before, after, servers, idle)
    if args.record:
        record_ratio(args, tps, deployments[0].label)
    tokens = args.rounds * args.requests * args.tokens
    print("CPU per generated token (ms) during each side's own rounds, per server and process:")
    for label in tps:
        parts = {k: c for k, c in cpu.items() if k.split(" ", 1)[0] == label}
        print(f"  {label}: total {1e3 * sum(parts.values()) / tokens:.2f}; "
              + ", ".join(f"{k.split(' ', 1)[1]} {1e3 * c / tokens:.2f}" for k, c in sorted(parts.items())))


def per_round_ratios(tps: dict[str, list[float]], side: str, plain: str) -> list[float]:
    """``side``'s tok/s over ``plain``'s, round by round."""
    return [a / p for a, p in zip(tps[side], tps[plain], strict=True)]


def record_ratio(args: argparse.Namespace, tps: dict[str, list[float]], label: str) -> None:
    """Record AFD's tok/s over plain's: the median of the per-round ratios against each plain server, the
    lower one published (plain as users run it, and plain tuned, whichever is faster)."""
    ratios = {plain: median(per_round_ratios(tps, label, plain)) for plain in tps if plain.startswith("plain")}
    lower = min(ratios, key=ratios.__getitem__)
    against = ", ".join(f"{p} ({'bind ' + (args.plain_best if p == 'plain-best' else args.bind or 'auto')}) "
                        f"{r:.2f}" for p, r in ratios.items())
    record.write("afd_server_load", [
        record.Figure("afd_over_plain", f"AFD {args.attention_ranks}A1F / plain vLLM, OpenAI servers, "
                      f"{args.requests} concurrent × {args.tokens} tokens, tiny Llama, the same cores", ratios[lower],
                      "×", 2, f"tokens/s, median of {args.rounds} rotated rounds, the lower of: {against}", readme=1),
        *(record.Figure(f"{side}_tokens_per_s", f"{side}: decode tokens/s", median(rates), "tok/s", 0,
                        f"per round {min(rates):.0f}–{max(rates):.0f}") for side, rates in tps.items()),
    ])


def report(args: argparse.Namespace, tps: dict[str, list[float]], loadavg: list[float], before: dict[str, Any],
           after: dict[str, Any], servers: list[Server], idle: list[float]) -> None:
    """Print the figures (see the module docstring)."""
    print(f"tiny Llama, OpenAI server, {args.requests} concurrent x {args.tokens} tokens, greedy, float32; "
          f"AFD {args.attention_ranks}A1F; bind={args.bind or 'auto (default)'}, "
          f"FFN bind={args.ffn_bind or args.bind or 'auto (default)'}, "
          f"pin={'plain+attention core 0, FFN core 1' if args.pin else 'none'}; rounds rotate the order, "
          f"each side starts {SETTLE_S} s after the last")
    print(f"load average (1 min) after each round: {', '.join(f'{x:.1f}' for x in loadavg)}")
    for label, rates in tps.items():
        line = f"{label:16s} tok/s per round: {', '.join(f'{x:6.0f}' for x in rates)}  median {median(rates):6.0f}"
        if not label.startswith("plain"):
            for plain in (p for p in tps if p.startswith("plain")):
                ratios = per_round_ratios(tps, label, plain)
                line += f"; / {plain}: {', '.join(f'{x:.2f}' for x in ratios)}, median {median(ratios):.2f}"
        print(line)
    print("completions equal plain's in every round")
    for label, (t0, (a0, an0), (f0, fn0)) in before.items():
        t1, (a1, an1), (f1, fn1) = after[label]
        if an1 > an0:
            print(f"{label}: attention rank 0 {an1 - an0:.0f} exchanges, mean {1e3 * (a1 - a0) / (an1 - an0):.2f} ms "
                  f"send-to-answer; FFN {fn1 - fn0:.0f} calls, mean {1e3 * (f1 - f0) / max(fn1 - fn0, 1):.2f} ms "
                  "inputs-to-outputs")
        for name, (calls, seconds) in sorted(t1.items()):
            c0, s0 = t0.get(name, [0, 0.0])
            if calls > c0:
                print(f"  {name:40s} {calls - c0:7.0f} calls, mean {1e3 * (seconds - s0) / (calls - c0):6.2f} ms")
    print(f"idle CPU over {args.idle_s:.0f} s, % of one core: "
          + ", ".join(f"{s.name} {x:.1f}" for s, x in zip(servers, idle, strict=True)))
    for label in before:
        print(f"  {label} deployment in all: "
              f"{sum(x for s, x in zip(servers, idle, strict=True) if s.name.startswith(label + '-')):.1f}")


if __name__ == "__main__":
    main()
