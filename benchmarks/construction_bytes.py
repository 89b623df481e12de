"""Bytes allocated while each AFD role builds its model, vs plain vLLM, per architecture (a Markdown table).

For each architecture the FFN-heavy tiny checkpoint (``harness/tiny_model.py
--wide``: MLP/experts over 90 % of the parameters) is built, then plain vLLM,
the attention role and the FFN role construct the model in this process with
vLLM's own loader under an allocation counter (``harness/construction_bytes.py``
says how bytes are counted). No weights are loaded, no engine is started.

    python -m benchmarks.construction_bytes [--family llama ...]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks import record
from harness.construction_bytes import measure
from harness.engine import ARCH
from harness.tiny_model import build


def _kib(n: int) -> str:
    return f"{n / 1024:,.0f}"


def main() -> None:
    parser = record.parser(__doc__)
    parser.add_argument("--family", action="append", choices=sorted(ARCH))
    args = parser.parse_args()
    print("| architecture | FFN share of params | non-FFN / FFN params (KiB) | plain builds (KiB) | "
          "attention builds (KiB, × non-FFN) | FFN builds (KiB, × FFN) | FFN entries in attention's forward context |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.family or list(ARCH):
            r = measure(build(Path(tmp) / family, family, wide=True), ARCH[family])
            ffn, non = r["plain"]["plain_ffn_params"], r["plain"]["plain_non_ffn_params"]
            att, fr = r["attention"]["allocated"], r["ffn"]["allocated"]
            leaked = [k for k in r["attention"]["forward_context"] if ".mlp" in k]
            print(f"| {family} | {100 * ffn / (ffn + non):.1f} % | {_kib(non)} / {_kib(ffn)} | "
                  f"{_kib(r['plain']['allocated'])} | {_kib(att)} ({att / non:.3f}) | {_kib(fr)} ({fr / ffn:.3f}) | "
                  f"{len(leaked)} |", flush=True)


if __name__ == "__main__":
    main()
