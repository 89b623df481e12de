"""An FFN restart in the middle of decoding, 2A1F tiny Qwen3-MoE (issue 53): both attention engines hold and replay.

Offline engines (``harness.engine``): an FFN engine and two attention engines, ``schedule: pingpong`` (each rank's
rows are computed as 1A1F would, so the logprobs can be held to plain vLLM's bit for bit), ``timeout_s`` 5,
``hold_s`` far longer than an FFN engine's start. Once both attention engines are generating, the FFN engine is
SIGSTOPped (each rank's step in flight now waits on it) and SIGKILLed, and a new FFN engine is started on the same
port. Both attention engines must finish every request with plain vLLM's tokens and top-5 logprobs, and each must
have held and replayed at least one step. ``batched`` (the default) is tested on the connector
(tests/afd/test_hold_replay.py) and, behind the OpenAI server, by ``python -m benchmarks.chaos --hold-s``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from harness.engine import ENGINE_TIMEOUT_S, kill, run_engines, start, tail
from harness.env import free_port
from harness.tiny_model import build
from tests.integration.test_afd_e2e import _assert_same_outputs, _spec

pytestmark = pytest.mark.vllm

# vLLM starts: plain, the FFN engine, two attention engines, the restarted FFN engine.
ENGINE_BUDGET = 5

FAMILY = "qwen3_moe"
TOKENS = 160  # in flight well past the kill
HOLD_S = 240.0


def test_two_attention_engines_hold_and_replay_across_an_ffn_restart(tmp_path: Path) -> None:
    model = build(tmp_path / FAMILY, FAMILY)
    afd = {"port": free_port(), "num_attention_ranks": 2, "timeout_s": 5.0, "hold_s": HOLD_S,
           "connector_extra_config": {"schedule": "pingpong"}}
    (plain,) = run_engines([{**_spec("plain", "plain", model, FAMILY), "max_tokens": TOKENS}], tmp_path)
    ffn_spec = _spec("ffn", "ffn", model, FAMILY, {**afd, "role": "ffn"})
    ready = [tmp_path / f"ready-{r}" for r in range(2)]
    engines = [start(ffn_spec, tmp_path)]
    try:
        time.sleep(1.0)
        attns = []
        for r in range(2):
            spec = _spec(f"attn{r}", "attention", model, FAMILY, {**afd, "role": "attention", "rank": r})
            spec.update(max_tokens=TOKENS, ready_flag=str(ready[r]))
            attns.append(start(spec, tmp_path))
        engines += attns
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while not all(f.exists() for f in ready):
            assert all(e[0].poll() is None for e in engines), [tail(e[1], 3000) for e in engines]
            assert time.monotonic() < deadline, "the attention engines did not come up"
            time.sleep(0.1)
        time.sleep(1.0)  # generation is under way on both
        os.killpg(engines[0][0].pid, signal.SIGSTOP)  # each rank's step in flight now waits on the FFN
        time.sleep(1.0)
        os.killpg(engines[0][0].pid, signal.SIGKILL)
        engines[0][0].wait(30)
        killed = time.monotonic()
        engines.append(start({**ffn_spec, "name": "ffn2"}, tmp_path))
        for proc, log, _ in attns:
            proc.wait(ENGINE_TIMEOUT_S)
            assert proc.returncode == 0, tail(log, 5000)
        finished_s = time.monotonic() - killed
    finally:
        kill([e[0] for e in engines])
    for _, log, out in attns:
        result: dict[str, Any] = json.loads(out.read_text())
        _assert_same_outputs(plain, result)
        text = tail(log, 1 << 20)
        assert "held a step" in text and "running it again from its first layer" in text, text[-3000:]
        assert "failing its requests" not in text, text[-3000:]
    print(f"2A1F {FAMILY} pingpong: FFN killed mid-decode and restarted; both attention engines finished every "
          f"request exact (tokens and top-5 logprobs) {finished_s:.1f}s after the kill")
