"""AFD under a fault schedule, behind vLLM's OpenAI server, under load: what is lost and how long until it serves.

Per family in ``--families`` (``llama``: 1A1F tiny Llama; ``qwen3_moe``: 2A1F tiny Qwen3-MoE, both float32, built by
``harness.tiny_model``): one deployment (``benchmarks.chaos_deploy``: every engine in its own network namespace, the
FFN reached by name), ``--streams`` concurrent greedy streams (``benchmarks.chaos_load``, the ``openai`` client)
over its attention servers, each answer compared token for token with plain offline vLLM's for the same prompt
(computed once per checkpoint and prompt set: ``harness.plain_cache``), and ``/metrics`` sampled every 0.5 s. Then
the schedule (``benchmarks.chaos_faults``): a quiet ``steady`` phase, each fault alone, then ``mixed``. A phase is
``PRE_S`` of load, the fault, the wait for every attention server's first exact answer after the fault ended (at
most ``RECOVERY_CAP_S``), ``POST_S`` more; a request belongs to the phase it started in.

One table per deployment; per phase: requests ``exact``, ``named`` (an error naming AFD, a rank or the FFN's
address), ``cut`` (refused or reset by a server being killed or restarted), and the goals: ``wrong``, ``lost``,
``hung``, ``unnamed`` 0; ``recovery`` (fault end to every attention server's first exact answer) at most
2 x ``timeout_s``; ``gauge`` (the longest stretch ``vllm:afd_group_up`` contradicted the requests) at most
``timeout_s``. ``stale`` is how long the metrics snapshot was marked stale (by design during ``disk``); ``fault``
how long the fault lasted (``kill_ffn``: until the new FFN server was healthy); ``longest`` the longest request
that ended exact (with ``--hold-s``, a step held through the fault shows here).

Needs root (namespaces, tmpfs, ptrace) and the vLLM CPU build; everything it makes (namespaces, links,
/etc/netns entries, the tmpfs, processes) is removed at exit, Ctrl-C and SIGTERM included.

    python -m benchmarks.chaos [--families llama,qwen3_moe] [--faults a,b] [--timeout-s 2] [--hold-s S] [--logs DIR]
        [--record]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks import record
from benchmarks.chaos_deploy import AFD_PORT, NAME, Deployment
from benchmarks.chaos_faults import FAULTS
from benchmarks.chaos_load import Load, Sampler, gauge_judgement
from benchmarks.netns import Lab

PRE_S, POST_S, RECOVERY_CAP_S = 2.0, 2.0, 60.0
BAD = ("wrong", "lost", "hung", "unnamed")
KINDS = ("exact", "named", "cut", *BAD)
PROMPTS = [[(37 * i + 11 * j) % 500 + 1 for j in range(6)] for i in range(16)]
RANKS = {"llama": 1, "qwen3_moe": 2}


@dataclass
class Phase:
    name: str
    start: float
    fault_end: float
    recovery_s: float | None
    end: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)
    gauge_wrong_s: float = 0.0
    stale_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    fault_error: str = ""  # the fault could not be made (then the phase misses its goals)
    fault_s: float = 0.0  # from the fault's start to its end (kill_ffn: the FFN killed, restarted and healthy)
    longest_s: float = 0.0  # the longest request that ended exact (a held step's wait shows here)


def model(family: str, root: Path) -> Path:
    from harness.tiny_model import build
    from harness.tiny_tokenizer import build_tokenizer

    return build_tokenizer(build(root / f"tiny-{family}", family), vocab_size=512)


def plain_tokens(checkpoint: Path, prompts: list[list[int]], max_tokens: int, work: Path) -> list[list[int]]:
    """Plain offline vLLM's greedy tokens per prompt, from ``harness.plain_cache`` when stored there."""
    import os

    from harness import plain_cache
    from harness.engine import run_engines

    os.environ[plain_cache.ENV] = "1"
    spec = {"name": "plain", "mode": "plain", "model": str(checkpoint), "prompts": prompts, "max_tokens": max_tokens,
            "logprobs": 1, "multiprocessing": True, "env": {}}
    (result,) = run_engines([spec], work)
    return result["tokens"]  # type: ignore[no-any-return]


def first_exact_after(load: Load, servers: list[str], since: float, cap_s: float) -> float | None:
    """Seconds from ``since`` until every server in ``servers`` answered one request exactly after it (None: not
    within ``cap_s``)."""
    deadline = since + cap_s
    while True:
        firsts = [min((o.end for o in list(load.outcomes) if o.server == s and o.kind == "exact" and o.end > since),
                      default=None) for s in servers]
        if all(f is not None for f in firsts):
            return max(f for f in firsts if f is not None) - since
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


def run_schedule(d: Deployment, load: Load, faults: list[str]) -> list[Phase]:
    """``steady`` then ``faults`` in order on a running deployment under ``load`` (see the module docstring). A server
    found dead after a phase is noted there and started again."""
    phases: list[Phase] = []
    for name in ["steady", *faults]:
        start = time.monotonic()
        time.sleep(PRE_S)
        error, fault_start = "", time.monotonic()
        try:
            fault_end = FAULTS[name](d) if name != "steady" else time.monotonic()
        except Exception as e:  # noqa: BLE001 -- the fault could not be made: noted, the schedule goes on
            error, fault_end = f"the fault failed: {type(e).__name__}: {e}", time.monotonic()
        phase = Phase(name, start, fault_end, first_exact_after(load, d.attention, fault_end, RECOVERY_CAP_S))
        phase.fault_error, phase.fault_s = error, fault_end - fault_start
        time.sleep(POST_S)
        for label, server in d.servers.items():
            if server.proc.poll() is not None:
                phase.notes.append(f"{label} exited {server.proc.returncode}: {server.tail(600)}")
                try:
                    d.restart(label)
                except RuntimeError as e:
                    phase.notes.append(f"{label} did not start again: {str(e)[-600:]}")
        phase.end = time.monotonic()
        phases.append(phase)
    return phases


def schedule_under_load(d: Deployment, prompts: list[list[int]], expected: list[list[int]], max_tokens: int,
                        streams: int, hang_s: float, faults: list[str]) -> tuple[list[Phase], bool]:
    """``run_schedule`` under ``streams`` streams and the metrics sampler, judged (``judge``); the phases, and
    whether every request had ended ``hang_s + 30`` s after the load stopped."""
    names = ("AFD", f"{NAME}:{AFD_PORT}", "attention rank", "FFN rank")
    load = Load(d.urls(), str(d.model), prompts, expected, max_tokens, streams, hang_s, lambda: set(d.down), names)
    sampler = Sampler(d.urls())
    load.start()
    sampler.start()
    try:
        phases = run_schedule(d, load, faults)
    finally:
        settled = load.stop(hang_s + 30)
        sampler.stop()
    judge(phases, load, sampler)
    return phases, settled


def judge(phases: list[Phase], load: Load, sampler: Sampler) -> None:
    """Fill each phase's counts and gauge figures from the finished load and samples."""
    for i, p in enumerate(phases):
        until = phases[i + 1].start if i + 1 < len(phases) else float("inf")
        mine = [o for o in load.outcomes if p.start <= o.start < until]
        p.counts = Counter(o.kind for o in mine)
        p.longest_s = max((o.end - o.start for o in mine if o.kind == "exact"), default=0.0)
        bad = sorted((o for o in mine if o.kind in BAD), key=lambda o: o.end)
        p.notes += [f"{o.kind} at +{o.end - p.start:.1f}s (fault ended +{p.fault_end - p.start:.1f}s), {o.server}: "
                    f"{o.detail}" for o in bad[:3]]
        p.gauge_wrong_s, p.stale_s = gauge_judgement(sampler.samples, load.outcomes, p.start, p.end)


def met(p: Phase, timeout_s: float) -> bool:
    recovered = p.recovery_s is not None and p.recovery_s <= 2 * timeout_s
    return recovered and not any(p.counts[k] for k in BAD) and p.gauge_wrong_s <= timeout_s and not p.fault_error


def table(title: str, phases: list[Phase], timeout_s: float) -> str:
    head = (f"{'phase':15s}" + "".join(f"{k:>8s}" for k in KINDS)
            + f"{'recovery':>10s}{'gauge':>7s}{'stale':>7s}{'fault':>7s}{'longest':>8s}  goals")
    lines = [title, head]
    for p in phases:
        rec = "never" if p.recovery_s is None else f"{p.recovery_s:.1f}s"
        verdict = "met" if met(p, timeout_s) else "MISSED"
        lines.append(f"{p.name:15s}" + "".join(f"{p.counts[k]:8d}" for k in KINDS)
                     + f"{rec:>10s}{p.gauge_wrong_s:6.1f}s{p.stale_s:6.1f}s{p.fault_s:6.1f}s{p.longest_s:7.1f}s"
                     + f"  {verdict}")
    lines.append(f"goals: wrong, lost, hung, unnamed 0; recovery <= {2 * timeout_s:g}s; gauge <= {timeout_s:g}s")
    for p in phases:
        lines += [f"  {p.name}: {n}" for n in ([p.fault_error] if p.fault_error else []) + p.notes]
    return "\n".join(lines)


def figures(family: str, phases: list[Phase], timeout_s: float, hold_s: float | None = None,
            streams: int = 16) -> list[record.Figure]:
    """Per phase its recovery (the counts in the detail); per deployment the requests that broke a goal, and in a
    run with ``--hold-s`` those that failed at all."""
    out = []
    for p in phases:
        detail = ", ".join(f"{k} {p.counts[k]}" for k in KINDS) + (
            f"; gauge wrong {p.gauge_wrong_s:.1f}s; fault {p.fault_s:.1f}s; longest exact request "
            f"{p.longest_s:.1f}s; " + ("met" if met(p, timeout_s) else "MISSED"))
        out.append(record.Figure(f"{family}_{p.name}_recovery_s", f"{family} {RANKS[family]}A1F, {p.name}: fault end "
                                 f"to every attention server's first exact answer (timeout_s {timeout_s:g})",
                                 RECOVERY_CAP_S if p.recovery_s is None else p.recovery_s, "s", 1, detail))
    out.append(record.Figure(f"{family}_bad", f"{family} {RANKS[family]}A1F, whole schedule: requests wrong, lost, "
                             "hung or failed without naming the cause", sum(p.counts[k] for p in phases for k in BAD),
                             "requests", 0, f"of {sum(sum(p.counts.values()) for p in phases)}"))
    if hold_s is not None:  # a hold run: did any client see the faults at all?
        faulted = [p for p in phases if p.name != "steady"]
        failed = sum(p.counts[k] for p in faulted for k in KINDS if k != "exact")
        restarts = ", ".join(f"{p.name} {p.fault_s:.0f}s" for p in faulted)
        out.append(record.Figure(
            f"{family}_held_failed", f"{family} {RANKS[family]}A1F, {streams} streams through {restarts} (hold_s "
            f"{hold_s:g}): requests that failed", failed, "requests", 0,
            f"of {sum(sum(p.counts.values()) for p in faulted)}, every other exact; longest exact request "
            f"{max(p.longest_s for p in faulted):.1f}s", readme=5 if family == "llama" else None))
    return out


def run_family(lab: Lab, family: str, args: argparse.Namespace, work: Path,
               cleanup: list[Any]) -> tuple[str, list[record.Figure]]:
    checkpoint = model(family, work)
    expected = plain_tokens(checkpoint, PROMPTS, args.max_tokens, work)
    d = Deployment(lab, family, checkpoint, RANKS[family], args.timeout_s, work, args.hold_s)
    cleanup.append(d.stop_all)
    up_s = d.start()
    phases, settled = schedule_under_load(d, PROMPTS, expected, args.max_tokens, args.streams, args.hang_s,
                                          args.faults)
    hold = "" if args.hold_s is None else f", hold_s {args.hold_s:g}"
    title = (f"{family} {RANKS[family]}A1F, {args.streams} streams x {args.max_tokens} tokens, timeout_s "
             f"{args.timeout_s:g}{hold}, up in {up_s:.0f}s{'' if settled else '; requests still open at the end'}")
    d.stop_all()
    return table(title, phases, args.timeout_s), figures(family, phases, args.timeout_s, args.hold_s, args.streams)


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    parser = record.parser(__doc__, recorded=True)
    parser.add_argument("--families", default="llama,qwen3_moe")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of: {', '.join(FAULTS)}")
    parser.add_argument("--timeout-s", type=float, default=2.0)
    parser.add_argument("--hold-s", type=float, default=None,
                        help="the attention servers' hold_s (default: the config's, 3 x timeout_s)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--hang-s", type=float, default=60.0, help="no chunk for this long: the request hung")
    parser.add_argument("--logs", type=Path, default=None, help="copy the servers' logs here")
    args = parser.parse_args()
    args.faults = [f for f in args.faults.split(",") if f]
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)
    tables, figs = [], []
    cleanup: list[Any] = []
    work = Path(tempfile.mkdtemp(prefix="afd-chaos-"))
    try:
        for family in args.families.split(","):
            lab = Lab()
            cleanup.append(lab.close)
            text, f = run_family(lab.open(), family, args, work, cleanup)
            lab.close()
            print(text, flush=True)
            tables.append(text)
            figs += f
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # cleanup runs to its end
        for step in reversed(cleanup):
            with contextlib.suppress(Exception):
                step()
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            for log in work.glob("*.log"):
                shutil.copy(log, args.logs / log.name)
        shutil.rmtree(work, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.record:
        record.write("chaos", figs, name="chaos" if args.hold_s is None else "chaos_hold")  # a hold run: its own file


if __name__ == "__main__":
    main()
