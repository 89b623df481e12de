"""How much link delay AFD's micro-batches hide: decode throughput over a link of one-way delay D, N = 1..4.

For each model of ``--models`` (``balanced``: the micro-batch benchmark's Llama, hidden 1024, intermediate 1024, 4
layers; ``heavy-moe``: its Qwen3-MoE, 8 experts of intermediate 1024, top-2; any name ``benchmarks.afd_microbatch``
takes), behind vLLM's OpenAI server, float32, greedy:

1. plain vLLM (cores 0-1) answers the prompts once at each concurrency: the reference texts.
2. For each N of ``--micro-batches``: one AFD 1A1F deployment (attention worker on core 0, FFN worker on core 1,
   ``micro_batch_min_tokens`` 4) whose attention server reaches the FFN through a delay relay
   (``harness.delay_link``, its own process). For ``--rounds`` rounds, in an order rotated every round, the relay
   is set to each D of ``--delays`` and ``--requests`` concurrent completions of ``--tokens`` tokens run (and
   ``--wide`` of them at ``--wide-delay``); every completion must equal plain's. The engines start once per model
   and N; D changes under them.
3. With ``--predict``: a calibration (``benchmarks.pingpong_model``): AFD with ``AFD_TRACE_DIR`` set, through the
   relay at D = 0, N = 1 at 4, 8, 16, 32 and 64 concurrent requests and N = 2 at 16 and 64; the model fitted to
   that trace predicts every cell, printed beside the measurement, and names the best N per D.

Also measured first: the relay itself (round trips of 64 bytes through it to an echo server, against the same
without it): what it costs at D = 0 and the delay it really adds at each D. Reported: tok/s (median over rounds) and
TPOT (``--requests`` / tok/s) per cell, the ratio to N = 1 at D = 0, and with ``--predict`` the model's figure and its
error. ``--plot PNG`` draws throughput against D, a line per N, per model; ``--record`` writes
benchmarks/results/afd_link_delay.json.

    python -m benchmarks.afd_link_delay [--models balanced,heavy-moe] [--predict] [--plot out.png] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from afd_patches import trace
from benchmarks import pingpong_model, record
from benchmarks.afd_microbatch import Setup, model_spec
from benchmarks.afd_server_load import HOST, SETTLE_S, load
from harness.delay_link import RelayProcess, relay_cost
from harness.env import REPO, vllm_env
from harness.tiny_model import build
from harness.tiny_tokenizer import build_tokenizer

MIN_TOKENS = 4  # micro_batch_min_tokens: a 16-request decode step splits up to 4 ways
CALIBRATION = {1: (4, 8, 16, 32, 64), 2: (16, 64)}  # N -> concurrencies traced
CALIBRATION_TOKENS = 32


@dataclass
class Cell:
    """One (model, N, D, requests) cell: tok/s per round."""

    rates: list[float] = field(default_factory=list)

    @property
    def tps(self) -> float:
        return median(self.rates)


@dataclass
class ModelRun:
    """One model's grid: its cells by (N, D ms, requests), the calibration (with ``--predict``), the grid's
    seconds."""

    name: str
    cells: dict[tuple[int, float, int], Cell]
    calibration: pingpong_model.Calibration | None
    grid_s: float


def added(relay: dict[float, float], delay_ms: float) -> float:
    """The model's D: what the relay adds one way at ``delay_ms`` beyond what it adds at 0 (the calibration ran
    through it at 0, so that part is in its latency already)."""
    return relay[delay_ms / 1000] - relay[0.0]


class Deployment:
    """An AFD 1A1F setup of N micro-batches behind a relay."""

    def __init__(self, n: int, family: str, model: Path, work: Path, env: dict[str, str],
                 args: argparse.Namespace, label: str = "") -> None:
        self.relay: RelayProcess | None = None
        self.setup = Setup(label or f"afd-n{n}", family, model, work, env, args, micro_batches=n,
                           min_tokens=MIN_TOKENS, via=self._relay)

    def _relay(self, ffn_port: int) -> int:
        self.relay = RelayProcess((HOST, ffn_port))
        return self.relay.port

    def __enter__(self) -> Deployment:
        self.setup.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.setup.stop()
        if self.relay is not None:
            self.relay.stop()

    def run(self, model: Path, requests: int, tokens: int, reference: list[str], what: str) -> float:
        rate, texts = load(self.setup.ports, model, requests, tokens)
        if texts != reference:
            wrong = sum(a != b for a, b in zip(texts, reference, strict=True))
            raise SystemExit(f"{what}: {wrong} of {requests} completions differ from plain vLLM's")
        return rate


def calibrate(family: str, model: Path, work: Path, env: dict[str, str],
              args: argparse.Namespace) -> pingpong_model.Calibration:
    """Trace N = 1 and N = 2 at D = 0 through the relay (``CALIBRATION``); the model's inputs."""
    events = {}
    for n, sizes in CALIBRATION.items():
        folder = work / f"trace-n{n}"
        folder.mkdir(mode=0o700)
        with Deployment(n, family, model, work, {**env, "AFD_TRACE_DIR": str(folder)}, args,
                        f"calibrate-n{n}") as d:
            load(d.setup.ports, model, 4, 8)
            for size in sizes:
                time.sleep(SETTLE_S)
                load(d.setup.ports, model, size, CALIBRATION_TOKENS)
        events[n] = trace.read(folder)
    return pingpong_model.calibrate(events[1], events[2])


def run_model(name: str, args: argparse.Namespace) -> ModelRun:
    family, overrides = model_spec(name)
    widths = sorted({args.requests, args.wide})
    cells: dict[tuple[int, float, int], Cell] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = vllm_env(PYTHONUNBUFFERED="1", VLLM_CACHE_ROOT=str(work / "vllm-cache"))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        model = build_tokenizer(build(work / name, family, overrides=overrides), vocab_size=512)
        plain = Setup("plain", family, model, work, env, args)
        reference: dict[int, list[str]] = {}
        try:
            plain.start()
            load(plain.ports, model, 4, 8)
            for width in widths:
                reference[width] = load(plain.ports, model, width, args.tokens)[1]
        finally:
            plain.stop()
        started = time.monotonic()
        for n in [] if args.calibrate_only else args.micro_batches:
            with Deployment(n, family, model, work, env, args) as d:
                assert d.relay is not None
                load(d.setup.ports, model, 4, 8)  # warm-up (and compile)
                for r in range(args.rounds):
                    order = args.delays[r % len(args.delays):] + args.delays[:r % len(args.delays)]
                    for delay in order if r % 2 == 0 else order[::-1]:
                        d.relay.set_delay(delay / 1000)
                        for width in widths if delay == args.wide_delay else [args.requests]:
                            time.sleep(SETTLE_S)
                            rate = d.run(model, width, args.tokens, reference[width],
                                         f"{name} N={n} D={delay} ms, {width} requests")
                            cells.setdefault((n, delay, width), Cell()).rates.append(rate)
                            print(f"{name} N={n} D={delay:g} ms {width:3d} requests: {rate:7.0f} tok/s", flush=True)
        grid_s = time.monotonic() - started
        cal = None
        if args.predict or args.calibrate_only:
            cal = calibrate(family, model, work, env, args)
            print(f"{name} calibration: {json.dumps(cal.as_json())}", flush=True)
    return ModelRun(name, cells, cal, grid_s)


def report(result: ModelRun, args: argparse.Namespace, relay: dict[float, float]) -> list[record.Figure]:
    name, cells, cal = result.name, result.cells, result.calibration
    base = cells[(1, 0.0, args.requests)].tps
    print(f"\n== {name}: decode over a delayed link, {args.requests} concurrent x {args.tokens} tokens "
          f"(engines and grid {result.grid_s:.0f} s); tokens equal plain vLLM's in every cell")
    figures = []
    errors: list[float] = []
    picks: list[float] = []  # the model's best N's throughput over the measured best's, per row
    for width in sorted({w for _, _, w in cells}):
        for delay in args.delays:
            row = {n: cells[(n, delay, width)] for n in args.micro_batches if (n, delay, width) in cells}
            if not row:
                continue
            best = max(row, key=lambda n: row[n].tps)
            parts = []
            for n, cell in row.items():
                text = f"N={n} {cell.tps:6.0f} tok/s ({1000 * width / cell.tps:5.2f} ms)"
                if cal is not None:
                    predicted = pingpong_model.throughput(cal, width, n, added(relay, delay))
                    errors.append(predicted / cell.tps - 1)
                    text += f" model {predicted:6.0f} ({100 * errors[-1]:+4.0f} %)"
                parts.append(text)
            line = f"D={delay:3g} ms, {width:2d} req: " + "; ".join(parts) + f"; best N={best}"
            if cal is not None:
                named = pingpong_model.best_n(cal, width, added(relay, delay), tuple(row))
                picks.append(row[named].tps / row[best].tps)
                line += f", model's {named}"
            print(line)
            if width == args.requests:
                figures.append(record.Figure(f"{name}_d{delay:g}_best", f"{name}: best N at D = {delay:g} ms against "
                                             "N = 1 at D = 0 (throughput ratio)", row[best].tps / base, "x",
                                             detail=f"best N {best}; " + ", ".join(
                                                 f"N={n} {c.tps:.0f}" for n, c in row.items()) + " tok/s"))
    if errors:
        worst = max(errors, key=abs)
        figures.append(record.Figure(f"{name}_model_error", f"{name}: the cost model's largest error over the cells",
                                     100 * worst, "%", digits=1, detail=f"{len(errors)} cells, median |error| "
                                     f"{100 * median(abs(e) for e in errors):.1f} %"))
        figures.append(record.Figure(f"{name}_model_pick", f"{name}: throughput of the model's best N against the "
                                     "measured best's (worst row)", min(picks), "x", detail=f"{len(picks)} rows"))
    return figures


def plot(results: list[ModelRun], args: argparse.Namespace, out: Path) -> None:
    """Throughput against D, one line per N, one panel per model (Pillow; no plotting library needed)."""
    from PIL import Image, ImageDraw, ImageFont

    w, h, pad = 560, 380, 60
    font = ImageFont.load_default(size=13)  # the bitmap default drops spaces
    colors = [(66, 133, 244), (219, 68, 55), (244, 180, 0), (15, 157, 88)]
    image = Image.new("RGB", (w * len(results), h), "white")
    draw = ImageDraw.Draw(image)
    for i, result in enumerate(results):
        cells = result.cells
        x0 = i * w
        top = max(c.tps for (_, _, width), c in cells.items() if width == args.requests) * 1.1
        dmax = max(args.delays) or 1.0

        def xy(delay: float, tps: float, x0: int = x0, top: float = top, dmax: float = dmax) -> tuple[float, float]:
            return x0 + pad + (w - 2 * pad) * delay / dmax, h - pad - (h - 2 * pad) * tps / top

        draw.text((x0 + pad, 12), f"{result.name}: tok/s against one-way delay D (ms), "
                                  f"{args.requests} requests", fill="black", font=font)
        draw.line([xy(0, 0), xy(dmax, 0)], fill="black")
        draw.line([xy(0, 0), xy(0, top)], fill="black")
        for delay in args.delays:
            draw.text((xy(delay, 0)[0] - 8, h - pad + 6), f"{delay:g}", fill="black", font=font)
        for frac in (0.25, 0.5, 0.75, 1.0):
            draw.text((x0 + 4, xy(0, top * frac / 1.1)[1] - 6), f"{top * frac / 1.1:.0f}", fill="black", font=font)
        for j, n in enumerate(args.micro_batches):
            points = [xy(d, cells[(n, d, args.requests)].tps) for d in args.delays]
            draw.line(points, fill=colors[j % len(colors)], width=3)
            for px, py in points:
                draw.ellipse([px - 4, py - 4, px + 4, py + 4], fill=colors[j % len(colors)])
            draw.text((x0 + w - pad - 40, pad + 16 * j), f"N={n}", fill=colors[j % len(colors)], font=font)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out)
    print(f"plot: {out}")


def main() -> None:
    parser = record.parser(__doc__, recorded=True, requests=16, tokens=64, rounds=2)
    parser.add_argument("--models", default="balanced,heavy-moe")
    parser.add_argument("--micro-batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2, 3, 4])
    parser.add_argument("--delays", type=lambda v: [float(x) for x in v.split(",")], default=[0.0, 0.5, 1.0, 2.0],
                        help="one-way delays, ms (0 must be among them)")
    parser.add_argument("--wide", type=int, default=64, help="also this many requests at --wide-delay")
    parser.add_argument("--wide-delay", type=float, default=1.0)
    parser.add_argument("--eager", action="store_true", help="--enforce-eager on every server")
    parser.add_argument("--predict", action="store_true", help="calibrate the cost model and print its prediction")
    parser.add_argument("--calibrate-only", action="store_true",
                        help="only the calibration: print the model's inputs and its prediction of every cell")
    parser.add_argument("--plot", type=Path, help="write the throughput plot here (PNG)")
    args = parser.parse_args()
    if 0.0 not in args.delays or 1 not in args.micro_batches:
        parser.error("--delays must include 0 and --micro-batches 1 (every ratio is against N = 1 at D = 0)")
    args.max_num_seqs = max(args.requests, args.wide, *(s for sizes in CALIBRATION.values() for s in sizes))
    relay = relay_cost([d / 1000 for d in args.delays])
    print(f"relay: direct round trip {relay[-1] * 1e6:.0f} us; added one-way: " + ", ".join(
        f"D={1000 * d:g} ms +{(relay[d] - d) * 1e6:.0f} us" for d in sorted(relay) if d >= 0), flush=True)
    results = [run_model(name, args) for name in args.models.split(",")]
    if args.calibrate_only:
        for result in results:
            cal = result.calibration
            assert cal is not None
            for width in sorted({args.requests, args.wide}):
                for delay in args.delays:
                    print(f"{result.name} model, {width} requests, D={delay:g} ms: " + ", ".join(
                        f"N={n} {pingpong_model.throughput(cal, width, n, added(relay, delay)):.0f} tok/s"
                        for n in args.micro_batches))
        return
    figures = [record.Figure("relay_cost_d0", "delay relay: added one-way time at D = 0", relay[0.0] * 1e6, "us",
                             digits=0)]
    for result in results:
        figures += report(result, args, relay)
    if args.plot:
        plot(results, args, args.plot)
    if args.record:
        record.write("afd_link_delay", figures)


if __name__ == "__main__":
    main()
