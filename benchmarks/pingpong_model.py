"""The ping-pong cost model of an AFD decode step with N micro-batches over a link of one-way delay D.

Inputs (``Calibration``), measured from AFD's own trace (``afd_patches.trace``) of a short run at D = 0, per batch
size b (tokens in one micro-batch or one unsplit step):

- ``attention_s``: the attention core's time per layer and micro-batch (the trace's ``attention`` + ``send``);
- ``ffn_s``: the FFN core's time per layer and micro-batch (``ffn`` + its ``send``);
- ``latency_s``: what the attention side waits beyond the FFN's work at N = 1 (``wait`` − ``ffn_s``): the two
  trips through the link, the wake-ups and the FFN's receive;
- ``overhead_s``: the time between a step's last answer and the next step's first layer (logits, sampling,
  vLLM's scheduler and output processing), per step;
- ``handover_s``, ``split_s``: what a split step costs beyond that (per micro-batch and layer: the baton's thread
  switch; per step: vLLM's slicing), from a traced N = 2 run against the N = 1 figures at the same sizes.

The step (``step_seconds``): the attention core runs the micro-batches' layers in strict turn (the baton: micro-batch
k computes layer l once it has the baton and its answer to layer l − 1); the FFN core serves them in the order they
arrive; each message takes D + latency/2 each way. In steady state a layer's cycle is therefore

    max(Σ_k attention_k, Σ_k ffn_k, attention + latency + 2·D + ffn)

(attention-bound, FFN-bound, or bound by one micro-batch's round trip), plus the pipeline's fill and drain; the
function walks the schedule event by event instead of using the closed form, so fill, drain and uneven micro-batches
(16 tokens in 3 are 6, 5, 5) come out exactly as the model has them. Throughput is b / step.

Limits: the model knows two cores and a link, nothing else; the engines' other processes (API server, engine core)
share those cores on this machine and show up only as far as the calibration run saw them. Costs between measured
sizes are interpolated linearly, beyond them extrapolated from the nearest two.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections import defaultdict
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from statistics import median
from typing import Any

from afd_patches import trace
from benchmarks import record


@dataclass(frozen=True)
class Costs:
    """Seconds per layer and micro-batch (``attention_s``, ``ffn_s``, ``latency_s``) and per step
    (``overhead_s``) at one batch size."""

    attention_s: float
    ffn_s: float
    latency_s: float
    overhead_s: float


@dataclass(frozen=True)
class Calibration:
    """The model's inputs: ``layers`` exchanges per step, ``points`` the costs by batch size, and the split's own
    costs."""

    layers: int
    points: dict[int, Costs]
    handover_s: float = 0.0
    split_s: float = 0.0

    def at(self, tokens: float) -> Costs:
        """The costs at ``tokens`` (linear between the measured sizes, extrapolated beyond them)."""
        sizes = sorted(self.points)
        if len(sizes) == 1:
            return self.points[sizes[0]]
        i = min(max(bisect_left(sizes, tokens), 1), len(sizes) - 1)
        lo, hi = sizes[i - 1], sizes[i]
        w = (tokens - lo) / (hi - lo)
        a, b = self.points[lo], self.points[hi]
        return Costs(*(max(0.0, getattr(a, f.name) + w * (getattr(b, f.name) - getattr(a, f.name)))
                       for f in fields(Costs)))

    def as_json(self) -> dict[str, Any]:
        return {"layers": self.layers, "handover_s": self.handover_s, "split_s": self.split_s,
                "points": {str(b): asdict(c) for b, c in sorted(self.points.items())}}


def split(tokens: int, n: int) -> list[int]:
    """``tokens`` cut into ``n`` near-equal micro-batches (as vLLM slices a decode step), none empty."""
    n = max(1, min(n, tokens))
    return [tokens // n + (1 if k < tokens % n else 0) for k in range(n)]


def step_seconds(cal: Calibration, tokens: int, n: int, delay_s: float) -> float:
    """One decode step of ``tokens`` tokens in ``n`` micro-batches over a link of one-way ``delay_s``."""
    sizes = split(tokens, n)
    costs = [cal.at(size) for size in sizes]
    extra = cal.handover_s if len(sizes) > 1 else 0.0
    attention_free = ffn_free = 0.0
    answered = [0.0] * len(sizes)
    for _ in range(cal.layers):
        for k, c in enumerate(costs):
            sent = max(attention_free, answered[k]) + c.attention_s + extra
            attention_free = sent
            ffn_done = max(ffn_free, sent + delay_s + c.latency_s / 2) + c.ffn_s
            ffn_free = ffn_done
            answered[k] = ffn_done + delay_s + c.latency_s / 2
    whole = cal.at(tokens)
    return max(answered) + whole.overhead_s + (cal.split_s if len(sizes) > 1 else 0.0)


def throughput(cal: Calibration, tokens: int, n: int, delay_s: float) -> float:
    """Decode tokens per second: ``tokens`` requests, one token each per step."""
    return tokens / step_seconds(cal, tokens, n, delay_s)


def best_n(cal: Calibration, tokens: int, delay_s: float, choices: tuple[int, ...] = (1, 2, 3, 4)) -> int:
    """The micro-batch count the model expects to be fastest."""
    return max(choices, key=lambda n: throughput(cal, tokens, n, delay_s))


# ---------------------------------------------------------------------------------------------- from a trace
@dataclass
class _Step:
    micro_batches: dict[int, int]  # micro-batch -> its tokens
    attention: list[float]
    ffn: list[float]
    wait: list[float]
    begin: float = float("inf")
    end: float = 0.0


def steps(events: list[dict[str, Any]]) -> dict[int, _Step]:
    """The traced steps of one attention rank and its FFN, by step number (zero-token idle steps left out)."""
    out: dict[int, _Step] = defaultdict(lambda: _Step({}, [], [], []))
    for e in events:
        a, seconds = e["args"], e["dur"] / 1e6
        s = out[a["step"]]
        if e["tid"] == "ffn":
            if e["name"] == "ffn":
                s.ffn.append(seconds)
                s.micro_batches[a["microbatch"]] = a["tokens"]
            elif s.ffn:  # its send, right after it in the file
                s.ffn[-1] += seconds
            continue
        if e["name"] == "attention":
            s.attention.append(seconds)
            s.begin = min(s.begin, e["ts"] / 1e6)
        elif e["name"] == "send":
            s.attention[-1] += seconds
        elif e["name"] == "wait":
            s.wait.append(seconds)
            s.end = max(s.end, (e["ts"] + e["dur"]) / 1e6)
    return {n: s for n, s in out.items() if s.micro_batches and all(s.micro_batches.values())}


def measure(events: list[dict[str, Any]]) -> dict[tuple[int, int], Costs]:
    """Median costs by (micro-batches, tokens per step) over the steps of that shape (decode steps of equal
    micro-batches; a step's overhead is the gap to the next step when that one has the same shape)."""
    traced = steps(events)
    shape = {n: (len(s.micro_batches), sum(s.micro_batches.values())) for n, s in traced.items()}
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for n in traced:
        groups[shape[n]].append(n)
    out = {}
    for key, numbers in groups.items():
        if len(numbers) < 5:
            continue
        chosen = [traced[n] for n in numbers]
        gaps = [traced[n + 1].begin - traced[n].end for n in numbers if shape.get(n + 1) == key]
        attention = median(x for s in chosen for x in s.attention)
        ffn = median(x for s in chosen for x in s.ffn)
        latency = median(x for s in chosen for x in s.wait) - ffn if key[0] == 1 else 0.0
        out[key] = Costs(attention, ffn, max(latency, 0.0), median(gaps) if gaps else 0.0)
    return out


def calibrate(events_n1: list[dict[str, Any]], events_n2: list[dict[str, Any]]) -> Calibration:
    """The model's inputs from a traced N = 1 run (several batch sizes) and a traced N = 2 run (the split's own
    costs, against N = 1 at the same micro-batch and step sizes); the exchanges per step are the layers traced."""
    layers = len({e["args"]["layer"] for e in events_n1 if e["tid"] != "ffn"})
    unsplit = {tokens: c for (n, tokens), c in measure(events_n1).items() if n == 1}
    if len(unsplit) < 2:
        raise ValueError(f"the N = 1 calibration trace holds {len(unsplit)} batch size(s) with 5 steps; 2 needed")
    base = Calibration(layers, unsplit)
    handovers, splits = [], []
    for (n, tokens), c in measure(events_n2).items():
        if n == 2:
            handovers.append(c.attention_s - base.at(tokens / 2).attention_s)
            splits.append(c.overhead_s - base.at(tokens).overhead_s)
    return Calibration(layers, unsplit, max(median(handovers), 0.0) if handovers else 0.0,
                       max(median(splits), 0.0) if splits else 0.0)


def main() -> None:
    parser = record.parser("Which micro_batches suits your link: the ping-pong model fitted to "
                           "two AFD traces of your own deployment (AFD_TRACE_DIR)")
    parser.add_argument("trace_n1", type=Path, help="a trace folder of micro_batches 1, at two or more concurrencies")
    parser.add_argument("trace_n2", type=Path, help="a trace folder of micro_batches 2 (the split's own costs)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per decode step (concurrent requests)")
    parser.add_argument("--delay-ms", type=float, action="append",
                        help="one-way delay your link adds beyond the one traced (repeatable; default 0, 0.5, 1, 2)")
    args = parser.parse_args()
    cal = calibrate(trace.read(args.trace_n1), trace.read(args.trace_n2))
    print(json.dumps(cal.as_json(), indent=1))
    for delay_ms in args.delay_ms or [0.0, 0.5, 1.0, 2.0]:
        rates = {n: throughput(cal, args.tokens, n, delay_ms / 1000) for n in (1, 2, 3, 4)}
        print(f"D = {delay_ms:g} ms, {args.tokens} tokens per step: " + ", ".join(
            f"N={n} {rate:.0f} tok/s" for n, rate in rates.items()) + f"; best N = {max(rates, key=rates.__getitem__)}")


if __name__ == "__main__":
    main()
