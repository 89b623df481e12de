"""AFD behind vLLM's OpenAI-compatible server: the --afd-* flags, for real.

1. ``python -m vllm.entrypoints.openai.api_server --help`` lists the ``AFD`` group, and
   ``--help=AFD`` lists every ``--afd-*`` flag (the plugin adds them through its manifest).
2. A tiny float32 Llama (plus a tiny word-level tokenizer) is served as an AFD pair: the FFN
   role server first, then the attention role server, both configured with ``--afd-*`` flags
   (the FFN one also with ``--additional-config``, to show both forms combine). One greedy
   ``/v1/completions`` request (token-id prompt, ``return_tokens_as_token_ids``) to the
   attention server must give the same token ids and top-5 logprobs as plain offline vLLM
   (harness/engine.py) on the same checkpoint.
3. The same pair, the attention server's process group SIGKILLed once both are healthy: the FFN
   server stops by itself within a bound (its serve loop's error stops its engine core, and the API
   server exits on the dead engine), logs the lost attention rank, and leaves no process behind.

Everything listens on 127.0.0.1 only; every wait is bounded; each server runs in its own
process group, which is terminated (then killed) in ``finally``. Marked ``vllm``: slow
(two servers, three processes each), needs the real vLLM CPU build.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from harness.engine import group_members, tail
from harness.env import REPO, free_port, vllm_env

pytestmark = pytest.mark.vllm

HOST = "127.0.0.1"
PROMPT = [1, 2, 3, 4, 5]
MAX_TOKENS = 8
LOGPROBS = 5
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
HELP_TIMEOUT_S = 120.0
AFD_FLAGS = ("--afd-role", "--afd-connector", "--afd-host", "--afd-port", "--afd-num-attention-ranks",
             "--afd-num-ffn-ranks", "--afd-rank", "--afd-timeout-s")
SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def _env(**extra: str) -> dict[str, str]:
    # dev mode adds POST /collective_rpc (loopback only here), used to read the AFD workers' counters
    return vllm_env(PYTHONUNBUFFERED="1", VLLM_SERVER_DEV_MODE="1", **extra)


def test_api_server_help_lists_afd_flags() -> None:
    overview = subprocess.run([*SERVER, "--help"], env=_env(), capture_output=True, text=True,
                              timeout=HELP_TIMEOUT_S, cwd=REPO)
    assert overview.returncode == 0, overview.stderr[-3000:]
    assert any(line.strip().startswith("AFD ") for line in overview.stdout.splitlines()), overview.stdout[-3000:]
    group = subprocess.run([*SERVER, "--help=AFD"], env=_env(), capture_output=True, text=True,
                           timeout=HELP_TIMEOUT_S, cwd=REPO)
    assert group.returncode == 0, group.stderr[-3000:]
    for flag in AFD_FLAGS:
        assert flag in group.stdout, f"{flag} missing from --help=AFD:\n{group.stdout}"


def _server_args(model: Path, port: int, *extra: str) -> list[str]:
    return [*SERVER, "--model", str(model), "--host", HOST, "--port", str(port), "--enforce-eager",
            "--max-model-len", "256", "--dtype", "float32", "--seed", "0", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "256", "--gpu-memory-utilization", "0.2",
            "--kv-cache-memory-bytes", str(64 << 20), *extra]


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, log: Path, timeout_s: float) -> float:
    """Poll ``/health`` until 200; fail on early exit or after ``timeout_s``. Returns seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            pytest.fail(f"server on port {port} exited {proc.returncode} before it was healthy:\n{tail(log)}")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    pytest.fail(f"server on port {port} not healthy within {timeout_s}s:\n{tail(log)}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL it after 30 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


@contextmanager
def _servers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """A list the test appends started servers to; all are stopped, last started first."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for proc in reversed(procs):  # attention first: its close ends the FFN serve loop cleanly
            _stop(proc)


def _start(procs: list[subprocess.Popen[bytes]], args: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as fh:
        proc = subprocess.Popen(args, env=_env(**env), stdout=fh, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)
    procs.append(proc)
    return proc


def _post(port: int, path: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        return json.loads(r.read())


def _complete(port: int, model: Path) -> dict[str, Any]:
    return _post(port, "/v1/completions", {
        "model": str(model), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": LOGPROBS,
        "ignore_eos": True, "return_tokens_as_token_ids": True})


def _afd_stats(port: int) -> dict[str, Any]:
    """The single worker's ``afd_stats()`` via the dev-mode ``/collective_rpc`` endpoint."""
    (stats,) = _post(port, "/collective_rpc", {"method": "afd_stats", "timeout": 30})["results"]
    return stats


def _token_id(text: str) -> int:
    assert text.startswith("token_id:"), text
    return int(text.split(":", 1)[1])


def _max_logprob_difference(plain: list[dict[str, float]], served: list[dict[str, float]]) -> float:
    """Largest |difference| between plain vLLM's top logprobs and a server's, step by step (same token sets)."""
    worst = 0.0
    for step_plain, step_served in zip(plain, served, strict=True):
        by_id = {str(_token_id(t)): v for t, v in step_served.items()}
        assert set(by_id) == set(step_plain)
        worst = max(worst, *(abs(v - by_id[t]) for t, v in step_plain.items()))
    return worst


def test_afd_pair_behind_openai_server_matches_plain_vllm(model_dir: Path, plain_generation: Any,
                                                          tmp_path: Path) -> None:
    plain = plain_generation
    plain_tokens = plain.result["tokens"][0]
    plain_logprobs = plain.result["logprobs"][0]

    afd_port, ffn_port, attn_port = free_port(), free_port(), free_port()
    arch = ["--hf-overrides", json.dumps({"architectures": ["AFDLlamaForCausalLM"]})]
    common = ["--afd-port", str(afd_port), "--afd-host", HOST, "--afd-timeout-s", "300"]
    with _servers() as procs:
        ffn_log, attn_log = tmp_path / "ffn.log", tmp_path / "attention.log"
        ffn = _start(procs, _server_args(model_dir, ffn_port, *arch, "--afd-role", "ffn", *common,
                                         "--additional-config",
                                         json.dumps({"afd": {"connector_extra_config": {"idle_timeout_s": 900}}})),
                     ffn_log)
        ffn_s = _wait_healthy(ffn, ffn_port, ffn_log, START_TIMEOUT_S)
        attn = _start(procs, _server_args(model_dir, attn_port, *arch, "--afd-role", "attention", *common), attn_log)
        attn_s = _wait_healthy(attn, attn_port, attn_log, START_TIMEOUT_S)
        t1 = time.monotonic()
        response = _complete(attn_port, model_dir)
        request_s = time.monotonic() - t1
        attn_stats, ffn_stats = _afd_stats(attn_port), _afd_stats(ffn_port)
        assert ffn.poll() is None, f"FFN server died:\n{tail(ffn_log)}"
    choice = response["choices"][0]
    lp = choice["logprobs"]
    tokens = [_token_id(t) for t in lp["tokens"]]
    assert tokens == plain_tokens, f"AFD server {tokens} != plain vLLM {plain_tokens}"
    worst = _max_logprob_difference(plain_logprobs, lp["top_logprobs"])
    assert worst == 0.0, f"max |logprob difference| {worst}"
    # the roles really ran disaggregated: the attention worker holds no MLP weights and sent every
    # layer's MLP input to the FFN worker, which has no KV cache and answered each one
    assert attn_stats["role"] == "attention" and attn_stats["mlp_param_names"] == []
    assert attn_stats["kv_cache_bytes"] > 0 and attn_stats["messages_sent"] > 0
    assert ffn_stats["role"] == "ffn" and ffn_stats["kv_cache_bytes"] == 0 and ffn_stats["attn_param_names"] == []
    assert ffn_stats["messages_received"] == attn_stats["messages_sent"] == attn_stats["messages_received"]
    print(f"AFD server: tokens {tokens} equal plain vLLM; max |dlogprob| {worst:.1e}; "
          f"FFN server healthy in {ffn_s:.1f}s, attention server in {attn_s:.1f}s, request {request_s:.2f}s; "
          f"{attn_stats['messages_sent']} layer messages exchanged")


def test_attention_server_killed_stops_ffn_server(model_dir: Path, tmp_path: Path) -> None:
    """SIGKILL the attention server's group: the FFN server exits by itself within ``timeout_s + 60`` s,
    its log names the lost attention rank, and nothing of its process group is left. ``timeout_s`` also
    bounds the handshake, so it must cover the attention server's start (a stopped handshake stops the
    FFN server too); the lost peer itself is seen at once, when its socket closes."""
    timeout_s = 120
    afd_port, ffn_port, attn_port = free_port(), free_port(), free_port()
    arch = ["--hf-overrides", json.dumps({"architectures": ["AFDLlamaForCausalLM"]})]
    common = ["--afd-port", str(afd_port), "--afd-host", HOST, "--afd-timeout-s", str(timeout_s)]
    with _servers() as procs:
        ffn_log, attn_log = tmp_path / "ffn.log", tmp_path / "attention.log"
        ffn = _start(procs, _server_args(model_dir, ffn_port, *arch, "--afd-role", "ffn", *common), ffn_log)
        _wait_healthy(ffn, ffn_port, ffn_log, START_TIMEOUT_S)
        attn = _start(procs, _server_args(model_dir, attn_port, *arch, "--afd-role", "attention", *common), attn_log)
        _wait_healthy(attn, attn_port, attn_log, START_TIMEOUT_S)
        assert len(_complete(attn_port, model_dir)["choices"][0]["logprobs"]["tokens"]) == MAX_TOKENS
        os.killpg(attn.pid, signal.SIGKILL)
        attn.wait(30)
        t0 = time.monotonic()
        try:
            code = ffn.wait(timeout_s + 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"FFN server still up {timeout_s + 60}s after the attention server was killed:\n"
                        f"{tail(ffn_log)}")
        elapsed = time.monotonic() - t0
        gone_by = time.monotonic() + 30
        while (left := group_members(ffn.pid)) and time.monotonic() < gone_by:
            time.sleep(0.2)
        assert not left, f"FFN server process group {ffn.pid} still has processes: {left}"
        log = tail(ffn_log, 20000)
        assert "AFD FFN serve loop stopped" in log and "lost attention rank 0" in log, log[-3000:]
    print(f"FFN server exited {code} {elapsed:.1f}s after the attention server was killed")
