"""An FFN restart that no client notices (issue 53), behind vLLM's OpenAI server.

1A1F on the tiny float32 Llama: an FFN server and an attention server with ``hold_s`` far longer than an FFN
server's start, ``timeout_s`` 5. The FFN server's process tree is SIGSTOPped (so a step is surely in flight,
waiting on it) and then SIGKILLed; a new FFN server is started on the same ports. The attention engine holds the
step, re-forms the group by itself and runs the step again: every request finishes, with the tokens and top-5
logprobs plain vLLM gives, bit for bit. While the step is held ``/health`` is 500 naming AFD and the FFN's address
and ``vllm:afd_group_up`` is 0; afterwards ``/metrics`` counts the replayed steps and the hold times. Once in the
middle of decoding (three streams), once in the middle of a prompt's prefill.

Every wait is bounded; each server runs in its own process group, terminated (then killed) at the end.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.engine import Generation, generate, tail
from harness.env import free_port
from tests.integration.test_afd_server import (
    HOST,
    LOGPROBS,
    PROMPT,
    REQUEST_TIMEOUT_S,
    START_TIMEOUT_S,
    _http_error,
    _max_logprob_difference,
    _post,
    _server_args,
    _servers,
    _start,
    _token_id,
    _wait_gauge,
    _wait_healthy,
    attention_sample,
    stream_events,
)

pytestmark = pytest.mark.vllm

# vLLM starts: the plain engine (both prompts), the FFN server, the attention server, two FFN restarts.
ENGINE_BUDGET = 5

TIMEOUT_S = 5.0
HOLD_S = 240.0  # far longer than an FFN server's start on a loaded 2-core machine
TOKENS = 32
STREAMS = 3
LONG_PROMPT = [(7 * i) % 500 + 1 for i in range(160)]  # one prefill step of 160 tokens


@dataclass
class Held:
    """The module's pair; ``restart_ffn`` replaces its FFN server."""

    procs: list[Any]
    folder: Path
    address: str
    ffn_args: list[str]
    ffn_port: int
    attn_port: int
    attn: Any
    attn_log: Path
    ffn: Any
    plain: Generation
    restarts: int = 0

    def kill_ffn_mid_step(self) -> float:
        """SIGSTOP the FFN server's tree (a step in flight now waits on it), then SIGKILL it; when it died."""
        os.killpg(self.ffn.pid, signal.SIGSTOP)
        time.sleep(1.0)
        os.killpg(self.ffn.pid, signal.SIGKILL)
        self.ffn.wait(30)
        return time.monotonic()

    def restart_ffn(self) -> float:
        """A fresh FFN server on the same ports; seconds until it was healthy."""
        self.restarts += 1
        log = self.folder / f"ffn-{self.restarts}.log"
        self.ffn = _start(self.procs, self.ffn_args, log)
        return _wait_healthy(self.ffn, self.ffn_port, log, START_TIMEOUT_S)

    def metric(self, name: str) -> float:
        """The attention server's ``name`` sample (role attention), 0 if absent."""
        return attention_sample(self.attn_port, name) or 0.0


@pytest.fixture(scope="module")
def held(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Held]:
    folder = tmp_path_factory.mktemp("afd-hold")
    plain = generate(model_dir, folder, prompts=[PROMPT, LONG_PROMPT], max_tokens=TOKENS, logprobs=LOGPROBS,
                     timeout_s=START_TIMEOUT_S)
    assert plain.returncode == 0 and plain.result, plain.output[-3000:]
    afd_port, ffn_port, attn_port = free_port(), free_port(), free_port()
    arch = ["--hf-overrides", json.dumps({"architectures": ["AFDLlamaForCausalLM"]})]
    common = ["--afd-port", str(afd_port), "--afd-host", HOST, "--afd-timeout-s", f"{TIMEOUT_S:g}"]
    ffn_args = _server_args(model_dir, ffn_port, *arch, "--afd-role", "ffn", *common)
    attn_args = _server_args(model_dir, attn_port, *arch, "--afd-role", "attention", *common,
                             "--afd-hold-s", f"{HOLD_S:g}")
    with _servers() as procs:
        ffn = _start(procs, ffn_args, folder / "ffn-0.log")
        _wait_healthy(ffn, ffn_port, folder / "ffn-0.log", START_TIMEOUT_S)
        attn_log = folder / "attention.log"
        attn = _start(procs, attn_args, attn_log)
        _wait_healthy(attn, attn_port, attn_log, START_TIMEOUT_S)
        yield Held(procs, folder, f"{HOST}:{afd_port}", ffn_args, ffn_port, attn_port, attn, attn_log, ffn, plain)


def _assert_exact(held: Held, prompt: int, tokens: list[int], top: list[dict[str, float]]) -> None:
    plain_tokens, plain_top = held.plain.result["tokens"][prompt], held.plain.result["logprobs"][prompt]
    assert tokens == plain_tokens, (tokens, plain_tokens)
    worst = _max_logprob_difference(plain_top, top)
    assert worst == 0.0, f"max |logprob difference| {worst} against plain vLLM"


def _while_held(held: Held, requests_open: Any) -> float:
    """Checks while the step is held: requests still open, ``/health`` 500 naming AFD and the FFN's address
    (answered at once), the gauge 0. Returns how long ``/health`` took."""
    deadline = time.monotonic() + 10
    while True:  # the loss is seen at once (the socket closed); the snapshot follows within 0.5 s
        try:
            status, body, health_s = _http_error(held.attn_port, "/health")
            break
        except pytest.fail.Exception:
            assert time.monotonic() < deadline, "/health stayed 200 while the step was held"
            time.sleep(0.2)
    assert status >= 500 and "AFD" in body and held.address in body, (status, body)
    assert health_s < 5, f"/health took {health_s:.1f}s while a step was held"
    _wait_gauge(held.attn_port, 0.0)
    assert requests_open(), "a request ended while its step was held"
    return health_s


def test_streams_held_across_an_ffn_restart_mid_decode_finish_exactly(held: Held, model_dir: Path) -> None:
    replayed, holds = held.metric("vllm:afd_replayed_steps_total"), held.metric("vllm:afd_hold_seconds_count")
    results: list[dict[str, Any]] = [{"times": [], "tokens": [], "top": []} for _ in range(STREAMS)]

    def stream(out: dict[str, Any]) -> None:
        try:
            for event in stream_events(held.attn_port, model_dir, max_tokens=TOKENS, logprobs=LOGPROBS,
                                       return_tokens_as_token_ids=True):
                if "error" in event:
                    out["error"] = event["error"]
                    continue
                lp = event["choices"][0]["logprobs"]
                out["times"].append(time.monotonic())
                out["tokens"] += [_token_id(t) for t in lp["tokens"]]
                out["top"] += lp["top_logprobs"]
        except (OSError, ValueError) as e:
            out["exception"] = repr(e)
        out["end"] = time.monotonic()

    threads = [threading.Thread(target=stream, args=(r,), daemon=True) for r in results]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(r["times"] for r in results):
        assert time.monotonic() < deadline and not any("end" in r for r in results), results
        time.sleep(0.01)
    killed = held.kill_ffn_mid_step()
    health_s = _while_held(held, lambda: not any("end" in r for r in results))
    restart_s = held.restart_ffn()
    back = time.monotonic()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S)
    for r in results:
        assert "end" in r and "error" not in r and "exception" not in r, {k: r.get(k) for k in ("error", "exception")}
        _assert_exact(held, 0, r["tokens"], r["top"])
    pauses = [max(b - a for a, b in zip(r["times"], r["times"][1:], strict=False)) for r in results]
    first_after = min(t for r in results for t in r["times"] if t > killed)
    assert held.metric("vllm:afd_replayed_steps_total") >= replayed + 1
    assert held.metric("vllm:afd_hold_seconds_count") >= holds + 1
    _wait_gauge(held.attn_port, 1.0)
    lines = [line for line in tail(held.attn_log, 1 << 20).splitlines() if "held a step" in line]
    assert lines and held.address in lines[-1] and "attention rank 0" in lines[-1], lines
    assert held.attn.poll() is None
    print(f"FFN killed mid-decode; the new FFN server healthy {back - killed:.1f}s after the kill ({restart_s:.1f}s "
          f"after its start); {STREAMS} streams finished exact, none failed; longest pause {max(pauses):.1f}s, first "
          f"token after the kill {first_after - killed:.1f}s after it; /health answered 500 in {health_s:.2f}s")


def test_a_prefill_held_across_an_ffn_restart_finishes_exactly(held: Held, model_dir: Path) -> None:
    steps = held.metric("vllm:afd_steps_total")
    os.killpg(held.ffn.pid, signal.SIGSTOP)  # the prefill's first exchange now waits on the FFN
    out: dict[str, Any] = {}

    def complete() -> None:
        try:
            out["response"] = _post(held.attn_port, "/v1/completions", {
                "model": str(model_dir), "prompt": LONG_PROMPT, "max_tokens": TOKENS, "temperature": 0,
                "logprobs": LOGPROBS, "ignore_eos": True, "return_tokens_as_token_ids": True})
        except (OSError, ValueError) as e:
            out["exception"] = repr(e) + (e.read()[:500].decode() if isinstance(e, urllib.error.HTTPError) else "")

    request = threading.Thread(target=complete, daemon=True)
    request.start()
    deadline = time.monotonic() + 30
    while held.metric("vllm:afd_steps_total") == steps:  # the prefill step began and waits on the FFN
        assert time.monotonic() < deadline and request.is_alive(), out
        time.sleep(0.1)
    killed = held.kill_ffn_mid_step()
    _while_held(held, request.is_alive)
    restart_s = held.restart_ffn()
    request.join(REQUEST_TIMEOUT_S)
    assert "response" in out, out
    lp = out["response"]["choices"][0]["logprobs"]
    _assert_exact(held, 1, [_token_id(t) for t in lp["tokens"]], lp["top_logprobs"])
    print(f"FFN killed mid-prefill ({len(LONG_PROMPT)} tokens), restarted healthy in {restart_s:.1f}s; the request "
          f"finished exact {time.monotonic() - killed:.1f}s after the kill")
