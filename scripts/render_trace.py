"""Draw one step of AFD trace files (``afd_patches.trace``) as a PNG timeline.

    python scripts/render_trace.py TRACE_DIR --step 40 --out step.png [--title "N = 2"]

One lane per attention micro-batch and one for the FFN, on the time axis of the files (milliseconds from
the step's first event): ``attention`` blue, ``send`` grey, ``wait`` red, ``ffn`` green, each labelled with
its layer. Without ``--step`` it draws, among the steps split into the most micro-batches, the one with the
most tokens on the FFN. Reads
the files as data (JSON events only); draws with Pillow (a vLLM dependency).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from afd_patches import trace

COLORS = {"attention": (66, 133, 244), "send": (160, 160, 160), "wait": (219, 68, 55), "ffn": (15, 157, 88)}
LANE_H, PAD, LEFT, WIDTH = 34, 8, 150, 1400
FONT = ImageFont.load_default(size=12)  # Pillow's bitmap default drops spaces


def pick_step(events: list[dict[str, Any]]) -> int:
    """Among the steps that ran in the most micro-batches, the one with the most FFN tokens; ties: the latest."""
    tokens: dict[int, int] = {}
    lanes: dict[int, set[int]] = {}
    for e in events:
        step = e["args"]["step"]
        if e["name"] == "ffn":
            tokens[step] = tokens.get(step, 0) + e["args"].get("tokens", 0)
        lanes.setdefault(step, set()).add(e["args"]["microbatch"])
    return max(tokens, key=lambda s: (len(lanes[s]), tokens[s], s))


def render(events: list[dict[str, Any]], step: int, out: Path, title: str) -> None:
    chosen = [e for e in events if e["args"].get("step") == step]
    if not chosen:
        raise SystemExit(f"no event of step {step}")
    lanes = sorted({(e["pid"], e["tid"]) for e in chosen}, key=lambda lane: (lane[0].startswith("ffn"), lane))
    t0 = min(e["ts"] for e in chosen)
    t1 = max(e["ts"] + e["dur"] for e in chosen)
    scale = (WIDTH - LEFT - PAD) / max(t1 - t0, 1.0)
    height = 40 + len(lanes) * (LANE_H + PAD) + 40
    image = Image.new("RGB", (WIDTH, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((PAD, 8), f"{title}  step {step}  ({(t1 - t0) / 1000:.2f} ms)", fill="black", font=FONT)
    for row, (pid, tid) in enumerate(lanes):
        y = 40 + row * (LANE_H + PAD)
        draw.text((PAD, y + LANE_H // 3), f"{pid}: {tid}", fill="black", font=FONT)
        for e in (e for e in chosen if (e["pid"], e["tid"]) == (pid, tid)):
            x0 = LEFT + (e["ts"] - t0) * scale
            x1 = max(x0 + 1, LEFT + (e["ts"] + e["dur"] - t0) * scale)
            draw.rectangle([x0, y, x1, y + LANE_H], fill=COLORS.get(e["name"], (0, 0, 0)))
            if x1 - x0 > 18 and e["name"] in ("attention", "ffn"):
                draw.text((x0 + 3, y + 3), f"L{e['args']['layer']}", fill="white", font=FONT)
    axis = height - 30
    draw.line([LEFT, axis, WIDTH - PAD, axis], fill="black")
    ms = (t1 - t0) / 1000
    ticks = 5
    for i in range(ticks + 1):
        x = LEFT + i * (WIDTH - LEFT - PAD) / ticks
        draw.line([x, axis, x, axis + 5], fill="black")
        draw.text((x - 10, axis + 8), f"{ms * i / ticks:.2f} ms", fill="black", font=FONT)
    legend_x = WIDTH - 420
    for i, (name, color) in enumerate(COLORS.items()):
        draw.rectangle([legend_x + i * 100, 10, legend_x + i * 100 + 14, 24], fill=color)
        draw.text((legend_x + i * 100 + 20, 11), name, fill="black", font=FONT)
    image.save(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--step", type=int)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="AFD")
    args = parser.parse_args()
    events = trace.read(args.directory)
    step = args.step if args.step is not None else pick_step(events)
    render(events, step, args.out, args.title)
    print(f"wrote {args.out} (step {step})")


if __name__ == "__main__":
    main()
