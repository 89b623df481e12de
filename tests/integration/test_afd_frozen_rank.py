"""A frozen attention engine does not take its sibling down (issue 51, finding 2), behind vLLM's OpenAI server.

2A1F on a tiny float32 Llama, ``schedule: batched`` (one FFN call over both ranks), ``timeout_s`` 2: three API
servers on 127.0.0.1 (the FFN server, attention servers 0 and 1). Attention server 1's whole process tree is
SIGSTOPped for three times ``timeout_s`` while server 0 streams a long greedy completion. A frozen process
neither steps nor answers keep-alives, and its socket buffers fill: it must be treated like a rank that merely
stalls. Rank 0's stream never pauses longer than 2 x ``timeout_s`` (before the fix: 8-10 s, and the group ended)
and its tokens are those plain vLLM gives; after SIGCONT rank 1 serves exact answers again by itself (its FFN
rank dropped it; it re-joins the group).

Every wait is bounded; each server runs in its own process group, terminated (then killed) in ``finally``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from harness.engine import tail
from harness.env import free_port
from tests.integration.test_afd_server import (
    HOST,
    MAX_TOKENS,
    REQUEST_TIMEOUT_S,
    START_TIMEOUT_S,
    _complete,
    _server_args,
    _servers,
    _start,
    _token_id,
    _wait_healthy,
    stream_events,
)

pytestmark = pytest.mark.vllm

# vLLM starts: the session's plain engine (plain_generation) and three API servers.
ENGINE_BUDGET = 4

TIMEOUT_S = 2.0
FREEZE_S = 3 * TIMEOUT_S
STREAM_TOKENS = 200  # in flight well past the freeze
SLACK_S = 1.0  # one step of a loaded 2-core machine on top of the bound


def _stream_gaps(port: int, model: Path, out: dict[str, Any]) -> None:
    """A streamed greedy completion; records each chunk's arrival, its token ids and an error event."""
    out["times"], out["tokens"] = [], []
    try:
        for event in stream_events(port, model, max_tokens=STREAM_TOKENS, logprobs=1,
                                   return_tokens_as_token_ids=True):
            if "error" in event:
                out["error"] = event["error"]
                continue
            out["times"].append(time.monotonic())
            out["tokens"].extend(_token_id(t) for t in event["choices"][0]["logprobs"]["tokens"])
    except (OSError, ValueError) as e:  # recorded, judged by the test
        out["exception"] = repr(e)
    out["end"] = time.monotonic()


def test_a_frozen_sibling_does_not_stall_the_busy_attention_engine(model_dir: Path, plain_generation: Any,
                                                                   tmp_path: Path) -> None:
    afd_port = free_port()
    ports = {name: free_port() for name in ("ffn", "attn0", "attn1")}
    arch = ["--hf-overrides", json.dumps({"architectures": ["AFDLlamaForCausalLM"]})]
    common = ["--afd-port", str(afd_port), "--afd-host", HOST, "--afd-timeout-s", str(TIMEOUT_S),
              "--afd-num-attention-ranks", "2"]
    logs = {name: tmp_path / f"{name}.log" for name in ports}
    with _servers() as procs:
        ffn = _start(procs, _server_args(model_dir, ports["ffn"], *arch, *common, "--afd-role", "ffn"), logs["ffn"])
        _wait_healthy(ffn, ports["ffn"], logs["ffn"], START_TIMEOUT_S)
        attns = [_start(procs, _server_args(model_dir, ports[f"attn{r}"], *arch, *common, "--afd-role", "attention",
                                            "--afd-rank", str(r)), logs[f"attn{r}"]) for r in range(2)]
        for r, proc in enumerate(attns):
            _wait_healthy(proc, ports[f"attn{r}"], logs[f"attn{r}"], START_TIMEOUT_S)

        # the reference: rank 0's first MAX_TOKENS greedy tokens, as plain vLLM gives them
        plain = plain_generation.result["tokens"][0]
        assert [_token_id(t) for t in _complete(ports["attn0"], model_dir)["choices"][0]["logprobs"]["tokens"]] \
            == plain

        out: dict[str, Any] = {}
        streaming = threading.Thread(target=_stream_gaps, args=(ports["attn0"], model_dir, out), daemon=True)
        streaming.start()
        deadline = time.monotonic() + 60
        while len(out.get("times", [])) < 5:
            assert time.monotonic() < deadline and "end" not in out, out
            time.sleep(0.02)
        os.killpg(attns[1].pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            time.sleep(FREEZE_S)
        finally:
            os.killpg(attns[1].pid, signal.SIGCONT)
        thawed_at = time.monotonic()
        streaming.join(REQUEST_TIMEOUT_S)
        assert "end" in out and "exception" not in out and "error" not in out, {k: out.get(k) for k in
                                                                                 ("error", "exception")}
        during = [t for t in out["times"] if frozen_at - 1 <= t <= thawed_at + 2 * TIMEOUT_S]
        gaps = [b - a for a, b in zip(out["times"], out["times"][1:], strict=False)]
        longest = max(gaps)
        assert out["tokens"][:MAX_TOKENS] == plain, (out["tokens"][:MAX_TOKENS], plain)
        assert len(during) > 2, "rank 0 produced nothing while rank 1 was frozen"
        assert longest <= 2 * TIMEOUT_S + SLACK_S, f"rank 0's stream paused {longest:.2f}s (timeout_s={TIMEOUT_S})"
        ffn_log = tail(logs["ffn"], 50000)
        assert "attention rank 1" in ffn_log and ffn.poll() is None, ffn_log[-3000:]

        # rank 1, thawed: dropped by its FFN rank, it re-joins by itself and answers exactly again
        deadline = time.monotonic() + 10 * TIMEOUT_S + 30
        while True:
            try:
                again = [_token_id(t) for t in
                         _complete(ports["attn1"], model_dir)["choices"][0]["logprobs"]["tokens"]]
                break
            except urllib.error.HTTPError as e:
                assert time.monotonic() < deadline, f"rank 1 did not serve again: {e.read()[:300]!r}"
                time.sleep(0.2)
        rejoin_s = time.monotonic() - thawed_at
        assert again == plain and all(p.poll() is None for p in procs), (again, plain)
        assert [_token_id(t) for t in _complete(ports["attn0"], model_dir)["choices"][0]["logprobs"]["tokens"]] \
            == plain
        print(f"rank 1 frozen {FREEZE_S:.0f}s: rank 0's longest pause {longest:.2f}s (timeout_s={TIMEOUT_S}), "
              f"{len(during)} chunks meanwhile; rank 1 served exactly again {rejoin_s:.1f}s after SIGCONT")
