"""How fast oversized manifests are refused: a 15 MB file, 1,200 entries writing one target, 30,000 nodes.

    python -m benchmarks.manifest_limits
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from patchkit import ManifestError, manifest

HEAD = 'format: 1\nplugin: big\npackages: [plug]\nvllm: {version: "==0.32.0"}\npatches:\n'


def refuse(path: Path) -> tuple[float, str]:
    started = time.perf_counter()
    try:
        manifest.load(path)
    except ManifestError as exc:
        return time.perf_counter() - started, str(exc)
    raise AssertionError(f"{path.name} was accepted")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cases = {
            "15 MB file": HEAD + "".join(
                f"  - {{id: e{i}, target: 'a.b:c', op: wrap, with: 'plug.m:f', why: padding padding}}\n"
                for i in range(200_000)),
            "1,200 writers of one target": HEAD + "".join(
                f"  - {{id: e{i}, target: 'a.b:c', op: wrap, with: 'plug.m:f', why: t}}\n" for i in range(1200)),
            "30,000 YAML nodes": HEAD.replace("patches:\n", "patches: [" + ", ".join(["1"] * 30_000) + "]\n"),
        }
        print(f"{'case':30} {'size':>10} {'refused in':>11} {'message':>9}")
        for label, text in cases.items():
            path = Path(tmp) / "m.yaml"
            path.write_text(text)
            seconds, message = refuse(path)
            print(f"{label:30} {path.stat().st_size:10d} {seconds * 1000:9.0f} ms {len(message):7d} B"
                  f"  {message.splitlines()[0][:90]}")


if __name__ == "__main__":
    main()
