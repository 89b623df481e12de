"""The main job: a tiny random-weight model on real vLLM, plain and with the afd plugin loaded.

Prints the greedy tokens of both runs side by side and the per-process patch
reports (front end, engine core, worker), then checks they all applied one plan.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_model import build  # noqa: E402
from vllm_run import REPO, run_generate  # noqa: E402


def main() -> int:
    model = build(REPO / ".cache" / "models" / "tiny-llama", "llama")
    print(f"tiny model: {model}")
    with tempfile.TemporaryDirectory() as tmp:
        reports = Path(tmp) / "reports"
        print("running vLLM without plugins (VLLM_PLUGINS='') ...", flush=True)
        plain = run_generate(model, VLLM_PLUGINS="")
        print("running vLLM with the afd plugin (no AFD config: must change nothing) ...", flush=True)
        plugged = run_generate(model, PATCHKIT_REPORT_DIR=str(reports))
        for name, gen in (("plain", plain), ("plugin", plugged)):
            if gen.returncode != 0 or gen.result is None:
                print(f"{name} run failed:\n{gen.output[-3000:]}")
                return 1
        print(f"\n{'prompt':>6}  {'plain vLLM':40}  {'with afd plugin':40}  same")
        for i, (a, b) in enumerate(zip(plain.result["tokens"], plugged.result["tokens"], strict=True)):
            print(f"{i:>6}  {a!s:40}  {b!s:40}  {'yes' if a == b else 'NO'}")
        print("\nper-process patch reports:")
        check = subprocess.run([sys.executable, "-m", "patchkit.cli", "report", str(reports)])
        same = plain.result["tokens"] == plugged.result["tokens"]
        return 0 if same and check.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
