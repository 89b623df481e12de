"""An FFN restart in the middle of decoding, offline engines (issue 53): the attention engines hold and replay.

Offline engines (``harness.engine``): an FFN engine and two attention engines, ``schedule: pingpong`` (each rank's
rows are computed as 1A1F would, so the logprobs can be held to plain vLLM's bit for bit), ``timeout_s`` 5,
``hold_s`` far longer than an FFN engine's start. Once the attention engines are generating, the FFN engine is
SIGSTOPped (each rank's step in flight now waits on it) and SIGKILLed, and a new FFN engine is started on the same
port. Both attention engines must finish every request with plain vLLM's tokens and top-5 logprobs, and each must
have held and replayed at least one step. Also 1A1F tiny Llama with ``micro_batches: 2`` (``micro_batch_min_tokens``
2, so the decode steps of the three prompts run as two micro-batches): the held step is a split one. ``batched``
(the default) is tested on the connector
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

# vLLM starts: per case plain, the FFN engine, the attention engines, the restarted FFN engine (5 and 4); a literal,
# which tests/conftest.py reads from the source
ENGINE_BUDGET = 9

TOKENS = 160  # in flight well past the kill
HOLD_S = 240.0
CASES = {"qwen3_moe-2A1F-pingpong": ("qwen3_moe", 2, {"schedule": "pingpong"}),
         "llama-1A1F-micro_batches-2": ("llama", 1, {"micro_batches": 2, "micro_batch_min_tokens": 2})}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_engines_hold_and_replay_across_an_ffn_restart(tmp_path: Path, case: str) -> None:
    family, ranks, link = CASES[case]
    model = build(tmp_path / family, family)
    afd = {"port": free_port(), "num_attention_ranks": ranks, "timeout_s": 5.0, "hold_s": HOLD_S,
           "connector_extra_config": link}
    (plain,) = run_engines([{**_spec("plain", "plain", model, family), "max_tokens": TOKENS}], tmp_path)
    ffn_spec = _spec("ffn", "ffn", model, family, {**afd, "role": "ffn"})
    ready = [tmp_path / f"ready-{r}" for r in range(ranks)]
    engines = [start(ffn_spec, tmp_path)]
    try:
        time.sleep(1.0)
        attns = []
        for r in range(ranks):
            spec = _spec(f"attn{r}", "attention", model, family, {**afd, "role": "attention", "rank": r})
            spec.update(max_tokens=TOKENS, ready_flag=str(ready[r]))
            attns.append(start(spec, tmp_path))
        engines += attns
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while not all(f.exists() for f in ready):
            assert all(e[0].poll() is None for e in engines), [tail(e[1], 3000) for e in engines]
            assert time.monotonic() < deadline, "the attention engines did not come up"
            time.sleep(0.1)
        time.sleep(1.0)  # generation is under way on each
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
        if link.get("micro_batches"):  # its steps ran split (more micro-batches than forwards)
            a = result["stats"][0]
            assert a["micro_batches"] > a["steps"] - a["idle_steps"], a
    print(f"{case}: FFN killed mid-decode and restarted; every attention engine finished every request exact "
          f"(tokens and top-5 logprobs) {finished_s:.1f}s after the kill")
