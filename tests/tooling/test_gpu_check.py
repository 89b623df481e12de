"""scripts/gpu_check/check.py's CPU self-test of the ``microbatch`` call (the GPU run itself is the device's job).

It runs the real micro-batch schedule (afd_patches.models.microbatch) and the real connector and FFN serve loop
in two processes on gloo, without vLLM (a stand-in forward context), about 10 s on this host."""

from __future__ import annotations

import json
import subprocess
import sys

from harness.env import REPO

LAYERS = 2  # scripts/gpu_check/microbatch_step.py's LAYERS


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "scripts/gpu_check/check.py", "microbatch", "--device", "cpu", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=240)


def test_microbatch_cpu_self_test_splits_exactly() -> None:
    out = _run("--hidden", "64", "--requests", "7,1,12,3,9", "--reps", "2")
    lines = [json.loads(line[len("CHECK "):]) for line in out.stdout.splitlines() if line.startswith("CHECK ")]
    why = f"exit {out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"
    assert out.returncode == 0 and "GPU_CHECK PASS (3/3 checks" in out.stdout, why
    assert [c["micro_batches"] for c in lines] == [1, 2, 3], why
    for c in lines:
        n = c["micro_batches"]
        assert c["check"] == "microbatch" and c["ok"], c
        assert c["bitwise_equal_unsplit"] and c["kernels_row_independent"] and c["timed_steps_equal"], c
        assert c["ffn_exchanges_per_step"] == n * LAYERS == c["exchanges_per_step"], c
        assert c["contexts_ok"] and not c["context_problems"] and c["overlaps"] == 0, c
        assert c["schedule"] == [f"{layer}.{k}" for layer in range(LAYERS) for k in range(n)], c
        assert len(c["threads"]) == n and c["threads_distinct"], c
        assert len(c["slices"]) == (n if n > 1 else 0), c
    # the boundaries of both splits fall inside a request (12 tokens from 8 to 20), so KV crosses micro-batches
    assert lines[1]["slices"] == [[0, 16], [16, 32]] and lines[2]["slices"] == [[0, 10], [10, 21], [21, 32]]



def test_microbatch_payloads_above_inline_bytes_do_not_deadlock() -> None:
    """300 tokens x 256 x bf16: 150-row micro-batches carry 75 KiB, above gloo's default inline_bytes of 64 KiB, so
    each payload travels as its own message. The connector used to wait for its own earlier send before taking the
    peer's payload, and with two micro-batches in flight both sides waited until ``timeout_s`` (LinkTimeout)."""
    out = _run("--hidden", "256", "--requests", "100,60,140", "--reps", "1", "--timeout-s", "10")
    lines = [json.loads(line[len("CHECK "):]) for line in out.stdout.splitlines() if line.startswith("CHECK ")]
    assert out.returncode == 0 and "GPU_CHECK PASS (3/3 checks" in out.stdout, out.stdout + out.stderr[-3000:]
    assert [c["micro_batches"] for c in lines] == [1, 2, 3] and all(c["bitwise_equal_unsplit"] for c in lines), lines
